"""Text writers: `summary` of a planned step (what was saved, recomputed, and why) and
`render` of a Report (the CLI's output)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from remat.budget import format_bytes
from remat.errors import RematError
from remat_solvers import Decision, Phase
from remat_solvers.prefetch import prefetched_ids

if TYPE_CHECKING:
    from remat.compile_backend import RematBackend
    from remat.partitioner import PlannedStep
    from remat.report.data import Report


def summary(step: "PlannedStep", *, top: int = 10) -> str:
    """Budget, baseline and predicted peak, where the peak is, recompute cost, counts,
    and the largest saved and recomputed values with their source lines."""
    gp, plan, ev = step.graph_problem, step.plan, step.evaluation
    problem = gp.problem
    nodes = problem.nodes
    lines = [
        f"remat plan ({plan.solver}, {plan.status.value}, solved in {plan.solve_s:.3f} s)",
        f"  budget:          {format_bytes(step.budget_bytes)}",
        f"  baseline peak:   {format_bytes(step.baseline_peak_bytes)}  (nothing recomputed)",
        f"  predicted peak:  {format_bytes(ev.peak_bytes)}"
        f"  ({100.0 * ev.peak_bytes / max(step.baseline_peak_bytes, 1):.1f}% of baseline)",
    ]
    if step.no_remat_margin_bytes is not None:
        lines.insert(3, f"  under inductor:  baseline {format_bytes(step.no_remat_peak_bytes)}, this plan "
                        f"{format_bytes(ev.peak_bytes + step.fusion_margin_bytes)} (generated code; "
                        "a percentage budget is of its baseline)")
    if 0 <= ev.peak_step < len(ev.steps):
        s = ev.steps[ev.peak_step]
        where = gp.source[s.node_id] or "no source line"
        lines.append(f"  peak at:         step {ev.peak_step} ({s.kind.value} {nodes[s.node_id].name}, {where})")
    flops_note = f"{ev.recompute_s * 1e3:.3f} ms estimated"
    lines.append(f"  recompute:       {len(ev.recomputed_ids)} values, {flops_note}")
    if ev.offload_bytes:
        lines.append(
            f"  offload:         {plan.count(Decision.OFFLOAD)} values, {format_bytes(ev.offload_bytes)} "
            f"each way, transfer {ev.transfer_s * 1e3:.3f} ms ({ev.hidden_transfer_s * 1e3:.3f} ms "
            f"hidden behind compute, {ev.offload_s * 1e3:.3f} ms exposed; "
            f"{len(prefetched_ids(problem, ev))} reloads prefetched)"
        )
    lines.append(
        f"  decisions:       {plan.count(Decision.SAVE)} saved, {plan.count(Decision.RECOMPUTE)} "
        f"recomputed-or-dropped, {plan.count(Decision.OFFLOAD)} offloaded "
        f"(of {len(problem.decision_ids)} forward values backward may need)"
    )
    lines.append(
        f"  graph:           {sum(n.phase is Phase.FORWARD for n in nodes)} forward, "
        f"{sum(n.phase is Phase.BACKWARD for n in nodes)} backward values"
    )
    t = step.timings
    lines.append(
        f"  planning time:   trace {t.trace_s:.2f} s, profile {t.profile_s:.2f} s, "
        f"solve {t.solve_s:.2f} s, rewrite {t.rewrite_s:.2f} s"
    )
    if step.library_trace_path:
        lines.append(
            "  note:            traced with torch.compiler.is_compiling() set, because on its eager "
            "path branches on tensor values" + step.library_trace_path
            + "; the library may run an equivalent program that differs from eager in rounding"
        )
    read_in_backward = {s.node_id for s in ev.steps if s.kind.value != "forward"} | problem.needed_ids
    saved = [i for i, d in plan.decisions.items() if d is Decision.SAVE and i in read_in_backward
             and nodes[i].alias_of is None]
    lines += _largest("largest saved values", saved, gp, top)
    recomputed = [i for i in ev.recomputed_ids if nodes[i].alias_of is None]
    lines += _largest("largest recomputed values", recomputed, gp, top)
    return "\n".join(lines)


def _largest(title: str, ids: list[int], gp, top: int) -> list[str]:
    nodes = gp.problem.nodes
    ids = sorted(ids, key=lambda i: (-nodes[i].out_bytes, i))[:top]
    out = [f"  {title}:"]
    if not ids:
        out.append("    (none)")
    for i in ids:
        out.append(f"    {nodes[i].out_bytes / 2**20:9.3f} MiB  {nodes[i].name:<28} {gp.source[i]}")
    return out


def render(report: "Report") -> str:
    """The CLI's text report: headline numbers, breakdown, Pareto sweep."""
    b = report.breakdown
    o = b.options
    counts = {d: sum(r.decision == d for r in report.decisions) for d in ("save", "recompute", "offload")}
    lines = [
        f"remat report: {report.model}  ({report.solver}, {report.status}; cost model: {report.cost_model})",
        *([f"  does NOT fit:      budget {format_bytes(report.requested_budget_bytes)} is below the "
           f"smallest reachable peak {format_bytes(report.min_peak_bytes)}; shown: the plan at that floor"]
          if report.requested_budget_bytes is not None else []),
        f"  budget:            {format_bytes(report.budget_bytes)}",
        f"  predicted peak:    {format_bytes(report.predicted_peak_bytes)}",
        f"  no-remat peak:     {format_bytes(report.baseline_peak_bytes)}",
        f"  smallest peak:     {format_bytes(report.min_peak_bytes)}",
        f"  extra compute:     {report.extra_compute_s * 1e3:.3f} ms"
        + (f" (+ {report.offload_s * 1e3:.3f} ms offload transfers)" if report.offload_s else ""),
        f"  decisions:         {counts['save']} saved, {counts['recompute']} recomputed, "
        f"{counts['offload']} offloaded",
        *([f"  offload:           {format_bytes(report.offloaded_bytes)} each way, transfer "
           f"{report.transfer_s * 1e3:.3f} ms ({max(report.transfer_s - report.offload_s, 0.0) * 1e3:.3f} ms "
           f"hidden behind compute, {report.offload_s * 1e3:.3f} ms exposed)"] if report.offloaded_bytes else []),
        f"  model state ({o.optimizer}, {o.precision}, shard {o.shard} ZeRO-{o.zero_stage}, adapter {o.adapter}):",
        f"    weights {_mib(b.weights_bytes)}, gradients {_mib(b.gradients_bytes)}, "
        f"master {_mib(b.master_bytes)}, optimizer {_mib(b.optimizer_bytes)}",
        f"  activations at peak: saved {_mib(b.activations_saved_bytes)}, recomputed "
        f"{_mib(b.activations_recomputed_bytes)}, temporaries {_mib(b.temporaries_bytes)}; "
        f"offloaded {_mib(b.activations_offloaded_bytes)}",
        f"  total per device:  {_mib(b.total_bytes)}",
    ]
    if report.pareto:
        lines.append("  pareto (budget -> peak, extra time = recompute + offload):")
        lines += [f"    {_mib(p.budget_bytes):>14} -> {_mib(p.predicted_peak_bytes):>14}, "
                  f"{p.extra_time_s * 1e3:9.3f} ms" for p in report.pareto]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def backend_summary(be: "RematBackend") -> str:
    """`remat.backend(...).summary()`: the step's budget across its graphs, how they were
    compiled (cache, fusion, generated code against op by op), the measured peak against
    the prediction, then each graph's `summary`."""
    if not be.steps:
        if be.cache_hits:
            raise RematError(
                f"{be.cache_hits} graph(s) came from torch's compile cache, so remat did not "
                "plan them in this process, and remat's plan store had no record of them (a cache "
                "written without cache=True, or cleared); build the backend with cache=False (the "
                "default) for a report")
        raise RematError("nothing planned yet: run the compiled model under autograd first")
    step_wide = be.whole_step and be.ledger.predicted_step_bytes is not None
    head = (be.ledger.describe() if be.whole_step and len(be.steps) > 1 else
            f"{len(be.steps)} graphs captured: the budget {be.budget!r} holds per graph, "
            "each planned on its own" if len(be.steps) > 1 else "")
    compiled = f"compiled with {be.compiler} (cost model: {be.cost_model})"
    if be.cache_hits:
        compiled += (f"\ncache:           {be.cache_hits} graph(s) from torch's compile cache; "
                     f"{be.stored_steps} plan(s) read back from remat's plan store")
    if be.compiler == "inductor" and be.fusion_estimates:
        compiled += (f"\nfusion:          {be.fusion}; inductor's own estimate per graph, before -> after "
                     "fusion: " + ", ".join(
                         f"{e.graph} {e.before_fusion_bytes / 2**20:.2f} -> {e.after_fusion_bytes / 2**20:.2f} MiB"
                         for e in be.fusion_estimates))
    graph_bytes = [(i, g) for i, step in enumerate(be.steps) for g in step.fusion_graph_bytes]
    if graph_bytes:  # where the margin comes from: each graph as generated vs op by op
        compiled += "\ngenerated code:  " + ", ".join(
            f"{'' if len(be.steps) == 1 else f'#{i} '}{g.graph} {g.generated_bytes} B vs {g.op_by_op_bytes} B op by op"
            for i, g in graph_bytes)
    chosen = [(i, step.inductor_settings) for i, step in enumerate(be.steps) if step.inductor_settings]
    if chosen:  # what the closed loop set for a graph's compile, where its code peaks lower so
        compiled += "\ninductor config: " + ", ".join(
            f"{'' if len(be.steps) == 1 else f'#{i} '}" + ", ".join(f"{k}={v}" for k, v in settings)
            for i, settings in chosen) + " (the plan's code peaks lower so)"
    if be.measured is not None:
        predicted = (be.ledger.predicted_step_bytes if step_wide else
                     sum(step.evaluation.peak_bytes + step.fusion_margin_bytes for step in be.steps))
        margin = sum(step.fusion_margin_bytes for step in be.steps)
        compiled += (f"\nmeasured peak:   {format_bytes(be.measured.peak_bytes)} (profiler, one step; "
                     f"predicted {format_bytes(predicted)}"
                     + (f", of which {format_bytes(margin)} is inductor's fusion" if margin > 0 else
                        f", {format_bytes(-margin)} under remat's op-by-op model: inductor's fusion"
                        if margin < 0 else "")
                     + (", the sum of the graphs' peaks)" if len(be.steps) > 1 and not step_wide else ")"))
        budget = (be.ledger.budget_bytes if step_wide
                  else sum(step.budget_bytes for step in be.steps))
        if be.measured.peak_bytes > budget:
            compiled += (f"\nWARNING: the measured peak is {format_bytes(be.measured.peak_bytes - budget)} "
                         "over the budget: what inductor ran differs from remat's op-by-op model "
                         "here (fusion groups ops); lower the budget by that much, or use "
                         "compiler='eager' for the exact model")
    return "\n\n".join([line for line in (head, compiled) if line]
                       + [summary(step) for step in be.steps])
