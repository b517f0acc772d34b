"""A floor that plans: when no plan fits, the smallest reachable peak and the plan that
reaches it, such that planning at exactly that budget succeeds.

The floor is `remat_solvers.least_peak.least_peak_plan`'s (deterministic, independent of the budget):
the failed solve's own smallest-peak plan is not a candidate, since it depends on the
budget asked for (Whisper tiny's differs between a 60% and a 1-byte budget, and a new
process planning at the smaller figure would be refused). So every
refusal of one graph states the same floor, in any process, and planning at it succeeds.
Floor plans found in this process are remembered per graph and search options: the next
refusal and the report's Pareto sweep (`least_peak`) reuse the search, and the next
solve of the same graph at a budget the plan fits (the user re-planning at the reported
floor) is warm-started with it (`hint`); a solve below it is not, so what it returns
does not depend on what this process planned before.

With `schedules` (the eager runtime's default), a budget no canonical plan fits is then
tried with the plans that recompute a value more than once (`remat_solvers.least_peak.
scheduled_plans`): the cheapest that fits is returned, and the floor is the least peak
over the canonical floor plan and those. A budget the canonical search fits never gets
one (they replay more, so they are never cheaper where a canonical plan fits). They
never offload: with offload allowed, the floor is the least of the canonical plan
(offloading) and the recompute-only scheduled ones."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from typing import Any

from remat.budget import format_bytes
from remat.errors import InfeasibleBudgetError
from remat.frontend.problem import GraphProblem
from remat.offload.costing import offload_hint
from remat_solvers import SOLVERS, Plan, Problem, Status, solve
from remat_solvers.base import finish
from remat_solvers.least_peak import FLOOR_TIME_LIMIT_S, least_peak_plan, peak_lower_bound, scheduled_plans

_REMEMBERED = 16
"""Graphs whose floor plan is remembered (most recent first out)."""
_FLOOR_PLANS: OrderedDict[tuple[Problem, float, int, bool], Plan] = OrderedDict()
"""(graph at budget 0, floor search time limit, seed, descended) -> the floor plan."""


def takes_hint(solver: str) -> bool:
    return solver in SOLVERS and "hint" in {f.name for f in dataclasses.fields(SOLVERS[solver].options_type)}


def solve_with_floor(problem: Problem, solver: str, options: dict[str, Any], *,
                     descend_floor: bool = True) -> Plan:
    """`solve`, warm-started with this graph's remembered floor plan (of the floor search
    with or without its descent, as `descend_floor` says) when the solver
    takes a hint, the caller gave none, and the plan fits the budget. Below its peak
    the hint would only choose which failing plan the solve returns, and the whole-step
    ledger's best-effort step runs the lower of that and recompute-everything
    (`lowest_found`), so a floor named in a fresh process would not plan in one that
    has remembered the floor plan: on composition 25 under inductor (135,560 B), the
    warm-started solve returns a plan of the same peak op by op that inductor's code
    holds 16,000 B higher (tests/runtime/test_compositions.py)."""
    remembered = _remembered(problem.with_budget(0), descend_floor)
    if (remembered is not None and remembered.peak_bytes <= problem.budget_bytes and takes_hint(solver)
            and "hint" not in options):
        options = {**options, "hint": remembered.decisions}
    return solve(problem, solver, **options)


def refused_without_solving(problem: Problem, solver: str, options: dict[str, Any], *,
                            descend_floor: bool = True) -> Plan | None:
    """For a budget below `remat_solvers.least_peak.peak_lower_bound` (bytes live at the end of every
    plan): the floor plan, INFEASIBLE at this budget, as the failed solve's answer,
    without the solve (no plan can fit, and `at_the_floor` answers from the floor plan
    alone); else None."""
    if problem.budget_bytes >= peak_lower_bound(problem):
        return None
    floor_plan = least_peak(problem, time_limit_s=options.get("time_limit_s"), seed=int(options.get("seed", 0)),
                            descend_floor=descend_floor)
    return dataclasses.replace(floor_plan, status=Status.INFEASIBLE, solver=solver, lower_bound_s=None)


def at_the_floor(gp: GraphProblem, failed: Plan, *, solver: str, options: dict[str, Any],
                 baseline_bytes: int, offload: Any = "auto",
                 schedules: bool = False, descend_floor: bool = True) -> tuple[Plan, InfeasibleBudgetError | None]:
    """After `failed` (INFEASIBLE): a plan that fits when the floor does (warm-started
    with the floor plan; with `schedules`, else the cheapest fitting scheduled plan),
    else `failed` and the error stating the floor and its plan. `descend_floor`: as
    `least_peak`'s."""
    started_s = time.perf_counter()
    problem = gp.problem
    floor_plan = least_peak(problem, time_limit_s=options.get("time_limit_s"), seed=int(options.get("seed", 0)),
                            descend_floor=descend_floor)
    if floor_plan.peak_bytes <= problem.budget_bytes:
        if takes_hint(solver):
            plan = solve(problem, solver, **{**options, "hint": floor_plan.decisions})
        else:
            plan = finish(problem, floor_plan.decisions, solver, started_s=started_s)
        if plan.status is not Status.INFEASIBLE:
            return plan, None
    if schedules:
        scheduled = scheduled_plans(problem, floor_plan.decisions)
        fitting = [p for p in scheduled if p.status is not Status.INFEASIBLE]
        if fitting:  # ties: the lower peak, then the earlier (deterministic)
            best = min(fitting, key=lambda p: (p.objective_s, p.peak_bytes))
            return dataclasses.replace(best, solver=f"{solver}+scheduled"), None
        least = min(scheduled, key=lambda p: (p.peak_bytes, p.objective_s), default=None)
        if least is not None and least.peak_bytes < floor_plan.peak_bytes:
            floor_plan = finish(problem.with_budget(least.peak_bytes), least.decisions, "floor",
                                started_s=started_s, schedule=least.schedule)
    reach = floor_plan.peak_bytes
    error = InfeasibleBudgetError(
        f"budget {format_bytes(problem.budget_bytes)} is below the smallest reachable peak "
        f"{format_bytes(reach)} for this model and input shapes (no-remat peak "
        f"{format_bytes(baseline_bytes)}); raise the budget to at least {reach} bytes or shrink "
        f"the batch{offload_hint(gp, reach, offload)}",
        budget_bytes=problem.budget_bytes, min_peak_bytes=reach, min_peak_plan=floor_plan,
    )
    return failed, error


def least_peak(problem: Problem, *, time_limit_s: float | None = None, seed: int = 0,
               descend_floor: bool = True) -> Plan:
    """`remat_solvers.least_peak.least_peak_plan(problem)` (time_limit_s None: FLOOR_TIME_LIMIT_S),
    searched once per graph and options in this process: a refusal, the re-plan at the
    floor and the report's Pareto sweep of one model share one search (on LLaMA-7B's
    32 layers, each search is seconds of ILP)."""
    started_s = time.perf_counter()
    limit = time_limit_s or FLOOR_TIME_LIMIT_S
    key = (problem.with_budget(0), float(limit), int(seed), bool(descend_floor))
    if key not in _FLOOR_PLANS:
        least = least_peak_plan(problem, time_limit_s=limit, seed=key[2], descend_floor=key[3])
        _remember(key, finish(key[0].with_budget(least.peak_bytes), least.decisions, "floor",
                              started_s=started_s))
    _FLOOR_PLANS.move_to_end(key)
    return _FLOOR_PLANS[key]


def _remembered(problem: Problem, descended: bool) -> Plan | None:
    """The most recent floor plan of this graph (at budget 0) searched with or without
    the descent, whatever its other options."""
    for (graph, _, _, descent), plan in reversed(_FLOOR_PLANS.items()):
        if graph == problem and descent == descended:
            return plan
    return None


def _remember(key: tuple[Problem, float, int, bool], plan: Plan) -> None:
    _FLOOR_PLANS[key] = plan
    _FLOOR_PLANS.move_to_end(key)
    while len(_FLOOR_PLANS) > _REMEMBERED:
        _FLOOR_PLANS.popitem(last=False)


def lowest_found(problem: Problem, failed: Plan) -> Plan:
    """Without the floor search (seconds of ILP per graph): the lower-peak plan of the
    failed solve's and recompute-everything, as a plan that fits at its own peak."""
    everything = solve(problem.with_budget(0), "all")
    best = min((failed, everything), key=lambda p: (p.peak_bytes, p.objective_s))
    return finish(problem.with_budget(best.peak_bytes), best.decisions, "floor", started_s=0.0)
