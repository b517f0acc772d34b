"""`greedy`: cost-aware greedy rematerialization (bytes freed per second of recompute).

Chen's heuristics place checkpoints by memory alone; on real graphs most of the memory
sits in values that are nearly free to recompute (views aside: activations of pointwise
ops, norms, dropout-free elementwise chains), next to a few expensive ones (matmuls,
attention). This solver recomputes the cheapest bytes first:

  1. Candidates: recomputable decision values, ordered by out_bytes / compute_s,
     highest first (ties: larger first, then id).
  2. Shrink: walk the order, flip each to RECOMPUTE, keep the flip when the simulated
     peak does not rise; stop as soon as the plan fits the budget.
  3. Trim: walk the recomputed values from the most expensive down and flip each back
     to SAVE when the plan still fits (it was not needed).
The trim also runs from chen-greedy's and `all`'s plans; the cheapest plan that fits
wins (else the one with the smallest peak, INFEASIBLE).

Every step is checked by `simulate`, so the plan's claims are exact. It is a heuristic:
FEASIBLE at best, never OPTIMAL.
"""

from __future__ import annotations

import time

from solvers.base import Options, WorkClock, finish
from solvers.problem import Decision, Plan, Problem, decisions_all
from solvers.simulate import PlanError, evaluate

_TINY_S = 1e-15  # keeps zero-cost values (views) first without dividing by zero


def solve_greedy(problem: Problem, options: Options) -> Plan:
    started = time.perf_counter()
    clock = WorkClock(options.time_limit_s)
    starts = [_shrink(problem, clock)]
    for name in ("chen-greedy", "all"):  # other starting points, trimmed the same way
        from solvers.registry import get  # late: the registry imports this module

        plan = get(name).run(problem, options)
        clock.charge_s(plan.work_s)
        starts.append(dict(plan.decisions))
    best: tuple[tuple[int, float, int], dict[int, Decision]] | None = None
    for decisions in starts:
        decisions = _trim(problem, decisions, clock)
        ev = evaluate(problem, decisions)
        key = (0 if ev.fits else 1, ev.cost_s if ev.fits else float(ev.peak_bytes), ev.peak_bytes)
        if best is None or key < best[0]:
            best = (key, decisions)
    return finish(problem, best[1], "greedy", started_s=started, work_s=clock.spent_s)


def _shrink(problem: Problem, clock: WorkClock) -> dict[int, Decision]:
    """Flip the cheapest bytes to RECOMPUTE while the peak does not rise, until it fits."""
    nodes = problem.nodes
    decisions = decisions_all(problem, Decision.SAVE)
    peak = _peak(problem, decisions, clock)
    order = sorted(
        (i for i in problem.decision_ids if nodes[i].recomputable and nodes[i].alias_of is None),
        key=lambda i: (-nodes[i].out_bytes / max(nodes[i].compute_s, _TINY_S), -nodes[i].out_bytes, i),
    )
    for i in order:
        if peak <= problem.budget_bytes or clock.expired:
            break
        decisions[i] = Decision.RECOMPUTE
        new_peak = _peak(problem, decisions, clock)
        if new_peak is not None and new_peak <= peak:
            peak = new_peak
        else:
            decisions[i] = Decision.SAVE
    return decisions


def _trim(problem: Problem, decisions: dict[int, Decision], clock: WorkClock) -> dict[int, Decision]:
    """If the plan fits, flip recomputed values back to SAVE, most expensive first,
    while it still fits."""
    decisions = dict(decisions)
    if (_peak(problem, decisions, clock) or problem.budget_bytes + 1) > problem.budget_bytes:
        return decisions
    nodes = problem.nodes
    recomputed = [i for i, d in decisions.items() if d is Decision.RECOMPUTE and nodes[i].recomputable]
    for i in sorted(recomputed, key=lambda i: (-nodes[i].compute_s, nodes[i].out_bytes, i)):
        if clock.expired:
            break
        decisions[i] = Decision.SAVE
        new_peak = _peak(problem, decisions, clock)
        if new_peak is None or new_peak > problem.budget_bytes:
            decisions[i] = Decision.RECOMPUTE
    return decisions


def _peak(problem: Problem, decisions: dict[int, Decision], clock: WorkClock) -> int | None:
    try:
        ev = evaluate(problem, decisions)
    except PlanError:
        return None
    clock.charge_steps(len(ev.steps))
    return ev.peak_bytes
