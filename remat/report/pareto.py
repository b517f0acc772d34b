"""The budget/extra-compute trade-off of one planning problem: a sweep of budgets from
the no-remat peak down to the smallest reachable peak, kept as a Pareto front."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from remat.planning.floor import least_peak
from remat_solvers import Decision, Plan, Problem, Status, decisions_all, simulate, solve


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParetoPoint:
    """The cheapest plan found whose simulated peak fits `budget_bytes`."""

    budget_bytes: int
    predicted_peak_bytes: int
    extra_compute_s: float
    """Recompute seconds of the plan."""
    offload_s: float
    """Offload transfer seconds of the plan (0 without offload)."""
    extra_time_s: float
    """extra_compute_s + offload_s: simulate's objective, which never grows with the budget."""
    solver: str
    status: str
    """The status of the solve that found the plan (optimal, feasible)."""


def min_peak_bytes(problem: Problem) -> tuple[int, Plan]:
    """The smallest peak found and its plan: `remat_solvers.least_peak.least_peak_plan`, the floor
    the planner reports when it refuses a budget (deterministic; the planner's own
    search of this graph when it made one, `remat.planning.floor.least_peak`)."""
    plan = least_peak(problem)
    return plan.peak_bytes, plan


def sweep(
    problem: Problem,
    *,
    solver: str,
    points: int = 8,
    time_limit_s: float | None = 5.0,
    on_point: Callable[[int, int], None] | None = None,
    known: Sequence[Plan] = (),
    also_budgets: Sequence[int] = (),
) -> tuple[ParetoPoint, ...]:
    """`points` budgets evenly spaced from the floor to the no-remat peak, each solved
    with `solver`; every point reports the cheapest plan seen whose peak fits its budget
    (a plan found for a smaller budget fits a larger one), so extra compute never grows
    with the budget. `known`: plans already found (the plan being reported), so the
    front is never worse than them; `also_budgets` (their budgets) are added to the sweep
    when they lie inside it, so the curve passes through them. `on_point(done, total)`
    reports progress."""
    if points < 2:
        raise ValueError(f"points={points} must be at least 2 (the floor and the no-remat peak)")
    baseline_plan = _as_plan(problem, decisions_all(problem, Decision.SAVE), "none")
    floor, floor_plan = min_peak_bytes(problem)
    floor = min([floor, *(p.peak_bytes for p in known)])  # a known plan may peak lower
    top = max(baseline_plan.peak_bytes, floor)
    budgets = sorted({floor + (top - floor) * k // (points - 1) for k in range(points)}
                     | {b for b in also_budgets if floor < b < top})
    found: list[Plan] = [baseline_plan, floor_plan, *known]
    for done, budget in enumerate(budgets):
        if on_point is not None:
            on_point(done, len(budgets))
        if budget in also_budgets:
            continue  # a known plan was solved for this budget already
        plan = solve(problem.with_budget(budget), solver, time_limit_s=time_limit_s)
        if plan.status is not Status.INFEASIBLE:
            found.append(plan)
    out = []
    for budget in budgets:
        fitting = [p for p in found if p.peak_bytes <= budget]
        best = min(fitting, key=lambda p: (p.objective_s, p.peak_bytes))
        ev = simulate(problem, best)
        out.append(ParetoPoint(budget_bytes=budget, predicted_peak_bytes=best.peak_bytes,
                               extra_compute_s=ev.recompute_s, offload_s=ev.offload_s,
                               extra_time_s=best.objective_s, solver=best.solver,
                               status=best.status.value))
    return tuple(out)


def _as_plan(problem: Problem, decisions, solver: str) -> Plan:
    ev = simulate(problem, decisions)
    return Plan(decisions=decisions, status=Status.FEASIBLE, solver=solver, objective_s=ev.cost_s,
                peak_bytes=ev.peak_bytes)
