"""The joint graph as inductor's lowering runs it: a pointwise value read by one
pointwise or reduction op is computed inside that op's kernel and never allocated.

remat's model runs the graph op by op, so every decomposed intermediate holds its bytes
from its op to its last reader. Inductor's lowering inlines a pointwise op into the
kernel of the op that reads it when that reader is itself pointwise or a reduction (its
loader reads the producer's inputs instead), so the value has no buffer, and the
producer's inputs stay live until the reader's kernel has run. The backend's joint
graph is inductor's decomposition of the step, where this matters most: LLaMA tiny's
log-softmax becomes amax, sub, exp, sum and log over the vocabulary, and SiLU becomes
sigmoid and mul; op by op its floor holds 292,576 B more than `remat.plan`'s graph of
the same step (bench/README.md, "The budget under inductor on every zoo model",
"Inductor's decompositions").

`inlined_problem` plans against that: each such value costs 0 bytes, and its reader
reads its inputs (so they live until the reader runs). Only values with a single reader
in their own phase are inlined: inductor realizes a value read by several ops when the
chain holds a heavy op on CPU (`exp`, `log`, `sigmoid`, ...) or reads more than
`realize_reads_threshold` buffers, a rule that varies with the device and the torch
release. A value returned, or one a plan may save for the backward (a decision value),
keeps its bytes: saved, it is written, and at 0 B the solver would save it for free to
recompute from it. The plan's decisions are over the same ids as the plain problem's,
and stay valid there: every reader reads at least what it read before. A schedule that
recomputes a value twice runs each inlined op just before its reader, where inductor
runs it (`at_their_readers`), so it reads the copy the solver planned for the reader.
The prediction is not this model's: the closed loop estimates the generated code
against the plain graph run op by op (`remat.runtime.inductor.estimate`). This model
only steers the solver, and the closed loop tries it at the floor
(`remat.runtime.inductor.closed_loop`), over the plans that recompute each value once
and over all plans: on LLaMA tiny the first peaks lowest under inductor, on ViT tiny the
second, on GPT-2 and BERT the plain model does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from torch import fx

from remat.frontend.costs import fuses_pointwise_inputs, is_pointwise
from remat.frontend.problem import GraphProblem
from remat_solvers import Decision, Phase, Plan, Problem, evaluate


def inlined_ids(gp: GraphProblem, joint: fx.GraphModule) -> frozenset[int]:
    """Ids of the values inductor's lowering inlines into their one reader (see the
    module docstring)."""
    problem = gp.problem
    by_name = {n.name: n for n in joint.graph.nodes}
    users = problem.users
    outputs = set(problem.outputs)
    decided = set(problem.decision_ids)  # may be saved for the backward, where it is written
    out = set()
    for i, node in enumerate(problem.nodes):
        names = gp.fx_names[i]
        fx_node = by_name.get(names[0]) if len(names) == 1 else None
        if (fx_node is None or node.phase not in (Phase.FORWARD, Phase.BACKWARD) or node.alias_of is not None
                or not node.out_bytes or i in outputs or i in decided or not is_pointwise(fx_node)
                or len(fx_node.users) != 1 or len(users[i]) != 1):
            continue
        (reader,) = fx_node.users
        j = users[i][0]
        if (gp.fx_names[j][0] == reader.name and problem.nodes[j].phase is node.phase
                and problem.nodes[j].alias_of is None and fuses_pointwise_inputs(reader)):
            out.add(i)
    return frozenset(out)


def inlined_problem(gp: GraphProblem, joint: fx.GraphModule) -> GraphProblem:
    """`gp` with the values of `inlined_ids` at 0 bytes and their reader reading their
    inputs too (through chains of inlined values), so those inputs live until the kernel
    that reads them runs."""
    inlined = inlined_ids(gp, joint)
    if not inlined:
        return gp
    nodes = list(gp.problem.nodes)
    sources: dict[int, tuple[int, ...]] = {}  # inlined id -> what its reader's kernel reads for it
    for i, node in enumerate(nodes):
        extra = [k for j in node.inputs if j in sources for k in sources[j]]
        if extra:
            node = nodes[i] = dataclasses.replace(node, inputs=tuple(dict.fromkeys((*node.inputs, *extra))))
        if i in inlined:
            sources[i] = tuple(j for j in node.inputs if j not in sources)
            nodes[i] = dataclasses.replace(node, out_bytes=0)
    return dataclasses.replace(gp, problem=dataclasses.replace(gp.problem, nodes=tuple(nodes)))


def at_their_readers(problem: Problem, plan: Plan, inlined: Collection[int]) -> Plan:
    """`plan` with each step of an inlined value moved to just before the next step of
    its reader, as inductor's lowering runs it (inside the reader's kernel). A schedule
    that recomputes a value twice binds each read to the copy live when the reading op
    runs (`remat.runtime.schedule`): `inlined_problem` lets the reader read the inlined
    value's inputs, so the solver may recompute them afresh just before the reader and
    free the copy the inlined op read at its own step. In the graph the inlined op still
    reads that older copy, and inductor, computing it inside the reader's kernel, holds
    that copy until then: on LLaMA tiny's scheduled floor the SiLU backward's kernel read
    the gate and up projections recomputed long before, across an attention recompute
    (2,441,984 B generated against 1,990,924 B op by op in the backward). Run at its
    reader, the op reads the copies the solver planned for it. `problem`: the inlined
    problem the plan was solved on; its peak there does not rise (the moved ops hold 0
    bytes and their inputs are read by the reader anyway). Plans without a schedule run
    each value's one copy, and are returned as they are. A recompute left with no reader
    before the value's next copy (its reader moved past that copy) is dropped."""
    if plan.schedule is None or not inlined:
        return plan
    users = problem.users
    order = list(plan.schedule)
    for pos in range(len(order) - 1, -1, -1):  # readers first: a chain of inlined ops lands in order
        i = order[pos]
        if i not in inlined:
            continue
        readers = set(users[i])
        nxt = next((q for q in range(pos + 1, len(order)) if order[q] in readers), None)
        if nxt is not None and nxt > pos + 1:
            order.insert(nxt - 1, order.pop(pos))
    order = _without_unread_copies(problem, plan, order)
    if order == list(plan.schedule):
        return plan
    ev = evaluate(problem, plan.decisions, order)
    bound = plan.lower_bound_s
    return dataclasses.replace(plan, schedule=tuple(order), objective_s=ev.cost_s, peak_bytes=ev.peak_bytes,
                               lower_bound_s=bound if bound is None or bound <= ev.cost_s else None)


def _without_unread_copies(problem: Problem, plan: Plan, order: list[int]) -> list[int]:
    """`order` less each recompute step whose copy no step reads before the value's next
    copy (or the end), until none is left (a dropped copy may leave its inputs unread)."""
    users = problem.users
    recomputed = {i for i, d in plan.decisions.items() if d is Decision.RECOMPUTE}
    while True:
        unread = []
        for pos, i in enumerate(order):
            if i not in recomputed:
                continue
            readers = set(users[i])
            for q in range(pos + 1, len(order)):
                if order[q] in readers:
                    break
                if order[q] == i:
                    unread.append(pos)
                    break
            else:
                unread.append(pos)
        if not unread:
            return order
        dropped = set(unread)
        order = [i for pos, i in enumerate(order) if pos not in dropped]


__all__ = ["at_their_readers", "inlined_ids", "inlined_problem"]
