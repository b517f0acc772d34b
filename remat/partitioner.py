"""Plan one joint graph: profile it into a Problem, solve it under the budget, rewrite
it into forward and backward modules. AOTAutograd calls `Partitioner` as its
`partition_fn`, for `remat.plan` and for the `torch.compile` backend alike."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch import fx

from remat.budget import format_bytes, resolve_budget
from remat.errors import InfeasibleBudgetError, RematError
from remat.frontend import costs
from remat.frontend.find_layers import layer_structure
from remat.frontend.libraries import library_workspace_bytes
from remat.frontend.problem import GraphProblem, build_problem
from remat.frontend.random_ops import make_replayable, with_replay_workspace
from remat.frontend.workspace import joint_device, with_workspace
from remat.offload.costing import offload_floor_bytes, offload_hint, with_offload
from remat.planning import distributed
from remat.planning.floor import at_the_floor, lowest_found, refused_without_solving, solve_with_floor
from remat.planning.fused_recompute import prefer_fused_recompute
from remat.planning.inlining import at_their_readers, inlined_ids, inlined_problem
from remat.planning.settings import PlannerSettings
from remat.runtime.rewrite import partition
from remat_solvers import Decision, Evaluation, Plan, Problem, Status, decisions_all, simulate, solve
from remat_solvers.prefetch import prefetch
from remat_solvers.shared_storage import one_save_per_storage

log = logging.getLogger(__name__)
STAGE = "remat_stage"
"""`extra` key of the debug records marking each stage (the CLI's progress bar reads it)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanTimings:
    """Seconds spent in each stage of planning."""

    trace_s: float
    profile_s: float
    solve_s: float
    rewrite_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedStep:
    """Everything remat decided for one input signature."""

    graph_problem: GraphProblem
    plan: Plan
    evaluation: Evaluation
    baseline_peak_bytes: int
    budget_bytes: int
    forward: fx.GraphModule
    backward: fx.GraphModule
    timings: PlanTimings
    library_trace_path: str = ""
    """Why the model was traced on its library's compile path (see `trace.Traced`), or ''."""
    fusion_margin_bytes: int = 0
    """Under inductor: how much its generated code raises the peak over
    `evaluation.peak_bytes` (`remat.runtime.inductor.estimate.inductor_peak_bytes` over
    `fusion_graph_bytes`; negative where the code holds less); the plan was made to fit
    `budget_bytes` with this margin. 0 elsewhere."""
    fusion_graph_bytes: tuple[Any, ...] = ()
    """Under inductor: each graph's peak as inductor generates it vs op by op
    (`remat.runtime.inductor.estimate.GraphBytes`), where the margin comes from. () elsewhere."""
    no_remat_margin_bytes: int | None = None
    """Under inductor, where estimated (a percentage budget, or a refusal): what its
    generated code adds to the plan that saves everything; None elsewhere."""
    planned_peak_bytes: int | None = None
    """The peak of the model the plan was solved against, where it is not
    `evaluation`'s: under inductor, the graph as its lowering runs it
    (`PlannerSettings.inline_pointwise`). The closed loop moves its target in these
    bytes; None: `evaluation.peak_bytes`."""
    inductor_settings: tuple[tuple[str, Any], ...] = ()
    """Under inductor: the settings remat gave this graph's compile because its code
    peaks lower with them on the plan that runs (`layout_optimization` False:
    `remat.runtime.inductor.closed_loop`); () elsewhere."""
    refusal: InfeasibleBudgetError | None = None
    """With `PlannerSettings.floor_if_refused`, the refusal of the budget asked (never
    raised: it holds no traceback); this step is then planned at its `min_peak_bytes`."""

    @property
    def no_remat_peak_bytes(self) -> int:
        """The no-remat peak of the path that runs: under inductor, where estimated, the
        plan that saves everything as inductor generates it; else `baseline_peak_bytes`
        (op by op). A percentage budget is of this."""
        return self.baseline_peak_bytes + (self.no_remat_margin_bytes or 0)


class Partitioner:
    """AOTAutograd's partition_fn: plan the joint graph under `settings`, return fw/bw
    modules. What varies per graph is set here: the budget (inductor's closed loop sets
    it again), the ledger's share, the offload link of the graph's device."""

    def __init__(self, settings: PlannerSettings, *, num_params: int, started_s: float,
                 budget: int | str | None = None, offload_bandwidth_bytes_per_s: float | None = None,
                 random_s_per_element: float | None = None,
                 budget_for: Callable[[int], int] | None = None, best_effort: bool = False) -> None:
        self.settings = settings
        self.num_params = num_params
        """The first `num_params` primals are parameters and buffers, where AOTAutograd
        does not name them (see `__call__`)."""
        self.started_s = started_s
        """When planning this graph began (`perf_counter`): its trace time is from here."""
        self._budget = settings.budget if budget is None else budget
        self.offload_bandwidth_bytes_per_s = offload_bandwidth_bytes_per_s
        """The link offload may use from this graph's device; None: offload off."""
        self.random_s_per_element = random_s_per_element
        """What one of inductor's random draws costs here (`remat.frontend.inductor_random`),
        for the compiled cost models; None: priced by its traffic."""
        self.budget_for = budget_for
        """The budget in bytes given this graph's no-remat peak, instead of resolving
        `budget` against it (the whole-step ledger's share, `runtime.step.ledger`)."""
        self.best_effort = best_effort
        """Run at the lowest peak found instead of refusing when no plan fits (the
        ledger's first step, which cannot know the rest of the step yet)."""
        self.step: PlannedStep | None = None
        self.error: RematError | None = None
        self._problem_cache: tuple[Any, ...] | None = None

    @property
    def budget(self) -> int | str:
        return self._budget

    @budget.setter
    def budget(self, budget: int | str) -> None:
        # set again (inductor's fusion loop plans under the budget minus fusion's
        # margin): that budget, not the ledger's share, and a refusal when it cannot
        self._budget = budget
        self.budget_for = None
        self.best_effort = False

    def __call__(self, joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                 static_lifetime_input_indices: Any = None,
                 **_: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd names the parameters and buffers among the primals in
        `static_lifetime_input_indices` (under torch.compile they are interleaved with
        the user's inputs); without it, the first `num_params` primals are parameters."""
        # the error of this call only: one caught and planned past (inductor's closed loop
        # replanning at the floor) must not be kept, with its traceback's frames
        self.error = None
        try:
            return self._partition(joint, num_fwd_outputs, static_lifetime_input_indices)
        except RematError as e:  # AOTAutograd may wrap exceptions; keep ours to re-raise
            self.error = e
            raise

    def _solve(self, problem: Problem, options: dict[str, Any]) -> Plan:
        """The solver's plan; with offload="fallback", its recompute-only plan when that
        fits, and offload only when it does not."""
        if self.settings.offload == "fallback" and problem.offload_bandwidth_bytes_per_s is not None:
            plan = solve_with_floor(_recompute_only(problem), self.settings.solver, options,
                                    descend_floor=self.settings.descend_floor)
            if plan.status is not Status.INFEASIBLE:
                return plan
        return solve_with_floor(problem, self.settings.solver, options, descend_floor=self.settings.descend_floor)

    def _partition(self, joint: fx.GraphModule, num_fwd_outputs: int, param_indices: Any = None):
        t_traced = time.perf_counter()
        settings = self.settings
        options = dict(settings.solver_options)
        gp, baseline, speed = self._problem_of(joint, num_fwd_outputs, param_indices)
        gp = with_offload(gp, self.offload_bandwidth_bytes_per_s)
        # the problem solved: the graph as inductor's lowering runs it, where asked; a
        # percentage is of its no-remat peak
        inlined = inlined_problem(gp, joint) if settings.inline_pointwise else None
        solved_baseline = (baseline if inlined is None else
                           simulate(inlined.problem, decisions_all(inlined.problem, Decision.SAVE)).peak_bytes)
        budget_bytes = (self.budget_for(baseline) if self.budget_for is not None
                        else resolve_budget(self.budget, solved_baseline))
        gp = _with_budget(gp, budget_bytes)
        solving = gp if inlined is None else _with_budget(inlined, budget_bytes)
        t_profiled = time.perf_counter()
        log.debug("remat: solving %d decision values with %s", len(gp.problem.decision_ids), settings.solver,
                  extra={STAGE: "solve"})
        # below the bytes every plan holds at its end: refused from the floor search alone
        plan = None if self.best_effort else refused_without_solving(solving.problem, settings.solver, options,
                                                                     descend_floor=settings.descend_floor)
        if plan is None:
            plan = self._solve(solving.problem, options)
        refusal = None
        if plan.status is Status.INFEASIBLE and self.best_effort:
            plan = lowest_found(solving.problem, plan)
        elif plan.status is Status.INFEASIBLE:  # fits at the floor, or the error naming it
            plan, refusal = self._at_the_floor(solving, plan, options, baseline)
        kept_refusal = None
        if refusal is not None and settings.floor_if_refused:  # plan at the floor from this trace
            kept_refusal, budget_bytes = refusal, refusal.min_peak_bytes
            gp = _with_budget(gp, budget_bytes)
            solving = gp if inlined is None else _with_budget(inlined, budget_bytes)
            plan = self._solve(solving.problem, options)
            if plan.status is Status.INFEASIBLE:
                plan, refusal = self._at_the_floor(solving, plan, options, baseline)
        if settings.cost_model == "compiled" and plan.status is not Status.INFEASIBLE:
            # inductor: saving a fusible value costs traffic (remat.planning.fused_recompute); before the
            # ranks agree, so every rank takes rank 0's result
            plan = prefer_fused_recompute(joint, solving, plan, speed, random_s_per_element=self.random_s_per_element)
        # two saved tensors over one storage would let inductor's backward overwrite one
        # while the other is still to be read (solvers.shared_storage)
        plan = one_save_per_storage(solving.problem, plan)
        if inlined is not None and plan.schedule is not None:  # its inlined ops run where inductor runs them
            plan = at_their_readers(solving.problem, plan, inlined_ids(gp, joint))
        if plan.status is not Status.INFEASIBLE and not settings.custom_offload_ops:  # reloads early
            plan = prefetch(solving.problem, plan)
        if settings.sync_ranks or (settings.sync_ranks is None and distributed.world_size() > 1):
            plan = distributed.agree_on_plan(solving.problem, plan)  # before raising: all ranks alike
        if plan.status is Status.INFEASIBLE:
            raise refusal or _infeasible(solving, plan, budget_bytes, baseline, settings.offload)
        t_solved = time.perf_counter()
        log.debug("remat: rewriting into forward and backward modules", extra={STAGE: "rewrite"})
        evaluation = simulate(gp.problem, plan)
        fw, bw = partition(joint, gp, plan, evaluation, num_fwd_outputs=num_fwd_outputs,
                           custom_offload_ops=settings.custom_offload_ops)
        t_done = time.perf_counter()
        self.step = PlannedStep(
            graph_problem=gp, plan=plan, evaluation=evaluation, baseline_peak_bytes=baseline,
            budget_bytes=budget_bytes, forward=fw, backward=bw,
            timings=PlanTimings(trace_s=t_traced - self.started_s, profile_s=t_profiled - t_traced,
                                solve_s=t_solved - t_profiled, rewrite_s=t_done - t_solved),
            refusal=kept_refusal,
            planned_peak_bytes=None if inlined is None else simulate(solving.problem, plan).peak_bytes,
        )
        return fw, bw

    def _at_the_floor(self, gp: GraphProblem, failed: Plan, options: dict[str, Any],
                      baseline: int) -> tuple[Plan, InfeasibleBudgetError | None]:
        settings = self.settings
        return at_the_floor(gp, failed, solver=settings.solver, options=options, baseline_bytes=baseline,
                            offload=settings.offload, schedules=settings.schedules,
                            descend_floor=settings.descend_floor)

    def _problem_of(self, joint: fx.GraphModule, num_fwd_outputs: int, param_indices: Any):
        """The joint graph's problem (budget 0), its no-remat peak and the device speed.
        Kept for the same joint graph: inductor's loop plans it again
        under a lower budget (`remat.runtime.inductor.estimate`), and building it again
        would give the same problem."""
        key = (num_fwd_outputs, tuple(param_indices) if param_indices else None, len(joint.graph.nodes))
        if self._problem_cache is not None and self._problem_cache[0] is joint and self._problem_cache[1] == key:
            return self._problem_cache[2]
        built = self._build_problem(joint, num_fwd_outputs, param_indices)
        self._problem_cache = (joint, key, built)
        return built

    @property
    def measures_workspace(self) -> bool:
        """Whether the plans count each op's measured workspace
        (`PlannerSettings.measure_workspace`)."""
        return self.settings.measures_workspace

    def _build_problem(self, joint: fx.GraphModule, num_fwd_outputs: int, param_indices: Any):
        log.debug("remat: profiling the joint graph (%d nodes)", len(joint.graph.nodes), extra={STAGE: "profile"})
        settings = self.settings
        device = joint_device(joint)
        speed = settings.device_speed if settings.device_speed is not None else costs.speed_on(device)
        cost_s = costs.cost_function(settings.cost_model, speed, random_s_per_element=self.random_s_per_element)
        replayable = None
        if settings.replay_rng:
            replayable = make_replayable(joint, num_fwd_outputs=num_fwd_outputs, cost_s=cost_s)
            cost_s = replayable.costs(cost_s)
        gp = build_problem(joint, num_fwd_outputs=num_fwd_outputs, num_params=self.num_params,
                           budget_bytes=0, cost_s=cost_s,
                           resident_bytes=library_workspace_bytes(device) if device is not None else 0,
                           param_indices=tuple(param_indices) if param_indices else None,
                           sum_gradients_in_place=settings.sum_gradients_in_place,
                           drop_outputs=settings.drop_outputs)
        measured = self.measures_workspace
        if measured:
            gp = dataclasses.replace(gp, problem=with_workspace(gp.problem, gp.fx_names, joint))
        if replayable is not None:
            gp = dataclasses.replace(gp, problem=with_replay_workspace(gp.problem, gp.value_name, replayable,
                                                                       joint=joint if measured else None))
        if settings.cost_model == "compiled-traffic":
            gp = dataclasses.replace(gp, problem=with_save_costs(gp, joint, speed, self.random_s_per_element))
        layers = layer_structure(joint, gp)
        if layers is not None:  # repeated layers, for the solvers that use them
            gp = dataclasses.replace(gp, problem=dataclasses.replace(gp.problem, layers=layers))
        baseline = simulate(gp.problem, decisions_all(gp.problem, Decision.SAVE)).peak_bytes
        return gp, baseline, speed


def with_save_costs(gp: GraphProblem, joint: fx.GraphModule, speed: costs.DeviceSpeed,
                    random_s_per_element: float | None = None) -> Problem:
    """`gp.problem` with `Node.save_s` set on the values the backward reads whose saving
    costs time under the "compiled-traffic" cost model (`costs.save_cost_s`): plain
    (not views), recomputable values."""
    problem = gp.problem
    by_name = {n.name: n for n in joint.graph.nodes}
    nodes = list(problem.nodes)
    for i in problem.needed_ids:
        node, fx_node = nodes[i], by_name.get(gp.value_name[i])
        if fx_node is None or node.alias_of is not None or not node.recomputable or not node.out_bytes:
            continue
        save_s = costs.save_cost_s(fx_node, speed, random_s_per_element)
        if save_s:
            nodes[i] = dataclasses.replace(node, save_s=save_s)
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _with_budget(gp: GraphProblem, budget_bytes: int) -> GraphProblem:
    return dataclasses.replace(gp, problem=gp.problem.with_budget(budget_bytes))


def _recompute_only(problem: Problem) -> Problem:
    """`problem` with offload not allowed (its plans are valid plans of `problem`)."""
    return dataclasses.replace(problem, offload_bandwidth_bytes_per_s=None)


def _infeasible(gp: GraphProblem, plan: Plan, budget_bytes: int, baseline: int,
                offload: Any = "auto") -> InfeasibleBudgetError:
    """The error for a budget below every reachable peak, with the smallest one (and,
    when offload is off, the floor offload would reach)."""
    reach = min(
        [plan.peak_bytes]
        + [solve(gp.problem.with_budget(0), s).peak_bytes for s in ("all", "chen-greedy")]
    )
    if gp.problem.offload_bandwidth_bytes_per_s is not None:
        reach = min(reach, offload_floor_bytes(gp.problem))
    return InfeasibleBudgetError(
        f"budget {format_bytes(budget_bytes)} is below the smallest reachable peak "
        f"{format_bytes(reach)} for this model and input shapes (no-remat peak "
        f"{format_bytes(baseline)}); raise the budget to at least {reach} bytes or shrink "
        f"the batch{offload_hint(gp, reach, offload)}",
        budget_bytes=budget_bytes, min_peak_bytes=reach,
    )
