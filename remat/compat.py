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
| AOTAutograd's backward takes its gradients in a list it clears (`CompiledFunction.boxed_grads_call`) | no: autograd holds every tangent to the backward's end | yes: a tangent dies after its last use | the problem holds every tangent to the end (`releases_tangents`) |
| a random op's `generator=` argument traced by AOTAutograd | NotImplementedError | traced (2.13, 2.14) | `TraceError` naming the argument (`traces_generators`) |
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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


__all__ = ["SUPPORTED", "at_least", "fsdp_param_groups", "optimization_hint", "releases_tangents", "scheduler_pass_base", "torch_version", "traces_generators"]
