"""Prefetch reloads: the same decisions, with each reload issued early enough that its
copy overlaps backward compute, as far as the budget allows.

The canonical schedule reloads an offloaded value just before its first backward
reader, which then waits for the whole copy (`Problem.reload_s`). Issuing the reload
earlier hides the copy behind the backward steps in between, at the price of holding
the value on the device from the earlier step on. `prefetch` returns the plan with an
explicit schedule (`Plan.schedule`) in which every reload sits at the latest step that
hides it as well as any step allowed under the budget; `simulate` prices it (memory of
the early reload; the link as a queue of copies; see `simulate._exposed_reload_s`).

Per reload, in schedule order (a reload never passes an earlier one, so the link serves
them in the same order), two facts make binary search exact:
- the peak can only grow as the reload moves earlier (its live range only grows), so
  the earliest position under the budget is found by bisection;
- the exposed seconds can only shrink as it moves earlier (it is issued no later, and
  the reloads after it find the link free no later), so the latest position that is as
  good as that earliest one is found by bisection too.
The decisions never change: exact solvers stay exact over their own plan space, and
this pass only lowers the objective (a schedule that is not better is not returned).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from solvers.problem import Decision, Evaluation, Phase, Plan, Problem, StepKind
from solvers.simulate import evaluate


def prefetch(problem: Problem, plan: Plan) -> Plan:
    """`plan` with its reloads issued early (an explicit schedule), when that lowers its
    exposed transfer seconds within `problem.budget_bytes`; otherwise `plan` itself."""
    if problem.offload_bandwidth_bytes_per_s is None or Decision.OFFLOAD not in plan.decisions.values():
        return plan
    before = evaluate(problem, plan.decisions, plan.schedule)
    if not before.fits:
        return plan
    schedule = _backward_schedule(problem, before)
    kinds = [s.kind for s in before.steps[len(problem.forward_ids):]]
    floor = 0  # a reload is never moved before an earlier one
    for p in [k for k, kind in enumerate(kinds) if kind is StepKind.RELOAD]:
        q = _earliest_fitting(problem, plan, schedule, p, floor)
        q = _latest_as_good(problem, plan, schedule, p, q)
        schedule = _moved(schedule, p, q)
        floor = q + 1
    after = evaluate(problem, plan.decisions, schedule)
    if not after.fits or after.cost_s >= before.cost_s:
        return plan
    return _with_schedule(plan, schedule, after)


def _backward_schedule(problem: Problem, ev: Evaluation) -> list[int]:
    """The backward part of an evaluated schedule, as `Plan.schedule` writes it."""
    return [s.node_id for s in ev.steps[len(problem.forward_ids):]]


def _moved(schedule: Sequence[int], p: int, q: int) -> list[int]:
    """`schedule` with its step p moved to position q <= p."""
    out = list(schedule)
    out.insert(q, out.pop(p))
    return out


def _evaluate_moved(problem: Problem, plan: Plan, schedule: Sequence[int], p: int, q: int) -> Evaluation:
    return evaluate(problem, plan.decisions, _moved(schedule, p, q))


def _earliest_fitting(problem: Problem, plan: Plan, schedule: Sequence[int], p: int, floor: int) -> int:
    """The earliest q in [floor, p] whose peak fits the budget (q = p fits: it is the
    current schedule, and it was checked to fit)."""
    lo, hi = floor, p
    while lo < hi:
        mid = (lo + hi) // 2
        if _evaluate_moved(problem, plan, schedule, p, mid).fits:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _latest_as_good(problem: Problem, plan: Plan, schedule: Sequence[int], p: int, q: int) -> int:
    """The latest position in [q, p] with the exposed seconds of position q: no earlier
    than needed, so the reload holds its bytes no longer than it helps."""
    best = _evaluate_moved(problem, plan, schedule, p, q).offload_s
    lo, hi = q, p
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _evaluate_moved(problem, plan, schedule, p, mid).offload_s <= best:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _with_schedule(plan: Plan, schedule: Sequence[int], ev: Evaluation) -> Plan:
    """The plan with `schedule` and the claims simulate makes for it. Status and lower
    bound stay the solver's, over its own plan space (a bound above the new objective
    is dropped: it no longer bounds it)."""
    bound = plan.lower_bound_s
    return dataclasses.replace(
        plan, schedule=tuple(schedule), objective_s=ev.cost_s, peak_bytes=ev.peak_bytes,
        lower_bound_s=bound if bound is None or bound <= ev.cost_s else None,
    )


def prefetched_ids(problem: Problem, ev: Evaluation) -> tuple[int, ...]:
    """Offloaded values whose reload is issued before a BACKWARD step that precedes its
    first reader (i.e. really prefetched), in schedule order."""
    out = []
    steps = ev.steps[len(problem.forward_ids):]
    nodes = problem.nodes
    for k, step in enumerate(steps):
        if step.kind is not StepKind.RELOAD:
            continue
        for later in steps[k + 1:]:
            if later.kind is StepKind.RELOAD:
                continue
            if step.node_id in nodes[later.node_id].inputs:
                break
            if later.kind is StepKind.BACKWARD and nodes[later.node_id].phase is Phase.BACKWARD:
                out.append(step.node_id)
                break
    return tuple(out)


__all__ = ["prefetch", "prefetched_ids"]
