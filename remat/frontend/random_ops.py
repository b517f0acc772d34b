"""Make the joint graph's random ops replayable: each reads its generator state as a value.

Before each forward random op, a `generator_state` node reads the device's generator into
a small tensor (5,056 bytes on CPU; 16 on CUDA, on the host), and the op reads it as an
input (`remat.frontend.rng_ops`). The planner then chooses per value, with the memory model it
uses for everything else: save the op's output, or save the state (never recomputed: it
must be read in forward, where eager reads it) and recompute the op from it.

`native_dropout` becomes two single-output values, `dropout_mask(state, x, p, train)` and
`native_dropout_backward(x, mask, scale)` (= dropout's output, bit for bit on CPU), so that
the mask (a quarter of the output's bytes in fp32) and the output are separate decisions:
save the mask and recompute the output with one pointwise op, or replay the mask too. A
replayed mask costs the op's whole run: its output is made and dropped (workspace bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from remat.compat import OpOverload, classify_nodes
from remat.frontend.profile import never_replay_reason, storage_bytes
from remat.frontend.rng_ops import DROPOUT_APPLY, dropout_mask, generator_state, random_op, state_numel
from remat.frontend.workspace import joint_device, measure
from remat_solvers import Problem

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_EXACT_SPLIT_DTYPES = (torch.float32, torch.float64)
"""Where native_dropout_backward(x, mask, scale) is native_dropout's output bit for bit
(measured on CPU, torch 2.13). In bf16/fp16 it is not (off by one rounding, up to 0.03 in
bf16: native_dropout scales by 1/(1-p) rounded to the dtype), so dropout in those dtypes
stays saved."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Replayable:
    """What `make_replayable` changed, for the cost model and the problem."""

    cost_s: Mapping[str, float]
    """Seconds of the new random nodes (their original op's estimate), by fx name."""
    workspace_bytes: Mapping[str, int]
    """Per replayable node: the generator state a replay holds while it runs, and for a
    `dropout_mask` node also the output bytes its op makes and drops."""
    ops: Mapping[str, tuple[Any, tuple, dict]] = dataclasses.field(default_factory=dict)
    """Per replayable node: the ATen op a replay runs, (target, args, kwargs) with the
    joint graph's nodes as tensor arguments; its own workspace is measured on them
    (`measured_workspace`)."""

    def costs(self, cost_s: Callable[[fx.Node], float]) -> Callable[[fx.Node], float]:
        """`cost_s`, knowing the new nodes (whose targets are Python functions)."""
        def cost(node: fx.Node) -> float:
            return self.cost_s[node.name] if node.name in self.cost_s else cost_s(node)
        return cost


def make_replayable(joint: fx.GraphModule, *, num_fwd_outputs: int,
                    cost_s: Callable[[fx.Node], float]) -> Replayable:
    """Rewrite `joint` in place (see the module docstring); returns the new nodes' costs."""
    info = classify_nodes(joint, [], num_fwd_outputs)
    costs: dict[str, float] = {}
    workspace: dict[str, int] = {}
    ops: dict[str, tuple[Any, tuple, dict]] = {}
    for node in list(joint.graph.nodes):
        if node.op != "call_function" or not info.is_required_fw(node) or not _replayable(node):
            continue
        cost = cost_s(node)
        # A replay holds the generator's current state (`rng_ops.at_state`'s copy, made
        # outside the dispatcher: the allocator sees it, a tensor tracker does not) while
        # its op runs: counted as the op's workspace (in forward, where nothing is
        # copied, that over-counts the state's bytes at one step).
        held = state_numel(_device(node))  # `_replayable` checked the device
        if node.target is _NATIVE_DROPOUT:
            op = (node.target, tuple(node.args), dict(node.kwargs))
            made = _split_dropout(joint.graph, node)
            if made is not None:
                costs[made[0].name] = cost
                workspace[made[0].name] = made[1] + held
                ops[made[0].name] = op
        elif isinstance(node.meta.get("val"), torch.Tensor):
            op = (node.target, tuple(node.args), dict(node.kwargs))
            wrapped = _wrap_random(joint.graph, node)
            costs[wrapped.name] = cost
            workspace[wrapped.name] = held
            ops[wrapped.name] = op
    if costs:
        joint.graph.lint()
        joint.recompile()
    return Replayable(cost_s=costs, workspace_bytes=workspace, ops=ops)


def measured_workspace(replayable: Replayable, joint: fx.GraphModule) -> dict[str, int]:
    """Per replayable node: its ATen op's own workspace, measured on the device as
    `remat.frontend.workspace` measures every op (a replayable node's target is a Python
    function, which that pass skips). CPU's `native_dropout` makes a float copy of its
    mask beside its output (`input.mul(mask)`): as many bytes again as the output."""
    device = joint_device(joint)
    if device is None or device.type == "meta" or not replayable.ops:
        return {}
    graph = fx.Graph()
    stand_in: dict[fx.Node, fx.Node] = {}

    def arg(a: Any) -> Any:
        if not isinstance(a, fx.Node):
            return a
        if a not in stand_in:
            stand_in[a] = graph.placeholder(f"arg{len(stand_in)}")
            stand_in[a].meta["val"] = a.meta.get("val")
        return stand_in[a]

    names: dict[str, str] = {}
    calls = []
    for name, (target, args, kwargs) in replayable.ops.items():
        call = graph.call_function(target, fx.node.map_aggregate(args, arg), fx.node.map_aggregate(kwargs, arg))
        names[call.name] = name
        calls.append(call)
    return {names[k]: v for k, v in measure(calls, device).items()}


def with_replay_workspace(problem: Problem, value_name: tuple[str, ...], replayable: Replayable,
                          *, joint: fx.GraphModule | None = None) -> Problem:
    """`problem` with each replayable op's workspace (`Replayable.workspace_bytes`), and
    with `joint` (measure_workspace on) also its op's own measured workspace: all of it
    is live at once while a replay runs (T5 tiny at its floor: leaving the mask's float
    copy out puts the allocator 10,100 B over the prediction)."""
    if not replayable.workspace_bytes:
        return problem
    inner = measured_workspace(replayable, joint) if joint is not None else {}
    nodes = list(problem.nodes)
    for i, name in enumerate(value_name):
        extra = replayable.workspace_bytes.get(name)
        if extra is not None:
            # the node's target is a Python function: nothing measured it before
            nodes[i] = dataclasses.replace(nodes[i], workspace_bytes=nodes[i].workspace_bytes + extra
                                           + inner.get(name, 0))
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _replayable(node: fx.Node) -> bool:
    """A forward random op whose only state is the device's default generator."""
    target = node.target
    if not isinstance(target, OpOverload) or never_replay_reason(node) != "random":
        return False
    if node.kwargs.get("generator") is not None or not node.users:
        return False
    device = _device(node)
    if target is _NATIVE_DROPOUT and node.meta["val"][0].dtype not in _EXACT_SPLIT_DTYPES:
        return False
    return device is not None and device.type in ("cpu", "cuda")


def _device(node: fx.Node) -> torch.device | None:
    val = node.meta.get("val")
    first = val[0] if isinstance(val, (tuple, list)) and val else val
    return first.device if isinstance(first, torch.Tensor) else None


def _state_node(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """`generator_state(device)` just before `node`, with a value of the state's size."""
    device = _device(node)
    with graph.inserting_before(node):
        state = graph.call_function(generator_state, (str(device),))
    state.meta = _meta_without_val(node)
    val = node.meta["val"]
    first = val[0] if isinstance(val, (tuple, list)) else val
    fake_mode = getattr(first, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        state.meta["val"] = torch.empty(state_numel(device), dtype=torch.uint8)
    return state


def _meta_without_val(node: fx.Node) -> dict:
    return {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}


def _split_dropout(graph: fx.Graph, node: fx.Node) -> tuple[fx.Node, int] | None:
    """native_dropout(x, p, train) -> dropout_mask(state, x, p, train) and
    native_dropout_backward(x, mask, scale); None when backward never reads the mask."""
    x, p, *rest = node.args
    train = rest[0] if rest else node.kwargs.get("train")
    getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if 1 not in getitems or not isinstance(x, fx.Node) or len(getitems) != len(node.users):
        return None
    out_bytes = storage_bytes(node.meta["val"][0])
    state = _state_node(graph, node)
    with graph.inserting_before(node):
        mask = graph.call_function(dropout_mask, (state, x, p, train))
    mask.meta = {**_meta_without_val(node), "val": getitems[1].meta["val"]}
    getitems[1].replace_all_uses_with(mask)
    if 0 in getitems:
        # eager's scale: 1 / (1 - p), 0 when p == 1 (ATen's native_dropout)
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        with graph.inserting_after(mask):
            out = graph.call_function(DROPOUT_APPLY, (x, mask, scale))
        out.meta = {**_meta_without_val(node), "val": getitems[0].meta["val"]}
        getitems[0].replace_all_uses_with(out)
    for g in getitems.values():
        graph.erase_node(g)
    graph.erase_node(node)
    return mask, out_bytes


def _wrap_random(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """op(*args) -> random_op(state, device, op, *args)."""
    state = _state_node(graph, node)
    with graph.inserting_before(node):
        wrapped = graph.call_function(random_op, (state, str(_device(node)), node.target, *node.args),
                                      dict(node.kwargs))
    wrapped.meta = dict(node.meta)
    node.replace_all_uses_with(wrapped)
    graph.erase_node(node)
    return wrapped
