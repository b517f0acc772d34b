"""`report.json`: the Report as plain JSON, schema version 1.

Schema (all byte counts are ints, all times float seconds):

    schema_version        1
    model                 str    what was planned (TARGET or class name)
    budget_bytes          int    the budget remat.plan resolved
    baseline_peak_bytes   int    simulated peak with every activation saved
    predicted_peak_bytes  int    simulated peak of the plan (<= budget_bytes)
    min_peak_bytes        int    smallest peak any plan found (the Pareto floor)
    solver, status        str    solver name; optimal | feasible | infeasible (the budget asked
                                 for is below every reachable peak: the plan is the floor's)
    solve_s               float
    extra_compute_s       float  recompute seconds under the cost model
    offload_s             float  exposed transfer seconds of offloaded values
    peak_step             int    index into timeline where the peak is first reached
    cost_model            str    how per-op seconds were estimated
    fake                  bool   planned on fake/meta tensors (no weights allocated)
    planning_s            {trace, profile, solve, rewrite: float}
    offloaded_bytes       int    bytes moved to host memory (each way)
    transfer_s            float  transfer seconds out and back in full (hidden = transfer_s - offload_s)
    requested_budget_bytes int|null  the budget asked for when infeasible (budget_bytes is then
                                 min_peak_bytes, where the plan shown runs); null otherwise
    breakdown             {trainable_params, frozen_params, weights_bytes, gradients_bytes,
                           master_bytes, optimizer_bytes, buffers_bytes, inputs_bytes,
                           activations_saved_bytes, activations_recomputed_bytes,
                           activations_offloaded_bytes, temporaries_bytes,
                           model_state_bytes, activations_bytes, total_bytes, peak_step,
                           options: {optimizer, precision, shard, zero_stage, adapter}}
    timeline              [{step, kind: forward|backward|recompute|reload, name, live_bytes}]
    decisions             [{name, bytes, decision: save|recompute|offload, module,
                            module_class, source: 'file:line', reason}]
    pareto                [{budget_bytes, predicted_peak_bytes, extra_compute_s, offload_s,
                            extra_time_s, solver, status}]  budgets ascending from
                           min_peak_bytes to baseline_peak_bytes; extra_time_s
                           (= extra_compute_s + offload_s) never increases
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from remat.report.data import Report

SCHEMA_VERSION = 1


def to_dict(report: Report) -> dict[str, Any]:
    """The report as JSON-ready builtins (the schema above)."""
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
    out.update(dataclasses.asdict(report))
    b = report.breakdown
    out["breakdown"].update(model_state_bytes=b.model_state_bytes, activations_bytes=b.activations_bytes,
                            total_bytes=b.total_bytes)
    return out


def write_json(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_dict(report), indent=1) + "\n", encoding="utf-8")
    return path
