"""What `DistributedDataParallel` holds during a step that no compiled graph sees.

DDP's reducer allocates, when the DDP module is built, flat bucket buffers for every
gradient it all-reduces: as many bytes as the parameters that require grad. They live as
long as the DDP module, outside every graph that `torch.compile(DDP(model))` hands the
backend (DDPOptimizer's bucket graphs take the parameters, never the buckets), and the
gradients are copied into them after each backward. With `gradient_as_bucket_view=True`
the reducer makes each gradient a view of its bucket instead (the gradient a backward
computes is copied in and freed): those gradients take no bytes beyond the buckets, and
the ledger counts them once, as buckets (`grads_in_buckets`).

`DdpState` finds the DDP modules whose parameters a graph call takes (once per ledger,
through the garbage collector: DDP keeps no registry) and gives their bucket bytes.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from remat.runtime.step.storages import key


class DdpState:
    """The DDP modules of one model, found from the parameters its graphs take."""

    def __init__(self) -> None:
        self._modules: list[weakref.ref] = []
        self._looked = False

    def discover(self, args: Sequence[Any]) -> None:
        """Find the DDP modules wrapping a graph call's parameters (once, when a process
        group is up: DDP needs one)."""
        if self._looked or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        keys = {key(a) for a in args if isinstance(a, torch.nn.Parameter)}
        if not keys:
            return
        self._looked = True
        for obj in gc.get_objects():
            # type(), not isinstance: a dead weak proxy among the objects raises on __class__
            if issubclass(type(obj), DistributedDataParallel) and any(
                    key(p) in keys for p in obj.module.parameters()):
                self._modules.append(weakref.ref(obj))

    def grads_in_buckets(self) -> frozenset[int]:
        """Storage keys of the parameters whose gradients are views of their DDP module's
        buckets (`gradient_as_bucket_view=True`): counted in `bucket_bytes`, not again
        as gradients."""
        keys = set()
        for ref in self._modules:
            module = ref()
            if module is not None and module.gradient_as_bucket_view:
                keys |= {key(p) for p in module.module.parameters() if p.requires_grad}
        return frozenset(keys)

    def bucket_bytes(self) -> int:
        """Bytes of the reducer's bucket buffers of every live DDP module found."""
        total = 0
        for ref in self._modules:
            module = ref()
            if module is not None:
                total += sum(p.numel() * p.element_size() for p in module.module.parameters() if p.requires_grad)
        return total
