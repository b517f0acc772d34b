"""Block-sequence structure for `dp`: split a problem at articulation points, or say why not.

A *block sequence* splits the forward decision values into blocks B_1..B_K (contiguous
id ranges) at boundary values a_1 < ... < a_{K-1} (a_b is the last value of B_b) with:
  - forward: every read of a decision value's storage happens in its own block's forward
    steps, except that a_b (the block's output) is also read by B_{b+1};
  - backward: every backward node reads forward values of one block B_b plus, possibly,
    a_{b-1}; the blocks read by consecutive backward nodes never increase (backward
    visits B_K, ..., B_1 in turn: phase G_b).
A boundary is a plain value (no alias, not aliased, not an output). Under these rules the
canonical schedule's memory decomposes: during block b's phases (forward F_b and backward
G_b) the earlier blocks contribute a constant (what they keep) plus, when a_{b-1} is
dropped, the profile of recomputing it (see local.py). Bytes that no decision changes
(parameters, inputs, non-decision forward values, backward values) are the *static* part,
computed once per step here.
"""

from __future__ import annotations

import dataclasses

from remat_solvers.problem import Phase, Problem
from remat_solvers.registry import UnsupportedProblem


@dataclasses.dataclass(frozen=True, kw_only=True)
class Block:
    """One block of the sequence, with the static bytes at each of its steps."""

    index: int
    values: tuple[int, ...]
    """Decision values of the block, ascending (the boundary last, if any)."""
    boundary: int | None
    """a_b, read by the next block; None for the last block."""
    prev: int | None
    """a_{b-1}, the previous block's boundary; None for the first block."""
    forward_steps: tuple[int, ...]
    """Forward node ids run in phase F_b, in order."""
    backward_steps: tuple[int, ...]
    """Backward node ids run in phase G_b, in order."""
    static_forward: tuple[int, ...]
    """Static live bytes at each forward step."""
    static_backward: tuple[int, ...]
    """Static live bytes at each backward node's step."""
    static_before: tuple[int, ...]
    """Static live bytes just before each backward node (where recomputations run)."""
    prev_read_later: bool
    """a_{b-1} is read by phase G_{b-1} (so it outlives G_b once on the device)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSequence:
    blocks: tuple[Block, ...]
    initial_bytes: int
    """Bytes live before the first step (parameters and inputs)."""


def analyze(problem: Problem, *, fixed: frozenset[int] = frozenset(),
            release_early: frozenset[int] = frozenset()) -> BlockSequence:
    """The finest block sequence of `problem`; UnsupportedProblem if there is none.
    `fixed` decision values are kept (SAVE): they count as static bytes, like values no
    decision changes, and belong to no block. Storages in `release_early` count only
    until the phase (F_b or G_b) holding their last read begins (fewer bytes than
    simulate holds: for relaxations, e.g. `layers`' lower bound)."""
    decision = set(problem.decision_ids) - set(fixed)
    _check_supported(problem, decision)
    cuts = _forward_cuts(problem, decision)
    while True:
        block_of = _block_map(problem, cuts)
        bad = _backward_violations(problem, decision, cuts, block_of)
        if not bad:
            break
        cuts = [c for c in cuts if c not in bad]
    return _build(problem, decision, cuts, block_of, release_early)


def _check_supported(problem: Problem, decision: set[int]) -> None:
    nodes, root = problem.nodes, problem.storage_of
    for j in problem.outputs:
        if root[j] in decision:
            raise UnsupportedProblem(
                f"dp: output {j} ({nodes[j].name!r}) lives in the storage of forward decision value "
                f"{root[j]}; dp needs outputs outside the decision values; use 'ilp'"
            )
    for i in problem.backward_ids:
        if root[i] in decision:
            raise UnsupportedProblem(
                f"dp: backward node {i} ({nodes[i].name!r}) is a view of forward value {root[i]}; "
                "dp does not model backward views of activations; use 'ilp'"
            )


def _forward_cuts(problem: Problem, decision: set[int]) -> list[int]:
    """Decision values v such that no decision value or storage before v is read by a
    forward node after v, and v itself is a plain, unaliased, non-output value."""
    nodes, root = problem.nodes, problem.storage_of
    last_read: dict[int, int] = {}
    aliased: set[int] = set()
    for i in problem.forward_ids:
        if nodes[i].alias_of is not None:
            aliased.add(root[i])
        for j in nodes[i].inputs:
            # A read needs the value (a recomputation reads it) and its storage.
            for s in (j, root[j]):
                if s in decision:
                    last_read[s] = max(last_read.get(s, i), i)
    outputs = {root[j] for j in problem.outputs}
    cuts, reach = [], -1
    for v in problem.forward_ids:
        if (v in decision and reach <= v and nodes[v].alias_of is None and v not in aliased
                and v not in outputs):
            cuts.append(v)
        if v in decision:
            reach = max(reach, last_read.get(v, v))
    # The last decision value closes the last block; it is no boundary.
    last = max(decision) if decision else -1
    return [c for c in cuts if c != last]


def _block_map(problem: Problem, cuts: list[int]) -> dict[int, int]:
    """Forward id -> block index (0-based) for the given boundaries."""
    out, b, k = {}, 0, 0
    for i in problem.forward_ids:
        out[i] = b
        if k < len(cuts) and i == cuts[k]:
            b, k = b + 1, k + 1
    return out


def _backward_violations(
    problem: Problem, decision: set[int], cuts: list[int], block_of: dict[int, int]
) -> set[int]:
    """Boundaries to remove so that every backward node reads one block (plus the
    previous boundary) and the blocks read never increase along backward."""
    nodes = problem.nodes
    bad: set[int] = set()
    for r in problem.backward_ids:
        reads = [j for j in nodes[r].inputs if j in decision]
        if not reads:
            continue
        hi, lo = max(reads), min(reads)
        b = block_of[hi]
        ok_lo = block_of[lo] == b or (b > 0 and lo == cuts[b - 1])
        if not ok_lo:
            bad.update(c for c in cuts if lo <= c < hi)
    low = None  # lowest block seen so far along backward
    for _, b in _backward_phases(problem, decision, cuts, block_of):
        if low is not None and b > low:
            bad.update(cuts[low:b])
        low = b if low is None else min(low, b)
    return bad


def _backward_phases(
    problem: Problem, decision: set[int], cuts: list[int], block_of: dict[int, int]
) -> list[tuple[int, int]]:
    """(backward id, block whose phase G_b runs it) for each backward node that reads
    decision values: the block of the highest value it reads, except that a node reading
    only a boundary a_b runs in G_{b+1} when the next such node does (G_{b+1} may read
    a_b; an RMSNorm's backward reads its input before its rsqrt)."""
    nodes = problem.nodes
    rows = []
    for r in problem.backward_ids:
        reads = [j for j in nodes[r].inputs if j in decision]
        if reads:
            hi = max(reads)
            b = block_of[hi]
            rows.append([r, b, min(reads) == hi and b < len(cuts) and hi == cuts[b]])
    after = None  # phase block of the next row
    for row in reversed(rows):
        if row[2] and after == row[1] + 1:
            row[1] = after
        after = row[1]
    return [(r, b) for r, b, _ in rows]


def _build(problem: Problem, decision: set[int], cuts: list[int], block_of: dict[int, int],
           release_early: frozenset[int] = frozenset()) -> BlockSequence:
    nodes = problem.nodes
    n_blocks = len(cuts) + 1
    fwd: list[list[int]] = [[] for _ in range(n_blocks)]
    for i in problem.forward_ids:
        fwd[block_of[i]].append(i)
    bwd: list[list[int]] = [[] for _ in range(n_blocks)]
    phase = dict(_backward_phases(problem, decision, cuts, block_of))
    current = n_blocks - 1
    for r in problem.backward_ids:
        current = phase.get(r, current)
        bwd[current].append(r)
    released = _phase_starts(problem, release_early, fwd, bwd) if release_early else {}
    static_at, static_before, initial = static_profile(problem, decision, released)
    prev_read_later = [False] * n_blocks
    for b in range(1, n_blocks):
        a = cuts[b - 1]
        prev_read_later[b] = any(a in nodes[r].inputs for r in bwd[b - 1])
    blocks = []
    for b in range(n_blocks):
        values = tuple(v for v in fwd[b] if v in decision)
        blocks.append(Block(
            index=b,
            values=values,
            boundary=cuts[b] if b < len(cuts) else None,
            prev=cuts[b - 1] if b > 0 else None,
            forward_steps=tuple(fwd[b]),
            backward_steps=tuple(bwd[b]),
            static_forward=tuple(static_at[i] for i in fwd[b]),
            static_backward=tuple(static_at[r] for r in bwd[b]),
            static_before=tuple(static_before[r] for r in bwd[b]),
            prev_read_later=prev_read_later[b],
        ))
    return BlockSequence(blocks=tuple(blocks), initial_bytes=initial)


def _phase_starts(problem: Problem, storages: frozenset[int], fwd: list[list[int]],
                  bwd: list[list[int]]) -> dict[int, int]:
    """Storage -> the first step of the phase (F_b or G_b) holding its last read, for the
    given storages that are not outputs."""
    nodes, root = problem.nodes, problem.storage_of
    start_of = {i: steps[0] for steps in (*fwd, *bwd) for i in steps}
    last: dict[int, int] = {}
    for i in (*problem.forward_ids, *problem.backward_ids):
        for j in nodes[i].inputs:
            if root[j] in storages:
                last[root[j]] = i
    outputs = {root[j] for j in problem.outputs}
    return {s: start_of[i] for s, i in last.items() if s not in outputs}


def static_profile(problem: Problem, decision: set[int],
                   released: dict[int, int] | None = None) -> tuple[dict[int, int], dict[int, int], int]:
    """Bytes no decision changes: (live at each node's step, the node's workspace
    included; live just before each node's step; live before the first step). Steps:
    forward ids, then backward ids. `released`: storage -> node id; the storage counts
    only before that node's step (never, if it starts there or later)."""
    nodes, root = problem.nodes, problem.storage_of
    order = list(problem.forward_ids) + list(problem.backward_ids)
    pos = {i: k for k, i in enumerate(order)}
    forever = len(order)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    initial = 0
    for i, node in enumerate(nodes):
        if node.phase in (Phase.PARAM, Phase.INPUT):
            initial += node.out_bytes if node.alias_of is None else 0
            continue
        s = root[i]
        if s not in decision and nodes[s].phase not in (Phase.PARAM, Phase.INPUT):
            start.setdefault(s, pos[i])
            end[s] = max(end.get(s, pos[i]), pos[i])
        for j in node.inputs:
            t = root[j]
            if t in start:
                end[t] = max(end[t], pos[i])
    for j in problem.outputs:
        if root[j] in start:
            end[root[j]] = forever
    for s_, at in (released or {}).items():
        if s_ in start:
            end[s_] = pos[at] - 1
            if end[s_] < start[s_]:
                del start[s_], end[s_]
    delta_at = [0] * (forever + 2)
    delta_before = [0] * (forever + 2)
    for s, a in start.items():
        size = nodes[s].out_bytes
        delta_at[a] += size
        delta_at[end[s] + 1] -= size
        # Alive just before step k: allocated before k and freed no earlier than k.
        if end[s] > a:
            delta_before[a + 1] += size
            delta_before[end[s] + 1] -= size
    at, before = {}, {}
    live_at = live_before = initial
    for k, i in enumerate(order):
        live_at += delta_at[k]
        live_before += delta_before[k]
        at[i], before[i] = live_at + nodes[i].workspace_bytes, live_before
    return at, before, initial
