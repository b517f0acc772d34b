"""Named devices for planning a machine you are not on (`--device h100`): roofline
figures from the vendors' datasheets, used instead of measuring this machine.

These are peak figures (dense tensor-core FLOP/s, HBM bandwidth); real kernels reach
some fraction of them, so estimated seconds are optimistic lower bounds. They set the
relative cost of recomputing one op against another (what the solvers trade), not a
prediction of step time. fp32 matmuls use the non-tensor-core fp32 peak (torch's
default: TF32 off); bf16/fp16 models use the tensor-core peak.
"""

from __future__ import annotations

import dataclasses

import torch

from remat.frontend.costs import DeviceSpeed


@dataclasses.dataclass(frozen=True, kw_only=True)
class NamedDevice:
    """Datasheet figures of one accelerator."""

    name: str
    fp32_flops_per_s: float
    half_flops_per_s: float
    """bf16/fp16 dense tensor-core peak."""
    bandwidth_bytes_per_s: float
    memory_bytes: int
    source: str

    def speed(self, dtype: torch.dtype) -> DeviceSpeed:
        half = dtype in (torch.bfloat16, torch.float16)
        return DeviceSpeed(peak_flops_per_s=self.half_flops_per_s if half else self.fp32_flops_per_s,
                           bandwidth_bytes_per_s=self.bandwidth_bytes_per_s)


DEVICES = {
    d.name: d for d in (
        NamedDevice(name="h100", fp32_flops_per_s=66.9e12, half_flops_per_s=989.4e12,
                    bandwidth_bytes_per_s=3.35e12, memory_bytes=80 * 10**9,
                    source="NVIDIA H100 SXM5 datasheet"),
        NamedDevice(name="h200", fp32_flops_per_s=66.9e12, half_flops_per_s=989.4e12,
                    bandwidth_bytes_per_s=4.8e12, memory_bytes=141 * 10**9,
                    source="NVIDIA H200 SXM datasheet"),
        NamedDevice(name="a100", fp32_flops_per_s=19.5e12, half_flops_per_s=312e12,
                    bandwidth_bytes_per_s=2.039e12, memory_bytes=80 * 10**9,
                    source="NVIDIA A100 SXM4 80GB datasheet"),
        NamedDevice(name="l4", fp32_flops_per_s=30.3e12, half_flops_per_s=121e12,
                    bandwidth_bytes_per_s=300e9, memory_bytes=24 * 10**9,
                    source="NVIDIA L4 datasheet"),
    )
}


def named_device(name: str) -> NamedDevice:
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; known devices: {sorted(DEVICES)}")
    return DEVICES[key]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The floating dtype holding most of the model's parameters (float32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32
