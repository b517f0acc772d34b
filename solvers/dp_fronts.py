"""The forward pass of `dp` over blocks: exact Pareto fronts, vectorized with numpy.

After block b a partial plan is summarized by its outcome key (decision of a_b, "the
suffix brings a_b back"), the cascade summary (P, N, NR) of a dropped a_b, the bytes K
it keeps alive for the later blocks, its cost and its peak so far. Partial plans with
the same key and summary form a group; within a group only (K, cost) matter to the
future (or (K, peak) when minimizing the peak), so each group keeps its 2-D Pareto
front, sorted by K. A block's option then fits exactly the entries with
K <= budget - (its local peak for that group's summary): a prefix of the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from solvers.dp_local import NEG, Local
from solvers.problem import Decision

DROPPED = (Decision.RECOMPUTE, Decision.OFFLOAD)
_NO_CASCADE = (NEG, 0, 0)


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
class _Group:
    k: np.ndarray
    cost: np.ndarray
    peak: np.ndarray
    ids: np.ndarray


@dataclasses.dataclass
class _Layer:
    parent: np.ndarray
    option: np.ndarray
    options: list[Option]


def next_summary(loc: Local, p: float, n: int, nr: int) -> tuple[float, int, int]:
    """The cascade summary after a block, given the incoming one."""
    c = loc.cascade
    if c is None:
        return _NO_CASCADE
    n_out = loc.cascade_net + (nr if loc.cascade_nested else 0)
    return (c.at(p, n, nr), n_out, n_out - loc.cascade_freed)


def local_peak(loc: Local, offsets: tuple[int, int], p: float, n: int, nr: int) -> float:
    """Largest bytes during the block's phases, the earlier blocks' K excluded."""
    return max(loc.peak_forward + offsets[0], loc.peak_backward.at(p, n, nr) + offsets[1])


def run(
    tables: Sequence[tuple[dict, tuple[int, int]]], initial_bytes: int, budget: int, *, min_peak: bool
) -> tuple[list[tuple[Decision, ...]], float, int] | None:
    """(configurations, one per block; cost; peak) of the cheapest plan whose peak fits
    `budget` (min_peak: of the least peak, budget ignored); None if nothing fits."""
    start = _Group(np.zeros(1, np.int64), np.zeros(1), np.array([initial_bytes], np.int64), np.zeros(1, np.int64))
    fronts: dict[tuple, dict[tuple, _Group]] = {(None, False): {_NO_CASCADE: start}}
    layers: list[_Layer] = []
    for table, offsets in tables:
        buckets: dict[tuple, list[tuple]] = {}
        options: list[Option] = []
        for (mode_prev, delta_prev), groups in fronts.items():
            touched = delta_prev if mode_prev in DROPPED else False
            for opt in table.get((mode_prev, touched), ()):
                index = len(options)
                options.append(opt)
                key = (opt.mode, opt.delta if opt.mode in DROPPED else False)
                for summary, group in groups.items():
                    _extend(group, summary, opt, index, offsets, budget, min_peak, key, buckets)
        fronts, layer = _prune(buckets, options, min_peak)
        if not fronts:
            return None
        layers.append(layer)
    return _backtrack(fronts, layers, min_peak)


def _extend(group: _Group, summary: tuple, opt: Option, index: int, offsets: tuple[int, int],
            budget: int, min_peak: bool, key: tuple, buckets: dict) -> None:
    loc = opt.local
    peak_local = local_peak(loc, offsets, *summary)
    if min_peak:
        m = len(group.k)
    else:
        m = int(np.searchsorted(group.k, budget - peak_local, side="right"))
        if m == 0:
            return
    k = group.k[:m]
    peak = np.maximum(group.peak[:m], k + int(peak_local)) if peak_local > NEG else group.peak[:m]
    part = (k + loc.keep_bytes, group.cost[:m] + loc.cost_s, peak, group.ids[:m], index)
    buckets.setdefault((key, next_summary(loc, *summary)), []).append(part)


def _prune(buckets: dict, options: list[Option], min_peak: bool) -> tuple[dict, _Layer]:
    fronts: dict[tuple, dict[tuple, _Group]] = {}
    parents, chosen = [], []
    total = 0
    for (key, summary), parts in buckets.items():
        k = np.concatenate([p[0] for p in parts])
        cost = np.concatenate([p[1] for p in parts])
        peak = np.concatenate([p[2] for p in parts])
        parent = np.concatenate([p[3] for p in parts])
        option = np.concatenate([np.full(len(p[0]), p[4], np.int64) for p in parts])
        if min_peak:
            order = np.lexsort((cost, peak, k))
            second = peak[order]
        else:
            order = np.lexsort((peak, cost, k))
            second = cost[order]
        best = np.minimum.accumulate(second)
        keep = np.ones(len(order), bool)
        keep[1:] = second[1:] < best[:-1]
        idx = order[keep]
        ids = np.arange(total, total + len(idx), dtype=np.int64)
        total += len(idx)
        parents.append(parent[idx])
        chosen.append(option[idx])
        fronts.setdefault(key, {})[summary] = _Group(k[idx], cost[idx], peak[idx], ids)
    if not parents:
        return {}, _Layer(np.zeros(0, np.int64), np.zeros(0, np.int64), options)
    return fronts, _Layer(np.concatenate(parents), np.concatenate(chosen), options)


def _backtrack(fronts: dict, layers: list[_Layer], min_peak: bool) -> tuple[list[tuple[Decision, ...]], float, int]:
    best = None
    for groups in fronts.values():
        for g in groups.values():
            rank = (np.lexsort((g.cost, g.peak)) if min_peak else np.lexsort((g.peak, g.cost)))[0]
            score = (g.peak[rank], g.cost[rank]) if min_peak else (g.cost[rank], g.peak[rank])
            if best is None or score < best[0]:
                best = (score, int(g.ids[rank]), float(g.cost[rank]), int(g.peak[rank]))
    _, entry, cost, peak = best
    configs = []
    for layer in reversed(layers):
        configs.append(layer.options[int(layer.option[entry])].config)
        entry = int(layer.parent[entry])
    configs.reverse()
    return configs, cost, peak
