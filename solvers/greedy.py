"""`greedy`: cost-aware greedy rematerialization (bytes freed per second of recompute).

Chen's heuristics place checkpoints by memory alone; on real graphs most of the memory
sits in values that are nearly free to recompute (views aside: activations of pointwise
ops, norms, dropout-free elementwise chains), next to a few expensive ones (matmuls,
attention). This solver recomputes the cheapest bytes first:

  1. Candidates: (value, move) pairs, move RECOMPUTE for recomputable decision values
     (priced compute_s) and, where the problem allows it, OFFLOAD (priced by its exposed
     transfer, `Problem.store_s + reload_s`), ordered by out_bytes / price, highest
     first (ties: larger first, then id, RECOMPUTE before OFFLOAD).
  2. Shrink: walk the order, apply each move to a value still SAVEd, keep it when the
     simulated peak does not rise; stop as soon as the plan fits the budget.
  3. Trim: walk the recomputed and offloaded values from the most expensive down and
     flip each back to SAVE when the plan still fits (it was not needed).
The trim also runs from chen-greedy's and `all`'s plans (and, with offload allowed,
from offloading every movable value, the rest saved or recomputed); the cheapest plan that fits
wins (else the one with the smallest peak, INFEASIBLE).

Every step is checked by `simulate`, so the plan's claims are exact. It is a heuristic:
FEASIBLE at best, never OPTIMAL.
"""

from __future__ import annotations

import time

from remat_solvers.base import Options, WorkClock, finish
from remat_solvers.problem import Decision, Plan, Problem, decisions_all
from remat_solvers.simulate import PlanError, evaluate

_TINY_S = 1e-15  # keeps zero-cost values (views) first without dividing by zero


def solve_greedy(problem: Problem, options: Options) -> Plan:
    started = time.perf_counter()
    clock = WorkClock(options.time_limit_s)
    starts = [_shrink(problem, clock)]
    for name in ("chen-greedy", "all"):  # other starting points, trimmed the same way
        from remat_solvers.registry import get  # late: the registry imports this module

        plan = get(name).run(problem, options)
        clock.charge_s(plan.work_s)
        starts.append(dict(plan.decisions))
    if problem.offload_bandwidth_bytes_per_s is not None:  # everything movable offloaded,
        starts.append(decisions_all(problem, Decision.OFFLOAD))  # the rest saved or recomputed
        starts.append(_offload_else_recompute(problem))
    best: tuple[tuple[int, float, int], dict[int, Decision]] | None = None
    for decisions in starts:
        decisions = _trim(problem, decisions, clock)
        ev = evaluate(problem, decisions)
        key = (0 if ev.fits else 1, ev.cost_s if ev.fits else float(ev.peak_bytes), ev.peak_bytes)
        if best is None or key < best[0]:
            best = (key, decisions)
    return finish(problem, best[1], "greedy", started_s=started, work_s=clock.spent_s)


def repair(problem: Problem, decisions: dict[int, Decision], clock: WorkClock) -> dict[int, Decision]:
    """`decisions` made to fit, if the shrink can: its saved values dropped cheapest bytes
    first while the peak does not rise, then trimmed. `ilp` repairs the optimum of its
    relaxation this way (cheap, and close to the cheapest plan where the relaxation is
    tight): a fitting plan long before its search finds one as good."""
    return _trim(problem, _shrink(problem, clock, start=decisions), clock)


def _shrink(problem: Problem, clock: WorkClock, start: dict[int, Decision] | None = None) -> dict[int, Decision]:
    """Drop the cheapest bytes (RECOMPUTE or OFFLOAD) while the peak does not rise,
    until it fits; from `start` (default: everything saved)."""
    nodes = problem.nodes
    decisions = dict(start) if start is not None else decisions_all(problem, Decision.SAVE)
    peak = _peak(problem, decisions, clock)
    if peak is None:
        return decisions
    moves = [(i, Decision.RECOMPUTE) for i in problem.decision_ids
             if nodes[i].recomputable and nodes[i].alias_of is None]
    moves += [(i, Decision.OFFLOAD) for i in problem.decision_ids if Decision.OFFLOAD in problem.allowed(i)]
    order = sorted(moves, key=lambda m: (-nodes[m[0]].out_bytes / max(_price_s(problem, *m), _TINY_S),
                                         -nodes[m[0]].out_bytes, m[0], m[1] is Decision.OFFLOAD))
    # Second pass (offload only): a recomputed value's recomputation brings its inputs
    # back too, so below the recompute-only floor swap RECOMPUTE for OFFLOAD where that
    # strictly lowers the peak.
    second = [m for m in order if m[1] is Decision.OFFLOAD]
    for (i, move), strict in [(m, False) for m in order] + [(m, True) for m in second]:
        if peak <= problem.budget_bytes or clock.expired:
            break
        before = decisions[i]
        if before is move or (before is not Decision.SAVE and not strict):
            continue
        decisions[i] = move
        new_peak = _peak(problem, decisions, clock)
        if new_peak is not None and (new_peak < peak or (new_peak == peak and not strict)):
            peak = new_peak
        else:
            decisions[i] = before
    return decisions


def _trim(problem: Problem, decisions: dict[int, Decision], clock: WorkClock) -> dict[int, Decision]:
    """If the plan fits, flip recomputed values back to SAVE, most expensive first,
    while it still fits (not those that cost at least as much to save, `Node.save_s`)."""
    decisions = dict(decisions)
    if (_peak(problem, decisions, clock) or problem.budget_bytes + 1) > problem.budget_bytes:
        return decisions
    nodes = problem.nodes
    dropped = [i for i, d in decisions.items()
               if (d is Decision.RECOMPUTE and nodes[i].recomputable) or d is Decision.OFFLOAD]
    for i in sorted(dropped, key=lambda i: (-_price_s(problem, i, decisions[i]), nodes[i].out_bytes, i)):
        if clock.expired:
            break
        if nodes[i].save_s and nodes[i].save_s >= _price_s(problem, i, decisions[i]):
            continue  # saving it costs no less (the compiled-traffic model's pointwise values)
        move, decisions[i] = decisions[i], Decision.SAVE
        new_peak = _peak(problem, decisions, clock)
        if new_peak is None or new_peak > problem.budget_bytes:
            decisions[i] = move
    return decisions


def _price_s(problem: Problem, i: int, move: Decision) -> float:
    """What dropping value i this way adds to the step (if backward needs it)."""
    if move is Decision.OFFLOAD:
        return problem.store_s(i) + problem.reload_s(i)
    return problem.nodes[i].compute_s


def _offload_else_recompute(problem: Problem) -> dict[int, Decision]:
    """Every movable value offloaded, the others recomputed where they can be."""
    out = {}
    for i in problem.decision_ids:
        if Decision.OFFLOAD in problem.allowed(i):
            out[i] = Decision.OFFLOAD
        else:
            out[i] = Decision.RECOMPUTE if problem.nodes[i].recomputable else Decision.SAVE
    return out


def _peak(problem: Problem, decisions: dict[int, Decision], clock: WorkClock) -> int | None:
    try:
        ev = evaluate(problem, decisions)
    except PlanError:
        return None
    clock.charge_steps(len(ev.steps))
    return ev.peak_bytes
