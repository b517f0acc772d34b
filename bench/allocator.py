"""The budget as the allocator counts it: budget, predicted, allocator-measured and
tracker-measured peak per zoo model at 100%, 60% and the reported floor.

    HF_HUB_OFFLINE=1 python bench/allocator.py [--models cnn,resnet,gpt2] [--size tiny]
        [--workspace default|on|off] [--time-limit 2]

Models: the zoo's (`remat/testing/zoo.py`, at --size) and bench/models_hf.py's tiny transformers
models (convnext, clip, t5, whisper, llama8, mamba).

allocator: `remat.testing.measure.measure_step_profiler` (every byte the CPU allocator serves,
kernel scratch included: what the budget promises). tracker: `remat.testing.measure.measure_step`
(tensor storages only). The floor is `InfeasibleBudgetError.min_peak_bytes` from a 1-byte
budget. The table goes to stdout.
"""

from __future__ import annotations

import argparse
import os
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.errors import InfeasibleBudgetError  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step, measure_step_profiler  # noqa: E402


def _step(planned, case):
    torch.manual_seed(0)
    out = planned(*case.args, **case.kwargs)
    out.loss.backward()
    return out


def _measure(planned, case) -> tuple[int, int]:
    register = (case.model, *case.args, *case.kwargs.values())
    peaks = []
    for measure in (measure_step_profiler, measure_step):
        for p in case.model.parameters():
            p.grad = None
        peaks.append(measure(lambda: _step(planned, case), register=register).peak_bytes)
    return peaks[0], peaks[1]


def _case(name: str, size: str):
    """A zoo model, or one of bench/models_hf.py's (seeded like the zoo)."""
    if name in zoo.NAMES:
        return zoo.build(name, size=size)
    from models_hf import BUILDERS

    torch.manual_seed(0)
    model, args, kwargs = BUILDERS[name](torch.Generator().manual_seed(1))
    return types.SimpleNamespace(model=model.train(), args=args, kwargs=kwargs)


def rows(name: str, size: str, options: dict) -> list[str]:
    case = _case(name, size)
    try:
        remat.plan(case.model, case.args, case.kwargs, budget=1, **options)
        floor = None
    except InfeasibleBudgetError as err:
        floor = err.min_peak_bytes
    out = []
    for label, budget in (("100%", "100%"), ("60%", "60%"), ("floor", floor)):
        try:
            planned = remat.plan(case.model, case.args, case.kwargs, budget=budget, **options)
        except InfeasibleBudgetError as err:
            out.append(f"| {name} | {label} | refused (floor {err.min_peak_bytes:,}) | | | | |")
            continue
        allocator, tracker = _measure(planned, case)
        predicted = planned.predicted_peak_bytes
        out.append(f"| {name} | {label} | {planned.budget_bytes:,} | {predicted:,} | {allocator:,} "
                   f"({allocator / predicted - 1:+.2%}) | {tracker:,} | "
                   f"{'yes' if allocator <= planned.budget_bytes else 'NO'} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,resnet,gpt2")
    parser.add_argument("--size", default="tiny")
    # default: remat.plan's own (workspace measured on a real device)
    parser.add_argument("--workspace", choices=("default", "on", "off"), default="default")
    parser.add_argument("--time-limit", type=float, default=2.0)
    args = parser.parse_args()
    options = {"time_limit_s": args.time_limit}
    if args.workspace != "default":
        options["measure_workspace"] = args.workspace == "on"
    print(f"workspace {args.workspace}, time_limit_s {args.time_limit}\n")
    print("| model | at | budget B | predicted B | allocator B (vs predicted) | tracker B | allocator <= budget |")
    print("|---|---|---:|---:|---:|---:|---|")
    for name in args.models.split(","):
        for line in rows(name, args.size, options):
            print(line, flush=True)


if __name__ == "__main__":
    main()
