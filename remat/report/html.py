"""`report.html`: one self-contained page (inline CSS and SVG, no script, no network):
headline numbers, memory timeline, Pareto curve, breakdown, per-layer decisions."""

from __future__ import annotations

import html
from collections import defaultdict
from pathlib import Path

from remat.report import plots
from remat.report.data import Report, decision_counts

_MIB = 2**20
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 4px} h2{font-size:16px;margin:22px 0 6px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px} td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;gap:12px;flex-wrap:wrap}.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px}
.card b{display:block;font-size:18px}.muted{color:#777;font-size:12px}
.save{color:#4C72B0}.recompute{color:#55A868}.offload{color:#8172B3}
svg{max-width:100%;height:auto}
"""


def _mib(n: int) -> str:
    return f"{n / _MIB:,.1f} MiB"


def _e(text: object) -> str:
    return html.escape(str(text))


def render(report: Report) -> str:
    """The page as one string."""
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>remat report: {_e(report.model)}</title><style>{_CSS}</style></head><body>",
        f"<h1>remat report: {_e(report.model)}</h1>",
        f"<p class='muted'>solver {_e(report.solver)} ({_e(report.status)}), cost model: "
        f"{_e(report.cost_model)}{' — fake tensors, nothing allocated or measured' if report.fake else ''}</p>",
        _cards(report),
        "<h2>Memory timeline</h2>", plots.svg_text(plots.timeline_figure(report)),
    ]
    if report.pareto:
        parts += ["<h2>Budget vs extra compute (Pareto)</h2>",
                  plots.svg_text(plots.pareto_figure(report)), _pareto_table(report)]
    parts += ["<h2>Where the bytes go</h2>", _breakdown_table(report),
              "<h2>Decisions per layer</h2>", _layer_table(report),
              "<details><summary>every decision value</summary>", _decision_table(report), "</details>",
              "</body></html>"]
    return "\n".join(parts)


def write_html(report: Report, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render(report), encoding="utf-8")
    return path


def _cards(report: Report) -> str:
    counts = decision_counts(report)
    items = [
        ("budget", _mib(report.budget_bytes)),
        ("predicted peak", _mib(report.predicted_peak_bytes)),
        ("no-remat peak", _mib(report.baseline_peak_bytes)),
        ("smallest reachable peak", _mib(report.min_peak_bytes)),
        ("extra compute" + (" + offload" if report.offload_s else ""),
         f"{report.extra_compute_s * 1e3:.3f}" + (f" + {report.offload_s * 1e3:.3f}" if report.offload_s else "")
         + " ms"),
        ("saved / recomputed / offloaded", f"{counts['save']} / {counts['recompute']} / {counts['offload']}"),
    ]
    cells = "".join(f"<div class='card'><span class='muted'>{_e(k)}</span><b>{_e(v)}</b></div>" for k, v in items)
    return f"<div class='cards'>{cells}</div>"


def _pareto_table(report: Report) -> str:
    rows = "".join(
        f"<tr><td class='n'>{_mib(p.budget_bytes)}</td><td class='n'>{_mib(p.predicted_peak_bytes)}</td>"
        f"<td class='n'>{p.extra_compute_s * 1e3:.3f}</td><td class='n'>{p.offload_s * 1e3:.3f}</td>"
        f"<td>{_e(p.solver)}</td><td>{_e(p.status)}</td></tr>"
        for p in report.pareto
    )
    return ("<table><tr><th class='n'>budget</th><th class='n'>predicted peak</th>"
            "<th class='n'>recompute ms</th><th class='n'>offload ms</th><th>solver</th><th>status</th></tr>"
            f"{rows}</table>")


def _breakdown_table(report: Report) -> str:
    b = report.breakdown
    o = b.options
    rows = [
        ("weights", b.weights_bytes, f"{b.trainable_params:,} trainable + {b.frozen_params:,} frozen parameters"),
        ("gradients", b.gradients_bytes, "trainable parameters only"),
        ("fp32 master copy", b.master_bytes, o.precision),
        ("optimizer state", b.optimizer_bytes, o.optimizer),
        ("buffers", b.buffers_bytes, ""),
        ("inputs", b.inputs_bytes, ""),
        ("activations saved (at peak)", b.activations_saved_bytes, "planned by remat"),
        ("activations recomputed (at peak)", b.activations_recomputed_bytes, "planned by remat"),
        ("temporaries (at peak)", b.temporaries_bytes, "backward values, forward values in flight"),
        ("total per device", b.total_bytes, f"shard {o.shard} (ZeRO stage {o.zero_stage}), adapter {o.adapter}"),
        ("activations offloaded (host)", b.activations_offloaded_bytes, "not on the device"),
    ]
    body = "".join(f"<tr><td>{_e(k)}</td><td class='n'>{_mib(v)}</td><td class='muted'>{_e(note)}</td></tr>"
                   for k, v, note in rows)
    return f"<table><tr><th>what</th><th class='n'>bytes</th><th>note</th></tr>{body}</table>"


def layer_of(module: str) -> str:
    """Group key of a module path: up to the first numeric component ('h.3', 'layers.0')."""
    parts = module.split(".") if module else ["(model)"]
    for k, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return ".".join(parts[:2])


def _layer_table(report: Report) -> str:
    groups: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    order: list[str] = []
    for row in report.decisions:
        key = layer_of(row.module)
        if key not in groups:
            order.append(key)
        cell = groups[key][row.decision]
        cell[0] += 1
        cell[1] += row.bytes
    body = ""
    for key in order:
        cells = "".join(
            f"<td class='n {d}'>{groups[key][d][0]} · {_mib(groups[key][d][1])}</td>"
            for d in ("save", "recompute", "offload")
        )
        body += f"<tr><td>{_e(key)}</td>{cells}</tr>"
    return ("<table><tr><th>layer</th><th class='n'>saved</th><th class='n'>recomputed</th>"
            f"<th class='n'>offloaded</th></tr>{body}</table>")


def _decision_table(report: Report) -> str:
    body = "".join(
        f"<tr><td>{_e(r.name)}</td><td class='n'>{_mib(r.bytes)}</td><td class='{r.decision}'>{r.decision}</td>"
        f"<td>{_e(r.module)}</td><td>{_e(r.module_class)}</td><td class='muted'>{_e(r.source)}</td>"
        f"<td class='muted'>{_e(r.reason)}</td></tr>"
        for r in report.decisions
    )
    return ("<table><tr><th>value</th><th class='n'>bytes</th><th>decision</th><th>module</th>"
            f"<th>class</th><th>source</th><th>why not recomputed</th></tr>{body}</table>")
