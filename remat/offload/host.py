"""Execute OFFLOAD: store a value off the device after its last forward use, reload it
before its first backward use.

The rewriter (`insert_offloads`) puts two plain call_function nodes into the emitted
modules: `store(x)` in the forward, right after x's last forward user, returning a host
handle that AOTAutograd saves instead of x (so x's device storage dies there, as
`simulate` frees it); and `reload(handle, ...)` in the backward at `simulate`'s RELOAD
step (just in time, or earlier when the plan prefetches: solvers/prefetch.py), which
allocates a fresh device storage and starts filling it, then `reload_wait(x)` just
before x's first reader, where the compute waits for the copy. The bytes are copied
verbatim (the whole storage, any strides), so gradients stay bit-for-bit equal.

- CPU (tests, CI): the host store is numpy memory, outside torch's allocator, copied
  with `ctypes.memmove` and wrapped outside any dispatch mode, so no tracker sees it. The dispatch-mode tracker and the
  profiler then see exactly what a device would: the storage dropped at the store and
  a new one allocated at the reload. (torch's own `prims.device_put` cpu->cpu returns
  the same storage, and its async `ao::offload` ops raise "Accelerator expected" on CPU,
  so neither can lower a CPU peak.)
- CUDA: pinned host buffers, copies on one side stream per device ordered by events;
  the compute stream waits on an event, never the host (no synchronize, no .item()),
  and only at `reload_wait`, so the copy overlaps the compute issued in between.
  `record_stream` keeps the allocator from reusing a storage a pending copy reads or
  writes. This path is present but untested here (no GPU in CI).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from torch import fx

from remat.compat import disable_current_modes


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredLayout:
    """How to rebuild a stored value: its storage's bytes and the view on them."""

    nbytes: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "StoredLayout":
        return StoredLayout(
            nbytes=int(t.untyped_storage().nbytes()), size=tuple(int(s) for s in t.shape),
            stride=tuple(int(s) for s in t.stride()), storage_offset=int(t.storage_offset()),
            dtype=t.dtype, device=t.device,
        )


    def as_args(self) -> tuple:
        return (self.nbytes, self.size, self.stride, self.storage_offset, self.dtype, str(self.device))


# ---- the two runtime functions the emitted graphs call ----------------------------------


def store(x: torch.Tensor) -> torch.Tensor:
    """A host copy of `x`'s whole storage (uint8); `x` itself is left to die."""
    if x.device.type == "cuda":
        return _store_cuda(x)
    storage = x.untyped_storage()
    host = np.empty(storage.nbytes(), dtype=np.uint8)  # numpy's allocator, not torch's
    if host.size:
        ctypes.memmove(host.ctypes.data, storage.data_ptr(), host.size)
    # from_numpy allocates nothing but dispatches `lift_fresh`; a device-memory tracker
    # (a dispatch mode) would count host bytes as device bytes, so wrap the host buffer
    # outside the active modes, as a copy to another device would be invisible to them.
    with disable_current_modes():
        return torch.from_numpy(host)


def reload(handle: torch.Tensor, nbytes: int, size: tuple[int, ...], stride: tuple[int, ...],
           storage_offset: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """A new device tensor equal, bit for bit, to the stored one. (Plain arguments, so
    fx's code generator can print the call.)"""
    layout = StoredLayout(nbytes=nbytes, size=tuple(size), stride=tuple(stride),
                          storage_offset=storage_offset, dtype=dtype, device=torch.device(device))
    if layout.device.type == "cuda":
        return _reload_cuda(handle, layout)
    if handle.numel() != layout.nbytes:
        raise RuntimeError(f"remat offload: stored {handle.numel()} bytes, expected {layout.nbytes}")
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=layout.device)
    if layout.nbytes:
        ctypes.memmove(buf.data_ptr(), handle.data_ptr(), layout.nbytes)  # no ATen op
    return _view(buf, layout)


def reload_wait(x: torch.Tensor) -> torch.Tensor:
    """`x` (a reload's result), once its copy is done: on CUDA the compute stream waits
    for the copy's event here, before x's first reader; on CPU the copy is already done."""
    if x.device.type == "cuda":
        done = _RELOAD_EVENTS.pop(x.untyped_storage().data_ptr(), None)
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)
    return x


def _view(buf: torch.Tensor, layout: StoredLayout) -> torch.Tensor:
    out = torch.empty(0, dtype=layout.dtype, device=layout.device)
    return out.set_(buf.untyped_storage(), layout.storage_offset, layout.size, layout.stride)


# ---- CUDA: pinned buffers, a side stream, events ----------------------------------------

_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}
_STORE_EVENTS: dict[int, "torch.cuda.Event"] = {}  # host data_ptr -> event of its D2H copy
_RELOAD_EVENTS: dict[int, "torch.cuda.Event"] = {}  # device data_ptr -> event of its H2D copy


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device=device)
    return _STREAMS[device]


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over `t`'s whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _store_cuda(x: torch.Tensor) -> torch.Tensor:
    stream = _side_stream(x.device)
    host = torch.empty(x.untyped_storage().nbytes(), dtype=torch.uint8, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream(x.device))  # x is written on the compute stream
    with torch.cuda.stream(stream):
        host.copy_(_bytes_of(x), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    x.record_stream(stream)  # x's block is not reused before the copy has read it
    _STORE_EVENTS[host.data_ptr()] = event
    return host


def _reload_cuda(handle: torch.Tensor, layout: StoredLayout) -> torch.Tensor:
    stream = _side_stream(layout.device)
    current = torch.cuda.current_stream(layout.device)
    buf = torch.empty(layout.nbytes, dtype=torch.uint8, device=layout.device)
    stream.wait_stream(current)  # buf's block may still be read by earlier compute
    stored = _STORE_EVENTS.pop(handle.data_ptr(), None)
    with torch.cuda.stream(stream):
        if stored is not None:
            stream.wait_event(stored)
        buf.copy_(handle, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    buf.record_stream(stream)
    _RELOAD_EVENTS[buf.data_ptr()] = done  # reload_wait: the device waits, not the host
    return _view(buf, layout)


# ---- the rewrite ------------------------------------------------------------------------


def insert_offloads(
    fw: fx.GraphModule, bw: fx.GraphModule, names: Iterable[str], *, num_fwd_outputs: int,
    rank: Mapping[str, int] | None = None, custom_ops: bool = False,
) -> dict[str, int]:
    """Store each named saved value after its last forward use and reload it before its
    first backward use. Returns the ranks for the new reload nodes (the offloaded value's
    own rank, i.e. simulate's RELOAD step), to merge into the backward order; each
    reload's wait has no rank, so the reorder puts it just before its first user.
    custom_ops: emit the torch.library ops of remat/offload/ops.py instead of
    the Python functions (for graphs inductor compiles; the reload waits in place)."""
    if custom_ops:
        # offload_ops imports this module (a cycle) and registers torch.library ops when
        # loaded: only graphs inductor compiles need them
        from remat.offload import ops as offload_ops
    names = set(names) & {n.name for n in bw.graph.nodes if n.op == "placeholder" and n.users}
    out = fw.graph.output_node()
    values = list(out.args[0])
    by_name = {n.name: n for n in fw.graph.nodes}
    handles: dict[str, fx.Node] = {}
    host_vals: dict[str, object] = {}
    for name in sorted(names):
        x = by_name[name]
        last = max((u for u in x.users if u is not out), key=_position(fw.graph), default=x)
        with fw.graph.inserting_after(last):
            if custom_ops:
                nbytes = StoredLayout.of(x.meta["val"]).nbytes
                handle = fw.graph.call_function(offload_ops.STORE, (x, nbytes))
            else:
                handle = fw.graph.call_function(store, (x,))
        handle.meta = dict(x.meta)
        if custom_ops:  # a compiler reads the handle's meta: a host uint8 buffer
            host_vals[name] = offload_ops.host_val(x.meta["val"], nbytes)
            handle.meta = {"val": host_vals[name]}
        handles[name] = handle
    values = values[:num_fwd_outputs] + [
        handles.get(v.name, v) if isinstance(v, fx.Node) else v for v in values[num_fwd_outputs:]
    ]
    out.args = (tuple(values),)
    new_rank: dict[str, int] = {}
    for ph in list(bw.graph.nodes):
        if ph.op != "placeholder" or ph.name not in names:
            continue
        first = min(ph.users, key=_position(bw.graph))
        layout = StoredLayout.of(ph.meta["val"])
        with bw.graph.inserting_before(first):
            if custom_ops:
                node = bw.graph.call_function(offload_ops.RELOAD, (
                    ph, list(layout.size), list(layout.stride), layout.storage_offset,
                    layout.dtype, layout.device))
            else:
                node = bw.graph.call_function(reload, (ph, *layout.as_args()))
        node.meta = dict(ph.meta)
        ready = node
        if not custom_ops:
            with bw.graph.inserting_after(node):
                ready = bw.graph.call_function(reload_wait, (node,))
            ready.meta = dict(ph.meta)
        ph.replace_all_uses_with(ready, delete_user_cb=lambda u: u is not node and u is not ready)
        if custom_ops:
            ph.meta = {"val": host_vals[ph.name]}
        if rank is not None and ph.name in rank:
            new_rank[node.name] = rank[ph.name]
    return new_rank


def _position(graph: fx.Graph):
    index = {n: k for k, n in enumerate(graph.nodes)}
    return index.__getitem__
