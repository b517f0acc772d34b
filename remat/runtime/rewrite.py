"""Plan -> forward and backward GraphModules that execute `simulate`'s schedule.

The forward graph is AOTAutograd's extraction for the plan's saved set: it runs the
forward nodes in joint order and returns the saved values. The backward graph contains
every backward node plus the recomputation of every forward value it needs that was
not saved (the extraction stops at saved values and primals, exactly where `simulate`'s
recursion stops). We then reorder the backward graph to `simulate`'s canonical steps,
so each recomputation sits just before its first use; fx's codegen frees every value
after its last use, and AOTAutograd's boxed backward frees saved tensors as it goes.
A schedule that recomputes a value twice (Plan.schedule) is copied step by step
instead (`remat.runtime.schedule`).
"""

from __future__ import annotations

import heapq

import torch
from torch import fx

from remat.compat import extract_fwd_bwd_modules, is_sym_node
from remat.errors import UnsupportedGraphError
from remat.frontend.accumulate import sum_in_place
from remat.frontend.problem import GraphProblem
from remat.offload.host import insert_offloads
from remat.runtime import rng
from remat.runtime.schedule import rebuild_backward, recomputes_twice
from remat_solvers import Decision, Evaluation, Plan, StepKind
from remat_solvers.shared_storage import read_in_backward, shared_saves


def partition(
    joint: fx.GraphModule,
    graph_problem: GraphProblem,
    plan: Plan,
    evaluation: Evaluation,
    *,
    num_fwd_outputs: int,
    custom_offload_ops: bool = False,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules of `plan` (whose simulation is `evaluation`).
    custom_offload_ops: offload through torch.library ops (graphs inductor compiles)."""
    _check_storages_saved_once(graph_problem, plan, evaluation)
    by_name = {n.name: n for n in joint.graph.nodes}
    # Primals are saved too (free: they are live all step); extraction drops the unused.
    saved = [n for n in joint.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    # Only the saved values backward reads (directly or to recompute): extraction keeps
    # any saved value some copied node reads, even a dead random op it copied.
    read = read_in_backward(graph_problem.problem, evaluation.steps)
    kept = [graph_problem.value_name[i] for i, d in plan.decisions.items()
            if d in (Decision.SAVE, Decision.OFFLOAD) and i in read]
    saved += [by_name[name] for name in kept]
    offloaded = {graph_problem.value_name[i] for i, d in plan.decisions.items()
                 if d is Decision.OFFLOAD and i in read}
    saved_sym = _saved_sym_nodes(joint)
    saved = [n for n in saved if n not in saved_sym]
    fw, bw = extract_fwd_bwd_modules(joint, saved, saved_sym, num_fwd_outputs=num_fwd_outputs)
    rebuilt = recomputes_twice(evaluation)
    if rebuilt:  # extraction recomputes a value once: copy the steps instead
        rebuild_backward(bw, joint, graph_problem, evaluation)
    else:
        _drop_dead_copies(bw, {name for names in graph_problem.fx_names for name in names})
    rng.replay_in_backward(bw)
    _recompute_batch_norm_without_stats(bw)
    _prune_unused_saved(fw, bw, num_fwd_outputs)
    _check_recomputed(bw, graph_problem, evaluation)
    sum_in_place(bw, dict(graph_problem.in_place_sums))  # as the problem models them
    rank = _backward_rank(graph_problem, evaluation)
    rank.update(insert_offloads(fw, bw, offloaded, num_fwd_outputs=num_fwd_outputs, rank=rank,
                                custom_ops=custom_offload_ops))
    if not rebuilt:  # a rebuilt backward is in step order already
        _reorder(bw, rank)
    rng.eager_forward(fw)  # last: fw's saved outputs are matched by name above
    fw.graph.lint()
    bw.graph.lint()
    fw.recompile()
    bw.recompile()
    return fw, bw


def _check_storages_saved_once(graph_problem: GraphProblem, plan: Plan, evaluation: Evaluation) -> None:
    """No two saved values share a forward storage: AOTAutograd would donate both to
    inductor's backward, which may overwrite one while the other is still to be read
    (`remat_solvers.shared_storage`; the planner makes every plan so)."""
    shared = shared_saves(graph_problem.problem, plan, evaluation.steps)
    if shared:
        names = [[graph_problem.value_name[i] for i in ids] for ids in shared.values()][:3]
        raise UnsupportedGraphError(
            f"internal: the plan saves several values over one storage ({names}); the backward "
            "could read a buffer already reused; please report this model")


def _saved_sym_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """SymInts the backward reads (dynamic shapes): symbolic placeholders and forward
    size computations. AOTAutograd hands them to backward as `saved_sym_nodes`, as its
    min-cut partitioner does; a SymInt passed as a saved tensor value breaks extraction
    ("Node ... was invalid, but is output"). They cost no device memory."""
    sym = []
    for node in joint.graph.nodes:
        if not is_sym_node(node) or node.name.startswith("tangents"):
            continue
        if node.op == "placeholder" or not _depends_on_tangents(node):
            sym.append(node)
    return sym


def _depends_on_tangents(node: fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name.startswith("tangents"):
            return True
        stack.extend(n.all_input_nodes)
    return False


def _backward_rank(graph_problem: GraphProblem, evaluation: Evaluation) -> dict[str, int]:
    """fx name -> position in simulate's backward steps."""
    rank: dict[str, int] = {}
    steps = [s for s in evaluation.steps if s.kind is not StepKind.FORWARD]
    for k, step in enumerate(steps):
        for name in graph_problem.fx_names[step.node_id]:
            rank.setdefault(name, k)
    return rank


def _drop_dead_copies(bw: fx.GraphModule, joint_names: set[str]) -> None:
    """Extraction copies every node whose inputs are available, and fx's DCE keeps
    impure ones (random ops): rerunning dropout in backward would consume the RNG.
    Remove every unused copy of a joint-graph op, to a fixed point."""
    for node in reversed(list(bw.graph.nodes)):
        if node.op == "call_function" and not node.users and node.name in joint_names:
            bw.graph.erase_node(node)


_BN_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_NO_STATS = torch.ops.aten._native_batch_norm_legit.no_stats


def _recompute_batch_norm_without_stats(bw: fx.GraphModule) -> None:
    """A training-mode BatchNorm recomputed in backward must not read the running stats:
    the forward epilogue has already updated them in place (reading them would trip
    autograd's saved-tensor version check). In training mode outputs 0-2 do not depend
    on them, so recompute with `_native_batch_norm_legit.no_stats` (same kernel, same
    bits) and drop the running-stat outputs, which nothing in backward reads."""
    for node in list(bw.graph.nodes):
        if node.target is not _BN_FUNCTIONAL or node.args[5] is not True:
            continue
        x, weight, bias, _mean, _var, training, momentum, eps = node.args
        for user in list(node.users):
            if user.args[1] in (3, 4):
                if user.users:
                    raise UnsupportedGraphError(f"backward reads new BatchNorm stats: {user.format_node()}")
                bw.graph.erase_node(user)
        with bw.graph.inserting_before(node):
            replacement = bw.graph.call_function(_BN_NO_STATS, (x, weight, bias, training, momentum, eps))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        bw.graph.erase_node(node)


def _prune_unused_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Drop saved values the backward no longer reads, from both sides (the forward
    returns them after its `num_fwd_outputs` real outputs, in the backward's order)."""
    unused = {n.name for n in bw.graph.nodes if n.op == "placeholder" and not n.users
              and not n.name.startswith("tangents")}
    if not unused:
        return
    for n in list(bw.graph.nodes):
        if n.op == "placeholder" and n.name in unused:
            bw.graph.erase_node(n)
    out = fw.graph.output_node()
    values = list(out.args[0])
    kept = values[:num_fwd_outputs] + [
        v for v in values[num_fwd_outputs:] if not (isinstance(v, fx.Node) and v.name in unused)
    ]
    out.args = (tuple(kept),)
    fw.graph.eliminate_dead_code()


def _check_recomputed(bw: fx.GraphModule, graph_problem: GraphProblem, evaluation: Evaluation) -> None:
    """The forward values the backward graph computes are exactly simulate's recomputes."""
    problem = graph_problem.problem
    names = {n.name for n in bw.graph.nodes if n.op == "call_function"}
    in_graph = {
        i for i in problem.forward_ids
        if graph_problem.value_name[i] in names
    }
    expected = set(evaluation.recomputed_ids)
    if in_graph != expected:
        extra = sorted(graph_problem.value_name[i] for i in in_graph - expected)[:5]
        missing = sorted(graph_problem.value_name[i] for i in expected - in_graph)[:5]
        raise UnsupportedGraphError(
            "internal: the backward graph recomputes a different set than the plan "
            f"(extra {extra}, missing {missing}); please report this model"
        )


def _reorder(gm: fx.GraphModule, rank: dict[str, int]) -> None:
    """Topologically reorder `gm` by `rank`; unranked nodes go just before their first
    user (or as early as possible when they have none)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    index = {n: k for k, n in enumerate(nodes)}
    big = len(nodes) + 1
    key: dict[fx.Node, tuple[float, int]] = {}
    for n in reversed(nodes):
        if n.op in ("placeholder", "output"):
            key[n] = (-1 if n.op == "placeholder" else big + 1, index[n])
        elif n.name in rank:
            key[n] = (rank[n.name], index[n])
        else:
            users = [key[u][0] for u in n.users if u in key]
            key[n] = ((min(users) - 0.5) if users else -0.5, index[n])
    indegree = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(key[n], index[n], n) for n in nodes if indegree[n] == 0]
    heapq.heapify(ready)
    order: list[fx.Node] = []
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, (key[u], index[u], u))
    if len(order) != len(nodes):
        raise UnsupportedGraphError("internal: backward graph has a cycle after extraction")
    cursor = None
    for n in order:
        if cursor is not None and cursor.next is not n:
            cursor.append(n)
        cursor = n
