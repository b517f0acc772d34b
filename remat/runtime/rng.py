"""Random ops replayed from a saved generator state, as `torch.utils.checkpoint` does.

The joint graph (after `remat.frontend.random_ops`) reads the generator state just
before each random op, into a small tensor (`generator_state`), and the op reads that
tensor as an explicit input, so that the state is a value the planner decides about like
any other: saved when backward recomputes the op, freed right after the op otherwise.
In forward the op draws from the generator as eager does (the state is not set: the
generator already is at that state). In backward (`replay_in_backward`) a recomputed op
runs at its saved state and the generator is put back where it was, so a replay never
moves the global random stream (torch's `run_with_rng_state` does the same).

Dropout is split in two values, so that each is one decision: `dropout_mask` (the
random part: `native_dropout`'s mask) and `native_dropout_backward(x, mask, scale)`,
which is bit for bit `native_dropout`'s output on CPU (both are `x * mask * scale`;
`tests/test_rng_replay.py` checks it). The forward module runs `native_dropout` once,
as eager does (`eager_forward`), so forward costs no extra kernel.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
DROPOUT_APPLY = torch.ops.aten.native_dropout_backward.default
CUDA_STATE_BYTES = 16
"""`torch.cuda.get_rng_state()` is the Philox seed and offset (two int64), on the host."""


def state_numel(device: torch.device) -> int:
    """Bytes of `generator_state`'s result for a device (uint8 elements)."""
    return CUDA_STATE_BYTES if device.type == "cuda" else int(torch.get_rng_state().numel())


def generator_state(device: str) -> torch.Tensor:
    """The state of the device's default generator, as a new uint8 tensor (on the
    host). Cloned through ATen so that memory instruments, which see ATen ops, count it
    (the generator's own copy is made outside the dispatcher)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_rng_state(dev).clone()
    return torch.get_rng_state().clone()


@contextlib.contextmanager
def at_state(state: torch.Tensor, device: torch.device) -> Iterator[None]:
    """Run at `state`, then put the generator back where it was."""
    if device.type == "cuda":
        before = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(state, device)
        try:
            yield
        finally:
            torch.cuda.set_rng_state(before, device)
        return
    before = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        torch.set_rng_state(before)


def dropout_mask(state: torch.Tensor, x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """Forward: `native_dropout`'s mask, drawn from the generator as eager draws it
    (`state` is where the generator already is). `eager_forward` replaces it
    in the forward module by the op itself, so its output is not computed twice."""
    return _NATIVE_DROPOUT(x, p, train)[1]


def dropout_mask_replay(state: torch.Tensor, x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """Backward: the same mask, drawn again at the saved state."""
    with at_state(state, x.device):
        return _NATIVE_DROPOUT(x, p, train)[1]


def random_op(state: torch.Tensor, device: str, op: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Forward: a random op, drawing from the generator as eager does. The first three
    parameters are positional-only: the op's own keywords (`device=`, `dtype=`) pass
    through `kwargs`."""
    return op(*args, **kwargs)


def random_op_replay(state: torch.Tensor, device: str, op: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Backward: the same op at the saved state."""
    with at_state(state, torch.device(device)):
        return op(*args, **kwargs)


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
