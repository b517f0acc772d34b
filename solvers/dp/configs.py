"""The configurations dp enumerates for one block, with exact pruning of useless ones.

A configuration is a tuple of decisions aligned with `block.values`. Values whose
decision cannot change the plan are fixed, and configurations that a SAVE dominance rule
proves useless are never generated (`_save_dominated`).
"""

from __future__ import annotations

from remat_solvers.dp.structure import Block
from remat_solvers.problem import Decision, Problem
from remat_solvers.registry import UnsupportedProblem


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
    # by position in `values`, decided from the last one back (readers before inputs)
    at = {v: k for k, v in enumerate(values)}
    always = [v == block.boundary or v in read_by_backward for v in values]
    kids = [tuple(at[c] for c in children[v]) for v in values]
    choices = [tuple(d for d in problem.allowed(v)
                     if not (d is Decision.RECOMPUTE and v in read_by_backward and not nodes[v].recomputable))
               for v in values]  # backward would have to recompute it: always InvalidLocal
    checks = [tuple((at[v], at[c], tuple(at[u] for u in others)) for v, c, others in rules.get(w, ()))
              for w in values]
    out: list[tuple[Decision, ...]] = []
    cur: list[Decision] = [Decision.SAVE] * len(values)
    save, recompute = (Decision.SAVE,), Decision.RECOMPUTE

    def rec(k: int) -> None:
        if k < 0:
            out.append(tuple(cur))
            if len(out) > limit:
                raise UnsupportedProblem(
                    f"dp: block {block.index} ({len(values)} decision values, first "
                    f"{nodes[values[0]].name!r}) has more than max_block_configs={limit} "
                    "configurations; use 'ilp' or raise max_block_configs"
                )
            return
        relevant = always[k] or any(cur[c] is recompute for c in kids[k])
        for d in choices[k] if relevant else save:
            cur[k] = d
            if checks[k] and any(cur[v] is Decision.SAVE and cur[c] is recompute
                                 and all(cur[u] is Decision.SAVE for u in others) for v, c, others in checks[k]):
                continue  # dominated by saving the reader instead (_save_dominated)
            rec(k - 1)

    rec(len(values) - 1)
    return out


def _save_dominated(problem: Problem, block: Block,
                    read_by_backward: set[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Rules (v, c, others): a configuration with v SAVE, c RECOMPUTE and every value of
    `others` SAVE is useless. v is read only by c (in forward, never by backward); c's
    other inputs are either outside the block and not a_{b-1} (always on the device) or
    the block values `others`; neither v nor c is the boundary, an output, a view or
    viewed; c's bytes are at most v's; and saving c costs at most recomputing it
    (`Node.save_s`, charged when the backward reads c: at most c's compute seconds).

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
    less and c's save seconds more (v and `others` are SAVE in both, v is charged in
    neither: the backward does not read it), at most as much as X: X is never needed
    for an optimal plan, nor for the least peak."""
    nodes = problem.nodes
    inside = set(block.values)
    viewed = {nodes[i].alias_of for i in range(len(nodes)) if nodes[i].alias_of is not None}
    outputs = {problem.storage_of[j] for j in problem.outputs}
    plain = {v for v in block.values
             if v != block.boundary and v not in viewed and v not in outputs and nodes[v].alias_of is None}
    charge = dict(problem.save_charged)
    out = []
    for v in sorted(plain):
        readers = problem.users[v]
        if v in read_by_backward or len(readers) != 1 or readers[0] not in plain:
            continue
        c = readers[0]
        others = tuple(dict.fromkeys(j for j in nodes[c].inputs if j != v))
        if block.prev in others:
            continue
        if nodes[c].out_bytes <= nodes[v].out_bytes and charge.get(c, 0.0) <= nodes[c].compute_s:
            out.append((v, c, tuple(j for j in others if j in inside)))
    return out


def doomed_test(problem: Problem, block: Block):
    """A test of configurations every replay of which raises InvalidLocal, whatever a_{b-1}'s
    mode and the boundary's cascade: a non-recomputable value set RECOMPUTE (it then means
    "drop") that the block's backward needs. Needed: read by a backward step of G_b, or
    read by a needed RECOMPUTE value (the replay brings back every input of a value it
    recomputes that is not on the device; what it reloads it does not expand). The replay
    meets such a value with nothing to bring it back from and raises. Tables skip these
    configurations (they add no option) but count them, so the clock and the limit are
    charged as before. GPT-2's attention block with RNG replay: 33,600 of 57,600 (a
    dropped generator state read by a recomputed dropout)."""
    nodes = problem.nodes
    values = block.values
    inside = set(values)
    droppable = [k for k, v in enumerate(values) if not nodes[v].recomputable]
    read = {j for r in block.backward_steps for j in nodes[r].inputs if j in inside}
    inputs = {v: tuple(j for j in nodes[v].inputs if j in inside) for v in values}
    order = list(reversed(range(len(values))))  # readers (higher ids) before their inputs

    def doomed(config: tuple[Decision, ...]) -> bool:
        if not any(config[k] is Decision.RECOMPUTE for k in droppable):
            return False
        needed = set(read)
        for k in order:
            v = values[k]
            if v in needed and config[k] is Decision.RECOMPUTE:
                if not nodes[v].recomputable:
                    return True
                needed.update(inputs[v])
        return False

    return doomed

