"""The CUDA math libraries' persistent workspaces: bytes the caching allocator holds for
the whole step, in no tensor of the graph.

cuBLAS and cuBLASLt each get a workspace per (handle, stream) at their first matmul on
a stream, and torch keeps it until `torch._C._cuda_clearCublasWorkspaces()`. Its size
comes from `CUBLAS_WORKSPACE_CONFIG` (and `CUBLASLT_WORKSPACE_SIZE`, in KiB), by default
32 MiB each on Hopper (sm 9.0) and 8.125 MiB elsewhere
(`aten/src/ATen/cuda/CublasHandlePool.cpp`). `torch.cuda.max_memory_allocated` counts
them in every step's peak, so the plan counts them as a value live all step
(`frontend.problem.LIBRARY_WORKSPACES`).

Measured once per device and process: the workspaces cleared, one matmul of each kind
run on the current stream in each floating dtype (`mm`, and `addmm` with a bias, which
takes cuBLASLt), what stays allocated once their outputs are freed. While a profiler
records nothing runs (a second session would end the user's); the configured sizes
stand in. 0 off CUDA.
"""

from __future__ import annotations

import os
import re

import torch

from remat import compat

_MEASURED: dict[int, int] = {}

HOPPER_DEFAULT_BYTES = 4096 * 8 * 1024
"""cuBLAS's default workspace on sm 9.0 (`:4096:8`)."""
OTHER_DEFAULT_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
"""cuBLAS's default workspace on other GPUs (`:4096:2:16:8`)."""


def library_workspace_bytes(device: torch.device) -> int:
    """Bytes the CUDA math libraries hold on `device` for the whole step (see the module
    docstring); 0 off CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _MEASURED:
        if compat.profiler_enabled():
            return configured_bytes(torch.cuda.get_device_capability(index))
        _MEASURED[index] = _measure(torch.device("cuda", index))
    return _MEASURED[index]


def _measure(device: torch.device) -> int:
    with compat.unset_fake_temporarily(), torch.no_grad(), torch.autocast("cuda", enabled=False), \
            torch.cuda.device(device):
        torch.cuda.synchronize(device)
        compat.clear_cublas_workspaces()
        before = torch.cuda.memory_allocated(device)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = torch.ones(128, 128, device=device, dtype=dtype)
            bias = torch.ones(128, device=device, dtype=dtype)
            torch.mm(x, x)
            torch.addmm(bias, x, x)
            del x, bias
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.memory_allocated(device) - before)


def configured_bytes(capability: tuple[int, int], environ: dict[str, str] | None = None) -> int:
    """cuBLAS's plus cuBLASLt's workspace per stream, from the environment as torch
    reads it (`CublasHandlePool.cpp`): `CUBLAS_WORKSPACE_CONFIG` is `:SIZE_KIB:COUNT`
    pairs, the size the sum of SIZE_KIB; cuBLASLt's is `CUBLASLT_WORKSPACE_SIZE` KiB,
    else cuBLAS's."""
    env = os.environ if environ is None else environ
    pairs = re.findall(r":([0-9]+):([0-9]+)", env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        cublas = sum(int(size) for size, _ in pairs) * 1024
    else:
        cublas = HOPPER_DEFAULT_BYTES if capability == (9, 0) else OTHER_DEFAULT_BYTES
    lt = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return cublas + (int(lt) * 1024 if lt.isdigit() else cublas)
