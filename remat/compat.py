"""The one door to torch's version-dependent API: what each supported torch has, and what
remat does where it is missing.

remat supports torch 2.11 through 2.14 (`SUPPORTED`; pyproject.toml's bounds say the
same, and CI runs the suite on the oldest, the pinned and the newest). Everything below
that differs between those versions goes through this module; code elsewhere asks it,
never `torch.__version__`. Where a feature cannot work on the torch at hand, remat raises
a `RematError` naming the feature and the torch it needs (a random op's `generator=` on
2.11: `TraceError`), and the rest keeps working.

| feature | 2.11 | 2.13, 2.14 | without it |
|---|---|---|---|
| `custom_graph_pass.CustomSchedulerPass` (inductor's pre/post-fusion passes) | absent | present | the passes subclass `CustomGraphPass`, which 2.11's scheduler calls and its cache keys alike (`scheduler_pass_base`) |
| `symbolic_shapes.optimization_hint` | absent | present | `symbolic_shapes.size_hint`, the same hint (`optimization_hint`) |
| an FSDP2 state's parameter groups | `_fsdp_param_group` (one or None) | `_fsdp_param_groups` (a list) | `fsdp_param_groups` reads either |
| AOTAutograd's backward takes its gradients in a list it clears (`CompiledFunction.boxed_grads_call`) | no: autograd holds every tangent to the backward's end | yes: a tangent dies after its last use | the problem holds every tangent to the end, and inductor's estimate counts tangents as held outside the graph (`releases_tangents`) |
| a random op's `generator=` argument traced by AOTAutograd | NotImplementedError | traced (2.13, 2.14) | `TraceError` naming the argument (`traces_generators`) |

Every private torch name the rest of remat uses is one of this module's names (a test
checks that no other module of remat imports one). Those in `_PRIVATE` are resolved on
first use, so importing remat imports no more of torch than the modules that use them
did; torch 2.11, 2.13 and 2.14 have all of them (`tests/integration/test_compat.py` resolves each on
the torch it runs on). Where a torch lacks one, using it raises `UnsupportedTorchError`
naming the feature that needs it and the torch versions that have it; the features that
do not need it keep working.

| name here | torch's name | 2.11–2.14 | without it, `UnsupportedTorchError` from |
|---|---|---|---|
| **AOTAutograd** | | | |
| `aot_module_simplified` | `torch._functorch.aot_autograd.aot_module_simplified` | present | tracing a model (every plan) |
| `BoxedCodeGen` | `torch.fx.graph._BoxedCodeGen` (the boxed calling convention of AOTAutograd's compilers) | present | tracing a model (every plan) |
| `functorch_config` | `torch._functorch.config` (`enable_autograd_cache`, `force_non_lazy_backward_lowering`, `donated_buffer`) | present | tracing a model (every plan) |
| `classify_nodes` | `torch._functorch.partitioners.classify_nodes` | present | the problem built from the joint graph (every plan) |
| `is_sym_node` | `torch._functorch.partitioners.is_sym_node` | present | the rewrite of the joint graph (every plan) |
| `extract_fwd_bwd_modules` | `torch._functorch.partitioners._extract_fwd_bwd_modules` | present | the rewrite of the joint graph (every plan) |
| **dynamo, export** | | | |
| `aot_autograd` | `torch._dynamo.backends.common.aot_autograd` | present | the torch.compile backend (`remat.backend`) |
| `ShortenTraceback` | `torch._dynamo.exc.ShortenTraceback` | present | the torch.compile backend (`remat.backend`) |
| `UserError` | `torch._dynamo.exc.UserError` | present | tracing a model (every plan) |
| `compiling_state_context` | `torch._export.utils._compiling_state_context` | present | tracing a model whose eager path branches on tensor values |
| **inductor** | | | |
| `CustomPartitionerFn` | `torch._inductor.custom_graph_pass.CustomPartitionerFn` | present | the inductor backend (`remat.backend(mode=...)`) |
| `get_hash_for_files` | `torch._inductor.custom_graph_pass.get_hash_for_files` | present | the inductor backend (`remat.backend(mode=...)`) |
| `list_mode_options` | `torch._inductor.list_mode_options` | present | the inductor backend (`remat.backend(mode=...)`) |
| `compile_fx` | `torch._inductor.compile_fx.compile_fx` | present | the inductor backend (`remat.backend(mode=...)`) |
| `compile_fx_inner` | `torch._inductor.compile_fx.compile_fx_inner` | present | inductor's estimate of a plan's peak; the inductor random-op cost |
| `inductor_config` | `torch._inductor.config` | present | inductor's estimate of a plan's peak |
| `GraphLowering` | `torch._inductor.graph.GraphLowering` | present | inductor's estimate of a plan's peak |
| `inductor_cache_dir` | `torch._inductor.runtime.cache_dir_utils.cache_dir` | present | the plan store beside inductor's cache |
| `inductor_wrapper` | `torch._inductor.codegen.wrapper` (its `*Line` classes) | present | the walk of inductor's generated code |
| `inductor_ir` | `torch._inductor.ir` | present | the walk of inductor's generated code |
| `V` | `torch._inductor.virtualized.V` | present | the walk of inductor's generated code; the fusion-aware peak |
| `inductor_memory` | `torch._inductor.memory` | present | the fusion-aware peak (inductor's scheduler) |
| `NopKernelSchedulerNode` | `torch._inductor.scheduler.NopKernelSchedulerNode` | present | the fusion-aware peak (inductor's scheduler) |
| `OrderedSet` | `torch.utils._ordered_set.OrderedSet` | present | the fusion-aware peak (inductor's scheduler) |
| `inductor_prims` | `torch._inductor.inductor_prims` (registers `prims.inductor_random`) | present | the inductor random-op cost |
| **tracing context** | | | |
| `detect_fake_mode` | `torch._guards.detect_fake_mode` | present | the torch.compile backend; FLOP counts of decomposed ops; compiled offload |
| `TracingContext` | `torch._guards.TracingContext` | present | inductor's estimate of a plan's peak |
| `tracing` | `torch._guards.tracing` | present | the inductor random-op cost |
| **fake tensors** | | | |
| `FakeTensor` | `torch._subclasses.fake_tensor.FakeTensor` | present | planning on a fake model; the compiled step's ledger |
| `FakeTensorMode` | `torch._subclasses.fake_tensor.FakeTensorMode` | present | planning on a fake model; the trace-time layout check |
| `is_fake` | `torch._subclasses.fake_tensor.is_fake` | present | memory measurement |
| `unset_fake_temporarily` | `torch._subclasses.fake_tensor.unset_fake_temporarily` | present | cost and workspace measurement |
| `torch_decomp_decompositions` | `torch._subclasses.fake_tensor.torch_decomp_decompositions` | present | the trace-time layout check |
| `DynamicOutputShapeException` | `torch._subclasses.fake_tensor.DynamicOutputShapeException` | present | tracing a model (every plan) |
| `DataDependentOutputException` | `torch._subclasses.fake_tensor.DataDependentOutputException` | present | tracing a model (every plan) |
| **symbolic shapes, fx.experimental** | | | |
| `free_symbols` | `torch.fx.experimental.symbolic_shapes.free_symbols` | present | the torch.compile backend (`remat.backend`) |
| `statically_known_true` | `torch.fx.experimental.symbolic_shapes.statically_known_true` | present | the in-place gradient-sum rewrite (every plan) |
| `GuardOnDataDependentSymNode` | `torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode` | present | tracing a model (every plan) |
| `make_fx` | `torch.fx.experimental.proxy_tensor.make_fx` | present | the inductor random-op cost |
| **dispatch, ops** | | | |
| `TorchDispatchMode` | `torch.utils._python_dispatch.TorchDispatchMode` | present | FLOP counting and memory measurement (every plan) |
| `disable_current_modes` | `torch.utils._python_dispatch._disable_current_modes` | present | host offload; cost measurement |
| `OpOverload` | `torch._ops.OpOverload` | present | profiling the joint graph (every plan) |
| `HigherOrderOperator` | `torch._ops.HigherOrderOperator` | present | profiling the joint graph (every plan) |
| `DispatchKey` | `torch._C.DispatchKey` | present | FLOP counting (every plan) |
| `decomposition_table` | `torch._decomp.decomposition_table` | present | the trace-time layout check |
| `suggest_memory_format` | `torch._prims_common.suggest_memory_format` | present | the trace-time layout check |
| **storages** | | | |
| `storage_expired` | `torch.UntypedStorage._expired` | present | the compiled step's ledger (its measured peak) |
| `storage_free_weak_ref` | `torch.UntypedStorage._free_weak_ref` | present | the compiled step's ledger (its measured peak) |
| **profiler** | | | |
| `profiler_enabled()` | `torch.autograd.profiler._is_profiler_enabled` | present | workspace measurement |
| **CUDA** | | | |
| `clear_cublas_workspaces()` | `torch._C._cuda_clearCublasWorkspaces` | present in CUDA builds | measuring the CUDA libraries' workspaces |
| `profiler_event_tree(prof)` | `prof.profiler.kineto_results.experimental_event_tree()` | present | the profiler's measured peak (`torch.compile`); workspace measurement |
| **distributed, FSDP2** | | | |
| `get_default_store` | `torch.distributed.distributed_c10d._get_default_store` | present | the plan exchange between ranks (a distributed plan) |
| `fsdp_state_refs()` | `torch.distributed._composable_state._module_state_mapping` (filled once `torch.distributed.fsdp._fully_shard._fsdp_state` is loaded) | present | the compiled step's ledger of an FSDP2 (`fully_shard`) model |

Not routed here: `torch.utils._pytree` (`tree_flatten`, `tree_map`, `tree_leaves`: the
same in 2.11–2.14 and used by torch's own public APIs as if public; torch has no public
`torch.utils.pytree` in these versions), private attributes read on objects torch hands
remat (`storage._cdata`, `storage._weak_ref()` in the step ledger's hot loop,
`module._parameters`, `op._schema`, FSDP2's `FSDPParam` fields, read with `getattr`
defaults where a version may lack them; inductor's objects reached through `V`, such as
`V.graph.sizevars.optimization_hint`, the same in 2.11–2.14) and `torch.ops.*` operator
names.
"""

from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

import torch

from remat.errors import UnsupportedTorchError

SUPPORTED = ((2, 11), (2, 14))
"""The oldest and the newest torch (major, minor) remat is tested on."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of `version` (default: the installed torch), e.g. "2.11.0+cu130"."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def at_least(major: int, minor: int) -> bool:
    return torch_version() >= (major, minor)


@functools.lru_cache(maxsize=1)
def scheduler_pass_base() -> type:
    """The base class of inductor's pre-/post-fusion scheduler passes: torch's
    `CustomSchedulerPass` where it exists (2.13, 2.14), else `CustomGraphPass` (torch 2.11's
    scheduler calls the pass on its node list whatever its class, and its FX-graph cache
    keys a `CustomGraphPass` by its uuid, where it bypasses the cache for any other)."""
    from torch._inductor import custom_graph_pass

    return getattr(custom_graph_pass, "CustomSchedulerPass", custom_graph_pass.CustomGraphPass)


def optimization_hint(value: Any, fallback: int = 4096) -> int:
    """The hint of a symbolic size (its example value), without guarding on it; a size
    with no hint (data-dependent) counts as `fallback`."""
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or symbolic_shapes.size_hint
    return int(hint(value, fallback=fallback))


def fsdp_param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: `_fsdp_param_groups` (2.13, 2.14: a list), or 2.11's
    single `_fsdp_param_group` (None when the module holds no parameters of its own)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def releases_tangents() -> bool:
    """Whether AOTAutograd's compiled backward frees a gradient input (a tangent) after its
    last use: 2.13 and 2.14 pass the gradients boxed, in a list the backward's prologue
    clears (`CompiledFunction.boxed_grads_call`); 2.11 passes them as arguments, which
    autograd holds until the backward returns (measured: the 65,536 B zero tangent of a
    dropped output held to the end)."""
    return at_least(2, 13)


def traces_generators() -> bool:
    """Whether AOTAutograd traces a random op called with an explicit `generator=`
    (torch 2.11 raises NotImplementedError: "argument of type: <class 'torch._C.Generator'>";
    2.13 and 2.14 trace it and remat saves the op's output, never replaying it)."""
    return at_least(2, 13)


_ALWAYS = "torch 2.11 to 2.14 have it"

# name here -> (torch's module:attribute, the feature that needs it); attribute "" is the
# module itself. Grouped as the table above.
_PRIVATE: dict[str, tuple[str, str]] = {
    # AOTAutograd
    "aot_module_simplified": ("torch._functorch.aot_autograd:aot_module_simplified", "tracing a model"),
    "BoxedCodeGen": ("torch.fx.graph:_BoxedCodeGen", "tracing a model"),
    "functorch_config": ("torch._functorch.config:", "tracing a model"),
    "classify_nodes": ("torch._functorch.partitioners:classify_nodes", "the problem built from the joint graph"),
    "is_sym_node": ("torch._functorch.partitioners:is_sym_node", "the rewrite of the joint graph"),
    "extract_fwd_bwd_modules": ("torch._functorch.partitioners:_extract_fwd_bwd_modules",
                                "the rewrite of the joint graph"),
    # dynamo, export
    "aot_autograd": ("torch._dynamo.backends.common:aot_autograd", "the torch.compile backend"),
    "ShortenTraceback": ("torch._dynamo.exc:ShortenTraceback", "the torch.compile backend"),
    "UserError": ("torch._dynamo.exc:UserError", "tracing a model"),
    "compiling_state_context": ("torch._export.utils:_compiling_state_context",
                                "tracing a model whose eager path branches on tensor values"),
    # inductor
    "CustomPartitionerFn": ("torch._inductor.custom_graph_pass:CustomPartitionerFn", "the inductor backend"),
    "get_hash_for_files": ("torch._inductor.custom_graph_pass:get_hash_for_files", "the inductor backend"),
    "list_mode_options": ("torch._inductor:list_mode_options", "the inductor backend"),
    "compile_fx": ("torch._inductor.compile_fx:compile_fx", "the inductor backend"),
    "compile_fx_inner": ("torch._inductor.compile_fx:compile_fx_inner",
                         "inductor's estimate of a plan's peak and the inductor random-op cost"),
    "inductor_config": ("torch._inductor.config:", "inductor's estimate of a plan's peak"),
    "GraphLowering": ("torch._inductor.graph:GraphLowering", "inductor's estimate of a plan's peak"),
    "inductor_cache_dir": ("torch._inductor.runtime.cache_dir_utils:cache_dir",
                           "the plan store beside inductor's cache"),
    "inductor_wrapper": ("torch._inductor.codegen.wrapper:", "the walk of inductor's generated code"),
    "inductor_ir": ("torch._inductor.ir:", "the walk of inductor's generated code"),
    "V": ("torch._inductor.virtualized:V", "the walk of inductor's generated code and the fusion-aware peak"),
    "inductor_memory": ("torch._inductor.memory:", "the fusion-aware peak"),
    "NopKernelSchedulerNode": ("torch._inductor.scheduler:NopKernelSchedulerNode", "the fusion-aware peak"),
    "OrderedSet": ("torch.utils._ordered_set:OrderedSet", "the fusion-aware peak"),
    "inductor_prims": ("torch._inductor.inductor_prims:", "the inductor random-op cost"),
    # tracing context
    "detect_fake_mode": ("torch._guards:detect_fake_mode",
                         "the torch.compile backend, FLOP counts of decomposed ops and compiled offload"),
    "TracingContext": ("torch._guards:TracingContext", "inductor's estimate of a plan's peak"),
    "tracing": ("torch._guards:tracing", "the inductor random-op cost"),
    # fake tensors
    "FakeTensor": ("torch._subclasses.fake_tensor:FakeTensor",
                   "planning on a fake model and the compiled step's ledger"),
    "FakeTensorMode": ("torch._subclasses.fake_tensor:FakeTensorMode",
                       "planning on a fake model and the trace-time layout check"),
    "is_fake": ("torch._subclasses.fake_tensor:is_fake", "memory measurement"),
    "unset_fake_temporarily": ("torch._subclasses.fake_tensor:unset_fake_temporarily",
                               "cost and workspace measurement"),
    "torch_decomp_decompositions": ("torch._subclasses.fake_tensor:torch_decomp_decompositions",
                                    "the trace-time layout check"),
    "DynamicOutputShapeException": ("torch._subclasses.fake_tensor:DynamicOutputShapeException",
                                    "tracing a model"),
    "DataDependentOutputException": ("torch._subclasses.fake_tensor:DataDependentOutputException",
                                     "tracing a model"),
    # symbolic shapes, fx.experimental
    "free_symbols": ("torch.fx.experimental.symbolic_shapes:free_symbols", "the torch.compile backend"),
    "statically_known_true": ("torch.fx.experimental.symbolic_shapes:statically_known_true",
                              "the in-place gradient-sum rewrite"),
    "GuardOnDataDependentSymNode": ("torch.fx.experimental.symbolic_shapes:GuardOnDataDependentSymNode",
                                    "tracing a model"),
    "make_fx": ("torch.fx.experimental.proxy_tensor:make_fx", "the inductor random-op cost"),
    # dispatch, ops
    "TorchDispatchMode": ("torch.utils._python_dispatch:TorchDispatchMode",
                          "FLOP counting and memory measurement"),
    "disable_current_modes": ("torch.utils._python_dispatch:_disable_current_modes",
                              "host offload and cost measurement"),
    "OpOverload": ("torch._ops:OpOverload", "profiling the joint graph"),
    "HigherOrderOperator": ("torch._ops:HigherOrderOperator", "profiling the joint graph"),
    "DispatchKey": ("torch._C:DispatchKey", "FLOP counting"),
    "decomposition_table": ("torch._decomp:decomposition_table", "the trace-time layout check"),
    "suggest_memory_format": ("torch._prims_common:suggest_memory_format", "the trace-time layout check"),
    # storages
    "storage_expired": ("torch:UntypedStorage._expired", "the compiled step's ledger"),
    "storage_free_weak_ref": ("torch:UntypedStorage._free_weak_ref", "the compiled step's ledger"),
    # distributed
    "get_default_store": ("torch.distributed.distributed_c10d:_get_default_store",
                          "the plan exchange between ranks"),
}


def _unsupported(feature: str, api: str, cause: BaseException | None = None) -> UnsupportedTorchError:
    found = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return UnsupportedTorchError(
        f"{feature} needs torch's `{api}`, which torch {torch.__version__} does not have{found}; "
        f"{_ALWAYS}: install one of them to use it")


def __getattr__(name: str) -> Any:
    """A name of `_PRIVATE`, looked up in torch at each import of it (not kept here: a
    name torch's own module has patched, as a test's spy on `compile_fx`, is what remat
    gets)."""
    if name not in _PRIVATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    api, feature = _PRIVATE[name]
    module_name, _, path = api.partition(":")
    try:
        value = importlib.import_module(module_name)
        for attribute in path.split(".") if path else ():
            value = getattr(value, attribute)
    except (ImportError, AttributeError) as e:
        raise _unsupported(feature, api.replace(":", ".").rstrip("."), e) from e
    return value


def profiler_enabled() -> bool:
    """Whether a torch profiler session is recording in this process."""
    enabled = getattr(torch.autograd.profiler, "_is_profiler_enabled", None)
    if enabled is None:
        raise _unsupported("workspace measurement", "torch.autograd.profiler._is_profiler_enabled")
    return bool(enabled)


def clear_cublas_workspaces() -> None:
    """Free the cuBLAS and cuBLASLt workspaces torch holds per (handle, stream); the next
    matmul on a stream allocates its own again."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        raise _unsupported("measuring the CUDA libraries' workspaces", "torch._C._cuda_clearCublasWorkspaces")
    clear()


def profiler_event_tree(prof: Any) -> list[Any]:
    """The root events of a finished `torch.profiler.profile` session (each with its
    `children`; allocator events carry `extra_fields.alloc_size`)."""
    results = prof.profiler.kineto_results
    tree = getattr(results, "experimental_event_tree", None)
    if tree is None:
        raise _unsupported("measuring memory with the profiler",
                           "_ProfilerResult.experimental_event_tree")
    return list(tree())


_FSDP_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"


def fsdp_state_refs() -> list[Any]:
    """Weak references to the FSDP2 (`fully_shard`) states of this process (torch's
    composable-state registry); empty while FSDP2 is not loaded, without loading it."""
    if _FSDP_STATE_MODULE not in sys.modules:
        return []
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError as e:
        raise _unsupported("the compiled step's ledger of an FSDP2 model",
                           "torch.distributed._composable_state._module_state_mapping") from e
    return list(_module_state_mapping.values())


__all__ = ["SUPPORTED", "at_least", "clear_cublas_workspaces", "fsdp_param_groups", "fsdp_state_refs", "optimization_hint",
           "profiler_enabled", "profiler_event_tree", "releases_tangents", "scheduler_pass_base",
           "torch_version", "traces_generators", *_PRIVATE]
