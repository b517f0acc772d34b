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
and stay valid there: every reader reads at least what it read before. The prediction
is not this model's: the closed loop estimates the generated code against the plain
graph run op by op (`remat.runtime.inductor.estimate`). This model only steers the
solver, and the closed loop tries it at the floor (`remat.runtime.inductor.closed_loop`),
over the plans that recompute each value once and over all plans: on LLaMA tiny the
first peaks lowest under inductor, on ViT tiny the second, on GPT-2 and BERT the plain
model does.
"""

from __future__ import annotations

import dataclasses

from torch import fx

from remat.frontend.costs import fuses_pointwise_inputs, is_pointwise
from remat.frontend.problem import GraphProblem
from remat_solvers import Phase


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


__all__ = ["inlined_ids", "inlined_problem"]
