"""The budget under inductor on every zoo model: `remat.backend` (inductor, its defaults,
`outputs="loss"`) at each budget, its prediction (remat's peak plus fusion's margin)
against the peak the profiler's allocation events measure (plus what is registered
before the step: parameters, buffers, the batch).

    HF_HUB_OFFLINE=1 python bench/inductor_budget.py [--models mlp,cnn,...] [--budgets 100%,60%]
    HF_HUB_OFFLINE=1 python bench/inductor_budget.py --floors [--models ...]

A percentage under inductor is of inductor's no-remat peak (remat's plan that saves
everything as inductor generates it). `--floors` prints, per model, the floor op by op
(`remat.plan`) and under inductor (`remat.backend`), each as bytes and as a percentage of
its own path's no-remat peak, and the gap in points (`outputs="loss"` on both); and the
gap in bytes, as points of the eager no-remat peak (one denominator for both floors:
inductor's no-remat peak differs from eager's, which moves the percentages apart by
itself).

"over" = measured - predicted: never positive is the promise. A refused budget prints the
refusal's smallest reachable peak. LLaMA reads 32 B over: transformers keeps
`original_inv_freq`, a rotary buffer no graph reads, which this bench registers and remat
cannot see (tests/runtime/inductor/test_inductor_saved_views.py registers what the graphs take).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compiled  # noqa: E402  (bench/compiled.py; it imports bench/compare.py)
import torch  # noqa: E402

compare = sys.modules["compare"]

import remat  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step_profiler  # noqa: E402


def row(model: str, size: str, budget: str) -> str:
    try:
        prepared = compiled.prepare_remat_inductor(zoo.build(model, size=size), budget)
    except remat.InfeasibleBudgetError as e:
        return f"| {model} | {budget} | refused: smallest reachable {e.min_peak_bytes:,} B | | |"
    prepared.case.model.zero_grad(set_to_none=True)
    gc.collect()
    measured = measure_step_profiler(prepared.step, register=compare._register(prepared.case)).peak_bytes
    predicted = prepared.predicted_peak_bytes
    return f"| {model} | {budget} | {predicted:,} | {measured:,} | {measured - predicted:+,} |"


def _floor(plan_at: Any) -> int:
    """The smallest reachable peak a refusal at 1 byte names."""
    try:
        plan_at(1)
    except remat.InfeasibleBudgetError as e:
        return e.min_peak_bytes
    raise AssertionError("a 1-byte budget planned")


def floors_row(model: str, size: str) -> str:
    case = zoo.build(model, size=size)
    eager_no_remat = remat.plan(case.model, case.args, case.kwargs, budget="100%", outputs="loss").baseline_peak_bytes
    eager = _floor(lambda b: remat.plan(case.model, case.args, case.kwargs, budget=b, outputs="loss"))
    # what a percentage is of: the plan that saves everything, as inductor generates it (the
    # plan at "100%" may recompute what is cheaper to recompute than to save, and peak lower)
    no_remat = compiled.prepare_remat_inductor(case, "100%").no_remat_peak_bytes

    def under_inductor(budget: int) -> None:
        compiled.prepare_remat_inductor(zoo.build(model, size=size), budget, whole_step=False)

    inductor = _floor(under_inductor)
    e, i = 100.0 * eager / eager_no_remat, 100.0 * inductor / no_remat
    in_bytes = 100.0 * (inductor - eager) / eager_no_remat  # one denominator for both floors
    return (f"| {model} | {eager:,} | {e:.1f}% of {eager_no_remat:,} | {inductor:,} "
            f"| {i:.1f}% of {no_remat:,} | {i - e:+.1f} | {in_bytes:+.1f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(zoo.NAMES))
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--budgets", default="100%,60%")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--floors", action="store_true", help="the floor op by op and under inductor, per model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.floors:
        print("| model | floor op by op B | of its no-remat | floor under inductor B | of its no-remat "
              "| gap (points) | gap in bytes, points of eager's no-remat |"
              "\n|---|---|---|---|---|---|---|", flush=True)
        for model in args.models.split(","):
            print(floors_row(model, args.size), flush=True)
        return
    print("| model | budget | predicted B | measured B | over |\n|---|---|---|---|---|", flush=True)
    for model in args.models.split(","):
        for budget in args.budgets.split(","):
            print(row(model, args.size, budget), flush=True)


if __name__ == "__main__":
    main()
