"""Matplotlib figures of a Report: the memory timeline and the Pareto curve, as PNG
files or inline SVG text (the HTML embeds the SVG; nothing is fetched)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from remat.report.data import Report

_MIB = 2**20
_KIND_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "recompute": "#55A868", "reload": "#8172B3"}


def _pyplot():
    # matplotlib loads with the first figure, not with remat.report (about 1 s to import)
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def timeline_figure(report: Report):
    """Live MiB per step, coloured by step kind, with the budget line and the peak marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6), dpi=100)
    steps = [p.step for p in report.timeline]
    live = [p.live_bytes / _MIB for p in report.timeline]
    ax.plot(steps, live, color="#333333", linewidth=0.8, zorder=1)
    for kind, color in _KIND_COLORS.items():
        xs = [p.step for p in report.timeline if p.kind == kind]
        ys = [p.live_bytes / _MIB for p in report.timeline if p.kind == kind]
        if xs:
            ax.scatter(xs, ys, s=4, color=color, label=kind, zorder=2)
    ax.axhline(report.budget_bytes / _MIB, color="#C44E52", linestyle="--", linewidth=1,
               label=f"budget {report.budget_bytes / _MIB:.1f} MiB")
    ax.axhline(report.baseline_peak_bytes / _MIB, color="#999999", linestyle=":", linewidth=1,
               label=f"no-remat peak {report.baseline_peak_bytes / _MIB:.1f} MiB")
    if 0 <= report.peak_step < len(report.timeline):
        ax.annotate(f"peak {report.predicted_peak_bytes / _MIB:.1f} MiB",
                    xy=(report.peak_step, report.predicted_peak_bytes / _MIB),
                    xytext=(0, 8), textcoords="offset points", ha="center", fontsize=8)
        ax.plot([report.peak_step], [report.predicted_peak_bytes / _MIB], marker="v", color="#C44E52")
    forward_end = sum(1 for p in report.timeline if p.kind == "forward")
    ax.axvline(forward_end - 0.5, color="#bbbbbb", linewidth=0.8)
    ax.set_xlabel("step of the simulated schedule (forward | backward)")
    ax.set_ylabel("live MiB")
    ax.set_title(f"memory timeline: {report.model}", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower center", ncol=3)
    fig.tight_layout()
    return fig


def pareto_figure(report: Report):
    """Extra time (recompute + offload, ms) against peak (MiB) for the sweep, the chosen
    plan marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=100)
    xs = [p.predicted_peak_bytes / _MIB for p in report.pareto]
    ys = [p.extra_time_s * 1e3 for p in report.pareto]
    ax.step(xs, ys, where="post", color="#4C72B0", linewidth=1)
    ax.scatter(xs, ys, s=14, color="#4C72B0", label="Pareto sweep", zorder=2)
    ax.scatter([report.predicted_peak_bytes / _MIB], [(report.extra_compute_s + report.offload_s) * 1e3], s=40,
               color="#C44E52", marker="*", label="this plan", zorder=3)
    ax.axvline(report.budget_bytes / _MIB, color="#C44E52", linestyle="--", linewidth=1, label="budget")
    ax.set_xlabel("predicted peak MiB")
    ax.set_ylabel("extra ms, recompute + offload (cost model)")
    ax.set_title("budget vs extra compute", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def save_png(fig, path: str | Path) -> Path:
    plt = _pyplot()
    fig.savefig(path, format="png")
    plt.close(fig)
    return Path(path)


def svg_text(fig) -> str:
    """The figure as an inline <svg> element (no XML prologue, no external refs)."""
    plt = _pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    # drop the RDF <metadata> block: it only names matplotlib and the Dublin Core schema
    text = re.sub(r"<metadata>.*?</metadata>", "", text, flags=re.DOTALL)
    return text[text.index("<svg"):]
