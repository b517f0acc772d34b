"""torch.compile against remat.backend at torch.compile's own points, step for step.

For each model and `activation_memory_budget` b: `torch.compile(model)` (inductor, its
min-cut partitioner) under b, its peak measured with the profiler's allocation events;
then `torch.compile(model, backend=remat.backend(budget=<that peak in bytes>,
outputs="loss"))`, measured the same way; then the two compiled steps timed alternately
(`--pairs` pairs after warm-up, gradients cleared before each step, median), so that the
machine's drift hits both alike. bench/compiled.py's ratios to eager move by about 0.1
between runs; a direct pair is what the issue's "lower or equal step time" needs.

    HF_HUB_OFFLINE=1 python bench/compiled_pairs.py --models gpt2,llama --budgets 1.0,0.5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import compiled  # noqa: E402  (bench/compiled.py: the two compiled steps, prepared alike; it imports bench/compare.py)
import torch  # noqa: E402

compare = sys.modules["compare"]

from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step_profiler  # noqa: E402

MIB = 2**20


def _peak(prepared: compare.Prepared) -> int:
    prepared.case.model.zero_grad(set_to_none=True)
    gc.collect()
    return measure_step_profiler(prepared.step, register=compare._register(prepared.case)).peak_bytes


def _compiles() -> int:
    """Frames dynamo has compiled so far in this process."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def pair(model: str, size: str, budget: float, pairs: int, **options) -> dict:
    """`options`: more `remat.backend` arguments."""
    torch._dynamo.reset()
    ours = compiled.prepare_torch_compile(zoo.build(model, size=size), budget)
    torch_peak = _peak(ours)
    # no dynamo reset: it would make `ours` recompile at torch's default budget
    remat = compiled.prepare_remat_inductor(zoo.build(model, size=size), torch_peak, reset=False, **options)
    remat_peak = _peak(remat)
    compiles = _compiles()
    for _ in range(3):
        compare._timed(ours), compare._timed(remat)
    times = [(compare._timed(ours), compare._timed(remat)) for _ in range(pairs)]
    if _compiles() != compiles:
        raise RuntimeError(f"{model} at {budget:g}: a step recompiled while timed; the pair is void")
    return {
        "model": model, "budget": budget, "torch_peak": torch_peak, "remat_peak": remat_peak,
        "remat_predicted": remat.predicted_peak_bytes,
        "torch_ms": 1e3 * statistics.median(t for t, _ in times),
        "remat_ms": 1e3 * statistics.median(r for _, r in times),
        "ratio": statistics.median(r / t for t, r in times),
        "torch_compile_s": ours.plan_s, "remat_compile_s": remat.plan_s,
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| model | torch.compile budget | torch.compile peak MiB | remat peak MiB (predicted) | "
             "torch.compile step ms | remat step ms | remat / torch.compile | compile s (torch / remat) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        predicted = "-" if r["remat_predicted"] is None else f"{r['remat_predicted'] / MIB:.2f}"
        lines.append(
            f"| {r['model']} | {r['budget']:g} | {r['torch_peak'] / MIB:.2f} | {r['remat_peak'] / MIB:.2f} "
            f"({predicted}) | {r['torch_ms']:.2f} | {r['remat_ms']:.2f} | {r['ratio']:.3f} | "
            f"{r['torch_compile_s']:.1f} / {r['remat_compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--budgets", default="1.0,0.5")
    parser.add_argument("--pairs", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cost-model", help="remat.backend's cost_model (default: the backend's own)")
    args = parser.parse_args(argv)
    options = {"cost_model": args.cost_model} if args.cost_model else {}
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        for budget in map(float, args.budgets.split(",")):
            rows.append(pair(model, args.size, budget, args.pairs, **options))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
