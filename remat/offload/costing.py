"""Whether a plan may offload, at what link bandwidth, and which values can move.

`remat.plan(..., offload=...)` takes "auto" (the default: allowed on CUDA, off on CPU,
where the host store only exists for tests), True, False, or "fallback" (allowed, but
only when the solver's recompute-only plan does not fit: an input that usually fits
recomputes, the unlucky long one offloads). Allowing it gives the Problem a link
bandwidth; `simulate` then prices each offloaded byte both ways.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import torch

from remat.budget import format_bytes
from remat.errors import RematError
from remat.frontend import costs
from remat.frontend.problem import GraphProblem
from remat_solvers import Decision, Phase, Problem, simulate

OFFLOAD_VALUES = ("auto", True, False, "fallback")


class OffloadError(RematError, ValueError):
    """An `offload=` value remat does not know, or a device it cannot offload from."""


def check_offload(offload: Any) -> None:
    """Reject a bad `offload=` before anything is traced."""
    if not any(offload is v or (isinstance(v, str) and offload == v) for v in OFFLOAD_VALUES):
        raise OffloadError(
            f"offload={offload!r} is not an offload setting; use offload=True (allow "
            "offloading activations to host memory), False (never), 'auto' (allowed on "
            "CUDA, off on CPU) or 'fallback' (only where recomputing alone does not fit)"
        )


def offload_device(tensors: list[torch.Tensor], offload: Any = True) -> torch.device | None:
    """The one device the step's tensors live on (offload moves from it to the host).
    Tensors on several devices: an error when offload was asked for, else None (off)."""
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        return devices.pop()
    if offload is True:
        raise OffloadError(
            f"offload needs the model and inputs on one device, found {sorted(map(str, devices))}; "
            "move them to one device or pass offload=False"
        )
    return None


def resolve_bandwidth(offload: Any, device: torch.device | None) -> float | None:
    """The link bandwidth the planner may use, or None when offload is off."""
    check_offload(offload)
    if offload is False or device is None or (offload == "auto" and device.type != "cuda"):
        return None
    if device.type not in ("cpu", "cuda"):
        raise OffloadError(
            f"cannot offload from device {device} (remat offloads from CUDA to pinned host "
            "memory, or on CPU to a host store for tests); pass offload=False"
        )
    return link_bandwidth_bytes_per_s(device)


def link_bandwidth_bytes_per_s(device: torch.device) -> float:
    """Device->host copy bandwidth. On CPU the host store is one memcpy, i.e. half the
    read+written bandwidth `costs.device_speed` reports for the current thread count (read
    each time: a figure kept from a call under another thread count would make the same
    model's plan depend on what ran before it in the process); on CUDA measured once per
    process and device (`_cuda_link_bandwidth_bytes_per_s`)."""
    if device.type == "cpu":
        return costs.device_speed("cpu").bandwidth_bytes_per_s / 2.0
    return _cuda_link_bandwidth_bytes_per_s(device)


@functools.lru_cache(maxsize=None)
def _cuda_link_bandwidth_bytes_per_s(device: torch.device) -> float:
    src = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return src.numel() / best


def with_offload(gp: GraphProblem, bandwidth_bytes_per_s: float | None) -> GraphProblem:
    """`gp` with offload allowed at this bandwidth, on the values that can move: not a
    view (it shares its base's storage), not a step output (it stays on the device
    anyway), not empty, and not pinned where the kernel makes it (`Node.offloadable`
    False from the front end: a value the trace knows only as a meta tensor)."""
    if bandwidth_bytes_per_s is None:
        return gp
    p = gp.problem
    outputs = set(p.outputs)
    nodes = tuple(
        dataclasses.replace(
            n, offloadable=(n.offloadable and n.phase is Phase.FORWARD and n.alias_of is None
                            and i not in outputs and n.out_bytes > 0))
        for i, n in enumerate(p.nodes)
    )
    problem = dataclasses.replace(p, nodes=nodes, offload_bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    return dataclasses.replace(gp, problem=problem)


def offload_floor_bytes(problem: Problem) -> int:
    """A peak offload reaches: every movable value offloaded, the rest recomputed where
    it can be (else saved), or everything movable offloaded and the rest saved."""
    best = None
    for rest in (Decision.RECOMPUTE, Decision.SAVE):
        decisions = {}
        for i in problem.decision_ids:
            allowed = problem.allowed(i)
            if Decision.OFFLOAD in allowed:
                decisions[i] = Decision.OFFLOAD
            elif rest is Decision.RECOMPUTE and problem.nodes[i].recomputable:
                decisions[i] = Decision.RECOMPUTE
            else:
                decisions[i] = Decision.SAVE
        peak = simulate(problem, decisions).peak_bytes
        best = peak if best is None else min(best, peak)
    return best


def offload_hint(gp: GraphProblem, reach_bytes: int, offload: Any) -> str:
    """For an InfeasibleBudgetError with offload off: the floor offload would reach."""
    if gp.problem.offload_bandwidth_bytes_per_s is not None:
        return ""
    on = with_offload(gp, 1.0).problem  # the bandwidth does not change bytes
    floor = offload_floor_bytes(on)
    if floor >= reach_bytes:
        return ""
    why = "offload=False" if offload is False else "offload='auto' leaves it off on CPU"
    return (f"; offloading activations to host memory would reach {format_bytes(floor)}, "
            f"but {why}: pass offload=True to allow it")
