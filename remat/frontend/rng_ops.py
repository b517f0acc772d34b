"""The random ops of a joint graph whose randomness is a value: each reads the generator
state it draws at (`generator_state`, read just before it) as an explicit input, as
`torch.utils.checkpoint` replays from a saved state. `remat.frontend.random_ops`
threads them into the joint graph, so that the state is a value the planner decides
about like any other; `remat.runtime.rng` runs them.

In forward an op draws from the generator as eager does (`random_op`, `dropout_mask`:
the generator already is at the state); its `_replay` twin, which backward runs for a
recomputed op, sets the saved state and puts the generator back where it was, so a
replay never moves the global random stream (torch's `run_with_rng_state` does the
same). Dropout is split in two values, so that each is one decision: `dropout_mask`
(the random part: `native_dropout`'s mask) and `native_dropout_backward(x, mask,
scale)` (`DROPOUT_APPLY`), which is bit for bit `native_dropout`'s output on CPU (both
are `x * mask * scale`; `tests/runtime/test_rng_replay.py` checks it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

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
