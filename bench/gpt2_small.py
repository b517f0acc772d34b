"""GPT-2 small (4 layers, 256 wide, batch 8, seq 256) on this machine: baseline and
smallest feasible measured peak, step-time ratio to eager at 100% and 50% budgets, and
the time to plan by stage.

    HF_HUB_OFFLINE=1 python bench/gpt2_small.py [--solver chen-greedy] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step  # noqa: E402


def _step(fn, case):
    case.model.zero_grad(set_to_none=True)
    out = fn(*case.args, **case.kwargs)
    out.loss.backward()
    return out.loss.detach()


def _median_ratio(planned, case, repeats: int) -> float:
    """Median over interleaved (eager, planned) pairs of planned/eager step time."""
    ratios = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _step(case.model, case)
        t1 = time.perf_counter()
        _step(planned, case)
        t2 = time.perf_counter()
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--solver", default="chen-greedy")
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    case = zoo.build("gpt2", size="small")
    inputs = [t for t in (*case.args, *case.kwargs.values()) if isinstance(t, torch.Tensor)]
    eager = measure_step(lambda: _step(case.model, case), register=(case.model, *inputs))
    try:
        remat.plan(case.model, case.args, case.kwargs, budget=1, solver=opts.solver)
    except remat.InfeasibleBudgetError as e:
        smallest = e.min_peak_bytes
    rows = []
    for label, budget in (("100%", "100%"), ("50%", "50%"), ("smallest", smallest)):
        started = time.perf_counter()
        planned = remat.plan(case.model, case.args, case.kwargs, budget=budget, solver=opts.solver)
        plan_s = time.perf_counter() - started
        measured = measure_step(lambda: _step(planned, case), register=(case.model, *inputs))
        ratio = _median_ratio(planned, case, opts.repeats)
        t = planned.step.timings
        rows.append((label, planned.budget_bytes, planned.predicted_peak_bytes, measured.peak_bytes,
                     ratio, plan_s, t))
    mib = 2**20
    print(f"GPT-2 small, solver {opts.solver}; eager measured peak {eager.peak_bytes / mib:.2f} MiB\n")
    print("| budget | budget MiB | predicted MiB | measured MiB | step time / eager | plan s | trace / profile / solve / rewrite s |")
    print("|---|---|---|---|---|---|---|")
    for label, b, pred, meas, ratio, plan_s, t in rows:
        print(f"| {label} | {b / mib:.2f} | {pred / mib:.2f} | {meas / mib:.2f} | {ratio:.2f} | {plan_s:.2f} | "
              f"{t.trace_s:.2f} / {t.profile_s:.2f} / {t.solve_s:.2f} / {t.rewrite_s:.2f} |")


if __name__ == "__main__":
    main()
