"""`dp`: exact dynamic programming over chains and block sequences.

Plan space: simulate's canonical plan space (every decision value SAVE / RECOMPUTE /
OFFLOAD where allowed, canonical schedule), the same space `brute` enumerates. `dp`
splits the problem at articulation points into blocks (structure.py; a chain is a
sequence of one-value blocks, a transformer one block per residual branch). For each
block it enumerates the block's configurations (decisions of irrelevant values fixed)
and replays the canonical schedule of the block's phases exactly (local.py). The
earlier blocks affect block b only through a constant K (bytes they keep alive) and,
when the boundary a_{b-1} is dropped, the profile of recomputing it (P, N, NR), so a
forward DP over blocks keeps, per (decision of a_b, "the suffix brings a_b back"), the
Pareto front of (K, cost, P, N, NR): exact, in integer bytes, with no discretization
(fronts.py). The cost counts recompute, transfer and save seconds (`Node.save_s` of
the SAVE values the backward reads, "compiled-traffic"): each is a function of one
value's decision, charged to the block owning the value. Speed: identical layers share one table (their static bytes differ by
a constant); a backward pass over a relaxation (exact K when the kept bytes have a
usable gcd, cascade summaries at their floors) bounds the cost of finishing from any
partial plan; a beam search guided by it gives a plan, which is returned at once when
it meets the bound, else the exact pass drops every partial plan whose cost plus bound
exceeds the beam's cost. 10,000-node transformer stacks solve in 1-2 s.

What dp cannot handle it refuses with UnsupportedProblem (no block sequence, a block
with more configurations than `max_block_configs`). Its claims are checked: the final
plan goes through simulate (base.finish) and must match the DP's predicted cost and
peak, else it is returned FEASIBLE without a bound (and a warning is logged).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping

from remat_solvers.base import Options, WorkClock, finish
from remat_solvers.dp import fronts
from remat_solvers.dp.fronts import DROPPED, local_peak, next_summary
from remat_solvers.dp.local import NEG, BlockEvaluator, Local
from remat_solvers.dp.structure import analyze
from remat_solvers.dp.tables import block_tables
from remat_solvers.problem import Decision, Plan, Problem
from remat_solvers.simulate import evaluate

log = logging.getLogger(__name__)

BEAM_WIDTH = 16
"""Entries per outcome key in the beam search that finds the first upper bound."""
FIRST_GRID = 1 << 14
"""Points over the budget of the first completion bound (K rounded down to budget /
FIRST_GRID, unless the gcd of the kept bytes gives at most 2^16 points: exact)."""
FINE_GRIDS = (1 << 16, 1 << 17)
"""Grids of the finer completion bounds tried in turn when an exact run under the
coarser one outgrows MAX_FRONT. Each block loses up to one grid step of K to
rounding, so deep stacks need fine grids (GPT-2-24 at 50%: 2.3% below the optimum on
4,096 points, 0.4% on 65,536)."""
MAX_FRONT = 1024
"""Entries per outcome key past which an exact run under a coarse bound is abandoned."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOptions(Options):
    """Options of `dp`. time_limit_s (deterministic seconds) bounds building the block
    tables (the part that grows with block size): past it dp gives up with
    UnsupportedProblem (so `auto` and `ilp` move on). seed and workers are unused: the DP is deterministic and
    single-threaded."""

    max_block_configs: int = 1 << 14
    """Largest number of configurations enumerated for one block; a larger block makes
    dp raise UnsupportedProblem (use 'ilp')."""


def solve_dp(problem: Problem, options: Options) -> Plan:
    started = time.perf_counter()
    if not problem.decision_ids:
        return finish(problem, {}, "dp", started_s=started, optimal=True, lower_bound_s=0.0)
    limit = getattr(options, "max_block_configs", DPOptions().max_block_configs)
    clock = WorkClock(options.time_limit_s)
    seq = analyze(problem)
    tables = block_tables(problem, seq, limit, clock)
    found = _cheapest(tables, seq.initial_bytes, problem.budget_bytes)
    feasible = found is not None
    if not feasible:
        # Nothing fits: the least peak, then the cheapest plan at that peak.
        least = fronts.run(tables, seq.initial_bytes, problem.budget_bytes, min_peak=True)
        found = fronts.run(tables, seq.initial_bytes, least[2], min_peak=False) or least
    configs, cost, peak = found
    decisions = {}
    for block, config in zip(seq.blocks, configs):
        decisions.update(zip(block.values, config))
    decisions = {i: decisions[i] for i in problem.decision_ids}
    ev = evaluate(problem, decisions)
    exact = math.isclose(ev.cost_s, cost, rel_tol=1e-9, abs_tol=1e-12) and ev.peak_bytes == peak
    if not exact:
        log.warning("dp: predicted cost %.6g / peak %d but simulate gives %.6g / %d; not claiming optimality",
                    cost, peak, ev.cost_s, ev.peak_bytes)
    optimal = feasible and exact
    # OPTIMAL: no plan is cheaper than this one (up to float summation order).
    return finish(problem, decisions, "dp", started_s=started, optimal=optimal,
                  lower_bound_s=ev.cost_s if optimal else None, work_s=clock.spent_s)


def _cheapest(tables: list, initial_bytes: int, budget: int) -> tuple | None:
    """fronts.run with bounding: a beam search gives a plan (an upper bound), then the
    exact run drops every partial plan whose cost plus its completion bound exceeds it.
    A loose bound lets partial plans pile up in the exact run (GPT-2-24 at 50%: fronts
    of ~5,000 entries per key, minutes, with a bound 2.3% below the optimum), so an
    exact run whose front outgrows MAX_FRONT entries is abandoned for a bound on a
    finer grid of kept bytes (FINE_GRIDS; there 0.4% below, a few seconds), the last
    one without a limit. Every exact run returns the optimum: the bounds only decide
    how much it explores, and the limit is a count (the same plan on any machine)."""
    bounds = fronts.completion_bounds(tables, budget, grid=FIRST_GRID)
    if float(bounds.after[0][(None, False)][0]) == math.inf:
        return None
    upper, guess = math.inf, None
    for beam in (BEAM_WIDTH, 4 * BEAM_WIDTH):
        guess = fronts.run(tables, initial_bytes, budget, min_peak=False, bounds=bounds, beam=beam)
        if guess is not None:
            upper = guess[1]
            break
    grids = [g for g in FINE_GRIDS if max(1, budget // g) < bounds.quantum]  # those finer than the first
    for k in range(len(grids) + 1):
        if k:
            bounds = fronts.completion_bounds(tables, budget, grid=grids[k - 1], max_grid=grids[k - 1])
            # a beam guided by the finer bound may find a cheaper plan: a lower threshold
            # (GPT-2-48 at 50%: 0.16% lower, the exact run then minutes -> 9 s)
            better = fronts.run(tables, initial_bytes, budget, min_peak=False, bounds=bounds, beam=BEAM_WIDTH)
            if better is not None and better[1] < upper:
                guess, upper = better, better[1]
        if guess is not None and guess[1] <= float(bounds.after[0][(None, False)][0]) * (1 + 1e-12):
            return guess  # the bound proves the guess optimal
        try:
            return fronts.run(tables, initial_bytes, budget, min_peak=False, bounds=bounds, threshold=upper,
                              max_front=MAX_FRONT if k < len(grids) else None)
        except fronts.FrontTooLarge:
            continue
    raise AssertionError("unreachable: the last exact run has no front limit")


# ---- the decomposition as a predictor (for tests) ----


def predict(problem: Problem, decisions: Mapping[int, Decision]) -> tuple[float, int]:
    """(cost, peak) of `decisions` computed block by block, as dp sees it; equals
    simulate's (cost_s, peak_bytes) whenever `analyze` accepts the problem. Raises
    InvalidLocal where simulate raises PlanError."""
    seq = analyze(problem)
    blocks = seq.blocks
    evals = [BlockEvaluator(problem, b) for b in blocks]
    configs = [tuple(decisions[v] for v in b.values) for b in blocks]
    locs: list[Local] = [None] * len(blocks)  # type: ignore[list-item]
    delta = False
    for b in reversed(range(len(blocks))):
        block = blocks[b]
        mode_prev = decisions[block.prev] if block.prev is not None else None
        mode_b = configs[b][-1] if block.boundary is not None else None
        locs[b] = evals[b].evaluate(configs[b], mode_prev, delta and mode_b in DROPPED)
        delta = locs[b].prev_touched
    k, cost, summary, peak = 0, 0.0, (NEG, 0, 0), seq.initial_bytes
    for block, loc in zip(blocks, locs):
        peak = max(peak, k + int(local_peak(loc, (0, 0), *summary)))
        k, cost, summary = k + loc.keep_bytes, cost + loc.cost_s, next_summary(loc, *summary)
    return cost, peak
