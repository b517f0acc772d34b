"""The offload store and reload as torch.library custom ops, for graphs inductor compiles.

Inductor lowers only registered ops: remat's plain Python `store`/`reload`
(remat/offload/host.py) cannot appear in a graph it compiles. As custom ops they
become fallback kernels - inductor calls them as they are, in graph order, and frees a
stored value's buffer after its last use (the store), as `simulate` does. Their fake
implementations give inductor the shapes: a host uint8 buffer of the stored storage's
bytes, and the reloaded value's exact size and strides.

Why not torch's own `prims.device_put` or `ao::offload`/`ao::reload`: a CPU-to-CPU
`device_put` is dropped by inductor (it returns the same storage: nothing leaves the
device), and the `ao` ops need an accelerator ("Accelerator expected" on CPU). Here the
same host store as the eager runtime does the copy (numpy memory on CPU, pinned memory
on a side stream on CUDA), so the measured CPU peak drops as a device's would.

Under inductor the reload waits for its copy in place (no separate wait op: an op whose
output aliases its input needs an aliasing schema inductor treats specially), so on
CUDA a prefetched reload would not overlap compute; `remat.backend` therefore plans
reloads just in time (no prefetch), and prices them fully exposed.
"""

from __future__ import annotations

import ctypes

import torch

from remat.compat import detect_fake_mode
from remat.offload import host


@torch.library.custom_op("remat::offload_store", mutates_args=())
def offload_store(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A host copy of `x`'s whole storage (`nbytes` bytes, uint8)."""
    handle = host.store(x)
    if handle.numel() != nbytes:
        raise RuntimeError(f"remat offload: stored {handle.numel()} bytes, planned {nbytes}")
    return handle


@offload_store.register_fake
def _(x: torch.Tensor, nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


@torch.library.custom_op("remat::offload_reload", mutates_args=())
def offload_reload(handle: torch.Tensor, size: list[int], stride: list[int], storage_offset: int,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new device tensor of this size and strides, equal bit for bit to the stored
    value (its bytes start `storage_offset` elements into the stored storage). Dense:
    the new storage holds exactly the value's extent, as the fake says."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    extent = _extent_bytes(size, stride, itemsize)
    start = storage_offset * itemsize
    if start + extent > handle.numel():
        raise RuntimeError(f"remat offload: the stored {handle.numel()} bytes do not hold "
                           f"{extent} bytes at offset {start}")
    if device.type == "cuda":  # the eager runtime's copy (events, side stream), then dense
        whole = host.reload_wait(host.reload(handle, int(handle.numel()), tuple(size), tuple(stride),
                                             storage_offset, dtype, str(device)))
        if storage_offset == 0 and whole.untyped_storage().nbytes() == extent:
            return whole
        return torch.empty_strided(size, stride, dtype=dtype, device=device).copy_(whole)
    out = torch.empty_strided(size, stride, dtype=dtype, device=device)
    if extent:
        ctypes.memmove(out.data_ptr(), handle.data_ptr() + start, extent)  # no ATen op
    return out


def _extent_bytes(size: list[int], stride: list[int], itemsize: int) -> int:
    """Bytes from a strided tensor's first element to its last (0 when it is empty)."""
    if any(n == 0 for n in size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


@offload_reload.register_fake
def _(handle: torch.Tensor, size: list[int], stride: list[int], storage_offset: int,
      dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


def host_val(val: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The fake value of the host buffer storing `val` (a fake tensor), for node meta."""
    mode = detect_fake_mode([val])
    with mode:
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")


STORE = torch.ops.remat.offload_store.default
RELOAD = torch.ops.remat.offload_reload.default

__all__ = ["RELOAD", "STORE", "offload_reload", "offload_store"]
