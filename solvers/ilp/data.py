"""What the CP-SAT model (model.py) needs from a problem, in node-step time.

Node steps: forward ids 0..F-1, then backward ids F..F+T-1 (the recomputations before a
backward node are "at" that node). Per decision value: its forward children, its first
and last backward read (a backward view of it extends the read to the view's last use),
and per plain decision storage: its forward end (last forward use, through forward
views; the last step if an output lives in it) and its decision members. Static bytes
per node step come from dp.structure.static_profile (shared with dp).
"""

from __future__ import annotations

import dataclasses

from remat_solvers.dp.structure import static_profile
from remat_solvers.problem import Phase, Problem


@dataclasses.dataclass(frozen=True)
class ModelData:
    """What the model needs from the problem, in node-step time."""

    n_steps: int
    step: dict[int, int]
    decision: tuple[int, ...]
    children: dict[int, tuple[int, ...]]
    first_read: dict[int, int]
    last_read: dict[int, int]
    forward_end: dict[int, int]
    members: dict[int, tuple[int, ...]]
    static: tuple[int, ...]


def model_data(problem: Problem) -> ModelData:
    nodes, root = problem.nodes, problem.storage_of
    order = list(problem.forward_ids) + list(problem.backward_ids)
    step = {i: k for k, i in enumerate(order)}
    forever = len(order) - 1
    decision = problem.decision_ids
    dset = set(decision)
    outputs = set(problem.outputs)
    at, _, _ = static_profile(problem, dset)
    children = {v: tuple(c for c in problem.users[v] if c in dset) for v in decision}
    # End of every instance, through the views made of it (backward views of a saved
    # activation keep its storage alive until their own last use).
    inst_end: dict[int, int] = {}
    for i in reversed(order):
        end = forever if i in outputs else step[i]
        for u in problem.users[i]:
            end = max(end, step[u])
            if nodes[u].alias_of == i:
                end = max(end, inst_end[u])
        inst_end[i] = end
    first_read, last_read = {}, {}
    for v in decision:
        reads = [(step[r], inst_end[r] if nodes[r].alias_of == v else step[r])
                 for r in problem.users[v] if nodes[r].phase is Phase.BACKWARD]
        if reads:
            first_read[v] = min(a for a, _ in reads)
            last_read[v] = max(b for _, b in reads)
    forward_end: dict[int, int] = {}
    members: dict[int, list[int]] = {}
    for i in problem.forward_ids:
        s = root[i]
        if s not in dset:
            continue
        end = forever if i in outputs else step[i]
        for u in problem.users[i]:
            if nodes[u].phase is Phase.FORWARD:
                end = max(end, step[u])
                if nodes[u].alias_of == i and u not in dset:
                    end = max(end, inst_end[u])
        forward_end[s] = max(forward_end.get(s, 0), end)
        if i in dset:
            members.setdefault(s, []).append(i)
    return ModelData(
        n_steps=len(order),
        step=step,
        decision=decision,
        children=children,
        first_read=first_read,
        last_read=last_read,
        forward_end=forward_end,
        members={s: tuple(m) for s, m in members.items()},
        static=tuple(at[i] for i in order),
    )



def runs(d: ModelData, groups: dict[int, list[int]], earliest: dict[int, int], limit: int):
    """(first step, largest static bytes) of the runs of node steps over which no
    storage changes between absent / fixed / live-if-saved, at most `limit` of them
    (evenly spread: fewer knapsacks give a weaker but still valid bound)."""
    cuts = {0, d.n_steps}
    for s, vs in groups.items():
        cuts.update((d.step[s], d.forward_end[s] + 1))
        for v in vs:
            if v in d.first_read:
                cuts.update((d.first_read[v], d.last_read[v] + 1))
            else:
                cuts.add(earliest[v])
    cuts = sorted(c for c in cuts if 0 <= c <= d.n_steps)
    runs = [(a, max(d.static[a:b])) for a, b in zip(cuts, cuts[1:]) if b > a]
    if len(runs) > limit:
        runs = [runs[round(k * (len(runs) - 1) / (limit - 1))] for k in range(limit)]
    return runs
