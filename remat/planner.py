"""Plan one joint graph: profile it into a Problem, solve it under the budget, rewrite
it into forward and backward modules. AOTAutograd calls `Partitioner` as its
`partition_fn`, for `remat.plan` and for the `torch.compile` backend alike."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torch import fx

from remat.budget import format_bytes, resolve_budget
from remat.errors import InfeasibleBudgetError, RematError
from remat.frontend import costs
from remat.frontend.layers import layer_structure
from remat.frontend.problem import GraphProblem, build_problem
from remat.runtime.rewrite import partition
from solvers import Decision, Evaluation, Plan, Status, decisions_all, simulate, solve


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


class Partitioner:
    """AOTAutograd's partition_fn: plan the joint graph, return fw/bw modules."""

    def __init__(self, *, num_params: int, budget: int | str, solver: str, options: dict[str, Any],
                 started_s: float) -> None:
        self.num_params = num_params
        self.budget = budget
        self.solver = solver
        self.options = options
        self.started_s = started_s
        self.step: PlannedStep | None = None
        self.error: RematError | None = None

    def __call__(self, joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int,
                 **_: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        try:
            return self._partition(joint, num_fwd_outputs)
        except RematError as e:  # AOTAutograd may wrap exceptions; keep ours to re-raise
            self.error = e
            raise

    def _partition(self, joint: fx.GraphModule, num_fwd_outputs: int):
        t_traced = time.perf_counter()
        speed = costs.device_speed("cpu")
        gp = build_problem(joint, num_fwd_outputs=num_fwd_outputs, num_params=self.num_params,
                           budget_bytes=0, cost_s=lambda node: costs.node_cost_s(node, speed))
        layers = layer_structure(joint, gp)
        if layers is not None:  # repeated layers, for the solvers that use them
            gp = dataclasses.replace(gp, problem=dataclasses.replace(gp.problem, layers=layers))
        baseline = simulate(gp.problem, decisions_all(gp.problem, Decision.SAVE)).peak_bytes
        budget_bytes = resolve_budget(self.budget, baseline)
        gp = dataclasses.replace(gp, problem=gp.problem.with_budget(budget_bytes))
        t_profiled = time.perf_counter()
        plan = solve(gp.problem, self.solver, **self.options)
        if plan.status is Status.INFEASIBLE:
            raise _infeasible(gp, plan, budget_bytes, baseline)
        t_solved = time.perf_counter()
        evaluation = simulate(gp.problem, plan)
        fw, bw = partition(joint, gp, plan, evaluation, num_fwd_outputs=num_fwd_outputs)
        t_done = time.perf_counter()
        self.step = PlannedStep(
            graph_problem=gp, plan=plan, evaluation=evaluation, baseline_peak_bytes=baseline,
            budget_bytes=budget_bytes, forward=fw, backward=bw,
            timings=PlanTimings(trace_s=t_traced - self.started_s, profile_s=t_profiled - t_traced,
                                solve_s=t_solved - t_profiled, rewrite_s=t_done - t_solved),
        )
        return fw, bw


def _infeasible(gp: GraphProblem, plan: Plan, budget_bytes: int, baseline: int) -> InfeasibleBudgetError:
    """The error for a budget below every reachable peak, with the smallest one."""
    reach = min(
        [plan.peak_bytes]
        + [solve(gp.problem.with_budget(0), s).peak_bytes for s in ("all", "chen-greedy")]
    )
    return InfeasibleBudgetError(
        f"budget {format_bytes(budget_bytes)} is below the smallest reachable peak "
        f"{format_bytes(reach)} for this model and input shapes (no-remat peak "
        f"{format_bytes(baseline)}); raise the budget to at least {reach} bytes or shrink "
        "the batch",
        budget_bytes=budget_bytes, min_peak_bytes=reach,
    )
