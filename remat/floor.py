"""A floor that plans: when no plan fits, the smallest reachable peak and the plan that
reaches it, such that planning at exactly that budget succeeds.

The floor comes from `solvers.floor.least_peak_plan` (deterministic, independent of the
budget) and from the failed solve's own smallest-peak plan. Floor plans found in this
process are remembered per graph, so the next solve of the same graph (the user
re-planning at the reported floor) is warm-started with it (`hint`) and returns it or
a cheaper plan; a different process reaches the same floor through the deterministic
search (unless the failed solve happened to peak lower; then pass
`hint=error.min_peak_plan` to `remat.plan`)."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Any

from remat.budget import format_bytes
from remat.errors import InfeasibleBudgetError
from remat.frontend.offloading import offload_hint
from remat.frontend.problem import GraphProblem
from solvers import SOLVERS, Plan, Problem, Status, solve
from solvers.base import finish
from solvers.floor import FLOOR_TIME_LIMIT_S, least_peak_plan

_REMEMBERED = 16
"""Graphs whose floor plan is remembered (most recent first out)."""
_FLOOR_PLANS: OrderedDict[Problem, Plan] = OrderedDict()


def takes_hint(solver: str) -> bool:
    return solver in SOLVERS and "hint" in {f.name for f in dataclasses.fields(SOLVERS[solver].options_type)}


def solve_with_floor(problem: Problem, solver: str, options: dict[str, Any]) -> Plan:
    """`solve`, warm-started with this graph's remembered floor plan when the solver
    takes a hint and the caller gave none."""
    remembered = _FLOOR_PLANS.get(problem.with_budget(0))
    if remembered is not None and takes_hint(solver) and "hint" not in options:
        options = {**options, "hint": remembered.decisions}
    return solve(problem, solver, **options)


def at_the_floor(gp: GraphProblem, failed: Plan, *, solver: str, options: dict[str, Any],
                 baseline_bytes: int, offload: Any = "auto") -> tuple[Plan, InfeasibleBudgetError | None]:
    """After `failed` (INFEASIBLE): a plan that fits when the floor does (warm-started
    with the floor plan), else `failed` and the error stating the floor and its plan."""
    started_s = time.perf_counter()
    problem = gp.problem
    key = problem.with_budget(0)
    limit = options.get("time_limit_s") or FLOOR_TIME_LIMIT_S
    remembered = _FLOOR_PLANS.get(key)
    if remembered is not None and remembered.peak_bytes <= problem.budget_bytes:
        # it fits: no new search (inductor's loop plans one problem at several budgets)
        candidates = [remembered, failed]
    else:
        candidates = [least_peak_plan(problem, time_limit_s=limit, seed=options.get("seed", 0)), failed]
        if remembered is not None:
            candidates.append(remembered)
    best = min(candidates, key=lambda p: (p.peak_bytes, p.objective_s))
    floor_plan = finish(problem.with_budget(best.peak_bytes), best.decisions, "floor", started_s=started_s)
    _remember(key, floor_plan)
    if floor_plan.peak_bytes <= problem.budget_bytes:
        if takes_hint(solver):
            plan = solve(problem, solver, **{**options, "hint": floor_plan.decisions})
        else:
            plan = finish(problem, floor_plan.decisions, solver, started_s=started_s)
        if plan.status is not Status.INFEASIBLE:
            return plan, None
    reach = floor_plan.peak_bytes
    error = InfeasibleBudgetError(
        f"budget {format_bytes(problem.budget_bytes)} is below the smallest reachable peak "
        f"{format_bytes(reach)} for this model and input shapes (no-remat peak "
        f"{format_bytes(baseline_bytes)}); raise the budget to at least {reach} bytes or shrink "
        f"the batch{offload_hint(gp, reach, offload)}",
        budget_bytes=problem.budget_bytes, min_peak_bytes=reach, min_peak_plan=floor_plan,
    )
    return failed, error


def _remember(key: Problem, plan: Plan) -> None:
    _FLOOR_PLANS[key] = plan
    _FLOOR_PLANS.move_to_end(key)
    while len(_FLOOR_PLANS) > _REMEMBERED:
        _FLOOR_PLANS.popitem(last=False)

