"""dp's block tables: every configuration of a block evaluated (local.py) and Pareto-pruned
per context, shared between identical blocks, kept across solves and on disk.

A table maps a context (mode of a_{b-1}, a_{b-1} brought back in block b) to the options
(configuration, Local) no other option of the same outcome key dominates. Identical
blocks (same `_signature`: a layer deep in a stack differs from the first only by
constant static bytes) share one table.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import numpy as np

from solvers.base import WorkClock
from solvers.dp import fronts, table_cache
from solvers.dp.configs import enumerate_configs
from solvers.dp.fronts import DROPPED, Option
from solvers.dp.local import BlockEvaluator, InvalidLocal
from solvers.dp.structure import Block, BlockSequence
from solvers.problem import Problem
from solvers.registry import UnsupportedProblem


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


