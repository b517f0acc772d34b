"""A backward module built from simulate's steps, for schedules that recompute a value
more than once (`Plan.schedule`: dropped after one backward use, recomputed before a
later one).

AOTAutograd's extraction computes each forward value at most once in backward, so such
a schedule cannot come out of extraction plus a reorder. Here every RECOMPUTE and
BACKWARD step copies its joint-graph nodes in step order, each copy reading the newest
copy of its inputs: a value recomputed twice gets two copies, and fx's codegen frees
each after its own last reader, which is where simulate frees each instance (a read
binds to the newest instance). The saved values and tangents stay the extraction's
placeholders, in its order (the forward module returns them so).
"""

from __future__ import annotations

import operator

from torch import fx

from remat.compat import is_sym_node
from remat.errors import UnsupportedGraphError
from remat.frontend.problem import GraphProblem
from remat_solvers import Evaluation, StepKind


def recomputes_twice(evaluation: Evaluation) -> bool:
    """Whether some value is recomputed more than once (extraction cannot run it)."""
    seen: set[int] = set()
    for step in evaluation.steps:
        if step.kind is StepKind.RECOMPUTE:
            if step.node_id in seen:
                return True
            seen.add(step.node_id)
    return False


def rebuild_backward(bw: fx.GraphModule, joint: fx.GraphModule, graph_problem: GraphProblem,
                     evaluation: Evaluation) -> None:
    """Replace `bw`'s body (the extraction's) by one copy of each step's joint nodes, in
    step order; `bw`'s placeholders and outputs stay as they are."""
    by_name = {n.name: n for n in joint.graph.nodes}
    graph = fx.Graph()
    newest: dict[str, fx.Node] = {}  # joint node name -> its newest copy
    for ph in bw.graph.find_nodes(op="placeholder"):
        newest[ph.name] = graph.placeholder(ph.name, type_expr=ph.type)
        newest[ph.name].meta = dict(ph.meta)
    copies: dict[str, int] = {}

    def read(n: fx.Node) -> fx.Node:
        if n.name not in newest:
            _check_untracked(n)
            _copy(graph, n, newest, read)  # copied just before its first reader
        return newest[n.name]

    def run(node: fx.Node) -> None:
        # a second copy gets a name no joint node has (passes after this one match
        # joint names: the first copy keeps its name)
        k = copies.get(node.name, 0)
        copies[node.name] = k + 1
        _copy(graph, node, newest, read, name=node.name if k == 0 else f"{node.name}_recomputed{k}")

    for step in evaluation.steps:
        if step.kind is StepKind.FORWARD:
            continue
        if step.kind is StepKind.RELOAD:
            raise UnsupportedGraphError("a schedule that recomputes a value twice and reloads an "
                                        "offloaded one is not supported; plan without offload")
        for name in graph_problem.fx_names[step.node_id]:
            node = by_name[name]
            if node.op == "placeholder":  # a tangent: already a placeholder of bw
                continue
            if (_other_output_of_untracked_op(node, graph_problem.fx_names[step.node_id])
                    and node.args[0].name not in newest):
                # another output of a multi-output op no step has run yet (the problem
                # models it as reading the op's inputs): the op runs here, for it
                run(node.args[0])
            run(node)
    out = bw.graph.output_node()
    graph.output(fx.node.map_arg(out.args[0], lambda n: newest[n.name]), type_expr=out.type)
    bw.graph = graph


def _other_output_of_untracked_op(node: fx.Node, step_names) -> bool:
    """`node` is a getitem of an op that this step does not run (the op belongs to another
    problem node, the op's first output)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    op = node.args[0]
    return isinstance(op, fx.Node) and op.op == "call_function" and op.name not in step_names


def _check_untracked(node: fx.Node) -> None:
    """`node` is read before any step made it: only a joint node no problem node stands for
    (a size computation) may be; a tensor value must come from a step or be saved."""
    if node.op == "placeholder" or not is_sym_node(node):
        raise UnsupportedGraphError(
            f"internal: the schedule reads {node.name!r} ({node.format_node()}) before any step "
            "makes it and it is not saved; please report this model")


def _copy(graph: fx.Graph, node: fx.Node, newest: dict[str, fx.Node], read, name: str | None = None) -> None:
    """Append a copy of joint node `node` to `graph`, reading the newest copies of its
    inputs; it becomes `node`'s newest copy."""
    copy = graph.create_node(node.op, node.target, fx.node.map_arg(node.args, read),
                             fx.node.map_arg(node.kwargs, read), name=name or node.name, type_expr=node.type)
    copy.meta = dict(node.meta)
    newest[node.name] = copy
