"""Where the bytes of a training step go: model state counted from the model and the
training options, activations and temporaries read from the plan's simulated peak.

Model state (per device, Ψ = parameters; ZeRO paper, Rajbhandari et al. 2020, §3.1):

| precision   | weights | gradients | master copy | Adam/AdamW | SGD+momentum | SGD |
|-------------|---------|-----------|-------------|------------|--------------|-----|
| fp32        | 4Ψ      | 4Ψ        | 0           | 8Ψ         | 4Ψ           | 0   |
| bf16/fp16-mixed | 2Ψ  | 2Ψ        | 4Ψ          | 8Ψ         | 4Ψ           | 0   |

so Adam in mixed precision is 2 + 2 + 12 = 16 bytes per parameter. Optimizer states are
fp32. Only trainable parameters (``requires_grad``) have gradients, master copies and
optimizer states; frozen ones (LoRA/QLoRA base weights) have weights only.

Sharding over N devices (``shard``, ZeRO stage ``zero_stage``): stage 1 divides the
optimizer states and master copy by N, stage 2 also the gradients, stage 3 (= FSDP
FULL_SHARD) also the weights.

Adapters: ``adapter="lora"`` keeps frozen base weights at the weight precision above;
``adapter="qlora"`` stores them in 4-bit NF4 with double-quantized block constants
(Dettmers et al. 2023, §3): 4 + 0.127 bits = 0.516 bytes per frozen parameter. The
trainable (adapter) parameters are counted like any trainable parameter.

Activations are what remat plans: the bytes of forward values live at the simulated
peak (saved, recomputed), and the temporaries live there (backward values other than
parameter gradients, forward values in flight), at the dtype the model was traced in.
The total adds them to the model state, which counts every gradient in full even when
the peak comes before backward has made them all (an upper bound).
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from remat.frontend.problem import LIBRARY_WORKSPACES
from remat_solvers import Decision, Evaluation, Phase, Problem, StepKind

OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
"""Optimizer -> fp32 state tensors per trainable parameter."""
PRECISIONS = {"fp32": 4, "bf16-mixed": 2, "fp16-mixed": 2}
"""Precision -> bytes per weight and per gradient; mixed precisions add a 4-byte master copy."""
ADAPTERS = ("none", "lora", "qlora")
QLORA_BITS_PER_PARAM = 4.127
"""NF4 weight (4 bits) + double-quantized constants (8/64 + 32/(64*256) = 0.127 bits)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    """How the model is trained; decides the model-state bytes."""

    optimizer: str = "adamw"
    """One of OPTIMIZERS: sgd, sgd-momentum, adam, adamw."""
    precision: str = "fp32"
    """One of PRECISIONS: fp32, bf16-mixed, fp16-mixed."""
    shard: int = 1
    """Devices the model state is sharded over (ZeRO / FSDP); 1 = no sharding."""
    zero_stage: int = 3
    """What `shard` divides: 1 optimizer states, 2 + gradients, 3 + weights (FSDP)."""
    adapter: str = "none"
    """none, lora (frozen base at weight precision) or qlora (frozen base in 4 bits)."""

    def __post_init__(self) -> None:
        checks = (
            ("optimizer", self.optimizer, OPTIMIZERS), ("precision", self.precision, PRECISIONS),
            ("adapter", self.adapter, ADAPTERS), ("zero_stage", self.zero_stage, (1, 2, 3)),
        )
        for name, value, valid in checks:
            if value not in valid:
                raise ValueError(f"{name}={value!r} is not one of {sorted(valid)}")
        if not isinstance(self.shard, int) or self.shard < 1:
            raise ValueError(f"shard={self.shard!r} must be an int >= 1 (devices to shard over)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Bytes per device of one training step, by what holds them."""

    trainable_params: int
    """Number of trainable parameters (requires_grad), shared ones counted once."""
    frozen_params: int
    """Number of frozen parameters (LoRA/QLoRA base weights)."""
    weights_bytes: int
    gradients_bytes: int
    master_bytes: int
    """fp32 master copy of the trainable weights in mixed precision."""
    optimizer_bytes: int
    buffers_bytes: int
    inputs_bytes: int
    activations_saved_bytes: int
    """Forward values saved for backward and live at the peak."""
    activations_recomputed_bytes: int
    """Recomputed forward values live at the peak."""
    activations_offloaded_bytes: int
    """Forward values in host memory during backward (not on the device)."""
    temporaries_bytes: int
    """Other values live at the peak: backward temporaries, forward values in flight, and
    on CUDA the math libraries' workspaces (`remat.frontend.libraries`)."""
    peak_step: int
    options: TrainingOptions

    @property
    def model_state_bytes(self) -> int:
        return self.weights_bytes + self.gradients_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def activations_bytes(self) -> int:
        return self.activations_saved_bytes + self.activations_recomputed_bytes + self.temporaries_bytes

    @property
    def total_bytes(self) -> int:
        """Model state + buffers + inputs + activations and temporaries at the peak."""
        return self.model_state_bytes + self.buffers_bytes + self.inputs_bytes + self.activations_bytes


def count_parameters(model: nn.Module) -> tuple[int, int, int]:
    """(trainable, frozen, buffer bytes), each shared tensor counted once."""
    trainable = frozen = 0
    for p in model.parameters():  # parameters() already skips shared (tied) tensors
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return trainable, frozen, buffers


def model_state(trainable: int, frozen: int, options: TrainingOptions) -> dict[str, int]:
    """weights/gradients/master/optimizer bytes per device (the module docstring's table)."""
    width = PRECISIONS[options.precision]
    frozen_bytes = (math.ceil(frozen * QLORA_BITS_PER_PARAM / 8) if options.adapter == "qlora"
                    else frozen * width)
    weights = trainable * width + frozen_bytes
    gradients = trainable * width
    master = trainable * 4 if options.precision != "fp32" else 0
    optimizer = trainable * 4 * OPTIMIZERS[options.optimizer]
    n, stage = options.shard, options.zero_stage
    return {
        "weights_bytes": _shard(weights, n if stage >= 3 else 1),
        "gradients_bytes": _shard(gradients, n if stage >= 2 else 1),
        "master_bytes": _shard(master, n),
        "optimizer_bytes": _shard(optimizer, n),
    }


def _shard(nbytes: int, n: int) -> int:
    return math.ceil(nbytes / n)


def activations_at_peak(problem: Problem, decisions, evaluation: Evaluation) -> dict[str, int]:
    """Split the bytes live at the simulated peak by kind (each storage counted once):
    params, inputs, gradients (backward outputs), saved, recomputed, temporaries; they
    sum to the peak. Also `offloaded`: bytes the plan keeps in host memory."""
    live = live_storages(problem, evaluation, evaluation.peak_step)
    nodes = problem.nodes
    # a gradient output may be a view (the transpose of a matmul): count its storage
    grads = {problem.storage_of[i] for i in problem.outputs
             if nodes[i].phase is Phase.BACKWARD and nodes[i].inputs}
    out = {"inputs": 0, "saved": 0, "recomputed": 0, "temporaries": 0, "params": 0, "gradients": 0}
    for node_id, kind in live.values():
        nbytes = nodes[node_id].out_bytes
        phase = nodes[node_id].phase
        if nodes[node_id].name == LIBRARY_WORKSPACES:  # not the model's: a temporary to the report
            out["temporaries"] += nbytes
        elif phase is Phase.PARAM:
            out["params"] += nbytes
        elif node_id in grads:  # counted in full with the model state
            out["gradients"] += nbytes
        elif phase is Phase.INPUT:
            out["inputs"] += nbytes
        elif kind is StepKind.RECOMPUTE:
            out["recomputed"] += nbytes
        elif phase is Phase.FORWARD and decisions.get(node_id) is Decision.SAVE:
            out["saved"] += nbytes
        else:
            out["temporaries"] += nbytes
    offloaded = sum(nodes[i].out_bytes for i, d in decisions.items() if d is Decision.OFFLOAD)
    out["offloaded"] = offloaded
    return out


def live_storages(problem: Problem, evaluation: Evaluation, at_step: int) -> dict[object, tuple[int, StepKind]]:
    """Storage key -> (node id that allocated it, how) for each storage live while step
    `at_step` runs, replaying simulate's accounting (freed after the last read; outputs,
    parameters and inputs live to the end). Its bytes are that node's `out_bytes`."""
    nodes, steps = problem.nodes, evaluation.steps
    storage_of = problem.storage_of
    made: dict[object, tuple[int, int, StepKind]] = {}  # storage -> (first step, node, kind)
    last: dict[object, int] = {}
    for i, n in enumerate(nodes):
        if n.phase in (Phase.PARAM, Phase.INPUT):
            made[i] = (-1, i, StepKind.FORWARD)
            last[i] = len(steps)
    newest: dict[int, object] = {}  # node id -> key of its newest instance's storage
    for k, step in enumerate(steps):
        node = nodes[step.node_id]
        if step.kind is not StepKind.RELOAD:
            for j in node.inputs:
                key = newest.get(j, storage_of[j])
                last[key] = max(last.get(key, k), k)
        if node.alias_of is not None and step.kind is not StepKind.RELOAD:
            key = newest.get(node.alias_of, storage_of[node.alias_of])
        else:
            key = ("step", k)
            made[key] = (k, step.node_id, step.kind)
        last[key] = max(last.get(key, k), k)
        newest[step.node_id] = key
    for i in problem.outputs:
        last[newest.get(i, storage_of[i])] = len(steps)
    return {
        key: (node_id, kind)
        for key, (start, node_id, kind) in made.items()
        if start <= at_step <= last.get(key, start)
    }
