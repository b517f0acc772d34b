"""Trace-time layouts that match eager CPU kernels where torch 2.13's fake tensors do not.

Why: the traced graph bakes in every stride-dependent choice (a `view` where the input
was contiguous in the trace, a `reshape` copy where it was not). If a fake kernel
predicts a layout the real kernel does not produce, the graph holds a `view` the real
run cannot do ("view size is not compatible with input tensor's size and stride") -
under AOTAutograd's own runtime too, whatever remat plans.

BatchNorm on CPU is such a kernel (pytorch/pytorch#192668, open for 2.13; the fix in
review mirrors what is done here). Its ops have no meta kernel, so fake tensors run the
`native_batch_norm_helper` decomposition, whose elementwise arithmetic keeps the input's
strides; eager `batch_norm_cpu` and `batch_norm_backward_cpu` allocate their output as
`empty_like(input, input.suggest_memory_format())`: contiguous for a transposed (B, D, T)
input, channels-last only for a channels-last input. Measured on torch 2.13 CPU for 2-D
to 5-D inputs (transposed, permuted, sliced, channels-last): forward (train and eval)
and backward's grad_input all follow that rule, the decomposition does not.

`eager_cpu_layouts()` swaps, while remat traces, the decomposition-table entries of the
BatchNorm ops for ones that return the same values with eager's layout on CPU. No graph
node changes (the op is recorded as before); only the fake value's strides, and so the
view/reshape choices downstream, agree with what runs. CUDA keeps torch's
decomposition (its kernel does preserve the input's layout).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

# torch's private names come from remat.compat inside the functions that use them: resolved
# when a trace runs, so a torch without one fails only this check (remat.compat).

aten = torch.ops.aten

# Ops whose first output is the normalised input (forward) or grad_input (backward);
# each has the input as its first tensor argument except the backward (second).
_FORWARD_OPS = (
    "native_batch_norm.default",
    "_native_batch_norm_legit.default",
    "_native_batch_norm_legit.no_stats",
    "_native_batch_norm_legit_functional.default",
    "_native_batch_norm_legit_no_training.default",
    "_batch_norm_with_update.default",
    "_batch_norm_with_update_functional.default",
    "_batch_norm_no_update.default",
)
_BACKWARD_OPS = ("native_batch_norm_backward.default",)


def _overload(qualified: str) -> Any:
    name, overload = qualified.split(".")
    packet = getattr(aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def _eager_cpu_layout(decomposition: Callable[..., Any], input_position: int) -> Callable[..., Any]:
    """`decomposition` with its first output laid out as the eager CPU kernel lays it out."""
    from remat.compat import suggest_memory_format

    @functools.wraps(decomposition)
    def run(*args: Any, **kwargs: Any) -> Any:
        outputs = decomposition(*args, **kwargs)
        source = args[input_position] if len(args) > input_position else None
        if not isinstance(source, torch.Tensor) or source.device.type != "cpu":
            return outputs
        first = outputs[0]
        if not isinstance(first, torch.Tensor):
            return outputs
        relaid = first.contiguous(memory_format=suggest_memory_format(source))
        return (relaid, *outputs[1:])

    return run


@contextlib.contextmanager
def eager_cpu_layouts(fake_mode: Any = None) -> Iterator[None]:
    """While tracing: BatchNorm's fake outputs take eager CPU's layout (see module doc).

    Fake tensors cache an op's output metadata by its inputs' metadata, not by the code
    that made it (the class-wide cache, and the cache of `fake_mode`'s ShapeEnv for
    symbolic sizes, e.g. dynamo's): those ops' entries are evicted on entry (torch's
    layout must not leak into the trace) and on exit (ours must not leak out of it).
    Re-entrant; restores the table's entries on exit, exceptions included."""
    from remat.compat import decomposition_table, torch_decomp_decompositions

    swapped: dict[Any, Callable[..., Any]] = {}
    for names, position in ((_FORWARD_OPS, 0), (_BACKWARD_OPS, 1)):
        for qualified in names:
            op = _overload(qualified)
            original = decomposition_table.get(op) if op is not None else None
            if original is None or getattr(original, "_remat_eager_layout", False):
                continue
            # fake tensors run a table entry only if this cached check says it is one
            # of torch's own decompositions: answer it for the original before swapping
            torch_decomp_decompositions(op)
            wrapped = _eager_cpu_layout(original, position)
            wrapped._remat_eager_layout = True  # type: ignore[attr-defined]
            swapped[op] = original
            decomposition_table[op] = wrapped
    _evict_cached(set(swapped), fake_mode)
    try:
        yield
    finally:
        for op, original in swapped.items():
            decomposition_table[op] = original
        _evict_cached(set(swapped), fake_mode)


def _evict_cached(ops: set[Any], fake_mode: Any) -> None:
    """Drop fake-tensor cache entries of `ops` (a key's first element is its op)."""
    from remat.compat import FakeTensorMode

    if not ops:
        return
    caches = [FakeTensorMode.cache]
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is not None:
        caches.append(shape_env.fake_tensor_cache)
    for cache in caches:
        for key in [k for k in list(cache) if k.key and k.key[0] in ops]:
            cache.pop(key, None)


__all__ = ["eager_cpu_layouts"]
