"""`remat.plan(model, args, budget=...)`: the public front door.

It traces the model's training step, plans it under the budget, rewrites it, and
returns a `Planned` module that shares the model's parameters and buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from remat.budget import format_bytes
from remat.compile_backend import RematBackend
from remat.errors import InfeasibleBudgetError, RematError
from remat.frontend import workspace
from remat.frontend.costs import DeviceSpeed
from remat.frontend.trace import FlatModel, FlatSignature, TensorsOnce, compile_joint
from remat.offload.costing import offload_device, resolve_bandwidth
from remat.partitioner import Partitioner, PlannedStep
from remat.planning import distributed
from remat.planning.settings import PlannerSettings, SettingsView
from remat.planning.shapes import ShapePlan, label_of, planned_shape, refused_shape, shapes_summary, with_length
from remat.report import summary
from remat.runtime.step.ledger import predicted_peak
from remat_solvers import Plan

log = logging.getLogger(__name__)


_COMPILED_STEPS = itertools.count()


def _compiled(flat: FlatModel, backend: Any) -> Any:
    """`torch.compile` of the flat step through a function with a code object of its
    own. Dynamo keeps per code object its compiled code, its recompile limit (8) and the
    sizes it saw change: compiled through `FlatModel.forward`, which every signature of
    every planned model shares, the ninth signature in a process stopped with
    `FailOnRecompileLimitHit`, and every signature after the first compiled with dynamic
    shapes. `dynamic=False`: a signature is one set of sizes; `fullgraph=True`: one
    graph, so the budget covers the whole step."""
    def step(*tensors: torch.Tensor) -> Any:
        return flat(*tensors)

    code = step.__code__.replace(co_name=f"remat_step_{next(_COMPILED_STEPS)}")
    own = types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)
    return torch.compile(own, backend=backend, fullgraph=True, dynamic=False)


@functools.lru_cache(maxsize=1)
def _stop_class() -> type:
    """The exception that stops a plan-time compile once remat has planned: a dynamo
    `ShortenTraceback`, which dynamo re-raises as it is."""
    from remat.compat import ShortenTraceback

    return type("PlannedUnderInductor", (ShortenTraceback,), {})


class Planned(SettingsView, nn.Module):
    """The model, rematerialized. Shares the model's parameters, buffers and submodules
    (same `state_dict()` keys, same Parameter objects), so optimizers and checkpoints
    work unchanged. Calling it runs the planned forward; `.loss.backward()` runs the
    planned backward. Other input shapes are re-planned under the same budget."""

    def __init__(self, model: nn.Module, settings: PlannerSettings, *, options: dict[str, Any],
                 compile: bool = False, cost_model: str | None = None, outputs: str = "all"):
        super().__init__()
        # Share, don't wrap: the same dicts, so keys and objects are the model's own.
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._modules = model._modules
        self.__dict__["_remat_model"] = model
        self.__dict__["_remat_cache"] = {}
        self.__dict__["_remat_settings"] = settings
        self.__dict__["_remat_refused"] = {}  # signature key -> InfeasibleBudgetError
        self.__dict__["_remat_shapes"] = {}  # signature key -> ShapePlan
        self.__dict__["_remat_runs"] = {}  # signature key -> forward calls
        self.__dict__["_remat_last"] = None  # signature key of the last forward call
        self.options = dict(options)
        self.compile = compile
        self.cost_model = cost_model
        self.outputs = outputs
        self.training = model.training

    @property
    def model(self) -> nn.Module:
        return self.__dict__["_remat_model"]

    @property
    def settings(self) -> PlannerSettings:
        """What every input signature is planned with (`PlannerSettings.for_eager`)."""
        return self.__dict__["_remat_settings"]

    def train(self, mode: bool = True) -> "Planned":
        self.model.train(mode)
        self.training = mode
        return self

    def prepare(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None
                ) -> tuple[PlannedStep, Any, FlatModel]:
        """Plan (or fetch the cached plan) for these inputs' signature. A signature no
        plan fits raises InfeasibleBudgetError here, before anything runs, and again on
        every later call without planning again."""
        kwargs = dict(kwargs or {})
        signature = FlatSignature.of(args, kwargs, self.model.training)
        cache = self.__dict__["_remat_cache"]
        refused = self.__dict__["_remat_refused"]
        if signature.key in refused:
            raise refused[signature.key]
        if signature.key not in cache:
            if cache:
                log.info("remat: new input signature %s; re-planning under the same budget", signature.key[2])
            label, started = label_of(args, kwargs), time.perf_counter()
            try:
                cache[signature.key] = self._compile(signature, args, kwargs)
            except InfeasibleBudgetError as e:
                refused[signature.key] = e
                self.__dict__["_remat_shapes"][signature.key] = refused_shape(
                    label, e, time.perf_counter() - started)
                raise
            self.__dict__["_remat_shapes"][signature.key] = planned_shape(
                label, cache[signature.key][0], time.perf_counter() - started)
        return cache[signature.key]

    def prepare_lengths(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None, *,
                        lengths: Sequence[int], dim: int = 1) -> dict[int, ShapePlan]:
        """Plan ahead for each sequence length in `lengths` (so no step stalls to plan):
        the example inputs are resized along `dim` (see `shapes.with_length`). Returns
        what was planned per length; raises InfeasibleBudgetError for the first length
        no plan fits, after planning the others."""
        if not isinstance(args, (tuple, list)):
            args = (args,)
        kwargs = dict(kwargs or {})
        out: dict[int, ShapePlan] = {}
        first_error: InfeasibleBudgetError | None = None
        for length in lengths:
            a, k = with_length(args, kwargs, length, dim=dim)
            key = FlatSignature.of(a, k, self.model.training).key
            try:
                with torch.enable_grad():
                    self.prepare(a, k)
            except InfeasibleBudgetError as e:
                first_error = first_error or e
            out[length] = self.__dict__["_remat_shapes"][key]
        if first_error is not None:
            raise first_error
        return out

    @property
    def shapes(self) -> tuple[ShapePlan, ...]:
        """What was planned (or refused) per input signature, in planning order."""
        return tuple(self.__dict__["_remat_shapes"].values())

    def _compile(self, signature: FlatSignature, args: Sequence[Any], kwargs: dict[str, Any]):
        started = time.perf_counter()
        flat = FlatModel(self.model, signature, outputs=self.outputs)
        # A tied weight goes to AOTAutograd once, so its gradients are summed in the plan.
        traced_module = TensorsOnce(flat) if TensorsOnce.has_tied(flat) else flat
        num_params = len(dict(traced_module.named_parameters(remove_duplicate=False))) + len(
            dict(traced_module.named_buffers(remove_duplicate=False)))
        # Re-plans keep the bytes the first plan resolved: the device does not grow.
        cache = self.__dict__["_remat_cache"]
        budget = next(iter(cache.values()))[0].budget_bytes if cache else self.budget
        tensors = signature.tensors(args, kwargs)
        bandwidth = None
        if self.offload is not False:  # offload=False never looks at devices
            device = offload_device([*tensors, *flat.parameters()], self.offload)
            bandwidth = resolve_bandwidth(self.offload, device)
        # with compile=True a budget no plan meets op by op is inductor's closed loop to
        # decide (below): the trace plans at the floor op by op instead of refusing
        probe = self.compile and not self.settings.floor_if_refused
        settings = dataclasses.replace(self.settings, floor_if_refused=True) if probe else self.settings
        partitioner = Partitioner(settings, num_params=num_params, budget=budget, started_s=started,
                                  offload_bandwidth_bytes_per_s=bandwidth)
        # a new input shape is planned inside the training step: measuring stays under
        # the bytes the first plan resolved
        measuring = workspace.inside_a_step(budget) if cache else contextlib.nullcontext()
        try:
            with measuring:
                traced = compile_joint(traced_module, tensors, partitioner, user_model=self.model)
        except Exception:
            if partitioner.error is not None:
                raise partitioner.error from None
            raise
        if partitioner.step is None:
            raise RematError(
                "AOTAutograd did not produce a joint graph (does the loss require grad? are "
                "gradients enabled?); call the model under torch.enable_grad() with trainable "
                "parameters"
            )
        step = dataclasses.replace(partitioner.step, library_trace_path=traced.library_trace_path)
        if probe and step.refusal is not None:
            # what runs is inductor's code, whose floor may sit above or below the floor op
            # by op: its closed loop decides, before anything runs. Where it holds, the
            # eager step at its floor op by op is the plan shown until the first call
            # compiles inductor's, under the budget asked.
            with measuring:
                self._holds_under_inductor(flat, tensors, step.refusal)
            step = dataclasses.replace(step, budget_bytes=step.refusal.budget_bytes, refusal=None)
        if self.compile:
            return step, self._inductor(flat, step.budget_bytes), flat
        return step, traced.compiled, flat

    def _backend(self, budget_bytes: int) -> RematBackend:
        return RematBackend(budget=budget_bytes, solver=self.solver, sync_ranks=self.sync_ranks,
                            offload=self.offload, cost_model=self.cost_model, **self.options)

    def _inductor(self, flat: FlatModel, budget_bytes: int) -> Any:
        """The same step through `torch.compile` with `remat.backend` (inductor) under the
        bytes this plan resolved. Dynamo captures the flat model (only the loss
        differentiable, as here), so the backend plans the same problem after inductor's
        joint-graph passes; it compiles on the first call (`_compiled`)."""
        be = self._backend(budget_bytes)
        self.__dict__.setdefault("_remat_backends", []).append(be)
        return _compiled(flat, be)

    def _holds_under_inductor(self, flat: FlatModel, tensors: Sequence[Any],
                              refused: InfeasibleBudgetError) -> None:
        """With `compile=True`, a budget no plan meets op by op: compile the step through
        the backend now and stop once it has planned, before the compiled code runs (no
        forward, so no gradient, buffer or RNG state changes). Returns if inductor's closed
        loop holds the budget; raises its refusal, which names inductor's floor, if not."""
        budget = refused.budget_bytes
        be = self._backend(budget)
        stop = _stop_class()

        def planned_then_stop(gm: Any, example_inputs: Sequence[Any]) -> Any:
            be(gm, example_inputs)
            raise stop("planned under inductor", first_useful_frame=None)

        try:
            _compiled(flat, planned_then_stop)(*tensors)
        except stop:
            pass
        else:
            raise RematError("torch.compile ran the step without calling remat's backend; "
                             "is torch.compiler.disable on for this model?")
        # the whole step is this one graph (fullgraph): a plan the ledger ran at its floor,
        # over the budget, is the floor under inductor
        over = [s for s in be.steps if predicted_peak(s) > budget]
        if over:
            floor = min(over, key=predicted_peak)
            peak = predicted_peak(floor)
            raise InfeasibleBudgetError(
                f"budget {format_bytes(budget)} does not hold under inductor (compile=True): the "
                f"smallest reachable peak found is {format_bytes(peak)} "
                f"({format_bytes(floor.evaluation.peak_bytes)} op by op, "
                f"{getattr(floor, 'fusion_margin_bytes', 0):+,} B from inductor's kernels); raise "
                f"the budget to at least {peak} bytes, or plan with compile=False (op by op)",
                budget_bytes=budget, min_peak_bytes=peak)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.model(*args, **kwargs)  # nothing to rematerialize without backward
        signature = FlatSignature.of(args, kwargs, self.model.training)
        _, compiled, flat = self.prepare(args, kwargs)
        runs = self.__dict__["_remat_runs"]
        runs[signature.key] = runs.get(signature.key, 0) + 1
        self.__dict__["_remat_last"] = signature.key
        outs = compiled(*signature.tensors(args, kwargs))
        return flat.unflatten(outs)

    # ---- what was decided, for the signature planned first ----

    @property
    def step(self) -> PlannedStep:
        """The plan that runs: with `compile=True`, inductor's once the first call compiled
        it (before that, the eager plan made at `remat.plan`, which fixed the budget; at a
        budget inductor holds and no plan op by op meets, the floor op by op, over it)."""
        cache = self.__dict__["_remat_cache"]
        if not cache:
            raise RematError("nothing planned yet: call remat.plan(model, args, budget=...)")
        backends = self.__dict__.get("_remat_backends") or []
        if backends and backends[0].steps:
            return backends[0].steps[0]
        return next(iter(cache.values()))[0]

    @property
    def plan(self) -> Plan:
        return self.step.plan

    @property
    def problem(self):
        return self.step.graph_problem.problem

    @property
    def predicted_peak_bytes(self) -> int:
        """The plan's simulated peak, plus what inductor's code holds beyond it once the
        first call compiled under `compile=True` (`PlannedStep.fusion_margin_bytes`)."""
        return predicted_peak(self.step)

    @property
    def baseline_peak_bytes(self) -> int:
        return self.step.baseline_peak_bytes

    @property
    def budget_bytes(self) -> int:
        return self.step.budget_bytes

    def summary(self) -> str:
        d = self.__dict__
        per_shape = [(plan, d["_remat_runs"].get(key, 0), key == d["_remat_last"])
                     for key, plan in d["_remat_shapes"].items()]
        return "\n".join([summary(self.step), *shapes_summary(per_shape)])


def plan(
    model: nn.Module,
    args: Sequence[Any] | Any,
    kwargs: dict[str, Any] | None = None,
    *,
    budget: int | str,
    solver: str = "auto",
    sync_ranks: bool | None = None,
    offload: bool | str = "auto",
    device_speed: DeviceSpeed | None = None,
    compile: bool = False,
    cost_model: str | None = None,
    outputs: str = "all",
    **options: Any,
) -> Planned:
    """Plan `model`'s training step on these example inputs under `budget`.

    budget: int bytes, a string with units ('800MB', '1.5GiB'), or a percentage of the
    no-remat peak ('60%'); it covers the whole forward+backward step. Raises
    `InfeasibleBudgetError` (a RematError) if no plan fits, stating the smallest peak.

    sync_ranks: under torch.distributed, every rank takes rank 0's plan (exchanged through
    the process group's store, so every rank must plan); None does so when a process
    group of more than one rank is initialized. Wrap the result in DDP as the model:
    `DDP(remat.plan(...))`. A model sharded by FSDP2 is refused (`CompositionError`):
    compile it with `remat.backend` instead (see `remat.planning.distributed`).

    offload: True lets the planner move activations to host memory between forward and
    backward (below the recompute-only floor); False never; "auto" (default) allows it
    on CUDA and leaves it off on CPU; "fallback" allows it only for input shapes whose
    recompute-only plan does not fit (the long batch offloads, the others recompute).

    device_speed: roofline figures for per-op costs (default: this machine, measured
    once and cached; `remat.frontend.devices.named_device('h100').speed(dtype)` plans
    for another device).

    Random ops (dropout) may be recomputed: the forward saves the generator state read
    just before each (5,056 bytes on CPU) and backward replays it, bit for bit, leaving
    the global random stream where eager leaves it; the planner weighs that against
    saving the mask and output. `replay_rng=False` (an option) always saves them, as
    `compile=True`'s trace does; the plan that then runs is inductor's graph's, where a
    mask is drawn from a saved seed (`prims.inductor_random`) and may be recomputed.

    Below every plan that recomputes each value at most once, the planner tries plans
    that drop a recomputed value after one backward reader and recompute it again for a
    later one (per-layer checkpointing among them) and takes the cheapest that fits;
    the stated floor is the least of both (`compile=True` too: inductor compiles the
    backward's copies of such a value like any other nodes). `schedules=False` (an
    option) plans the canonical ones only.

    compile: run the planned step with inductor's fused kernels (`torch.compile` with
    `remat.backend`, under the bytes resolved here); it compiles on the first call. The
    budget is checked here, before anything runs: op by op, and where no plan meets it
    op by op, by inductor's closed loop on the step compiled now (not run), whose
    refusal names the floor under inductor. Gradients then match eager up to inductor's
    rounding instead of bit for bit.

    cost_model: how a recompute's seconds are estimated, one of
    `remat.frontend.costs.COST_MODELS`: "eager" (default; each op its own kernel),
    "compiled" (pointwise ops fused into their consumers cost only the bytes they read;
    for comparing with inductor-compiled training) or "compiled-traffic" (the same, and
    a saved pointwise value costs its traffic; `compile=True`'s default, as
    `remat.backend`'s). It changes which plan is chosen, never the memory model or the
    runtime.

    outputs: "all" (default) returns every output of the model (other than the loss,
    detached), and plans for them being held until the step ends: the caller may keep
    them through backward. "loss" returns the loss only (the model's output with None in
    place of every other tensor, e.g. `out.logits is None`): those tensors die inside the
    forward, once nothing reads them, as they do when a training loop drops them before
    backward, and the budget no longer holds room for them (a language model's logits
    are often the largest single activation)."""
    if not isinstance(model, nn.Module):
        raise RematError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    settings = PlannerSettings.for_eager(  # checked here: fail before tracing, not after
        budget=budget, solver=solver, options=options, sync_ranks=sync_ranks, offload=offload,
        device_speed=device_speed, compile=compile, cost_model=cost_model, outputs=outputs)
    distributed.check_plannable(model)
    if not isinstance(args, (tuple, list)):
        args = (args,)
    kwargs = dict(kwargs or {})
    planned = Planned(model, settings, options=options, compile=compile, cost_model=cost_model, outputs=outputs)
    with torch.enable_grad():
        planned.prepare(tuple(args), kwargs)
    return planned
