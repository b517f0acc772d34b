"""The steps of dp's local replay (local.py): step kinds, the instances and storages a
replay tracks, and the max-plus form of a peak over a range of steps."""

from __future__ import annotations

import dataclasses
import enum

NEG = float("-inf")


class LocalStepKind(enum.IntEnum):
    """Kind of a step of the local step list (local.py), its first field."""

    FWD = 0
    """A forward step of block b (F_b)."""
    REC = 1
    """A recomputation of a dropped value of block b."""
    REL = 2
    """A reload of an offloaded value (of block b, or a_{b-1})."""
    BWD = 3
    """A backward step of block b (G_b)."""
    MID = 4
    """The later blocks' phases before the suffix first needs a_b (reads a_b)."""
    POST = 5
    """The later blocks' phases after a_b's cascade."""
    NEST = 6
    """a_{b-1}'s own cascade, opaque (the P step)."""
    ROOT = 7
    """a_{b-1}'s recomputation that ends its cascade (the N step)."""
    END = 8
    """Block b-1's reads of a_{b-1}, after G_b."""


# The step lists carry the kinds as plain ints, bound here: local.py's hot loops compare
# them against module globals, and a comparison of two exact ints is the interpreter's
# fast path, which IntEnum members (an int subclass) miss.
FWD, REC, REL, BWD, MID, POST, NEST, ROOT, END = map(int, LocalStepKind)
NO_INSTANCE = frozenset((BWD, MID, POST, NEST, END))
"""Kinds that make no instance."""


@dataclasses.dataclass(frozen=True)
class Terms:
    """max(c, p + P, n + N, nr + NR) for the previous boundary's cascade summary."""

    c: float = NEG
    p: float = NEG
    n: float = NEG
    nr: float = NEG

    def at(self, p_in: float, n_in: float, nr_in: float) -> float:
        return max(self.c, self.p + p_in, self.n + n_in, self.nr + nr_in)


class Instances:
    """Instances and storages as simulate._lifetimes keeps them (reads bind to the
    newest instance; a view shares its base's storage)."""

    def __init__(self) -> None:
        self.newest: dict[int, int] = {}
        self.inst_storage: list[int] = []
        self.inst_end: list[int] = []
        self.s_bytes: list[int] = []
        self.s_start: list[int] = []
        self.s_owner: list[int] = []

    def new(self, i: int, k: int, size: int) -> None:
        self.newest[i] = len(self.inst_storage)
        self.inst_storage.append(len(self.s_bytes))
        self.inst_end.append(k)
        self.s_bytes.append(size)
        self.s_start.append(k)
        self.s_owner.append(i)

    def view(self, i: int, base: int, k: int) -> None:
        if base not in self.newest:  # a view of a parameter or input: no local storage
            self.newest.pop(i, None)
            return
        self.newest[i] = len(self.inst_storage)
        self.inst_storage.append(self.inst_storage[self.newest[base]])
        self.inst_end.append(k)

    def copy(self) -> Instances:
        out = Instances.__new__(Instances)
        out.newest = dict(self.newest)
        out.inst_storage, out.inst_end = list(self.inst_storage), list(self.inst_end)
        out.s_bytes, out.s_start, out.s_owner = list(self.s_bytes), list(self.s_start), list(self.s_owner)
        return out

    def read(self, j: int, k: int) -> None:
        inst = self.newest.get(j)
        if inst is not None and self.inst_end[inst] < k:
            self.inst_end[inst] = k


def terms(value: list[int], lo: int, hi: int, nest: int, start: str, shift: int) -> Terms:
    """Max-plus form of the peak over steps lo..hi-1 (no pseudo steps there but a_{b-1}'s
    NEST at `nest`, -1: none): steps before the nested cascade go to `start` ("c", or
    "nr" when the cascade already happened), its NEST step adds P, its ROOT step (next)
    adds N, and the steps after add NR."""
    best = {"c": NEG, "p": NEG, "n": NEG, "nr": NEG}
    if nest < 0:
        best[start] = max(value[lo:hi], default=NEG) + shift
    else:
        best[start] = max(value[lo:nest], default=NEG) + shift
        best["p"] = value[nest] + shift
        best["n"] = value[nest + 1] + shift
        best["nr"] = max(best["nr"], max(value[nest + 2:hi], default=NEG) + shift)
    return Terms(**best)
