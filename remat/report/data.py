"""`Report`: the one frozen record of a planned step that every writer reads (text,
JSON, HTML, PNG). Built from a `PlannedStep` (what `remat.plan` decided) plus the
model's parameter counts, the training options and an optional Pareto sweep."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from remat.report.breakdown import Breakdown, TrainingOptions, activations_at_peak, count_parameters, model_state
from remat.report.pareto import ParetoPoint, min_peak_bytes, sweep
from remat_solvers import Decision, Phase

if TYPE_CHECKING:
    from remat.partitioner import PlannedStep


@dataclasses.dataclass(frozen=True, kw_only=True)
class TimelinePoint:
    """Live device bytes while one step of the simulated schedule runs."""

    step: int
    kind: str
    """forward, backward, recompute or reload."""
    name: str
    """The fx value the step makes."""
    live_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecisionRow:
    """What the plan does with one forward value that backward may need."""

    name: str
    bytes: int
    decision: str
    """save, recompute or offload."""
    module: str
    """Dotted path of the innermost submodule that made it ('' for the model itself)."""
    module_class: str
    source: str
    """'file:line' of the code that made it (the module's forward when torch recorded no
    stack), or ''."""
    reason: str
    """Why it may not be recomputed ('random', 'mutating', ...), or ''."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
    """Everything the writers show. Numbers are `remat.plan`'s for the same model,
    inputs and budget (the plan, its simulation, the budget it resolved)."""

    model: str
    """What was planned (the CLI's TARGET, or the model's class name)."""
    budget_bytes: int
    baseline_peak_bytes: int
    """Simulated peak with every activation saved (no remat)."""
    predicted_peak_bytes: int
    min_peak_bytes: int
    """Smallest peak any plan found reaches (the floor of the Pareto sweep)."""
    solver: str
    status: str
    solve_s: float
    extra_compute_s: float
    """Recompute seconds of the plan under the cost model."""
    offload_s: float
    peak_step: int
    cost_model: str
    """How per-op seconds were estimated (measured roofline of this machine, or a named device)."""
    fake: bool
    """Planned on fake/meta tensors: no weight allocated, no kernel run, no measurement."""
    breakdown: Breakdown
    timeline: tuple[TimelinePoint, ...]
    decisions: tuple[DecisionRow, ...]
    pareto: tuple[ParetoPoint, ...]
    planning_s: dict[str, float]
    """Seconds per stage: trace, profile, solve, rewrite."""
    offloaded_bytes: int = 0
    """Bytes the plan moves to host memory (each way)."""
    transfer_s: float = 0.0
    """Offload transfer seconds out and back, in full; `offload_s` is the exposed part."""
    requested_budget_bytes: int | None = None
    """The budget asked for when it is below every reachable peak (`status` "infeasible"):
    the plan shown is then the one at the floor, `budget_bytes` = `min_peak_bytes`. None
    when the budget asked for was planned."""


def below_the_floor(report: Report, requested_budget_bytes: int) -> Report:
    """`report` (of the plan at the floor) as the answer to a budget below it: status
    "infeasible", the budget asked for beside the floor that was planned."""
    return dataclasses.replace(report, status="infeasible", requested_budget_bytes=requested_budget_bytes)


def build_report(
    step: "PlannedStep",
    model: nn.Module,
    *,
    name: str = "",
    options: TrainingOptions = TrainingOptions(),
    pareto_points: int = 8,
    pareto_time_limit_s: float | None = 5.0,
    cost_model: str = "roofline of this machine (measured)",
    fake: bool = False,
    on_pareto_point: Callable[[int, int], None] | None = None,
    solver: str | None = None,
) -> Report:
    """The Report of `step` (a plan of `model`); `pareto_points=0` skips the sweep.
    `solver`: the registered solver the sweep plans with (default: the plan's; a plan from
    the floor search carries a name of its own, such as "auto+scheduled")."""
    gp, plan, ev = step.graph_problem, step.plan, step.evaluation
    problem = gp.problem
    if pareto_points:
        pareto = sweep(problem, solver=solver or plan.solver, points=pareto_points,
                       time_limit_s=pareto_time_limit_s, on_point=on_pareto_point, known=(plan,),
                       also_budgets=(step.budget_bytes,))
        floor = pareto[0].predicted_peak_bytes
    else:
        pareto, floor = (), min_peak_bytes(problem)[0]
    t = step.timings
    return Report(
        model=name or type(model).__name__,
        budget_bytes=step.budget_bytes,
        baseline_peak_bytes=step.baseline_peak_bytes,
        predicted_peak_bytes=ev.peak_bytes,
        min_peak_bytes=min(floor, ev.peak_bytes),
        solver=plan.solver,
        status=plan.status.value,
        solve_s=plan.solve_s,
        extra_compute_s=ev.recompute_s,
        offload_s=ev.offload_s,
        peak_step=ev.peak_step,
        cost_model=cost_model,
        fake=fake,
        breakdown=_breakdown(step, model, options),
        timeline=_timeline(step),
        decisions=_decisions(step),
        pareto=pareto,
        planning_s={"trace": t.trace_s, "profile": t.profile_s, "solve": t.solve_s, "rewrite": t.rewrite_s},
        offloaded_bytes=ev.offload_bytes,
        transfer_s=ev.transfer_s,
    )


def _breakdown(step: "PlannedStep", model: nn.Module, options: TrainingOptions) -> Breakdown:
    trainable, frozen, buffers = count_parameters(model)
    state = model_state(trainable, frozen, options)
    live = activations_at_peak(step.graph_problem.problem, step.plan.decisions, step.evaluation)
    return Breakdown(
        trainable_params=trainable, frozen_params=frozen, buffers_bytes=buffers,
        inputs_bytes=live["inputs"], activations_saved_bytes=live["saved"],
        activations_recomputed_bytes=live["recomputed"], activations_offloaded_bytes=live["offloaded"],
        temporaries_bytes=live["temporaries"], peak_step=step.evaluation.peak_step, options=options,
        **state,
    )


def _timeline(step: "PlannedStep") -> tuple[TimelinePoint, ...]:
    nodes = step.graph_problem.problem.nodes
    ev = step.evaluation
    return tuple(
        TimelinePoint(step=k, kind=s.kind.value, name=nodes[s.node_id].name, live_bytes=live)
        for k, (s, live) in enumerate(zip(ev.steps, ev.timeline))
    )


def _decisions(step: "PlannedStep") -> tuple[DecisionRow, ...]:
    gp = step.graph_problem
    nodes = gp.problem.nodes
    meta = {n.name: n.meta for g in (step.forward.graph, step.backward.graph) for n in g.nodes}
    rows = []
    for i, d in sorted(step.plan.decisions.items()):
        if nodes[i].phase is not Phase.FORWARD:
            continue
        module, cls, where = _module_of(meta.get(gp.value_name[i], {}))
        source = gp.source[i]
        # profile.source_line falls back to 'path (Class) file:line'; keep just file:line
        if where and source.endswith(where):
            source = where
        rows.append(DecisionRow(
            name=gp.value_name[i], bytes=nodes[i].out_bytes if nodes[i].alias_of is None else 0,
            decision=d.value, module=module, module_class=cls, source=source or where,
            reason=gp.never_replay.get(i, ""),
        ))
    return tuple(rows)


def _module_of(meta: dict) -> tuple[str, str, str]:
    """(path, class name, 'file:line') of the innermost module in `nn_module_stack`."""
    stack = meta.get("nn_module_stack") or {}
    if not stack:
        return "", "", ""
    entry = list(stack.values())[-1]
    path, cls = entry[0], entry[1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
    where = entry[2] if len(entry) > 2 else ""
    return ("" if path == "<model>" else path), name, where


def decision_counts(report: Report) -> dict[str, int]:
    """Decision -> number of values."""
    out = {d.value: 0 for d in Decision}
    for row in report.decisions:
        out[row.decision] = out.get(row.decision, 0) + 1
    return out
