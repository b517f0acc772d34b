"""The forward pass of `dp` over blocks: exact Pareto fronts, vectorized with numpy.

After block b a partial plan is summarized by its outcome key (decision of a_b, "the
suffix brings a_b back") and the vector (cost, K, P, N, NR, peak): its cost, the bytes K
it keeps alive for the later blocks, the cascade summary (P, N, NR) of a dropped a_b,
and its peak so far. The future depends on (K, P, N, NR) only, monotonically, so per
key only the entries not dominated in (cost, K, P, N, NR) are kept ((peak, K, P, N, NR)
when minimizing the peak). All byte quantities are integers below 2**53 and are held
exactly in float64 (P may be -inf: no cascade step).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from remat_solvers.dp.local import NEG, Local
from remat_solvers.dp.pareto import beam_front, pareto  # noqa: F401 (pareto: tables.py takes it from here)
from remat_solvers.problem import Decision

DROPPED = (Decision.RECOMPUTE, Decision.OFFLOAD)
_NO_CASCADE = (NEG, 0, 0)

# Columns of a front.
COST, K, P, N, NR, PEAK = range(6)


@dataclasses.dataclass(frozen=True)
class Option:
    """One evaluated configuration of a block in one context."""

    config: tuple[Decision, ...]
    local: Local
    mode: Decision | None
    """Decision of the block's boundary (None for the last block)."""
    delta: bool
    """The option assumes the next block brings the boundary back."""


@dataclasses.dataclass
class _Front:
    x: np.ndarray
    """(n, 6) float64 rows (COST, K, P, N, NR, PEAK)."""
    ids: np.ndarray


@dataclasses.dataclass
class _Layer:
    parent: np.ndarray
    option: np.ndarray
    options: list[Option]


def next_summary(loc: Local, p: float, n: int, nr: int) -> tuple[float, int, int]:
    """The cascade summary after a block, given the incoming one (scalar form)."""
    c = loc.cascade
    if c is None:
        return _NO_CASCADE
    n_out = loc.cascade_net + (nr if loc.cascade_nested else 0)
    return (c.at(p, n, nr), n_out, n_out - loc.cascade_freed)


def local_peak(loc: Local, offsets: tuple[int, int], p: float, n: int, nr: int) -> float:
    """Largest bytes during the block's phases, the earlier blocks' K excluded."""
    return max(loc.peak_forward + offsets[0], loc.peak_backward.at(p, n, nr) + offsets[1])


@dataclasses.dataclass(frozen=True)
class Menu:
    """The options of one block in one context, as columns (numpy arrays)."""

    options: tuple[Option, ...]
    keys: tuple[tuple, ...]
    """Outcome keys; `key` indexes them."""
    key: np.ndarray
    cost: np.ndarray
    keep: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    """(n, 4): the (c, p, n, nr) terms of the backward peak."""
    cascade: np.ndarray
    """(n, 4): the (c, p, n, nr) terms of the outgoing cascade (all -inf: none)."""
    has_cascade: np.ndarray
    net: np.ndarray
    nested: np.ndarray
    freed: np.ndarray


def compile_table(table: dict[tuple, list[Option]]) -> dict[tuple, Menu]:
    """Each context's options as a Menu."""
    out = {}
    for context, opts in table.items():
        keys = tuple(dict.fromkeys(_key(o) for o in opts))
        locs = [o.local for o in opts]
        none = (NEG, NEG, NEG, NEG)

        def terms(t):
            return none if t is None else (t.c, t.p, t.n, t.nr)

        out[context] = Menu(
            options=tuple(opts),
            keys=keys,
            key=np.array([keys.index(_key(o)) for o in opts], np.int64),
            cost=np.array([x.cost_s for x in locs]),
            keep=np.array([x.keep_bytes for x in locs], float),
            forward=np.array([x.peak_forward for x in locs], float),
            backward=np.array([terms(x.peak_backward) for x in locs], float).reshape(-1, 4),
            cascade=np.array([terms(x.cascade) for x in locs], float).reshape(-1, 4),
            has_cascade=np.array([x.cascade is not None for x in locs]),
            net=np.array([x.cascade_net for x in locs], float),
            nested=np.array([x.cascade_nested for x in locs]),
            freed=np.array([x.cascade_freed for x in locs], float),
        )
    return out


def _max_plus(terms: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(options, entries): max(c, p + P, n + N, nr + NR) for every pair."""
    out = np.maximum(terms[:, 0:1], terms[:, 1:2] + x[None, :, P])
    np.maximum(out, terms[:, 2:3] + x[None, :, N], out=out)
    np.maximum(out, terms[:, 3:4] + x[None, :, NR], out=out)
    return out


@dataclasses.dataclass(frozen=True)
class Bounds:
    """Lower bounds on the cost of finishing the plan: after[b + 1][key][j] bounds the
    cost of blocks b+1.. for a partial plan through block b with outcome `key` that
    keeps K >= j * quantum; after[0][(None, False)][0] bounds the whole plan."""

    quantum: int
    after: list[dict[tuple, np.ndarray]]

    def at(self, b: int, key: tuple, k: np.ndarray) -> np.ndarray:
        table = self.after[b + 1].get(key)
        if table is None:
            return np.full(len(k), np.inf)
        # K is a whole number of bytes (exact in float64): integer division is the
        # same floor, 2-3x faster than float floor division on the search's arrays
        j = k.astype(np.int64)
        j //= self.quantum
        np.minimum(j, len(table) - 1, out=j)
        return table[j]


def completion_bounds(tables: Sequence[tuple[dict[tuple, Menu], tuple[int, int]]], budget: int,
                      grid: int = 4096, max_grid: int = 1 << 16) -> Bounds:
    """A backward DP over a relaxation: each local peak evaluated at the smallest
    incoming cascade summary any partial plan can have (summary_floors; peaks grow with
    the summary) and K on a grid. The grid step is the gcd of all kept bytes when that
    gives at most `max_grid` points (then K is exact: every K is a multiple of it), else
    budget / `grid` with K rounded down (looser)."""
    floors = summary_floors(tables)
    step = 0
    for table, _ in tables:
        for menu in table.values():
            for keep in np.unique(menu.keep):
                step = math.gcd(step, int(keep))
    quantum = step if step and budget // step + 2 <= max_grid else max(1, budget // grid)
    size = budget // quantum + 2
    bound: dict[tuple, np.ndarray] = {k: np.zeros(size) for m in tables[-1][0].values() for k in m.keys}
    after = [bound]
    for b in reversed(range(len(tables))):
        table, (off_f, off_g) = tables[b]
        new: dict[tuple, np.ndarray] = {}
        for (mode_prev, touched), menu in table.items():
            floor = floors[b].get((mode_prev, touched))
            if floor is None:
                continue  # no partial plan reaches this context
            peak = np.maximum(menu.forward + off_f, _max_plus(menu.backward, np.array([floor]))[:, 0] + off_g)
            cap = np.floor((budget - peak) / quantum)  # j <= cap fits
            best = np.full(size, np.inf)
            for index, key in enumerate(menu.keys):
                nxt = bound.get(key)
                sel = (menu.key == index) & (cap >= 0)
                if nxt is not None and sel.any():
                    _shifted_min(best, nxt, menu.cost[sel], (menu.keep[sel] // quantum).astype(np.int64),
                                 np.minimum(cap[sel], size - 1).astype(np.int64))
            key_in = (mode_prev, touched)
            new[key_in] = np.minimum(new[key_in], best) if key_in in new else best
        bound = new
        after.append(bound)
    after.reverse()  # after[0]: before block 0; after[b + 1]: after block b
    return Bounds(quantum, after)


def _shifted_min(best: np.ndarray, nxt: np.ndarray, cost: np.ndarray, shift: np.ndarray, cap: np.ndarray) -> None:
    """best[j] = min(best[j], min over options o with j <= cap[o] of cost[o] +
    nxt[min(j + shift[o], size - 1)]), by groups of equal shift (options differ in
    their shifts far less often than in cost or cap): within one, by decreasing cap,
    the cheapest option fitting at j is a running minimum, constant between caps."""
    size = len(nxt)
    order = np.lexsort((-cap, shift))
    shift, cap, cost = shift[order], cap[order], cost[order]
    starts = np.flatnonzero(np.r_[True, shift[1:] != shift[:-1]])
    for lo, hi in zip(starts, np.r_[starts[1:], len(shift)]):
        s, top = int(shift[lo]), int(cap[lo]) + 1
        moved = nxt[s:s + top] if s < size else nxt[-1:]
        if len(moved) < top:
            moved = np.concatenate((moved, np.full(top - len(moved), nxt[-1])))
        cheapest = np.minimum.accumulate(cost[lo:hi])  # fits wherever j <= its cap
        caps = cap[lo:hi].tolist() + [-1]
        for k in range(hi - lo):
            a, b = caps[k + 1] + 1, caps[k] + 1  # j in (next cap, this cap]
            if a < b:
                np.minimum(best[a:b], cheapest[k] + moved[a:b], out=best[a:b])


def summary_floors(tables: Sequence[tuple[dict[tuple, Menu], tuple[int, int]]]) -> list[dict[tuple, np.ndarray]]:
    """floors[b][context]: a row (.., P, N, NR, ..) no smaller than the summary of any
    partial plan entering block b in that context (the summary map is monotone, so
    feeding it floors gives floors)."""
    start = np.array([0.0, 0.0, NEG, 0.0, 0.0, 0.0])
    floors = [{(None, False): start}]
    for table, _ in tables:
        out: dict[tuple, np.ndarray] = {}
        for context, menu in table.items():
            row = floors[-1].get(context)
            if row is None:
                continue
            x = row[None, :]
            p = np.maximum(np.maximum(menu.cascade[:, 0], menu.cascade[:, 1] + x[0, P]),
                           np.maximum(menu.cascade[:, 2] + x[0, N], menu.cascade[:, 3] + x[0, NR]))
            n = menu.net + np.where(menu.nested, x[0, NR], 0.0)
            p = np.where(menu.has_cascade, p, NEG)
            nr = np.where(menu.has_cascade, n - menu.freed, 0.0)
            n = np.where(menu.has_cascade, n, 0.0)
            for index, key in enumerate(menu.keys):
                sel = menu.key == index
                low = np.array([0.0, 0.0, p[sel].min(), n[sel].min(), nr[sel].min(), 0.0])
                out[key] = np.minimum(out[key], low) if key in out else low
        floors.append({_context(key): row for key, row in out.items()})
    return floors


def _context(key: tuple) -> tuple:
    """The table context that a state with outcome `key` enters next."""
    mode, delta = key
    return (mode, delta if mode in DROPPED else False)


def _key(opt: Option) -> tuple:
    return (opt.mode, opt.delta if opt.mode in DROPPED else False)


class FrontTooLarge(Exception):
    """run's front outgrew `max_front` (at the block in args[0])."""


def run(
    tables: Sequence[tuple[dict[tuple, Menu], tuple[int, int]]], initial_bytes: int, budget: int, *,
    min_peak: bool, bounds: Bounds | None = None, threshold: float = np.inf, beam: int = 0,
    max_front: int | None = None,
) -> tuple[list[tuple[Decision, ...]], float, int] | None:
    """(configurations, one per block; cost; peak) of the cheapest plan whose peak fits
    `budget` (min_peak: of the least peak, budget ignored); None if nothing fits.
    With `bounds`, partial plans whose cost plus the bound exceeds `threshold` are
    dropped: the answer is then exact if its cost is <= threshold, and None means
    no plan costs <= threshold. `beam` > 0 (with bounds) keeps only that many entries
    per key, the most promising by cost plus bound: a heuristic, for an upper bound.
    `max_front`: raise FrontTooLarge when a key's front outgrows it (the caller
    tightens the bounds and runs again; a count, so the same on any machine)."""
    start = np.array([[0.0, 0.0, NEG, 0.0, 0.0, float(initial_bytes)]])
    fronts = {(None, False): _Front(start, np.zeros(1, np.int64))}
    layers: list[_Layer] = []
    limit = threshold * (1 + 1e-9) + 1e-300
    for b, (table, offsets) in enumerate(tables):
        parts: dict[tuple, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        options: list[Option] = []
        for (mode_prev, delta_prev), front in fronts.items():
            menu = table.get((mode_prev, delta_prev if mode_prev in DROPPED else False))
            if menu is None:
                continue
            cut = None if bounds is None else (lambda key, cost, k, b=b: cost + bounds.at(b, key, k) <= limit)
            rows, parent, option, key = _extend(front, menu, offsets, budget, min_peak, cut)
            for index, out_key in enumerate(menu.keys):
                sel = key == index
                if sel.any():
                    parts.setdefault(out_key, []).append((rows[sel], parent[sel], option[sel] + len(options)))
            options.extend(menu.options)
        score = None if not (beam and bounds) else (lambda key, x, b=b: x[:, COST] + bounds.at(b, key, x[:, K]))
        fronts, layer = _prune(parts, options, min_peak, beam, score)
        if max_front is not None and any(len(f.x) > max_front for f in fronts.values()):
            raise FrontTooLarge(b)
        if not fronts:
            return None
        layers.append(layer)
    return _backtrack(fronts, layers, min_peak)


def _extend(front: _Front, menu: Menu, offsets: tuple[int, int], budget: int,
            min_peak: bool, cut=None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (option, entry) pair that fits: new rows, parent ids, option and key indices.
    `cut(key, cost, K)` (the bound test) drops pairs before their rows are built (most
    pairs fail it: building them all would be most of the search's time)."""
    x = front.x
    n_opt, n = len(menu.cost), len(x)
    passed = np.ones((n_opt, n), bool)
    if cut is not None:
        for index, out_key in enumerate(menu.keys):
            sel = np.flatnonzero(menu.key == index)
            if len(sel):
                cost = x[None, :, COST] + menu.cost[sel, None]
                k = x[None, :, K] + menu.keep[sel, None]
                passed[sel] = cut(out_key, cost.ravel(), k.ravel()).reshape(len(sel), n)
    o, e = np.nonzero(passed)
    if 4 * len(o) < n_opt * n:
        # most pairs failed the bound: the peaks of the rest only, the same float
        # operations pair by pair (exact run under a tight threshold)
        b = menu.backward[o]
        local = np.maximum(b[:, 0], b[:, 1] + x[e, P])
        np.maximum(local, b[:, 2] + x[e, N], out=local)
        np.maximum(local, b[:, 3] + x[e, NR], out=local)
        local = np.maximum(local + offsets[1], menu.forward[o] + offsets[0])
        peak = np.maximum(x[e, PEAK], x[e, K] + local)
    else:
        local = np.maximum(_max_plus(menu.backward, x) + offsets[1], menu.forward[:, None] + offsets[0])
        peak = np.maximum(x[None, :, PEAK], x[None, :, K] + local)[o, e]
    if not min_peak:
        fits = peak <= budget
        o, e, peak = o[fits], e[fits], peak[fits]
    xe = x[e]
    rows = np.empty((len(o), 6))
    rows[:, COST] = xe[:, COST] + menu.cost[o]
    rows[:, K] = xe[:, K] + menu.keep[o]
    rows[:, PEAK] = peak
    casc = menu.has_cascade[o]
    c = menu.cascade[o]
    p = np.maximum(np.maximum(c[:, 0], c[:, 1] + xe[:, P]), np.maximum(c[:, 2] + xe[:, N], c[:, 3] + xe[:, NR]))
    n_out = menu.net[o] + np.where(menu.nested[o], xe[:, NR], 0.0)
    rows[:, P] = np.where(casc, p, NEG)
    rows[:, N] = np.where(casc, n_out, 0.0)
    rows[:, NR] = np.where(casc, n_out - menu.freed[o], 0.0)
    return rows, front.ids[e], o.astype(np.int64), menu.key[o]


def _prune(parts: dict, options: list[Option], min_peak: bool, beam: int = 0,
           score=None) -> tuple[dict, _Layer]:
    fronts: dict[tuple, _Front] = {}
    parents, chosen = [], []
    total = 0
    dims = [PEAK, K, P, N, NR, COST] if min_peak else [COST, K, P, N, NR]
    for key, pieces in parts.items():
        x = np.concatenate([p[0] for p in pieces])
        parent = np.concatenate([p[1] for p in pieces])
        option = np.concatenate([p[2] for p in pieces])
        if score is not None and not min_peak:
            idx = beam_front(x[:, dims], score(key, x), beam)
        else:
            idx = pareto(x[:, dims[:5]], x[:, dims])
            if score is not None and len(idx) > beam:
                idx = idx[np.argsort(score(key, x[idx]), kind="stable")[:beam]]
        ids = np.arange(total, total + len(idx), dtype=np.int64)
        total += len(idx)
        parents.append(parent[idx])
        chosen.append(option[idx])
        fronts[key] = _Front(x[idx], ids)
    if not parents:
        return {}, _Layer(np.zeros(0, np.int64), np.zeros(0, np.int64), options)
    return fronts, _Layer(np.concatenate(parents), np.concatenate(chosen), options)


def _backtrack(fronts: dict, layers: list[_Layer], min_peak: bool) -> tuple[list[tuple[Decision, ...]], float, int]:
    best = None
    for front in fronts.values():
        for row, entry in zip(front.x, front.ids):
            score = (row[PEAK], row[COST]) if min_peak else (row[COST], row[PEAK])
            if best is None or score < best[0]:
                best = (score, int(entry), float(row[COST]), int(row[PEAK]))
    _, entry, cost, peak = best
    configs = []
    for layer in reversed(layers):
        configs.append(layer.options[int(layer.option[entry])].config)
        entry = int(layer.parent[entry])
    configs.reverse()
    return configs, cost, peak
