"""Per-node profile of the joint graph: storage bytes and identity (aliasing), where a
node comes from, and whether it may ever be replayed. FLOPs and seconds live in
`remat.frontend.costs`."""

from __future__ import annotations

import operator

import torch
from torch import fx

from remat.compat import HigherOrderOperator, OpOverload, optimization_hint
from remat.frontend.rng_ops import generator_state

_NEVER_REPLAY_NAMESPACES = ("c10d", "_c10d_functional", "_dtensor", "ao")


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


CUDA_BLOCK_BYTES = 512
"""CUDA's caching allocator serves every request in multiples of 512 bytes
(`kMinBlockSize`, `CUDACachingAllocator.cpp`'s `round_size`), and
`torch.cuda.max_memory_allocated` counts the rounded blocks."""


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes the device's allocator hands out for the tensor's storage: its size, on CUDA
    rounded up to the allocator's 512-byte blocks (`CUDA_BLOCK_BYTES`); a symbolic size
    counts as its hint (no guard)."""
    nbytes = t.untyped_storage().nbytes()
    nbytes = optimization_hint(nbytes, fallback=4096) if isinstance(nbytes, torch.SymInt) else int(nbytes)
    if t.device.type == "cuda" and nbytes:
        return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


def joint_device_type(joint: fx.GraphModule) -> str | None:
    """The device type of the joint graph's first tensor that is not on meta, or None."""
    for node in joint.graph.nodes:
        val = tensor_val(node)
        if val is not None and val.device.type != "meta":
            return val.device.type
    return None


RUN_TIME_RNG_RETURNS = frozenset({"philox_seed", "philox_offset", "rng_state", "unused"})
"""Return names (in the op's schema) of the fused attention kernels' Philox state: the
seed and offset of `_scaled_dot_product_efficient_attention`, `_efficient_attention_forward`
and cuDNN's, flash's `rng_state` and `unused` (its offset). Their device is the kernel's
choice at run time: host tensors, or device tensors under CUDA graph capture
(`_meta_registrations.py`, "Note [Seed and Offset]"). Fake tensors trace them on the
graph's device all the same, and their backward kernels dereference a host seed's
pointer on the host: a CUDA stand-in there is a segmentation fault."""


def made_at_run(node: fx.Node, device_type: str | None) -> bool:
    """Whether `node`'s value is a tensor whose device the trace does not know, in a graph
    on a real device: a fused attention kernel's Philox state (`RUN_TIME_RNG_RETURNS`), or
    any value traced as a meta tensor (a custom op's fake may say so). Such a value is
    never offloaded and never built afresh for an op to read."""
    val = tensor_val(node)
    if val is None or device_type in (None, "meta"):
        return False
    if val.device.type == "meta":
        return True
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    producer, index = node.args[0].target, node.args[1]
    returns = producer._schema.returns if isinstance(producer, OpOverload) else ()
    return isinstance(index, int) and index < len(returns) and returns[index].name in RUN_TIME_RNG_RETURNS


def source_line(node: fx.Node) -> str:
    """Where the node comes from in user code: the innermost user frame of its stack
    trace as 'file:line' when torch recorded one, else the innermost module that ran it
    as 'path.to.module (ClassName)' (AOTAutograd records the module stack)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    for ln in reversed(lines):
        if "/torch/" not in ln:
            parts = ln.split(",")
            file = parts[0].removeprefix("File ").strip('"')
            line = parts[1].strip().removeprefix("line ") if len(parts) > 1 else "?"
            return f"{file}:{line}"
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        entry = list(stack.values())[-1]
        path, cls = entry[0], entry[1]
        where = f" {entry[2]}" if len(entry) > 2 and entry[2] else ""
        name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1].strip("'>")
        return f"{path} ({name}){where}"
    return ""


def never_replay_reason(node: fx.Node) -> str | None:
    """Why this op must never be recomputed, or None if it may be."""
    target = node.target
    if target is generator_state:
        # read where eager reads it, in forward; rerun in backward it would read another state
        return "generator state"
    if isinstance(target, HigherOrderOperator):
        # with_effects (ordered side effects), invoke_subgraph, ...: min-cut saves these
        # (`force_save_effectful_ops`); replaying one would repeat its effect.
        return f"higher-order op {target.name()}"
    if not isinstance(target, OpOverload):
        return None
    tags = set(target.tags)
    seeded = torch.Tag.nondeterministic_seeded in tags
    deterministic = seeded and _dropout_off(node, target)  # fx calls it impure all the same
    if seeded and not deterministic:
        return "random"
    if target._schema.is_mutable:
        return "mutating"
    if target.namespace in _NEVER_REPLAY_NAMESPACES:
        return "collective or offload"
    if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags:
        return "data-dependent"
    if node.is_impure() and not deterministic:
        return "side effect"
    return None


def _dropout_off(node: fx.Node, target: OpOverload) -> bool:
    """A seeded op whose only randomness is a `dropout_p` argument that is 0 (the fused
    attention kernels: `_scaled_dot_product_flash_attention_for_cpu` is tagged
    nondeterministic_seeded for its dropout, yet with dropout_p=0 it draws no random
    numbers and returns the same bits on the same inputs), so it may be recomputed."""
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return False
    k = names.index("dropout_p")
    if "dropout_p" in node.kwargs:
        value = node.kwargs["dropout_p"]
    elif k < len(node.args):
        value = node.args[k]
    else:
        value = target._schema.arguments[k].default_value
    return isinstance(value, (int, float)) and value == 0
