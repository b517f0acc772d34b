"""Inductor fuses only neighbours in remat's order, so remat's memory model stays true.

remat plans with `solvers.simulate`: ops run one by one in the order remat emits, each
value allocated when produced and freed after its last use. Inductor's scheduler then
fuses any two kernels that read a common buffer, wherever they sit in the graph, and runs
the fused kernel where the first of them was: a recomputation remat placed just before
its use in layer 1 runs with its twin from layer 2 (they read the same input), and its
result lives across everything in between. That is the overrun measured under inductor
at tight budgets (inductor's own comment on `Scheduler.are_long_distant_nodes` names
this case, "recomputed nodes from different checkpointed regions get fused", though
nothing in torch 2.13 calls it).

Measured, GPT-2 tiny at 5.44 MiB (47.9% of its no-remat peak), profiler events:
- inductor's fusion: backward estimate (inductor's `memory.estimate_peak_memory`) 4.48
  MiB before fusion, 6.03 after; the step measured 6,027,072 B, 322,819 B over budget;
- neighbour-only fusion (this module): estimate 4.84 MiB after fusion; measured 5,656,377 B,
  under the budget and under remat's prediction (5,704,009 B);
- at 100%, the same step time (interleaved medians 113 ms vs 97 ms, 143 vs 146 kernels).

The rule: two scheduler nodes fuse only when nothing that allocates runs between them
in the order inductor lowered (remat's order), so every fused kernel covers a run of
consecutive ops and the order is kept. Inductor still decides which neighbours to fuse,
and its other checks (legality, cycles, profitability) all still apply.

Installed per compile through inductor's `_pre_fusion_custom_pass` config (a
`CustomSchedulerPass`, so torch's FX-graph cache keys on its uuid); it wraps `can_fuse`
on that compile's scheduler object only. A post-fusion pass records inductor's own
estimate of each graph's peak before and after fusion for the summary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

FUSION_MODES = ("neighbours", "inductor")
"""`neighbours`: fuse only consecutive ops (the default; the order and remat's memory
model hold). `inductor`: inductor's own fusion, unrestricted (may exceed the budget)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionEstimate:
    """Inductor's own estimate of one compiled graph's peak (`torch._inductor.memory`):
    graph inputs count until their last use, parameters and what lives outside the graph
    do not, so it is comparable between the two columns, not to a step's peak."""

    graph: str
    """"forward" or "backward"."""
    before_fusion_bytes: int
    after_fusion_bytes: int


def _estimate_bytes(nodes: list[Any]) -> int:
    from torch._inductor import memory
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet

    scheduler = nodes[0].scheduler
    peak, _ = memory.prepare_planning_info(
        list(nodes), scheduler.name_to_buf, scheduler.name_to_fused_node,
        OrderedSet(V.graph.graph_inputs.keys()), OrderedSet(V.graph.get_output_names()))
    return int(peak)


def _neighbours_only(can_fuse: Callable[..., bool], allocation_free: frozenset[int]) -> Callable[..., bool]:
    """`can_fuse` restricted to nodes with nothing that allocates between them (their
    `min_order`/`max_order`: positions in the order before fusion)."""

    def restricted(node1: Any, node2: Any, *args: Any, **kwargs: Any) -> bool:
        first, second = sorted((node1, node2), key=lambda n: n.min_order)
        if second.min_order <= first.max_order:
            return False  # interleaved groups: fusing them would reorder
        between = range(first.max_order + 1, second.min_order)
        if any(order not in allocation_free for order in between):
            return False
        return can_fuse(node1, node2, *args, **kwargs)

    return restricted


@functools.lru_cache(maxsize=1)
def _pass_classes() -> tuple[type, type]:
    from torch._inductor.custom_graph_pass import CustomSchedulerPass
    from torch._inductor.scheduler import NopKernelSchedulerNode

    class _Shared(CustomSchedulerPass):
        """Deep-copied as itself and pickled as its uuid (torch copies and pickles
        inductor's config; the record must reach the backend)."""

        def __init__(self, uuid: str, record: list[Any]) -> None:
            self._uuid = uuid
            self.record = record

        def uuid(self) -> str:
            return self._uuid

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            return self

        def __reduce__(self) -> tuple[Any, ...]:
            return (str, (self._uuid,))

    class BeforeFusion(_Shared):
        def __init__(self, uuid: str, record: list[Any], *, restrict: bool) -> None:
            super().__init__(uuid, record)
            self.restrict = restrict
            self.pending_bytes: int | None = None

        def __call__(self, nodes: list[Any]) -> list[Any]:
            if not nodes:
                return nodes
            self.pending_bytes = _estimate_bytes(nodes)
            if self.restrict:
                scheduler = nodes[0].scheduler  # this compile's scheduler object only
                free = frozenset(n.min_order for n in nodes if isinstance(n, NopKernelSchedulerNode))
                scheduler.can_fuse = _neighbours_only(scheduler.can_fuse, free)
            return nodes

    class AfterFusion(_Shared):
        def __init__(self, uuid: str, record: list[Any], *, before: BeforeFusion,
                     stop: type[Exception] | None = None) -> None:
            super().__init__(uuid, record)
            self.before = before
            self.stop = stop

        def __call__(self, nodes: list[Any]) -> list[Any]:
            from torch._inductor.virtualized import V

            before, self.before.pending_bytes = self.before.pending_bytes, None
            if nodes and before is not None:
                graph = "backward" if V.graph.is_backward else "forward"
                self.record.append(FusionEstimate(graph=graph, before_fusion_bytes=before,
                                                  after_fusion_bytes=_estimate_bytes(nodes)))
            if self.stop is not None:
                raise self.stop  # an estimate only (remat.runtime.inductor.estimate)
            return nodes

    return BeforeFusion, AfterFusion


def fusion_passes(mode: str, record: list[Any], *, stop: type[Exception] | None = None) -> dict[str, Any]:
    """Inductor config entries installing the fusion rule of `mode` (see FUSION_MODES)
    and appending a `FusionEstimate` to `record` for every graph compiled; `stop`: raised
    right after fusion (to estimate without generating code)."""
    before_cls, after_cls = _pass_classes()
    uuid = f"remat-fusion-{mode}"
    before = before_cls(uuid, record, restrict=mode == "neighbours")
    return {"_pre_fusion_custom_pass": before,
            "_post_fusion_custom_pass": after_cls(uuid, record, before=before, stop=stop)}


__all__ = ["FUSION_MODES", "FusionEstimate", "fusion_passes"]
