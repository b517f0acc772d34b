"""Inductor's fusion kept to what remat's memory model allows.

remat plans with `remat_solvers.simulate`: ops run one by one in the order remat emits, each
value allocated when produced and freed after its last use. Inductor's scheduler then
fuses any two kernels that read a common buffer, wherever they sit in the graph, and runs
the fused kernel where the first of them was: a recomputation remat placed just before
its use in layer 1 runs with its twin from layer 2 (they read the same input), and its
result lives across everything in between. That is the overrun measured under inductor
at tight budgets (inductor's own comment on `Scheduler.are_long_distant_nodes` names
this case, "recomputed nodes from different checkpointed regions get fused", though
nothing in torch 2.13 calls it).

On GPT-2 tiny at 5.44 MiB (47.9% of its no-remat peak), by the profiler's events, the
step under inductor's fusion peaks 322,819 B over the budget; under neighbour-only fusion
it stays under the budget and under remat's prediction.

The rules (`FUSION_MODES`):
- `neighbours`: two scheduler nodes fuse only when nothing that allocates runs between
  them in the order inductor lowered (remat's order), so every fused kernel covers a run
  of consecutive ops and the order is kept.
- `peak` (the backend's default): neighbours, and kernels further apart when moving the
  later one (and what it needs from in between) up to the first one's place keeps every
  position under the graph's own peak before fusion, by inductor's estimate
  (`_PeakGuard`). Neighbours only cost LLaMA's bench forward about 5% against
  torch.compile at a 100% budget, though most of the kernels it does not join run where
  the forward is far below its peak (its saved activations pile up to its end). With
  `peak`, LLaMA's bench forward ends fusion with as many scheduler nodes as inductor's
  own fusion, and the plans' measured peaks still equal their predictions (the closed
  loop reads the code generated under the same rule); bench/README.md, "Fusion rules".
- `inductor`: inductor's own rule, unrestricted (may exceed the budget).
Inductor still decides which allowed pairs to fuse, and its other checks (legality,
cycles, profitability) all still apply.

Installed per compile through inductor's `_pre_fusion_custom_pass` config (a
`CustomSchedulerPass` where torch has it, so torch's FX-graph cache keys on its uuid;
`remat.compat.scheduler_pass_base`); it wraps `can_fuse`
and `fuse_two_nodes` on that compile's scheduler object only. A post-fusion pass records
inductor's own estimate of each graph's peak before and after fusion for the summary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

# inductor's scheduler classes come from remat.compat inside each function: torch._inductor's
# scheduler and memory modules load when a graph is compiled, not with remat.

FUSION_MODES = ("peak", "neighbours", "inductor")
"""`peak` (the default): neighbours, and kernels further apart when moving the later one up
keeps every position under the graph's estimated peak before fusion (`_PeakGuard`).
`neighbours`: fuse only consecutive ops. `inductor`: inductor's own fusion, unrestricted
(may exceed the budget)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusionEstimate:
    """Inductor's own estimate of one compiled graph's peak (`torch._inductor.memory`):
    graph inputs count until their last use, parameters and what lives outside the graph
    do not, so it is comparable between the two columns, not to a step's peak."""

    graph: str
    """"forward" or "backward"."""
    before_fusion_bytes: int
    after_fusion_bytes: int


def _estimate(nodes: list[Any]) -> tuple[int, list[int]]:
    """Inductor's estimate (`torch._inductor.memory`) of the graph's peak and of the bytes
    live at each position of `nodes`, after its allocations (its last entry: after them
    all)."""
    from remat.compat import OrderedSet, V
    from remat.compat import inductor_memory as memory

    scheduler = nodes[0].scheduler
    outputs = OrderedSet(V.graph.get_output_names())
    _, freeable = memory.prepare_planning_info(
        list(nodes), scheduler.name_to_buf, scheduler.name_to_fused_node,
        OrderedSet(V.graph.graph_inputs.keys()), outputs)
    peak, live = memory.estimate_peak_memory(nodes, freeable, outputs)
    return int(peak), live


def _allocated(node: Any) -> dict[str, int]:
    """What running `node` allocates, by the storage's name: each output's bytes, but for
    an output written into another buffer (a `cat`'s input lowered as a write into its
    slice, `NonOwningLayout`) that whole buffer, which the generated code allocates
    before its first writer runs; inductor's estimate counts the slice only, where the
    buffer's own (nop) node sits after all its writers. Counted by the slice, one kernel
    that writes the first slice of many `cat`s (ViT's class token beside its recomputed
    patch embeddings) looks cheap to move early, and allocates every one of them there."""
    from remat.compat import V
    from remat.compat import inductor_ir as ir

    out: dict[str, int] = {}
    for i, buf in enumerate(node.get_outputs()):
        layout = getattr(getattr(buf, "node", None), "layout", None)
        if isinstance(layout, ir.NonOwningLayout):
            base = V.graph.try_get_buffer(layout.view.get_name())
            if base is not None:
                size = V.graph.sizevars.optimization_hint(base.get_numel(), fallback=0)
                out[base.get_name()] = max(int(size) * base.get_dtype().itemsize, buf.mpi_buffer.size_alloc)
                continue
        out[f"{node.get_name()}:{i}"] = buf.mpi_buffer.size_alloc
    return out


class _PeakGuard:
    """Fusions of kernels far apart that keep the graph's estimated peak.

    A fused kernel runs where the first of its parts ran (inductor sorts fused nodes by
    `min_order`, then its topological sort pulls up whatever the later part needs that ran
    in between), so what the later part and those ancestors allocate is live from there
    on. `live[t]`: inductor's estimate (`torch._inductor.memory`) of the bytes live at
    position t of the order before fusion, after t's allocations; a fusion is allowed when,
    with those allocations moved up (and those of the fusions already made), no position in
    between goes over the graph's peak before fusion. Frees that move up are not counted
    (the estimate only grows), nor buffers that fusion removes."""

    def __init__(self, nodes: list[Any], live: list[int]) -> None:
        self.live = live
        self.cap = max(live, default=0)
        self.where = {n.get_name(): (n.min_order, _allocated(n)) for n in nodes}

    def _extra(self, first: Any, second: Any) -> list[tuple[int, int]]:
        """(position, bytes that moving `second` up to `first` adds there), latest first;
        a buffer several moved nodes write into (a `cat`'s) counts once, from the latest."""
        names = {n.get_name() for n in second.get_nodes()} | set(second.ancestors)
        storages: dict[str, tuple[int, int]] = {}
        for name in names:
            where = self.where.get(name)
            if where is None or where[0] <= first.min_order:
                continue
            for storage, nbytes in (where[1] or {name: 0}).items():
                if storages.get(storage, (-1, 0))[0] < where[0]:
                    storages[storage] = (where[0], nbytes)
        moved = sorted(storages.values(), reverse=True)
        if not moved:  # a node not in the order before fusion: nothing known, nothing allowed
            return [(first.min_order, self.cap + 1)]
        out, extra, k = [], 0, 0
        for t in range(moved[0][0] - 1, first.min_order - 1, -1):
            while k < len(moved) and moved[k][0] > t:
                extra += moved[k][1]
                k += 1
            out.append((t, extra))
        return out

    def fits(self, first: Any, second: Any) -> bool:
        return all(self.live[t] + extra <= self.cap for t, extra in self._extra(first, second))

    def commit(self, first: Any, second: Any) -> None:
        for t, extra in self._extra(first, second):
            self.live[t] += extra


def _ordered(node1: Any, node2: Any) -> tuple[Any, Any]:
    first, second = sorted((node1, node2), key=lambda n: n.min_order)
    return first, second


def _restrict(scheduler: Any, allocation_free: frozenset[int], guard: _PeakGuard | None) -> None:
    """This scheduler's `can_fuse` restricted to nodes with nothing that allocates between
    them (their `min_order`/`max_order`: positions in the order before fusion) or, with a
    guard, to fusions that keep the peak; its `fuse_two_nodes` tells the guard."""
    can_fuse, fuse_two = scheduler.can_fuse, scheduler.fuse_two_nodes

    def neighbours(first: Any, second: Any) -> bool:
        between = range(first.max_order + 1, second.min_order)
        return all(order in allocation_free for order in between)

    def restricted(node1: Any, node2: Any, *args: Any, **kwargs: Any) -> bool:
        first, second = _ordered(node1, node2)
        if second.min_order <= first.max_order:
            return False  # interleaved groups: fusing them would reorder
        if not neighbours(first, second) and (guard is None or not guard.fits(first, second)):
            return False
        return can_fuse(node1, node2, *args, **kwargs)

    def fuse_two_nodes(node1: Any, node2: Any, *args: Any, **kwargs: Any) -> Any:
        first, second = _ordered(node1, node2)
        if guard is not None and not neighbours(first, second):
            guard.commit(first, second)
        return fuse_two(node1, node2, *args, **kwargs)

    scheduler.can_fuse = restricted
    scheduler.fuse_two_nodes = fuse_two_nodes


def _in_order(nodes: list[Any]) -> bool:
    """Whether each node's position is its `min_order` = `max_order` (the guard's
    positions are those of the estimate)."""
    return all(n.min_order == i == n.max_order for i, n in enumerate(nodes))


@functools.lru_cache(maxsize=1)
def _pass_classes() -> tuple[type, type]:
    from remat.compat import NopKernelSchedulerNode, scheduler_pass_base

    class _Shared(scheduler_pass_base()):
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
        def __init__(self, uuid: str, record: list[Any], *, mode: str) -> None:
            super().__init__(uuid, record)
            self.mode = mode
            self.pending_bytes: int | None = None

        def uuid(self) -> str:  # the closed loop may set the rule per plan (closed_loop.FALLBACK_RULES)
            return f"{self._uuid}-{self.mode}"

        def __call__(self, nodes: list[Any]) -> list[Any]:
            if not nodes:
                return nodes
            self.pending_bytes, live = _estimate(nodes)
            if self.mode != "inductor":
                guard = None
                if self.mode == "peak" and _in_order(nodes):
                    guard = _PeakGuard(nodes, live[:len(nodes)])
                free = frozenset(n.min_order for n in nodes if isinstance(n, NopKernelSchedulerNode))
                _restrict(nodes[0].scheduler, free, guard)  # this compile's scheduler object only
            return nodes

    class AfterFusion(_Shared):
        def __init__(self, uuid: str, record: list[Any], *, before: BeforeFusion,
                     stop: type[Exception] | None = None) -> None:
            super().__init__(uuid, record)
            self.before = before
            self.stop = stop

        def __call__(self, nodes: list[Any]) -> list[Any]:
            from remat.compat import V

            before, self.before.pending_bytes = self.before.pending_bytes, None
            if nodes and before is not None:
                graph = "backward" if V.graph.is_backward else "forward"
                self.record.append(FusionEstimate(graph=graph, before_fusion_bytes=before,
                                                  after_fusion_bytes=_estimate(nodes)[0]))
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
    before = before_cls(uuid, record, mode=mode)
    return {"_pre_fusion_custom_pass": before,
            "_post_fusion_custom_pass": after_cls(uuid, record, before=before, stop=stop)}


__all__ = ["FUSION_MODES", "FusionEstimate", "fusion_passes"]
