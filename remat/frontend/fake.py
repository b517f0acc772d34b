"""Build a model and its inputs on fake tensors, so a model larger than this machine can
be traced and planned with no weight ever allocated.

The factory runs under a `FakeTensorMode`: every tensor it creates is a FakeTensor
(shape, dtype, device; no storage), weight initialisers run on fakes and cost nothing.
A factory that builds on the meta device works too: meta parameters, buffers and inputs
are replaced by fake CPU tensors, so tracing takes the CPU kernels' decompositions
(for example CPU flash attention, which stores no score matrix, like GPU flash
attention). Nothing in planning then runs a kernel: tracing is symbolic, costs are
formulas on shapes, and the device speed must come from a named device (`devices.py`),
not a measurement. Limits: no measured costs, no bit-exact check, the returned module
cannot run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from remat.compat import FakeTensor, FakeTensorMode

T = TypeVar("T")


def build_fake(factory: Callable[[], T]) -> tuple[T, FakeTensorMode]:
    """Run `factory` under a fresh FakeTensorMode and make every tensor in what it
    returns (modules included) a fake CPU tensor."""
    # allow_non_fake_inputs: meta tensors and module-level real tensors may meet fakes.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        result = factory()
    return to_fake(result, mode), mode


def to_fake(value: T, mode: FakeTensorMode) -> T:
    """`value` (a pytree of modules, tensors and constants) with every tensor, and every
    parameter and buffer of every module, a fake CPU tensor of `mode`."""
    with mode:
        return pytree.tree_map(lambda x: _fake_value(x, mode), value, is_leaf=lambda x: isinstance(x, nn.Module))


def _fake_value(x: Any, mode: FakeTensorMode) -> Any:
    if isinstance(x, nn.Module):
        return _fake_module(x, mode)
    if isinstance(x, torch.Tensor) and not _is_fake_cpu(x):
        return _fake_cpu(x, mode)
    return x


def _is_fake_cpu(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor) and t.device.type == "cpu"


def _fake_cpu(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor like `t` (call under `mode`): meta and fake-meta tensors get
    fresh fake storage, real tensors are converted (their values are not needed)."""
    if t.device.type == "meta":
        fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
    else:
        fake = mode.from_tensor(t.detach())
    return fake.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else fake


def _fake_module(model: nn.Module, mode: FakeTensorMode) -> nn.Module:
    """Swap every parameter and buffer that is not a fake CPU tensor in place (not
    `to_empty`: it cannot swap fake tensors that hold weak references)."""
    swapped: dict[int, torch.Tensor] = {}  # by id: tied weights stay tied
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not _is_fake_cpu(p):
                if id(p) not in swapped:
                    swapped[id(p)] = nn.Parameter(_fake_cpu(p, mode), p.requires_grad)
                module._parameters[name] = swapped[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and not _is_fake_cpu(b):
                swapped.setdefault(id(b), _fake_cpu(b, mode))
                module._buffers[name] = swapped[id(b)]
    return model


def is_fake(model: nn.Module) -> bool:
    return any(isinstance(p, FakeTensor) for p in model.parameters())
