"""Repeated-layer structure of a problem, as data: which forward node ran in which layer.

The torch front end finds the layers (remat/frontend/find_layers.py reads `nn_module_stack`:
the children `h.0`, `h.1`, ... of one ModuleList); solvers read them from
`Problem.layers` and never guess them. A layer is a contiguous run of forward ids.

Values *shared* between layers (the causal mask or the rotary tables that the model
builds once and every layer reads) are what keeps a layer stack from being a sequence of
independent blocks: `shared_values` names them, so that a solver can keep them (SAVE)
and treat the rest layer by layer.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a cycle at run time: problem.py holds a LayerStructure field
    from remat_solvers.problem import Problem

OUTSIDE = -1
"""layer_of value of a node that ran in no repeated layer (embeddings, head, loss, backward)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerStructure:
    """The repeated layers of a joint graph."""

    layer_of: tuple[int, ...]
    """Per problem node id: the index of the layer it ran in (0-based, forward order),
    or OUTSIDE. Only forward nodes carry a layer."""
    names: tuple[str, ...]
    """Per layer: its module path (e.g. 'transformer.h.3')."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_of", tuple(self.layer_of))
        object.__setattr__(self, "names", tuple(self.names))
        n = len(self.names)
        bad = [k for k in self.layer_of if not isinstance(k, int) or not OUTSIDE <= k < n]
        if bad:
            raise ValueError(f"layer_of values must be ints in -1..{n - 1}, got {bad[:5]}")
        last = OUTSIDE
        for k in self.layer_of:  # layers run one after the other (ids are topological)
            if k != OUTSIDE:
                if k < last:
                    raise ValueError(f"layer {k} runs after layer {last}: layers must be contiguous "
                                     "runs in forward order")
                last = k

    @property
    def n_layers(self) -> int:
        return len(self.names)

    def segments(self) -> tuple[tuple[int, int], ...]:
        """Per layer: (first, last) node id it contains (inclusive)."""
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for i, k in enumerate(self.layer_of):
            if k != OUTSIDE:
                first.setdefault(k, i)
                last[k] = i
        return tuple((first[k], last[k]) for k in range(self.n_layers) if k in first)

    def shared_values(self, problem: Problem) -> frozenset[int]:
        """Forward decision values (and every value on the same storage) read by forward
        nodes of two or more layers other than their own: the residual stream that
        layer k hands to layer k+1 is not shared; a mask built once and read by every
        layer is."""
        if len(self.layer_of) != len(problem.nodes):
            raise ValueError(f"layer structure covers {len(self.layer_of)} nodes, problem has "
                             f"{len(problem.nodes)}")
        root = problem.storage_of
        readers: dict[int, set[int]] = {}
        for i in problem.forward_ids:
            k = self.layer_of[i]
            if k == OUTSIDE:
                continue
            for j in problem.nodes[i].inputs:
                for s in (j, root[j]):
                    if self.layer_of[s] != k:
                        readers.setdefault(s, set()).add(k)
        shared_roots = {root[s] for s, layers in readers.items() if len(layers) >= 2}
        return frozenset(v for v in problem.decision_ids if root[v] in shared_roots)
