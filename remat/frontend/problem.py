"""Joint fx graph + costs -> `remat_solvers.Problem`, with the map back to fx nodes.

Each tensor value of the joint graph becomes one problem node, except:
- a multi-output op (`native_layer_norm`, `native_dropout`, ...) and its `getitem`s:
  the first used element carries the op (its inputs, its cost, the bytes of outputs
  nobody reads); every other element reads the first element and the op's inputs (so
  they stay live until all outputs exist, as they do at runtime) and is not
  recomputable on its own (recomputing it would rerun the whole op at a cost and
  memory the model would not see). View multi-outputs (`split`, `unbind`) make one
  alias node per element.
- placeholders: parameters/buffers -> PARAM, user inputs -> INPUT, tangents ->
  BACKWARD nodes without inputs.
Phases come from AOTAutograd's `classify_nodes`: FORWARD is what the forward outputs
need; everything else runs in backward, placed just before its first backward user.

A forward output lives to the end of the step (the caller may hold it through backward),
unless the caller declared it dropped (`drop_outputs`: `remat.backend(outputs="loss")`):
then it lives to the forward's end only, which a last forward node of no bytes and no
cost, `FORWARD_END`, models by reading it (the forward graph returns it; the caller drops
it before backward).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection, Mapping

import torch
from torch import fx

from remat import compat
from remat.compat import classify_nodes
from remat.frontend.accumulate import in_place_operand
from remat.frontend.profile import (joint_device_type, made_at_run, never_replay_reason, source_line, storage_bytes,
                                    storage_key, tensor_val)
from remat_solvers import Node, Phase, Problem

LIBRARY_WORKSPACES = "remat_library_workspaces"
"""Name of the problem node (no fx node) that holds the CUDA math libraries' persistent
workspaces (`frontend.libraries`): a parameter-like value, live all step."""

FORWARD_END = "remat_forward_end"
"""Name of the problem node (no fx node) that holds dropped forward outputs to the
forward's end (see the module docstring)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GraphProblem:
    """A Problem plus the map between problem ids and fx nodes of the joint graph."""

    problem: Problem
    fx_names: tuple[tuple[str, ...], ...]
    """Per problem id: the fx nodes it stands for, in run order (op, then its getitem)."""
    value_name: tuple[str, ...]
    """Per problem id: the fx node whose value it is (the last of fx_names)."""
    source: tuple[str, ...]
    """Per problem id: 'file:line' of the user code that made it, or ''."""
    never_replay: Mapping[int, str]
    """Problem ids that must not be recomputed, with the reason."""
    in_place_sums: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Gradient sums (fx name of an `add`) modelled as written into one operand (its
    position), which the rewriter must run as `add_` (`remat.frontend.accumulate`)."""


@dataclasses.dataclass
class _Item:
    """A problem node under construction."""

    fx_names: tuple[str, ...]
    phase: Phase
    inputs: tuple[str, ...]  # value names of fx producers
    out_bytes: int
    compute_s: float
    alias_of: str | None
    never_replay: str | None
    source: str


def build_problem(
    joint: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    num_params: int,
    budget_bytes: int,
    cost_s: Callable[[fx.Node], float],
    param_indices: Collection[int] | None = None,
    sum_gradients_in_place: bool = False,
    drop_outputs: bool = False,
    resident_bytes: int = 0,
) -> GraphProblem:
    """The planning problem of `joint`. Parameters and buffers are the primals at
    `param_indices` (positions among all primals, SymInts included: under torch.compile
    dynamo interleaves them with user inputs and AOTAutograd names them in
    `static_lifetime_input_indices`); without it, the first `num_params` primals.
    `sum_gradients_in_place`: a parameter's gradient sum overwrites one of its operands
    (`GraphProblem.in_place_sums`; the rewriter must then apply them).
    `drop_outputs`: forward outputs of more than one element live to the forward's end
    only (see the module docstring); a loss (one element) stays held; tangents of more
    than one element die after their last use (`_released_tangents`).
    `resident_bytes`: what the device holds all step outside the graph's values (the CUDA
    libraries' workspaces), one node `LIBRARY_WORKSPACES` when not 0."""
    info = classify_nodes(joint, [], num_fwd_outputs)
    params = frozenset(range(num_params) if param_indices is None else param_indices)
    items: dict[str, _Item] = {}  # value name -> item
    seen_storage: set[int] = set()
    in_place: dict[str, int] = {}
    primal_index = -1
    if resident_bytes:
        if any(node.name == LIBRARY_WORKSPACES for node in joint.graph.nodes):
            raise ValueError(f"the joint graph has a node named {LIBRARY_WORKSPACES!r}")
        items[LIBRARY_WORKSPACES] = _Item((), Phase.PARAM, (), resident_bytes, 0.0, None, None,
                                          "cuBLAS and cuBLASLt workspaces (held by torch for the process)")
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            is_tangent = node.name.startswith("tangents")
            primal_index += 0 if is_tangent else 1
            val = tensor_val(node)
            if val is None:
                continue
            if is_tangent:
                phase = Phase.BACKWARD
            else:
                phase = Phase.PARAM if primal_index in params else Phase.INPUT
            key = storage_key(val)
            nbytes = 0 if key in seen_storage else storage_bytes(val)
            seen_storage.add(key)
            items[node.name] = _Item((node.name,), phase, (), nbytes, 0.0, None, None, "")
        elif node.op == "call_function" and node.target is not operator.getitem:
            phase = Phase.FORWARD if info.is_required_fw(node) else Phase.BACKWARD
            for item in _items_of_op(node, phase, items, cost_s):
                items[item.fx_names[-1]] = item
            pos = None
            if sum_gradients_in_place and phase is Phase.BACKWARD:
                pos = in_place_operand(node, lambda name: name in items and items[name].phase
                                       is Phase.BACKWARD and items[name].alias_of is None)
            if pos is not None:  # the sum lives in its operand's storage
                items[node.name].alias_of = node.args[pos].name
                in_place[node.name] = pos
    dropped = _dropped_outputs(joint, items, num_fwd_outputs) if drop_outputs else ()
    if dropped:
        items[FORWARD_END] = _Item((), Phase.FORWARD, dropped, 0, 0.0, None,
                                   "the forward's end, which holds the outputs returned to the caller", "")
    released = _released_tangents(joint) if drop_outputs and compat.releases_tangents() else frozenset()
    gp = _assemble(joint, items, num_fwd_outputs, budget_bytes, dropped=frozenset(dropped), released=released)
    return dataclasses.replace(gp, problem=_pinned_where_made(gp, joint), in_place_sums=in_place)


def _pinned_where_made(gp: GraphProblem, joint: fx.GraphModule) -> Problem:
    """`gp.problem` with the values whose device the trace does not know marked not
    offloadable (`frontend.profile.made_at_run`: SDPA's Philox seed and offset). A reload
    could only put them on the traced device, which is not where the kernel made them or
    reads them: a seed reloaded onto the GPU, or onto meta, crashes the backward."""
    by_name = {n.name: n for n in joint.graph.nodes}
    device_type = joint_device_type(joint)
    pinned = {i for i, name in enumerate(gp.value_name)
              if name in by_name and made_at_run(by_name[name], device_type)}
    if not pinned:
        return gp.problem
    nodes = tuple(dataclasses.replace(n, offloadable=False) if i in pinned else n
                  for i, n in enumerate(gp.problem.nodes))
    return dataclasses.replace(gp.problem, nodes=nodes)


def _dropped_outputs(joint: fx.GraphModule, items: Mapping[str, _Item], num_fwd_outputs: int) -> tuple[str, ...]:
    """The forward outputs a caller that keeps only the loss drops before backward: the
    forward values of more than one element among the first `num_fwd_outputs` outputs."""
    if FORWARD_END in items:
        raise ValueError(f"the joint graph has a node named {FORWARD_END!r}")
    leaves = torch.utils._pytree.tree_leaves(joint.graph.output_node().args)[:num_fwd_outputs]
    out = []
    for node in leaves:
        val = tensor_val(node) if isinstance(node, fx.Node) else None
        if (val is not None and val.numel() > 1 and node.name in items
                and items[node.name].phase is Phase.FORWARD and node.name not in out):
            out.append(node.name)
    return tuple(out)


def _released_tangents(joint: fx.GraphModule) -> frozenset[str]:
    """The tangents a caller that keeps only the loss does not hold: every tangent of more
    than one element. Only the seed of `loss.backward()` (one element) is held by the
    caller through the whole backward. Any other tangent (the zeros autograd materializes
    for an output the caller dropped, or a gradient that a later graph's backward hands
    on) reaches AOTAutograd's backward in a list its prologue clears
    (`CompiledFunction.boxed_grads_call`), so it dies after its last use in the backward
    graph, as every other value does (GPT-2 tiny under inductor: the logits' 262,144 B
    zero tangent is freed after the first kernel; held to the end in the model, the
    prediction would exceed the measurement by exactly its bytes).
    A torch whose backward takes its gradients unboxed holds them all to the end
    (`remat.compat.releases_tangents`): then none is released."""
    return frozenset(n.name for n in joint.graph.find_nodes(op="placeholder")
                     if n.name.startswith("tangents") and tensor_val(n) is not None and not is_loss_seed(n))


def is_loss_seed(node: fx.Node) -> bool:
    """Whether `node` is a tangent its caller holds through the whole backward: the seed
    of `loss.backward()`, one element (see `_released_tangents`)."""
    val = tensor_val(node)
    return node.name.startswith("tangents") and (val is None or val.numel() <= 1)


def _tensor_inputs(node: fx.Node, items: Mapping[str, _Item]) -> tuple[str, ...]:
    names = []
    for arg in node.all_input_nodes:
        if arg.name in items and arg.name not in names:
            names.append(arg.name)
    return tuple(names)


def _alias_source(val: torch.Tensor, node: fx.Node, inputs: tuple[str, ...]) -> str | None:
    key = storage_key(val)
    for arg in node.all_input_nodes:
        arg_val = tensor_val(arg)
        if arg.name in inputs and arg_val is not None and storage_key(arg_val) == key:
            return arg.name
    return None


def _items_of_op(
    node: fx.Node, phase: Phase, items: Mapping[str, _Item], cost_s: Callable[[fx.Node], float]
) -> list[_Item]:
    inputs = _tensor_inputs(node, items)
    reason = never_replay_reason(node)
    src = source_line(node)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        alias = _alias_source(val, node, inputs)
        nbytes = storage_bytes(val)
        cost = 0.0 if alias is not None else cost_s(node)
        return [_Item((node.name,), phase, inputs, nbytes, cost, alias, reason, src)]
    if not isinstance(val, (tuple, list)):
        return []  # symbolic or None result: nothing to plan
    getitems = sorted(
        (u for u in node.users if u.target is operator.getitem and tensor_val(u) is not None),
        key=lambda u: u.args[1],
    )
    used = {u.args[1] for u in getitems}
    dead_bytes = sum(
        storage_bytes(t) for i, t in enumerate(val) if isinstance(t, torch.Tensor) and i not in used
    )
    out: list[_Item] = []
    first: _Item | None = None
    for g in getitems:
        gval = tensor_val(g)
        alias = _alias_source(gval, node, inputs)
        if alias is not None:  # a view of an input (split, unbind, chunk)
            out.append(_Item((g.name,), phase, inputs, storage_bytes(gval), 0.0, alias, reason, src))
        elif first is None:
            first = _Item((node.name, g.name), phase, inputs, storage_bytes(gval) + dead_bytes,
                          cost_s(node), None, reason, src)
            out.append(first)
        else:
            out.append(_Item((g.name,), phase, (first.fx_names[-1], *inputs), storage_bytes(gval),
                             0.0, None, reason or "secondary output of a multi-output op", src))
    if first is None and dead_bytes:
        out.insert(0, _Item((node.name,), phase, inputs, dead_bytes, cost_s(node), None, reason, src))
    elif first is None and not out:
        out.append(_Item((node.name,), phase, inputs, 0, cost_s(node), None, reason, src))
    elif first is None:  # only views: the op itself still has to run first
        out[0] = dataclasses.replace(out[0], fx_names=(node.name, *out[0].fx_names))
    return out


def _assemble(
    joint: fx.GraphModule, items: Mapping[str, _Item], num_fwd_outputs: int, budget_bytes: int,
    dropped: frozenset[str] = frozenset(), released: frozenset[str] = frozenset(),
) -> GraphProblem:
    """Order items PARAM/INPUT, FORWARD, BACKWARD (just in time) and number them;
    `dropped` outputs and `released` tangents are not held to the end."""
    sources = [n for n, it in items.items() if it.phase in (Phase.PARAM, Phase.INPUT)]
    forward = [n for n, it in items.items() if it.phase is Phase.FORWARD]
    order = sources + forward
    placed = set(order)
    for name, it in items.items():  # backward: emit each after its backward inputs (DFS)
        if it.phase is not Phase.BACKWARD or name in placed or not _drives_backward(it, name, items):
            continue
        stack = [(name, False)]
        while stack:
            cur, expanded = stack.pop()
            if cur in placed:
                continue
            if expanded:
                placed.add(cur)
                order.append(cur)
                continue
            stack.append((cur, True))
            for j in reversed(items[cur].inputs):
                if j not in placed:
                    stack.append((j, False))
    order += [n for n in items if n not in placed]  # unused leftovers, at the end
    ids = {name: i for i, name in enumerate(order)}
    nodes = []
    for name in order:
        it = items[name]
        nodes.append(Node(
            name=name, inputs=tuple(ids[j] for j in it.inputs), out_bytes=it.out_bytes,
            phase=it.phase, compute_s=it.compute_s,
            alias_of=None if it.alias_of is None else ids[it.alias_of],
            recomputable=it.never_replay is None, offloadable=True,
        ))
    out_node = joint.graph.output_node()
    # Tangents stay live to the end unless `released` (see `_released_tangents`): autograd
    # holds the loss gradient it seeds backward with for the whole backward pass.
    outputs = tuple(dict.fromkeys(
        [ids[a.name] for a in torch.utils._pytree.tree_leaves(out_node.args)
         if isinstance(a, fx.Node) and a.name in ids and a.name not in dropped]
        + [ids[name] for name in order if name.startswith("tangents") and name not in released]
    ))
    problem = Problem(nodes=tuple(nodes), outputs=outputs, budget_bytes=budget_bytes)
    return GraphProblem(
        problem=problem,
        fx_names=tuple(items[n].fx_names for n in order),
        value_name=tuple(order),
        source=tuple(items[n].source for n in order),
        never_replay={ids[n]: items[n].never_replay for n in order if items[n].never_replay},
    )


def _drives_backward(item: _Item, name: str, items: Mapping[str, _Item]) -> bool:
    """Backward items are emitted in joint order from tangent-dependent ones; pure
    helpers (views of params, detach of activations) wait for their first user."""
    return name.startswith("tangents") or any(
        items[j].phase is Phase.BACKWARD for j in item.inputs
    ) or not item.inputs
