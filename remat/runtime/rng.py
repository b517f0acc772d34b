"""Random ops replayed in the backward from their saved generator state
(`remat.frontend.rng_ops`).

In backward (`replay_in_backward`) a recomputed op runs at its saved state and the
generator is put back where it was. The forward module runs `native_dropout` once, as
eager does (`eager_forward`), so forward costs no extra kernel.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from remat.frontend.rng_ops import (DROPOUT_APPLY, dropout_mask, dropout_mask_replay, generator_state, random_op,
                                    random_op_replay)

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_REPLAY = {dropout_mask: dropout_mask_replay, random_op: random_op_replay}


def replay_in_backward(bw: fx.GraphModule) -> None:
    """Recomputed random ops in the backward module replay their saved state. The state
    itself is never computed in backward (it would read the generator where backward
    left it): it is always a saved input there."""
    for node in bw.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is generator_state:
            raise RuntimeError(f"internal: backward reads the generator state afresh: {node.format_node()}")
        if node.target in _REPLAY:
            node.target = _REPLAY[node.target]


def eager_forward(fw: fx.GraphModule) -> None:
    """The forward module runs the random ops as eager does: each `dropout_mask` and the
    `native_dropout_backward` that applies it to the same input become one
    `native_dropout` (eager's op, one kernel), each `random_op` its op; states nothing
    reads any more (their op is saved, not replayed) are dropped."""
    graph = fw.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is random_op]:
        state, _device, op, *args = node.args
        with graph.inserting_before(node):
            plain = graph.call_function(op, tuple(args), dict(node.kwargs))
        plain.meta = dict(node.meta)
        node.replace_all_uses_with(plain)
        graph.erase_node(node)
        if isinstance(state, fx.Node) and not state.users:
            graph.erase_node(state)
    for mask in [n for n in graph.nodes if n.op == "call_function" and n.target is dropout_mask]:
        state, x, p, train = mask.args
        with graph.inserting_before(mask):
            op = graph.call_function(_NATIVE_DROPOUT, (x, p, train))
            new_mask = graph.call_function(operator.getitem, (op, 1))
            new_out = graph.call_function(operator.getitem, (op, 0))
        op.meta = {k: v for k, v in mask.meta.items() if k != "val"}
        new_mask.meta = dict(mask.meta)
        outs = [u for u in mask.users if u.target is DROPOUT_APPLY and u.args[0] is x and u.args[1] is mask]
        for out in outs:
            new_out.meta = dict(out.meta)
            out.replace_all_uses_with(new_out)
            graph.erase_node(out)
        if not outs:
            graph.erase_node(new_out)
        mask.replace_all_uses_with(new_mask)
        graph.erase_node(mask)
        if isinstance(state, fx.Node) and not state.users:
            graph.erase_node(state)
