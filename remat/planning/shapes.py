"""Variable-length inputs under one byte budget: one plan per input signature.

A planned module called with a new shape plans that shape under the bytes the first
plan resolved (the device does not grow with the batch). A shape that no plan fits is
refused with `InfeasibleBudgetError` before anything runs (planning traces with fake
tensors: no gradient, buffer or parameter is touched), and the refusal is remembered.
`Planned.prepare_lengths` plans a list of lengths ahead, so no training step pays a
planning stall; each shape's planning time and what ran are in the summary.

A shape planned on its first call is planned inside the training step, and that step
still holds the budget: tracing is symbolic, and op workspace is measured only within
what the budget leaves beside the step's inputs and parameters
(`remat.frontend.workspace`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from remat.budget import format_bytes
from remat.errors import RematError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapePlan:
    """What was planned for one input signature."""

    label: str
    """The input shapes, e.g. ``(8, 128) int64, (8, 128) int64``."""
    plan_s: float
    """Wall seconds spent planning this shape (trace, profile, solve, rewrite)."""
    predicted_peak_bytes: int | None
    """The plan's simulated peak; None when the shape was refused."""
    offload_bytes: int = 0
    """Bytes the plan moves to host memory (each way)."""
    transfer_s: float = 0.0
    """Transfer seconds out and back, in full."""
    hidden_transfer_s: float = 0.0
    """The part of `transfer_s` that overlaps compute."""
    refused: str = ""
    """Why no plan fits this shape ('' when planned)."""


def label_of(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The shapes and dtypes of the tensors among (args, kwargs), in call order."""
    leaves = pytree.tree_leaves((tuple(args), dict(kwargs)))
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
             for t in leaves if isinstance(t, torch.Tensor)]
    return ", ".join(parts) or "no tensors"


def planned_shape(label: str, step: Any, plan_s: float) -> ShapePlan:
    ev = step.evaluation
    return ShapePlan(label=label, plan_s=plan_s, predicted_peak_bytes=ev.peak_bytes,
                     offload_bytes=ev.offload_bytes, transfer_s=ev.transfer_s,
                     hidden_transfer_s=ev.hidden_transfer_s)


def refused_shape(label: str, error: Exception, plan_s: float) -> ShapePlan:
    return ShapePlan(label=label, plan_s=plan_s, predicted_peak_bytes=None, refused=str(error))


def with_length(args: Sequence[Any], kwargs: dict[str, Any], length: int, *, dim: int
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) with every tensor whose size along `dim` equals the first such
    tensor's resized to `length`: cut, or tiled with its own values (token ids stay in
    the vocabulary, masks stay masks)."""
    if not isinstance(length, int) or length < 1:
        raise RematError(f"lengths must be positive ints, got {length!r}")
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not tensors:
        raise RematError(f"no input tensor has a dimension {dim} to vary; pass dim= the "
                         "sequence dimension of your inputs")
    old = tensors[0].shape[dim]
    out = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] == old:
            reps = [1] * t.dim()
            reps[dim] = -(-length // old)
            t = t.detach().repeat(*reps).narrow(dim, 0, length).contiguous().requires_grad_(t.requires_grad)
        out.append(t)
    new_args, new_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs)


def shapes_summary(shapes: Iterable[tuple[ShapePlan, int, bool]]) -> list[str]:
    """Summary lines: per shape (with how often it ran, and whether it ran last), its
    plan time, peak and offload."""
    lines = ["  shapes (one plan each, same budget):"]
    any_last = False
    for s, runs, last in shapes:
        any_last |= last
        mark = "*" if last else " "
        if s.refused:
            lines.append(f"   {mark}[{s.label}] refused (no plan fits), planned in {s.plan_s:.2f} s")
            continue
        offload = ""
        if s.offload_bytes:
            offload = (f", offloads {format_bytes(s.offload_bytes)} ({s.transfer_s * 1e3:.3f} ms "
                       f"transfer, {s.hidden_transfer_s * 1e3:.3f} ms hidden)")
        lines.append(f"   {mark}[{s.label}] peak {format_bytes(s.predicted_peak_bytes)}{offload}, "
                     f"planned in {s.plan_s:.2f} s, ran {runs} times")
    if any_last:
        lines.append("    (* the shape that ran last)")
    return lines
