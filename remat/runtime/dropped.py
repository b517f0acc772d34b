"""`remat.backend(outputs="loss")`: the caller promised to drop every forward output but
the loss before backward (`loss = model(x).loss; loss.backward()`), so the plan holds them
to the forward's end only (`remat.frontend.problem.FORWARD_END`). This checks the promise
when each graph's backward begins: an output still held then (and not kept by the plan
for backward anyway) is memory the plan did not count, so the step stops with an error
that names it instead of silently running over the budget."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from remat.budget import format_bytes
from remat.errors import RematError


class DroppedOutputHeldError(RematError):
    """A forward output declared dropped (`outputs="loss"`) was still held when backward began."""


def watch(outputs: Sequence[Any], graph: int) -> None:
    """Check, when backward reaches this call's graph, that its outputs of more than one
    element are gone (the rule `build_problem(drop_outputs=True)` plans with)."""
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    # by storage: what the caller holds may be a view dynamo made of the graph's output
    dropped = [(k, StorageWeakRef(t.untyped_storage()), tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
               for k, t in enumerate(tensors) if t.numel() > 1]
    nodes = {id(t.grad_fn): t.grad_fn for t in tensors if t.grad_fn is not None and t.numel() == 1}
    if not dropped or not nodes:
        return

    def check(_grad_outputs: Any) -> None:
        held = [d for d in dropped if not d[1].expired()]
        if not held:
            return
        # what the plan saved for backward is counted (and alive) anyway
        kept = {StorageWeakRef(s.untyped_storage()) for node in nodes.values()
                for s in (getattr(node, "saved_tensors", ()) or ()) if isinstance(s, torch.Tensor)}
        held = [d for d in held if d[1] not in kept]
        if held:
            k, _, shape, dtype, nbytes = held[0]
            raise DroppedOutputHeldError(
                f"graph {graph}: output {k} ({dtype} {list(shape)}, {format_bytes(nbytes)}) is still "
                f"held when its backward begins ({len(held)} output(s) in all), but "
                "remat.backend(outputs=\"loss\") planned every output but the loss as dropped after "
                "the forward, so the budget does not count it; drop it before backward (e.g. "
                "`loss = model(x).loss; loss.backward()`), or build the backend with outputs=\"all\"")

    for node in nodes.values():
        node.register_prehook(check)
