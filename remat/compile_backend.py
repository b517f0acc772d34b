"""remat as a `torch.compile` backend: remat partitions, inductor compiles.

    backend = remat.backend(budget="60%")
    compiled = torch.compile(model, backend=backend)
    compiled(x).loss.backward()
    backend.steps  # one PlannedStep per graph dynamo captured

Each graph dynamo hands over goes to inductor's `compile_fx` with remat's planner installed
as inductor's `custom_partitioner_fn` (a `CustomPartitionerFn`, one per backend instance):
AOTAutograd traces the joint graph, inductor runs its joint-graph passes, remat plans the
result under the budget and returns the forward and backward graphs, and inductor
compiles those into fused kernels. `compiler="eager"` runs remat's graphs op by op
instead (bit-exact against eager on CPU; for debugging).

What inductor may change after the partition, and what remat pins:
- `reorder_for_peak_memory` is off: remat's memory model (`remat_solvers.simulate`) is the
  op-by-op order remat emits; inductor's reordering picks among orders by its own
  estimate, which can rank two plans the other way round from what they measure. Fusion
  and buffer reuse stay on: they only drop or share buffers.
- `emulate_precision_casts` is on: under bf16 autocast a fused recomputation would keep an
  intermediate in fp32 where the saved value was rounded to bf16 (max gradient difference
  0.0156 measured), so the gradients would depend on which values remat recomputed. With
  it, every plan gives the same gradients as saving everything under inductor.
- Fusion is kept to what keeps the peak (`fusion="peak"`, the default;
  `remat.runtime.inductor.fusion`): inductor's own fusion joins kernels from far apart
  (a recomputation with its twin from another layer) and runs them at the first one's
  place, which measured over the budget at tight budgets (GPT-2 tiny at 47.9% of its
  no-remat peak: 322,819 B over; neighbours only: under). Neighbours always fuse; kernels
  further apart only when no position in between then goes over the graph's peak
  before fusion (neighbours only cost LLaMA's bench forward 5% at a 100% budget).
- What fusion still adds (a fused run keeps its inputs to its end) is read
  from inductor before anything runs (`remat.runtime.inductor.estimate`): each plan's
  graphs are lowered and their code generated (no kernel compiled); what the code holds
  against the same graph op by op is the margin, and remat replans under the budget minus
  it, or, where the code holds less, tries a plan that uses the room
  (`remat.runtime.inductor.closed_loop`, `PlannedStep.fusion_margin_bytes`).

The budget is a promise for the whole step (`remat.runtime.step.ledger`): when dynamo splits
the step into several graphs (graph breaks, DDPOptimizer's buckets, FSDP2's wrapped
modules), each graph call is planned under the budget minus what is live outside it
(earlier graphs' saved activations, tensors crossing graph boundaries, the other graphs'
parameters and gradients), and after the first step the budget is split among the calls
(`remat.runtime.step.split`; a percentage is of the whole step's no-remat peak). A model that
compiles to one graph gets the same guarantee as `remat.plan`. `whole_step=False` plans
each graph on its own under the same budget (a percentage: of that graph's own peak). Unlike `remat.plan`, every differentiable output of the graph gets a
gradient input (dynamo's graph does not know which output is the loss).

Caches: by default remat's compiles bypass inductor's FX-graph cache and AOTAutograd's
cache, so that every compile plans (and `steps`/`summary` describe what runs) on this
machine's measured costs. `cache=True` keeps both caches: the key holds the partitioner's
`uuid()`, which covers everything a plan depends on (budget, solver and its options, cost
model, the device figures, remat's source), so a hit reuses a plan made from the same
inputs; on a hit remat is not called, `cache_hits` counts it, and the plan is read back
from remat's plan store (`remat.runtime.inductor.plan_store`), so `steps`/`summary` still work.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx

from remat.errors import CompositionError, RematError
from remat.frontend import costs
from remat.frontend.inductor_random import random_s_per_element
from remat.frontend.layouts import eager_cpu_layouts
from remat.frontend.trace import boxed_eager_compiler
from remat.offload.costing import offload_device, resolve_bandwidth
from remat.partitioner import Partitioner, PlannedStep
from remat.planning import distributed
from remat.planning.settings import OUTPUTS, PlannerSettings, SettingsView
from remat.report.text import backend_summary
from remat.runtime import dropped
from remat.runtime.inductor import plan_store
from remat.runtime.inductor.closed_loop import plan_under_fusion
from remat.runtime.inductor.fusion import FUSION_MODES, FusionEstimate, fusion_passes
from remat.runtime.step.graph import LedgeredGraph
from remat.runtime.step.ledger import StepLedger

# torch's private names come from remat.compat inside the functions that use them: each is
# resolved on first use, so inductor's and dynamo's modules load only for a compile, and a
# torch without one fails only the feature that needs it (remat.compat's docstring).

COMPILERS = ("inductor", "eager")

# Inductor settings remat pins for what it compiles (see the module docstring).
PINNED_INDUCTOR_CONFIG: dict[str, Any] = {
    "reorder_for_peak_memory": False,
    "emulate_precision_casts": True,
}


class RematBackend(SettingsView):
    """A callable `torch.compile` backend that records what it planned."""

    def __init__(self, *, budget: int | str, solver: str = "auto", compiler: str = "inductor",
                 cost_model: str | None = None, cache: bool = False, mode: str | None = None,
                 inductor_options: dict[str, Any] | None = None, sync_ranks: bool | None = None,
                 fusion: str = "peak", offload: bool | str = "auto", whole_step: bool = True,
                 outputs: str = "all", **options: Any) -> None:
        if compiler not in COMPILERS:
            raise RematError(f"unknown compiler={compiler!r}; valid compilers: {list(COMPILERS)}")
        if fusion not in FUSION_MODES:
            raise RematError(f"unknown fusion={fusion!r}; valid: {list(FUSION_MODES)}")
        self.settings = PlannerSettings.for_backend(
            budget=budget, solver=solver, options=options, sync_ranks=sync_ranks, offload=offload,
            compiler=compiler, cost_model=cost_model, outputs=outputs)
        """What every graph is planned with."""
        self.outputs = outputs
        self.fusion = fusion
        self.compiler = compiler
        self.cache = cache
        self.mode = mode
        self.inductor_options = dict(inductor_options or {})
        self.options = dict(options)
        self.whole_step = whole_step
        self.ledger = StepLedger(budget, solver=solver, solver_options=self.settings.solver_options)
        """What the step's graphs hold while each runs (`remat.runtime.step.ledger`)."""
        self._graphs = 0
        self.steps: list[PlannedStep] = []
        self.measured: Any = None
        """The last `measure(...)` (a `remat.testing.measure.MemoryMeasurement`), or None."""
        self.cache_hits = 0
        """Graphs whose compiled code came from torch's caches (remat was not called)."""
        self.stored_steps = 0
        """Of `steps`, those read from remat's plan store on a cache hit (`plan_store`)."""
        self.fusion_estimates: list[FusionEstimate] = []
        """Inductor's own peak estimate of each graph it compiled, before and after fusion."""

    @property
    def cost_model(self) -> str:
        return self.settings.cost_model

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], *, mode: str | None = None,
                 options: dict[str, Any] | None = None) -> Callable[..., Any]:
        """Compile one graph dynamo captured; `mode`/`options` come from `torch.compile`."""
        if self.cache and self.sync_ranks is not False and distributed.world_size() > 1:
            raise CompositionError(
                "remat.backend(cache=True) under torch.distributed: a rank that hits torch's "
                "compile cache skips planning while its peers wait for it in the plan exchange "
                "(a hang); use cache=False (the default) or sync_ranks=False")
        if self.whole_step and not _symbolic(gm):
            graph = LedgeredGraph(self._graphs, self.ledger, functools.partial(
                self._compile, gm, mode=mode, options=options), on_step=self.steps.append,
                drop_outputs=self.settings.drop_outputs)
            self._graphs += 1
            try:
                return graph.start(example_inputs)
            except RematError as e:
                raise reraised_through_dynamo(e) from None
        compiled, step = self._compile(gm, example_inputs, mode=mode, options=options)
        if step is not None:
            self.steps.append(step)
        if self.settings.drop_outputs and step is not None:
            compiled = _CheckingDroppedOutputs(compiled, self._graphs)
            self._graphs += 1
        return compiled

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 budget_for: Callable[[int], int] | None = None, best_effort: bool = False, *,
                 mode: str | None = None, options: dict[str, Any] | None = None
                 ) -> tuple[Callable[..., Any], PlannedStep | None]:
        """One compile of `gm`: the callable and what remat planned (None when torch's
        cache served it or AOTAutograd made no backward)."""
        key = plan_store.plan_key(self.uuid(), gm, example_inputs) if self.cache else None
        partitioner = Partitioner(self.settings, num_params=0, started_s=time.perf_counter(),
                                  offload_bandwidth_bytes_per_s=self._bandwidth(example_inputs),
                                  random_s_per_element=self._random_s_per_element(),
                                  budget_for=budget_for, best_effort=best_effort)
        try:
            if self.compiler == "eager":
                compiled = _compile_eager(gm, example_inputs, partitioner)
            else:
                patches = self._inductor_config(mode or self.mode, options, partitioner)
                compiled = _compile_inductor(gm, example_inputs, patches, cache=self.cache)
        except Exception as e:
            error = partitioner.error or (e if isinstance(e, RematError) else None)
            if error is not None:
                raise reraised_through_dynamo(error) from None
            raise
        if partitioner.step is not None:
            if key is not None:
                plan_store.store(key, partitioner.step)
        else:  # torch's cache: remat was not called; the plan store's record, if any
            self.cache_hits += 1
            stored = plan_store.load(key) if key is not None else None
            if stored is not None:
                self.steps.append(stored)
                self.stored_steps += 1
        return compiled, partitioner.step

    def _random_s_per_element(self) -> float | None:
        """Under inductor with a compiled cost model: what one of inductor's random draws
        costs on this machine (measured once, `remat.frontend.inductor_random`)."""
        if self.compiler != "inductor" or self.cost_model == "eager":
            return None
        return random_s_per_element("cpu")

    def _bandwidth(self, example_inputs: Sequence[Any]) -> float | None:
        """The link bandwidth offload may use for this graph's device, or None (off)."""
        if self.offload is False:
            return None
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        return resolve_bandwidth(self.offload, offload_device(tensors, self.offload))

    def _inductor_config(self, mode: str | None, options: dict[str, Any] | None,
                         partitioner: Partitioner) -> dict[str, Any]:
        from remat.compat import inductor_config as config
        from remat.compat import list_mode_options

        patches = dict(list_mode_options(mode)) if mode else {}
        patches.update(self.inductor_options)
        patches.update(options or {})
        patches.update(PINNED_INDUCTOR_CONFIG)
        passes = fusion_passes(self.fusion, self.fusion_estimates)
        patches.update(passes)
        # the closed loop may turn layout optimization off for this graph's plan: it sets
        # the key in this dict, which compile_fx applies again around each graph's
        # lowering (the backward's too, compiled lazily after this patch has ended)
        patches.setdefault("layout_optimization", config.layout_optimization)
        patches["custom_partitioner_fn"] = partitioner_fn(partitioner, self.uuid(), fusion=self.fusion,
                                                          rule=passes["_pre_fusion_custom_pass"],
                                                          inductor_config=patches)
        if not self.cache:
            patches["fx_graph_cache"] = False
        return patches

    def uuid(self) -> tuple[str, ...]:
        """Everything a plan depends on besides the graph and its input shapes (which
        torch's cache key holds already)."""
        return (
            "remat", _source_hash(), repr(self.budget), self.solver, repr(self.offload),
            repr(sorted(self.options.items())), self.cost_model, _device_fingerprint(),
            f"random={self._random_s_per_element() or 0:.2g}",
            f"fusion={self.fusion}", f"outputs={self.outputs}",
        )

    def summary(self) -> str:
        """What each captured graph's plan does, the step's budget across graphs, and the
        measured peak against the prediction (`remat.report.text.backend_summary`)."""
        return backend_summary(self)

    def measure(self, step: Callable[[], Any], *, register: Sequence[Any] = ()) -> Any:
        """Run `step` (one compiled forward+backward) under the profiler's allocation
        events, the instrument that sees what inductor runs, and keep the peak for the
        summary (predicted vs measured). `register`: what is live before the step (the
        model, its inputs); clear gradients first, the profiler cannot see older frees."""
        # remat.testing's instruments are for tests and benches; this method is the runtime's
        # one use of them, so the runtime does not depend on remat.testing until it is called
        from remat.testing.measure import measure_step_profiler

        self.measured = measure_step_profiler(step, register=register)
        return self.measured


def backend(*, budget: int | str, solver: str = "auto", **kwargs: Any) -> RematBackend:
    """A `torch.compile` backend that rematerializes each captured graph under `budget`.

    compiler: "inductor" (default; fused kernels) or "eager" (remat's graphs op by op,
    bit-exact on CPU). cost_model: "compiled-traffic" (default under inductor), "compiled" or "eager" (see
    `remat.frontend.costs.COST_MODELS`). cache: keep torch's compile caches (default off,
    see the module docstring). mode / inductor_options: as `torch.compile`'s. sync_ranks:
    as `remat.plan`'s (rank 0's plan on every rank). offload: as `remat.plan`'s ("auto":
    on CUDA only); under inductor the store and reload are custom ops
    (remat/offload/ops.py) and reloads wait in place (no prefetch). whole_step:
    one budget for the whole step across its graphs (default; `remat.runtime.step.ledger`) or
    each graph on its own (False). outputs: "all" (default) plans for the caller holding
    every output of the compiled step until backward ends; "loss" for a caller that keeps
    only the loss (`model(x).loss.backward()`, a training loop's usual shape): the other
    outputs (a language model's logits, often its largest activation) are held to the
    forward's end only, and a step that still holds one when backward begins stops with
    `remat.runtime.dropped.DroppedOutputHeldError`. Other keyword arguments go to the solver."""
    return RematBackend(budget=budget, solver=solver, **kwargs)


@functools.lru_cache(maxsize=1)
def _partitioner_class() -> type:
    from remat.compat import CustomPartitionerFn

    class _RematPartitionerFn(CustomPartitionerFn):
        """remat's `Partitioner` in the shape inductor's `custom_partitioner_fn` takes.

        torch deep-copies and pickles inductor's config for its cache key: the copy is the
        object itself (its plan record must reach the backend), and it pickles as its uuid
        (the planner state holds fx graphs and is not part of what the plan depends on)."""

        def __init__(self, partitioner: Partitioner, uuid: tuple[str, ...], fusion: str | None = None,
                     rule: Any = None, inductor_config: dict[str, Any] | None = None) -> None:
            self.partitioner = partitioner
            self._uuid = uuid
            self.fusion = fusion
            self.rule = rule
            self.inductor_config = inductor_config

        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            if self.fusion is None:
                return self.partitioner(gm, joint_inputs, **kwargs)
            return plan_under_fusion(self.partitioner, gm, joint_inputs, fusion=self.fusion, rule=self.rule,
                                     inductor_config=self.inductor_config, **kwargs)

        def uuid(self) -> tuple[str, ...]:
            return self._uuid

        def __deepcopy__(self, memo: dict[int, Any]) -> "_RematPartitionerFn":
            return self

        def __reduce__(self) -> tuple[Any, ...]:
            return (str, (repr(self._uuid),))

    return _RematPartitionerFn


def partitioner_fn(partitioner: Partitioner, uuid: tuple[str, ...], *, fusion: str | None = None,
                   rule: Any = None, inductor_config: dict[str, Any] | None = None) -> Any:
    """A `CustomPartitionerFn` (its class is built lazily: `torch._inductor` is heavy and
    only this backend needs it). `fusion`: plan in a closed loop with inductor's estimate
    of what fusion of that kind adds (`remat.runtime.inductor.estimate`); None: plan once.
    `inductor_config`: the compile's config patch, where the loop sets the settings it
    chose (`plan_under_fusion`)."""
    return _partitioner_class()(partitioner, uuid, fusion, rule, inductor_config)


class _CheckingDroppedOutputs:
    """A compiled graph that checks at backward that the outputs declared dropped are
    gone (`remat.runtime.dropped`); what else dynamo reads of it is the graph's own."""

    def __init__(self, compiled: Callable[..., Any], graph: int) -> None:
        self.compiled = compiled
        self.graph = graph

    def __call__(self, *args: Any) -> Any:
        out = self.compiled(*args)
        dropped.watch(out, self.graph)
        return out

    def __getattr__(self, name: str) -> Any:  # _boxed_call (dynamo's calling convention), ...
        if name.startswith("__") or "compiled" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.compiled, name)


def _symbolic(gm: fx.GraphModule) -> bool:
    """Whether the graph has symbolic sizes (dynamic shapes): a plan's bytes are then
    those of the size it was traced at, so the ledger cannot add them up per step."""
    from remat.compat import free_symbols

    return any(free_symbols(n.meta.get("example_value")) for n in gm.graph.nodes
               if n.op == "placeholder" and n.meta.get("example_value") is not None)


def _compile_eager(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Partitioner):
    # Through dynamo's `aot_autograd` wrapper, not `aot_module_simplified` directly: the
    # wrapper's counter is how DDPOptimizer knows a piece went through AOTAutograd and
    # records its metadata per bucket (without it, the lazily compiled backward asserts
    # "expected same # of fw and bw compiles, but found bucket -1").
    from remat.compat import aot_autograd, detect_fake_mode

    compiler = aot_autograd(fw_compiler=boxed_eager_compiler, bw_compiler=boxed_eager_compiler,
                            partition_fn=partitioner)
    # the traced views must be the ones eager's layouts allow (dynamo's fake mode
    # is the one AOTAutograd traces with, and it may have cached torch's layouts)
    with eager_cpu_layouts(detect_fake_mode(list(example_inputs))):
        return compiler(gm, list(example_inputs))


def _compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any],
                      *, cache: bool):
    from remat.compat import compile_fx, functorch_config

    with functorch_config.patch(enable_autograd_cache=cache):
        return compile_fx(gm, list(example_inputs), config_patches=patches)


def reraised_through_dynamo(error: RematError) -> RematError:
    """The same error, also a dynamo `ShortenTraceback`: dynamo re-raises those as they
    are instead of wrapping them in `BackendCompilerFailed`, so `except RematError` (and
    `except InfeasibleBudgetError`) in user code sees remat's error from `torch.compile`."""
    from remat.compat import ShortenTraceback

    if isinstance(error, ShortenTraceback):
        return error
    cls = _reraised_class(type(error))
    out = cls.__new__(cls)
    out.__dict__.update(error.__dict__)
    out.args = error.args
    out.first_useful_frame = None
    return out


@functools.lru_cache(maxsize=None)
def _reraised_class(cls: type) -> type:
    from remat.compat import ShortenTraceback

    return type(cls.__name__, (cls, ShortenTraceback), {"__module__": cls.__module__})


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of remat's and the solvers' source: a changed planner never reuses old plans."""
    from remat.compat import get_hash_for_files

    root = Path(__file__).resolve().parents[2]
    files = sorted(str(p) for d in ("remat", "solvers") for p in (root / d).rglob("*.py"))
    return get_hash_for_files(tuple(files)).hex()


def _device_fingerprint() -> str:
    """The device figures plans are costed with, to two significant digits."""
    speed = costs.device_speed("cpu")
    gpu = f"|{costs.device_key('cuda')}" if torch.cuda.is_available() else ""  # CUDA graphs: its own figures
    return (f"{costs.device_key('cpu')}|{speed.peak_flops_per_s:.2g}|"
            f"{speed.bandwidth_bytes_per_s:.2g}{gpu}")


__all__ = ["COMPILERS", "OUTPUTS", "PINNED_INDUCTOR_CONFIG", "RematBackend", "backend", "reraised_through_dynamo"]
