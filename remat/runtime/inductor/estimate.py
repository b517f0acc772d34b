"""What inductor's fusion adds to a plan's peak, read from inductor itself, before it runs.

Even with fusion kept to neighbours (`remat.runtime.inductor.fusion`), a fused kernel
is not op by op: it keeps every input of its run of ops until the run ends while it
writes the run's outputs, where `solvers.simulate` frees an input after its last op.
remat cannot see this in its own model, so it asks inductor: each planned graph is
lowered and scheduled by inductor (post-grad passes, lowering, fusion) and stopped
right after fusion, before any code is generated; inductor's memory estimator
(`torch._inductor.memory`) gives the graph's peak in the order before fusion and after.
The difference is what fusion adds; the backend replans under the budget minus it
(`RematBackend`, closed loop) and predicts remat's peak plus it.

Measured (Gated test model at its floor, tests/test_inductor_budget.py): inductor's
estimate rose 49,156 B with fusion; the step measured 49,932 B over remat's prediction.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from remat.runtime.inductor.fusion import FusionEstimate, fusion_passes

log = logging.getLogger(__name__)


class _Scheduled(Exception):
    """Raised by the estimating pass once inductor has fused: nothing more is needed."""


def _example_inputs(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _scheduled(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, _Scheduled):
            return True
        error = error.__cause__ or error.__context__
    return False


def estimate_fusion(graphs: Sequence[tuple[fx.GraphModule, bool]], *, fusion: str) -> tuple[FusionEstimate, ...]:
    """Inductor's peak estimate of each `(graph, is_backward)` before and after fusion,
    under the inductor config in force (the backend's compile), with `fusion`'s rule."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner

    record: list[FusionEstimate] = []
    for gm, is_backward in graphs:
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            graph = copy.deepcopy(gm)  # post-grad passes rewrite it in place
        passes = fusion_passes(fusion, record, stop=_Scheduled)
        try:
            with config.patch({**passes, "fx_graph_cache": False}):
                compile_fx_inner(graph, _example_inputs(graph), is_backward=is_backward)
        except Exception as e:  # inductor may wrap what the pass raised
            if not _scheduled(e):
                raise
    return tuple(record)


def fusion_excess_bytes(estimates: Sequence[FusionEstimate]) -> int:
    """How much fusion can raise the step's peak: each graph's peak rises by at most its
    own estimate's rise, and the step's peak is one graph's peak."""
    return max([0] + [e.after_fusion_bytes - e.before_fusion_bytes for e in estimates])




MAX_REPLANS = 3
"""Replans after the first plan; each lowers the target by the largest margin seen, so
the target only falls and the loop ends (measured: one replan on every model tried)."""


def plan_under_fusion(partitioner: Any, joint: fx.GraphModule, joint_inputs: Any, *, fusion: str,
                      **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Closed loop: plan, ask inductor what its fusion adds (`estimate_fusion`), and if
    remat's peak plus that margin is over the budget, plan again under the budget minus
    the margin. The step keeps the user's budget and records the margin."""
    import dataclasses

    from remat.budget import format_bytes
    from remat.errors import InfeasibleBudgetError

    fw, bw = partitioner(joint, joint_inputs, **kwargs)
    step = partitioner.step
    budget_bytes, margin, worst = step.budget_bytes, 0, 0
    for replan in range(MAX_REPLANS + 1):
        margin = fusion_excess_bytes(estimate_fusion(((fw, False), (bw, True)), fusion=fusion))
        worst = max(worst, margin)
        if step.evaluation.peak_bytes + margin <= budget_bytes:
            break
        if replan == MAX_REPLANS:
            partitioner.error = InfeasibleBudgetError(
                f"budget {format_bytes(budget_bytes)} does not hold under inductor's fusion: after "
                f"{MAX_REPLANS} replans remat's plan peaks at {format_bytes(step.evaluation.peak_bytes)} "
                f"and fusion adds {format_bytes(margin)}; raise the budget to at least "
                f"{step.evaluation.peak_bytes + margin} bytes or use compiler='eager'",
                budget_bytes=budget_bytes, min_peak_bytes=step.evaluation.peak_bytes + margin)
            raise partitioner.error
        partitioner.budget = budget_bytes - worst
        log.info("remat: inductor's fusion adds %d B to a plan peaking at %d B; replanning under %d B",
                 margin, step.evaluation.peak_bytes, partitioner.budget)
        try:
            fw, bw = partitioner(joint, joint_inputs, **kwargs)
        except InfeasibleBudgetError as e:
            partitioner.error = InfeasibleBudgetError(
                f"budget {format_bytes(budget_bytes)} does not hold under inductor's fusion, which adds "
                f"{format_bytes(worst)} to remat's peak here: the smallest reachable peak is "
                f"{format_bytes(e.min_peak_bytes + worst)}; raise the budget to at least "
                f"{e.min_peak_bytes + worst} bytes, or use compiler='eager' (op by op, no fusion)",
                budget_bytes=budget_bytes, min_peak_bytes=e.min_peak_bytes + worst)
            raise partitioner.error from None
        step = partitioner.step
    partitioner.step = dataclasses.replace(step, budget_bytes=budget_bytes, fusion_margin_bytes=margin)
    return fw, bw


__all__ = ["MAX_REPLANS", "estimate_fusion", "fusion_excess_bytes", "plan_under_fusion"]
