"""Pareto fronts of numpy rows for dp: the exact front (`pareto`), and the first rows
of the front by a score that dominance never increases (`beam_front`, for the beam)."""

from __future__ import annotations

import numpy as np

_CHUNK = 512
_BEAM_CHUNK = 64


def pareto(x: np.ndarray, order_by: np.ndarray | None = None) -> np.ndarray:
    """Indices of the rows of `x` no other row weakly dominates (all columns <=); of
    equal rows the first in lexicographic order of `order_by` (whose first columns are
    those of `x`) is kept."""
    order_by = x if order_by is None else order_by
    lo, hi = x.min(axis=0), x.max(axis=0)
    varying = [c for c in range(x.shape[1]) if lo[c] != hi[c]]
    if len(varying) <= 2:
        return _pareto_2d(x[:, varying], order_by)
    # A 2-D sweep within each group of rows equal outside the first two varying
    # columns (cheap, removes most rows), then the full test on the survivors.
    head, rest = varying[:2], varying[2:]
    keys = tuple(order_by[:, c] for c in reversed(range(order_by.shape[1])))
    order = np.lexsort(keys + tuple(x[:, c] for c in reversed(rest)))
    xs = x[order]
    new_group = np.ones(len(xs), bool)
    new_group[1:] = (xs[1:, rest] != xs[:-1, rest]).any(axis=1)
    _, rank = np.unique(xs[:, head[1]], return_inverse=True)
    # Offsetting each group below all earlier ones makes one running minimum per group.
    adjusted = rank.astype(np.int64) - np.cumsum(new_group) * (len(xs) + 1)
    best = np.minimum.accumulate(adjusted)
    keep = np.ones(len(xs), bool)
    keep[1:] = adjusted[1:] < best[:-1]
    survivors = order[keep]
    return survivors[_pareto_nd(x[survivors], order_by[survivors])]


def _pareto_2d(x: np.ndarray, order_by: np.ndarray) -> np.ndarray:
    order = np.lexsort(order_by.T[::-1])
    if x.shape[1] == 0:
        return order[:1]
    if x.shape[1] == 1:
        return order[x[order, 0] == x[:, 0].min()][:1]
    a = x[order]
    # Rows come by increasing first column (ties: by order_by); keep strict improvements.
    best = np.minimum.accumulate(a[:, 1])
    keep = np.ones(len(a), bool)
    keep[1:] = a[1:, 1] < best[:-1]
    return order[keep]


def _covers(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(b), len(a)): row j of `a` weakly dominates row i of `b`. Column by column
    (an all() over a last axis of 5 would be most of the search's Pareto time)."""
    out = a[None, :, 0] <= b[:, None, 0]
    for c in range(1, a.shape[1]):
        out &= a[None, :, c] <= b[:, None, c]
    return out


def _pareto_nd(x: np.ndarray, order_by: np.ndarray) -> np.ndarray:
    order = np.lexsort(order_by.T[::-1])
    xs = x[order]
    kept = np.empty((0, x.shape[1]))
    kept_idx = []
    for lo in range(0, len(xs), _CHUNK):
        chunk = xs[lo:lo + _CHUNK]
        alive = np.arange(len(chunk))
        if len(kept):
            alive = alive[~_covers(kept, chunk).any(-1)]
        sub = chunk[alive]
        # Only an earlier row (lexicographically smaller) can weakly dominate a later one.
        mutual = np.tril(_covers(sub, sub), -1).any(-1)
        alive = alive[~mutual]
        kept = np.concatenate([kept, chunk[alive]])
        kept_idx.append(order[lo + alive])
    return np.concatenate(kept_idx) if kept_idx else np.zeros(0, np.int64)


def beam_front(x: np.ndarray, score: np.ndarray, beam: int) -> np.ndarray:
    """pareto(x) ordered by `score` (stable) and cut to `beam` rows, as indices, for a
    score no row exceeds where it weakly dominates another (the cost plus a completion
    bound nondecreasing in K); if the front has at most `beam` rows, all of them in
    pareto's order. Without building the front: rows are scanned by (score, x, index),
    an order in which every row that weakly dominates another comes first, so a row is
    on the front iff no earlier row on it dominates it, and the scan stops once more
    than `beam` rows are found (building the full front would be most of a beam run's time).
    The rows of the lowest scores are sorted first (every row scoring at most the
    cutoff: a prefix of the full order); the rest only if the front is not found there."""
    rows = np.arange(len(x))
    if len(x) > 32 * (beam + 1):
        cutoff = np.partition(score, 8 * (beam + 1))[8 * (beam + 1)]
        head = np.flatnonzero(score <= cutoff)
        if len(head) < len(x):
            idx = _scan(x, score, head, beam)
            if len(idx) > beam:
                return idx[:beam]
    idx = _scan(x, score, rows, beam)
    if len(idx) > beam:
        return idx[:beam]
    got = x[idx]
    return idx[np.lexsort((idx,) + tuple(got[:, c] for c in reversed(range(x.shape[1]))))]


def _scan(x: np.ndarray, score: np.ndarray, rows: np.ndarray, beam: int) -> np.ndarray:
    """The front rows among `rows` in (score, x, index) order, up to beam + 1 of them."""
    order = rows[np.lexsort(tuple(x[rows, c] for c in reversed(range(x.shape[1]))) + (score[rows],))]
    xs = x[order]
    kept = np.empty((0, x.shape[1]))
    found: list[np.ndarray] = []
    lo = 0
    while lo < len(xs) and len(kept) <= beam:
        chunk = xs[lo:lo + _BEAM_CHUNK]
        alive = np.arange(len(chunk))
        if len(kept):
            alive = alive[~_covers(kept, chunk).any(-1)]
        sub = chunk[alive]
        alive = alive[~np.tril(_covers(sub, sub), -1).any(-1)]
        kept = np.concatenate([kept, chunk[alive]])
        found.append(order[lo + alive])
        lo += _BEAM_CHUNK
    return np.concatenate(found) if found else np.zeros(0, np.int64)
