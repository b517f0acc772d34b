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
(fronts.py). Speed: identical layers share one table (their static bytes differ by
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
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np

from solvers.base import Options, WorkClock, finish
from solvers.dp import fronts, table_cache
from solvers.dp.fronts import DROPPED, Option, local_peak, next_summary
from solvers.dp.local import NEG, BlockEvaluator, InvalidLocal, Local
from solvers.dp.structure import Block, BlockSequence, analyze
from solvers.problem import Decision, Plan, Problem
from solvers.registry import UnsupportedProblem
from solvers.simulate import evaluate

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


# ---- per-block tables ----


def block_tables(problem: Problem, seq: BlockSequence, limit: int, clock: WorkClock | None = None,
                 fixed: frozenset[int] = frozenset()) -> list[tuple[dict, tuple[int, int]]]:
    """For each block: context (mode of a_{b-1}, a_{b-1} brought back in block b) ->
    Pareto-pruned options. Identical blocks (same signature) share one table."""
    clock = clock or WorkClock(None)
    cache: dict[tuple, dict] = {}
    out = []
    for block in seq.blocks:
        rel, offsets = _relative(block)
        sig = _signature(problem, rel)
        if sig not in cache:
            cache[sig] = _shared_table(problem, rel, sig, limit, clock, fixed)
        out.append((cache[sig], offsets))
    return out


_TABLES: OrderedDict[tuple, tuple[dict, int, int]] = OrderedDict()
"""Tables of recent solves by (signature, limit), with what building them charged: a
budget sweep or a re-plan of the same model builds each table once. The signature holds
everything a table depends on (values read from outside the block are either fixed or
never brought back, and the evaluator treats both alike). Large tables are also kept
on disk across processes (table_cache)."""
_TABLES_KEPT = 32


def _shared_table(problem: Problem, block: Block, sig: tuple, limit: int, clock: WorkClock,
                  fixed: frozenset[int]) -> dict:
    """The block's table: from this process's recent solves, else from the disk cache
    (table_cache), else built (and stored in both)."""
    key = (sig, limit)
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
    else:
        hit = table_cache.load(sig, limit)
        if hit is None:
            raw, n_configs = _table(problem, block, limit, clock, fixed)
            modes_prev = problem.allowed(block.prev) if block.prev is not None else (None,)
            entry = (fronts.compile_table(raw), n_configs, len(modes_prev) * len(block.values))
            table_cache.store(sig, limit, entry)
            _remember(key, entry)
            return entry[0]
        _remember(key, hit)
    table, n_configs, steps = hit
    for k in range(n_configs):  # charge the clock exactly as building it did: same plans, same limits
        clock.charge_steps(steps)
        if k % 256 == 0 and clock.expired:
            raise UnsupportedProblem(f"dp: time limit reached while tabulating block {block.index} "
                                     f"({n_configs} configurations); raise time_limit_s or use 'ilp'",
                                     work_s=clock.spent_s)
    return table


def _remember(key: tuple, entry: tuple[dict, int, int]) -> None:
    _TABLES[key] = entry
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)


def _relative(block: Block) -> tuple[Block, tuple[int, int]]:
    """The block with its static bytes shifted to start at 0 in each phase, and the
    shifts (a layer deep in a stack differs from the first one only by these)."""
    off_f = min(block.static_forward)
    off_g = min(block.static_backward + block.static_before, default=0)
    rel = dataclasses.replace(
        block,
        static_forward=tuple(s - off_f for s in block.static_forward),
        static_backward=tuple(s - off_g for s in block.static_backward),
        static_before=tuple(s - off_g for s in block.static_before),
    )
    return rel, (off_f, off_g)


def _table(problem: Problem, block: Block, limit: int, clock: WorkClock,
           fixed: frozenset[int] = frozenset()) -> tuple[dict, int]:
    """The block's Pareto-pruned options per context, and how many configurations."""
    evaluator = BlockEvaluator(problem, block, fixed)
    configs = enumerate_configs(problem, block, limit)
    modes_prev = problem.allowed(block.prev) if block.prev is not None else (None,)
    groups: dict[tuple, list[Option]] = {}
    for k, config in enumerate(configs):
        # Work: one local evaluation per (config, context), each about the block's size.
        clock.charge_steps(len(modes_prev) * len(block.values))
        if k % 256 == 0 and clock.expired:
            raise UnsupportedProblem(f"dp: time limit reached while tabulating block {block.index} "
                                     f"({len(configs)} configurations); raise time_limit_s or use 'ilp'",
                                     work_s=clock.spent_s)
        mode_b = config[-1] if block.boundary is not None else None
        deltas = (False, True) if mode_b in DROPPED else (False,)
        by_delta = {delta: evaluator.evaluate_modes(config, modes_prev, delta) for delta in deltas}
        for mode_prev in modes_prev:
            for delta in deltas:
                local = by_delta[delta][mode_prev]
                if isinstance(local, InvalidLocal):
                    continue
                touched = local.prev_touched if mode_prev in DROPPED else False
                opt = Option(config, local, mode_b, delta)
                groups.setdefault((mode_prev, touched, mode_b, delta, local.cascade_nested), []).append(opt)
    table: dict[tuple, list[Option]] = {}
    for (mode_prev, touched, *_), opts in groups.items():
        table.setdefault((mode_prev, touched), []).extend(_prune_options(opts))
    return table, len(configs)


def enumerate_configs(problem: Problem, block: Block, limit: int) -> list[tuple[Decision, ...]]:
    """Configurations of the block's values, aligned with block.values. A value that no
    backward node reads and that no RECOMPUTE value of the block reads is never needed:
    SAVE and RECOMPUTE are then the same plan, so it is fixed to SAVE. A non-recomputable
    value that backward reads is never RECOMPUTE (simulate would reject the plan)."""
    nodes = problem.nodes
    values = block.values
    inside = set(values)
    read_by_backward = {j for r in problem.backward_ids for j in nodes[r].inputs if j in inside}
    children: dict[int, list[int]] = {v: [] for v in values}
    for c in values:
        for j in dict.fromkeys(nodes[c].inputs):
            if j in inside:
                children[j].append(c)
    # each dominance rule is checked when the last of its values is decided (the lowest
    # id: values are decided from the last one back)
    rules: dict[int, list[tuple[int, int, tuple[int, ...]]]] = {}
    for v, c, others in _save_dominated(problem, block, read_by_backward):
        rules.setdefault(min((v, *others)), []).append((v, c, others))
    out: list[tuple[Decision, ...]] = []
    partial: dict[int, Decision] = {}
    order = list(reversed(values))

    def rec(k: int) -> None:
        if k == len(order):
            out.append(tuple(partial[v] for v in values))
            if len(out) > limit:
                raise UnsupportedProblem(
                    f"dp: block {block.index} ({len(values)} decision values, first "
                    f"{nodes[values[0]].name!r}) has more than max_block_configs={limit} "
                    "configurations; use 'ilp' or raise max_block_configs"
                )
            return
        v = order[k]
        relevant = (v == block.boundary or v in read_by_backward
                    or any(partial[c] is Decision.RECOMPUTE for c in children[v]))
        for d in problem.allowed(v) if relevant else (Decision.SAVE,):
            if d is Decision.RECOMPUTE and v in read_by_backward and not nodes[v].recomputable:
                continue  # backward would have to recompute it: always InvalidLocal
            partial[v] = d
            if any(_dominated(partial, rule) for rule in rules.get(v, ())):
                continue  # dominated by saving the reader instead (_save_dominated)
            rec(k + 1)
        del partial[v]

    rec(0)
    return out


def _dominated(partial: dict[int, Decision], rule: tuple[int, int, tuple[int, ...]]) -> bool:
    v, c, others = rule
    return (partial[v] is Decision.SAVE and partial[c] is Decision.RECOMPUTE
            and all(partial[u] is Decision.SAVE for u in others))


def _save_dominated(problem: Problem, block: Block,
                    read_by_backward: set[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Rules (v, c, others): a configuration with v SAVE, c RECOMPUTE and every value of
    `others` SAVE is useless. v is read only by c (in forward, never by backward); c's
    other inputs are either outside the block and not a_{b-1} (always on the device) or
    the block values `others`; neither v nor c is the boundary, an output, a view or
    viewed; and c's bytes are at most v's.

    Why exact: take such a plan X and the plan Y that differs only in saving c (v is
    then never needed again). Recomputing c in X reads only values on the device (v and
    `others` are saved), so X's canonical schedule is Y's plus one step (c's
    recomputation, at c's first backward need) and brings back nothing else: the same
    values are brought back at the same places (a_{b-1} touched or not alike, the same
    outcome key). At each step: from c's last forward read to its recomputation X holds
    v where Y holds c (bytes(v) >= bytes(c)); `others` live in X at least as long as in
    Y (the recomputation reads them); otherwise the same storages (v's only read after
    c's forward step is c's recomputation, after which both hold c until its last read).
    So every step of Y has at most X's live bytes, and Y costs c's recompute seconds
    less: X is never needed for an optimal plan, nor for the least peak."""
    nodes = problem.nodes
    inside = set(block.values)
    viewed = {nodes[i].alias_of for i in range(len(nodes)) if nodes[i].alias_of is not None}
    outputs = {problem.storage_of[j] for j in problem.outputs}
    plain = {v for v in block.values
             if v != block.boundary and v not in viewed and v not in outputs and nodes[v].alias_of is None}
    out = []
    for v in sorted(plain):
        readers = problem.users[v]
        if v in read_by_backward or len(readers) != 1 or readers[0] not in plain:
            continue
        c = readers[0]
        others = tuple(dict.fromkeys(j for j in nodes[c].inputs if j != v))
        if block.prev in others:
            continue
        if nodes[c].out_bytes <= nodes[v].out_bytes:
            out.append((v, c, tuple(j for j in others if j in inside)))
    return out


def _option_vector(opt: Option) -> tuple[float, ...]:
    loc = opt.local
    g, c = loc.peak_backward, loc.cascade
    vec = (loc.cost_s, loc.peak_forward, g.c, g.p, g.n, g.nr, loc.keep_bytes)
    if c is not None:
        vec += (c.c, c.p, c.n, c.nr, loc.cascade_net, loc.cascade_net - loc.cascade_freed)
    return vec


def _prune_options(opts: list[Option]) -> list[Option]:
    """Drop options dominated in every component (same context and outcome key): the
    options in increasing (stable) order of their vectors, each kept unless an earlier
    one weakly dominates it (so of equal vectors the first). fronts.pareto computes
    exactly that set (only an equal vector can weakly dominate an earlier one; of equal
    rows it keeps the first in that order); a pairwise loop took ~10% of table building
    (GPT-2's attention groups keep thousands of options). Vectors are ints below 2**53
    and floats, exact in float64."""
    vecs = [_option_vector(o) for o in opts]
    order = sorted(range(len(opts)), key=vecs.__getitem__)
    if len(opts) < 2 or len({len(v) for v in vecs}) != 1:
        return _prune_plain([opts[k] for k in order], [vecs[k] for k in order])
    kept = fronts.pareto(np.array([vecs[k] for k in order], dtype=float))
    return [opts[order[k]] for k in sorted(kept.tolist())]


def _prune_plain(opts: list[Option], vecs: list[tuple[float, ...]]) -> list[Option]:
    """_prune_options on options already in order, pairwise (the reference; and for
    vectors of unequal lengths, which never share an outcome key in practice)."""
    kept: list[tuple[tuple[float, ...], Option]] = []
    for vec, opt in zip(vecs, opts):
        if not any(all(a <= b for a, b in zip(kv, vec)) for kv, _ in kept):
            kept.append((vec, opt))
    return [o for _, o in kept]


def _signature(problem: Problem, block: Block) -> tuple:
    """Everything the block's table depends on, with node ids relabeled locally and the
    static bytes as given (identical layers of a stack share their table)."""
    nodes = problem.nodes
    local: dict[int, int] = {}
    if block.prev is not None:
        local[block.prev] = -1
    items = []
    for i in block.forward_steps + block.backward_steps:
        local[i] = len(local)
        n = nodes[i]
        items.append((n.phase, n.out_bytes, n.workspace_bytes, n.compute_s, n.recomputable, n.offloadable,
                      local.get(n.alias_of, None if n.alias_of is None else "x"),
                      tuple(local.get(j, "x") for j in n.inputs)))
    prev = None
    if block.prev is not None:
        p = nodes[block.prev]
        prev = (p.out_bytes, p.workspace_bytes, p.recomputable, p.offloadable, block.prev_read_later)
    # store_s depends on the forward compute after a value, so identical layers at
    # different depths may price an offload differently
    store = tuple(problem.store_s(v) for v in block.values) if problem.offload_bandwidth_bytes_per_s else ()
    return (tuple(items), prev, block.boundary is None, problem.offload_bandwidth_bytes_per_s, store,
            block.static_forward, block.static_backward, block.static_before,
            tuple(local.get(v) for v in block.values))


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
