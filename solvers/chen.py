"""Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost") heuristics.

`chen-sqrt` saves about sqrt(N) evenly spaced segment boundaries; `chen-greedy` is the
paper's Algorithm 3 (memory-threshold segmentation) with a search over the threshold.
Both decide SAVE or RECOMPUTE only (never OFFLOAD) and always SAVE the non-recomputable
values that backward, or a recomputation, needs.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Mapping, Sequence

from remat_solvers.base import Options, WorkClock, finish
from remat_solvers.problem import Decision, Phase, Plan, Problem, decisions_all
from remat_solvers.simulate import evaluate

GREEDY_GRID_POINTS = 18
"""Geometric threshold points per candidate set; with two candidate sets and the fixed
points (0, sqrt(x*y), infinity, none, all) at most 44 simulations (~40 ms each at 10k
nodes)."""


def _forward_last_use(problem: Problem) -> dict[int, int]:
    """Forward id -> the last forward node that reads it (itself if none does)."""
    last_use = {i: i for i in problem.forward_ids}
    for i in problem.forward_ids:
        for j in problem.nodes[i].inputs:
            if problem.nodes[j].phase is Phase.FORWARD and last_use[j] < i:
                last_use[j] = i
    return last_use


def cut_candidates(problem: Problem) -> tuple[int, ...]:
    """Decision values v after which the forward linearization can be cut: no forward value
    before v is read by a forward node after v (v is an articulation point; PARAM/INPUT
    values are live all step and do not count)."""
    decided = set(problem.decision_ids)
    last_use = _forward_last_use(problem)
    out = []
    reach = -1  # the furthest forward reader of any value strictly before the current one
    for v in problem.forward_ids:
        if reach <= v and v in decided:
            out.append(v)
        reach = max(reach, last_use[v])
    return tuple(out)


LOOSE_CUT_FRACTION = 0.25
"""A loose cut after v tolerates crossing values of at most this fraction of v's bytes."""


def loose_cut_candidates(problem: Problem, fraction: float = LOOSE_CUT_FRACTION) -> tuple[int, ...]:
    """Like `cut_candidates`, but a cut after v may also be crossed by values much smaller
    than v (at most `fraction` of its bytes). Transformers share small values across
    every block (rotary cos/sin, masks), so they have no strict cut points at all; the
    block boundaries are loose ones. Crossing values are recomputed or kept like any
    other, `simulate` accounts for them."""
    nodes = problem.nodes
    decided = set(problem.decision_ids)
    last_use = _forward_last_use(problem)
    out = []
    alive: list[tuple[int, int, int]] = []  # max-heap of (-bytes, -last_use, id) crossing so far
    for v in problem.forward_ids:
        while alive and -alive[0][1] <= v:  # lazily drop values no longer read after v
            heapq.heappop(alive)
        biggest = -alive[0][0] if alive else 0
        if v in decided and biggest <= fraction * nodes[v].out_bytes:
            out.append(v)
        if last_use[v] > v:  # a view crossing the cut keeps its base's storage alive
            heapq.heappush(alive, (-nodes[problem.storage_of[v]].out_bytes, -last_use[v], v))
    return tuple(out)


def keep_required(problem: Problem, decisions: Mapping[int, Decision]) -> dict[int, Decision]:
    """`decisions` with every non-recomputable value that backward reads, or that a
    recomputation reaches, switched to SAVE (dropping it would be a PlanError)."""
    out = dict(decisions)
    nodes = problem.nodes
    stack = [i for i in problem.needed_ids if out[i] is Decision.RECOMPUTE]
    seen = set(stack)
    while stack:
        i = stack.pop()
        if not nodes[i].recomputable:
            out[i] = Decision.SAVE
            continue
        for j in nodes[i].inputs:
            if nodes[j].phase is Phase.FORWARD and j not in seen and out[j] is Decision.RECOMPUTE:
                seen.add(j)
                stack.append(j)
    return out


def _plan_saving(problem: Problem, saved: Iterable[int]) -> dict[int, Decision]:
    """SAVE `saved`, RECOMPUTE every other decision value, then keep what is required."""
    saved = set(saved)
    return keep_required(problem, {
        i: Decision.SAVE if i in saved else Decision.RECOMPUTE for i in problem.decision_ids
    })


def _evenly_spaced(candidates: Sequence[int], k: int) -> list[int]:
    """k of `candidates` splitting them into k+1 runs of near-equal length."""
    m = len(candidates)
    return [candidates[(j + 1) * m // (k + 1) - 1] for j in range(k)] if m else []


def solve_chen_sqrt(problem: Problem, options: Options) -> Plan:
    """Save round(sqrt(C)) evenly spaced cut points out of the C allowed ones.

    Fallback: a graph with no cut point (skip connections everywhere) would be one
    segment, i.e. recompute everything; instead every recomputable decision value is
    treated as a candidate (a saved value that is not a true cut still shortens the
    recomputations that reach it; simulate accounts for the longer ones)."""
    started = time.perf_counter()
    candidates = cut_candidates(problem)
    if not candidates:
        candidates = tuple(i for i in problem.decision_ids if problem.nodes[i].recomputable)
    k = round(math.sqrt(len(candidates)))
    decisions = _plan_saving(problem, _evenly_spaced(candidates, k))
    return finish(problem, decisions, "chen-sqrt", started_s=started)


def greedy_segments(problem: Problem, candidates: Iterable[int], threshold_bytes: float) -> list[int]:
    """Chen 2016 Algorithm 3: walk the decision values in order accumulating their
    storage bytes ("temp <- temp + size-of-output(v)"); at a candidate with temp > B,
    store it as a stage split and reset temp. Returns the values to SAVE."""
    candidates = set(candidates)
    nodes = problem.nodes
    saved, temp = [], 0
    for v in problem.decision_ids:
        if nodes[v].alias_of is None:  # a view adds no storage
            temp += nodes[v].out_bytes
        if v in candidates and temp > threshold_bytes:
            saved.append(v)
            temp = 0
    return saved


def _thresholds(problem: Problem) -> list[float]:
    """0, the paper's sqrt(x*y) (x, y: stored bytes and largest stage at B = 0), a
    geometric grid between the smallest and the total storage, and infinity."""
    sizes = [problem.nodes[v].out_bytes for v in problem.decision_ids
             if problem.nodes[v].alias_of is None and problem.nodes[v].out_bytes > 0]
    if not sizes:
        return [0.0, math.inf]
    lo, hi = min(sizes), sum(sizes)
    grid = [0.0, math.sqrt(hi * max(sizes))]
    if hi > lo:
        ratio = (hi / lo) ** (1 / (GREEDY_GRID_POINTS - 1))
        grid += [lo * ratio**k for k in range(GREEDY_GRID_POINTS)]
    return grid + [math.inf]


def solve_chen_greedy(problem: Problem, options: Options) -> Plan:
    """Algorithm 3 over a grid of thresholds B (both with the cut points as the
    candidate set, as in the paper, and with every decision value as a candidate, for
    graphs without cut points), plus the `none` and `all` plans; the cheapest plan that
    fits (ties: lower peak) wins, else the lowest peak (INFEASIBLE). Respects
    `options.time_limit_s` after the `none` and `all` plans."""
    started = time.perf_counter()
    clock = WorkClock(options.time_limit_s)
    everything = [i for i in problem.decision_ids if problem.nodes[i].recomputable]
    candidate_sets = [everything]
    for cuts in (loose_cut_candidates(problem), cut_candidates(problem)):
        if cuts and len(cuts) < len(everything) and list(cuts) not in candidate_sets:
            candidate_sets.insert(0, list(cuts))
    plans = [decisions_all(problem, Decision.SAVE), decisions_all(problem, Decision.RECOMPUTE)]
    plans += [
        _plan_saving(problem, greedy_segments(problem, cands, b))
        for cands in candidate_sets
        for b in _thresholds(problem)
    ]
    best_fit, best_any = None, None
    seen: set[tuple[Decision, ...]] = set()
    for k, decisions in enumerate(plans):
        if k >= 2 and clock.expired:
            break
        key = tuple(decisions.values())
        if key in seen:
            continue
        seen.add(key)
        ev = evaluate(problem, decisions)
        clock.charge_steps(len(ev.steps))
        if ev.fits and (best_fit is None or (ev.cost_s, ev.peak_bytes) < best_fit[0]):
            best_fit = ((ev.cost_s, ev.peak_bytes), decisions)
        if best_any is None or (ev.peak_bytes, ev.cost_s) < best_any[0]:
            best_any = ((ev.peak_bytes, ev.cost_s), decisions)
    chosen = best_fit if best_fit is not None else best_any
    return finish(problem, chosen[1], "chen-greedy", started_s=started, work_s=clock.spent_s)
