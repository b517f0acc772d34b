"""dp's exchange skip: a configuration that recomputes a value from private saved values
is never better than saving the value instead, so the tables skip it (and count it).

A configuration X is skipped when it recomputes a value c that backward always needs,
from private values (no other recomputation and no backward step reads them): the
RECOMPUTE ones C, the SAVE ones V, V of at least c's bytes and read last in F_b no
later than c. Y = X with c, C and V SAVE (C and V then never needed:
enumerate_configs fixes them to SAVE; Y is required to pass the _save_dominated
rules, so Y is enumerated) is never worse than X in any component of the option
vector, so the table keeps the same options without X.

Why: X's schedule is Y's plus C and c recomputed at c's first need (nothing else is
brought back: C and c read only values on the device, never a_{b-1}; a_{b-1} is
touched or not alike, the same outcome key). Cost: more by their recompute seconds,
less by what saving c costs in Y (`Node.save_s`, when the backward reads c; C is read
by no backward step, V is SAVE in both): so c qualifies only if its save seconds are
at most its own compute seconds (a part of C's). Bytes at each step of Y: C's forward instances live alike (read in F_b only in
both); until c's last forward read X holds V at least as long and c alike; from there
until c's recomputation X holds V where Y holds c (V's last read in Y was earlier), at
least as many bytes; after it both hold c and V is freed (its last read was the
recomputation); the other values C and c read live at least as long in X. So X's
peaks and kept bytes are no lower. The cascade's terms are rises above the kept
bytes; when the boundary's cascade may recompute c (a RECOMPUTE path from the
boundary), X's rises after c's recomputation stay no lower only if X keeps no more
bytes than Y, so then V must have exactly c's bytes and every other SAVE value read
must be read in G_b (held past the cascade in Y as well). Otherwise the bytes X holds
and Y does not only grow during the cascade, so its rises are no lower either.

LLaMA's attention block: 70,080 of 95,040 configurations skipped (its rotary chains
recomputed from saved values); GPT-2's: 12,792 of the 24,000 not doomed.
`save_instead_test` is the rule one configuration at a time (the reference, and it
names Y); `save_instead_mask` is the same rule over a block's whole list with numpy.
"""

from __future__ import annotations

import dataclasses
from itertools import chain

import numpy as np

from remat_solvers.dp.configs import _save_dominated
from remat_solvers.dp.structure import Block
from remat_solvers.problem import Decision, Phase, Problem

R, S = Decision.RECOMPUTE, Decision.SAVE


@dataclasses.dataclass(frozen=True)
class _Facts:
    """The block's values by position (0..m-1) and what the rule needs of them."""

    ins: list[tuple[int, ...]]
    """Inputs inside the block."""
    users: list[frozenset[int]]
    """Readers, -1 for those outside the block (backward steps, another block)."""
    read: list[int]
    """Values read by G_b's steps."""
    size: list[int]
    plain: list[bool]
    """Not the boundary, an output, a view or viewed."""
    ok: list[bool]
    """May be in C: plain, recomputable, not reading a_{b-1}, read inside the block only."""
    last_read: list[int]
    last_forward: list[int]
    """Node id of the last read (of the last forward read: own id if none)."""
    boundary: list[int]
    rules: list[tuple[int, int, tuple[int, ...]]]
    """_save_dominated's rules by position."""
    candidates: list[int]
    """Values c the rule may apply to, the last first (they end the longest chains)."""

    @staticmethod
    def of(problem: Problem, block: Block) -> _Facts:
        nodes, values = problem.nodes, block.values
        at = {v: k for k, v in enumerate(values)}
        viewed = {n.alias_of for n in nodes if n.alias_of is not None}
        outputs = {problem.storage_of[j] for j in problem.outputs}
        plain = [v != block.boundary and v not in viewed and v not in outputs and nodes[v].alias_of is None
                 for v in values]
        users = [frozenset(at.get(u, -1) for u in problem.users[v]) for v in values]
        own = [plain[k] and nodes[v].recomputable and block.prev not in nodes[v].inputs for k, v in enumerate(values)]
        ok = [own[k] and -1 not in users[k] for k in range(len(values))]
        by_backward = {j for r in problem.backward_ids for j in nodes[r].inputs if j in at}
        facts = _Facts(
            ins=[tuple(at[j] for j in dict.fromkeys(nodes[v].inputs) if j in at) for v in values],
            users=users,
            read=[at[j] for r in block.backward_steps for j in dict.fromkeys(nodes[r].inputs) if j in at],
            size=[nodes[v].out_bytes for v in values],
            plain=plain, ok=ok,
            last_read=[max(problem.users[v], default=v) for v in values],
            last_forward=[max((u for u in problem.users[v] if nodes[u].phase is Phase.FORWARD), default=v)
                          for v in values],
            boundary=[at[block.boundary]] if block.boundary is not None else [],
            rules=[(at[v], at[c], tuple(at[u] for u in others))
                   for v, c, others in _save_dominated(problem, block, by_backward)],
            candidates=[])
        charge = dict(problem.save_charged)  # saving c instead must cost no more than recomputing it
        costly = [k for k, v in enumerate(values)
                  if own[k] and nodes[v].compute_s > 0 and charge.get(v, 0.0) <= nodes[v].compute_s]
        facts.candidates.extend(c for c in reversed(costly) if facts.reach(c) >= facts.size[c])
        return facts

    def mine(self, j: int, c: int) -> bool:
        """j may count in V for c (privacy in the configuration aside)."""
        return self.plain[j] and -1 not in self.users[j] and self.last_read[j] <= self.last_forward[c]

    def reach(self, c: int) -> int:
        """The most bytes V can have for c in any configuration: candidates below c's
        bytes never apply (LLaMA: most values)."""
        seen, stack, most = {c}, [c], 0
        while stack:
            for j in self.ins[stack.pop()]:
                if j not in seen:
                    seen.add(j)
                    most += self.size[j] if self.mine(j, c) else 0
                    if self.ok[j]:
                        stack.append(j)
        return most


def save_instead_test(problem: Problem, block: Block):
    """A function of a configuration X: the configuration Y that is never worse (module
    docstring), or None."""
    f = _Facts.of(problem, block)
    read_set = set(f.read)

    def recomputed(config: tuple[Decision, ...], roots: list[int]) -> set[int]:
        """The RECOMPUTE values bringing `roots` back recomputes."""
        out: set[int] = set()
        stack = [k for k in roots if config[k] is R]
        while stack:
            k = stack.pop()
            if k not in out:
                out.add(k)
                stack.extend(j for j in f.ins[k] if config[j] is R)
        return out

    def private(config: tuple[Decision, ...], c: int) -> tuple[set[int], set[int], set[int]] | None:
        """(C with c, V, the other SAVE values read) of recomputing c, or None if a
        RECOMPUTE value read is not private or a value read is offloaded. Private: read
        by no backward step and by no RECOMPUTE value outside C (its other readers are
        saved or offloaded: never recomputed, they read it in F_b only, as in Y)."""
        C, V, stack = {c}, set(), [c]
        while stack:
            for j in f.ins[stack.pop()]:
                if config[j] is S:
                    V.add(j)
                elif config[j] is not R or not f.ok[j]:
                    return None  # offloaded, or a RECOMPUTE value not private
                elif j not in C:
                    C.add(j)
                    stack.append(j)

        def alone(k: int) -> bool:  # no other recomputation, and no backward step, reads k
            return all(u in C or u >= 0 and config[u] is not R for u in f.users[k])

        if not all(alone(k) for k in C if k != c):
            return None
        mine = {j for j in V if f.mine(j, c) and alone(j)}
        return C, mine, V - mine

    def better(config: tuple[Decision, ...]) -> tuple[Decision, ...] | None:
        cascade = None
        needed = recomputed(config, f.read)
        for c in f.candidates:
            if c not in needed:
                continue
            found = private(config, c)
            if found is None or sum(f.size[j] for j in found[1]) < f.size[c]:
                continue
            if sum(f.size[j] for j in found[1]) != f.size[c] or not found[2] <= read_set:
                cascade = recomputed(config, f.boundary) if cascade is None else cascade
                if c in cascade:
                    continue
            region = found[0] | found[1]
            y = tuple(S if k in region else d for k, d in enumerate(config))
            if any(y[v] is S and y[w] is R and all(y[u] is S for u in others) for v, w, others in f.rules):
                continue  # Y is not enumerated (c is such a rule's v): keep X
            return y
        return None

    return better


def save_instead_mask(problem: Problem, block: Block, configs: list[tuple[Decision, ...]]) -> np.ndarray:
    """[save_instead_test(problem, block)(x) is not None for x in configs], with numpy:
    one row per value, one column per configuration (LLaMA's attention block: 95,040
    configurations in ~0.1 s, ~2 s one at a time)."""
    f = _Facts.of(problem, block)
    m, n = len(block.values), len(configs)
    skip = np.zeros(n, bool)
    if not f.candidates or not n:
        return skip
    # decisions by identity (Decision members are singletons): no per-item hashing
    ids = np.fromiter(map(id, chain.from_iterable(configs)), np.int64, count=n * m).reshape(n, m).T
    rec, sav = ids == id(R), ids == id(S)
    readers: list[list[int]] = [[] for _ in range(m)]
    for u in range(m):
        for j in f.ins[u]:
            readers[j].append(u)

    def recomputed(roots: list[int]) -> np.ndarray:
        out = np.zeros((m, n), bool)
        for k in reversed(range(m)):  # inputs come before their readers
            hit = np.ones(n, bool) if k in roots else np.zeros(n, bool)
            for u in readers[k]:
                hit |= out[u]
            out[k] = hit & rec[k]
        return out

    needed, cascade = recomputed(f.read), recomputed(f.boundary)
    read_set = set(f.read)
    for c in f.candidates:
        above, stack = {c}, [c]
        while stack:
            for j in f.ins[stack.pop()]:
                if j not in above:
                    above.add(j)
                    stack.append(j)
        in_c = np.zeros((m, n), bool)
        in_c[c] = rec[c] & needed[c]
        fail = ~in_c[c]
        reached = np.zeros((m, n), bool)
        for j in sorted(above - {c}, reverse=True):
            for u in readers[j]:
                if u in above:
                    reached[j] |= in_c[u]
            fail |= reached[j] & ~rec[j] & ~sav[j]  # offloaded
            if f.ok[j]:
                in_c[j] = reached[j] & rec[j]
            else:
                fail |= reached[j] & rec[j]

        def alone(k: int) -> np.ndarray:
            out = np.ones(n, bool)
            for u in f.users[k]:
                if u < 0:
                    return np.zeros(n, bool)
                out &= in_c[u] | ~rec[u]
            return out

        total = np.zeros(n, np.int64)
        other_unread = np.zeros(n, bool)  # a SAVE value read that is neither mine nor read in G_b
        region = in_c.copy()
        for j in above - {c}:
            fail |= in_c[j] & ~alone(j)
            v = reached[j] & sav[j]
            mine = v & alone(j) if f.mine(j, c) else np.zeros(n, bool)
            total += np.where(mine, f.size[j], 0)
            region[j] |= mine
            if j not in read_set:
                other_unread |= v & ~mine
        exact = (total == f.size[c]) & ~other_unread
        good = ~fail & (total >= f.size[c]) & (exact | ~cascade[c])
        for v, w, others in f.rules:  # Y must be enumerated
            y_save = lambda k: region[k] | sav[k]  # noqa: E731
            fires = y_save(v) & ~region[w] & rec[w]
            for u in others:
                fires &= y_save(u)
            good &= ~fires
        skip |= good
    return skip
