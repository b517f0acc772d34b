"""torch.compile rows for bench/compare.py: inductor with PyTorch's partitioner against
inductor with remat's, measured with the instruments that work under torch.compile.

  torch.compile   ``torch.compile(model)`` (inductor, min-cut partitioner) under
                  ``torch._functorch.config.activation_memory_budget`` b
  remat+inductor  ``torch.compile(model, backend=remat.backend(budget=...))`` at 100% and at
                  each torch.compile point's measured peak (in bytes)

Per run: measured peak from the profiler's allocation events (a dispatch-mode tracker
would make dynamo fall back to eager), gradients against eager (max abs difference:
inductor rounds differently), step time interleaved with eager steps (median ratio), and
compile time (the first step, which compiles and runs once).

    HF_HUB_OFFLINE=1 python bench/compiled.py --models gpt2 --budgets 1.0,0.5
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

if "compare" not in sys.modules:  # run directly; under compare.py --compiled it is that module
    import compare  # noqa: E402  (bench/compare.py: Row, Prepared, measuring helpers)
compare = sys.modules["compare"]

from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step_profiler  # noqa: E402

log = logging.getLogger("bench.compiled")

TORCH_COMPILE_BUDGETS = (1.0, 0.6, 0.4)


def _one_graph(case: zoo.ModelCase) -> zoo.ModelCase:
    """transformers' `loss_function` calls `logger.warning_once` when `loss_type` is None
    (the zoo's configs), a graph break just before the loss. With a break each graph is
    planned on its own and the budget holds per graph, not per step; name the default
    loss so both compilers see one graph where that was the only break."""
    if getattr(case.model, "loss_type", "") is None:  # what the property falls back to anyway
        case.model.loss_type = "ForCausalLM"
    # transformers' classification losses set `config.problem_type` on their first call,
    # which fails dynamo's guard on it: the second step would recompile (and a measured
    # step would count the compile's own allocations). One eager forward settles it.
    with torch.no_grad():
        case.model(*case.args, **case.kwargs)
    return case


def _compiled_step(case: zoo.ModelCase, compiled: Any):
    def step() -> None:
        compiled(*case.args, **case.kwargs).loss.backward()

    return step


def prepare_torch_compile(case: zoo.ModelCase, budget: float) -> compare.Prepared:
    """Inductor with its own partitioner; the budget is read when the graph compiles,
    so the first (compiling) step runs under the patch."""
    from torch._functorch import config as functorch_config

    torch._dynamo.reset()
    compiled = torch.compile(_one_graph(case).model)
    step = _compiled_step(case, compiled)
    started = time.perf_counter()
    with functorch_config.patch(activation_memory_budget=budget):
        step()
    return compare.Prepared(case=case, step=step, plan_s=time.perf_counter() - started)


def prepare_remat_inductor(case: zoo.ModelCase, budget: int | str, *, reset: bool = True,
                           **options: Any) -> compare.Prepared:
    """`options`: more `remat.backend` arguments (cost_model=...). `reset=False` keeps
    what dynamo compiled before: `torch._dynamo.reset()` makes an earlier
    `prepare_torch_compile` step recompile on its next call, outside its budget's patch,
    so at torch's default budget (1.0)."""
    import remat

    if reset:
        torch._dynamo.reset()
    # the caller keeps the loss only, as the torch.compile rows' step does
    be = remat.backend(budget=budget, outputs="loss", **options)
    step = _compiled_step(case, torch.compile(_one_graph(case).model, backend=be))
    started = time.perf_counter()
    step()
    compile_s = time.perf_counter() - started
    if len(be.steps) != 1:  # the budget held per graph: no whole-step prediction
        log.warning("%d graphs: remat planned each under the budget on its own", len(be.steps))
        return compare.Prepared(case=case, step=step, plan_s=compile_s)
    (planned,) = be.steps
    return compare.Prepared(case=case, step=step, plan_s=compile_s,
                            predicted_peak_bytes=planned.evaluation.peak_bytes + planned.fusion_margin_bytes,
                            baseline_peak_bytes=planned.baseline_peak_bytes,
                            no_remat_peak_bytes=planned.no_remat_peak_bytes)


def measure_compiled(p: compare.Prepared, ref: compare.Reference, *, model: str, method: str,
                     setting: str, repeats: int) -> compare.Row:
    """Profiler peak (gradients cleared first: frees of older storage are invisible to
    it), gradients against eager, step time interleaved with eager."""
    compare._restore(p.case, ref.init_state)
    torch.manual_seed(compare.SEED)
    profiled = measure_step_profiler(p.step, register=compare._register(p.case))
    grads = compare._grads(p.case)
    diffs = [(grads[k] - g).abs().max().item() for k, g in ref.grads.items() if k in grads]
    step_s, eager_s, slowdown = compare._interleaved(p, ref.prepared, repeats)
    return compare.Row(
        model=model, method=method, setting=setting, peak_bytes=profiled.peak_bytes,
        profiler_peak_bytes=profiled.peak_bytes, predicted_peak_bytes=p.predicted_peak_bytes,
        step_s=step_s, eager_step_s=eager_s, slowdown=slowdown, plan_s=p.plan_s,
        grads_equal=compare._equal(grads, ref.grads),
        grads_max_abs_diff=max(diffs, default=0.0) if grads.keys() == ref.grads.keys() else float("inf"),
        note="plan_s = compile time (first step)",
    )


def compiled_rows(name: str, size: str, ref: compare.Reference, budgets, repeats: int) -> list[compare.Row]:
    """torch.compile at each `budgets` point, then remat+inductor at 100% and at each of
    those points' measured peaks."""
    import remat

    rows: list[compare.Row] = []
    for budget in budgets:
        setting = f"budget={budget:g}"
        try:
            prepared = prepare_torch_compile(zoo.build(name, size=size), budget)
            rows.append(measure_compiled(prepared, ref, model=name, method="torch.compile",
                                         setting=setting, repeats=repeats))
        except Exception as e:  # noqa: BLE001 - a benchmark reports failures and goes on
            rows.append(compare._failed(name, "torch.compile", setting, e))
        log.info("%s", compare._row_line(rows[-1]))
    targets = [("100%", "100%")] + [
        (r.peak_bytes, f"{r.peak_bytes / compare.MIB:.2f} MiB (= torch.compile {r.setting})")
        for r in rows if r.peak_bytes is not None and r.setting != "budget=1"
    ]
    for budget, setting in targets:
        try:
            prepared = prepare_remat_inductor(zoo.build(name, size=size), budget)
            rows.append(measure_compiled(prepared, ref, model=name, method="remat+inductor",
                                         setting=setting, repeats=repeats))
        except remat.InfeasibleBudgetError as e:
            rows.append(compare.Row(model=name, method="remat+inductor", setting=setting,
                                    note=f"infeasible; smallest reachable {compare._mib(e.min_peak_bytes)} MiB"))
        except Exception as e:  # noqa: BLE001
            rows.append(compare._failed(name, "remat+inductor", setting, e))
        log.info("%s", compare._row_line(rows[-1]))
    return rows


def markdown(rows: list[compare.Row]) -> str:
    head = ("| model | method | setting | measured peak MiB | predicted MiB | step / eager | "
            "compile s | max abs grad diff |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.method} | {r.setting} | {compare._mib(r.peak_bytes)} | "
            f"{compare._mib(r.predicted_peak_bytes)} | {compare._fmt(r.slowdown, '.2f')} | "
            f"{compare._fmt(r.plan_s, '.1f')} | {compare._fmt(r.grads_max_abs_diff, '.1e')} |"
            + (f" {r.note}" if r.note and r.peak_bytes is None else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--size", default="bench")
    parser.add_argument("--budgets", default=",".join(map(str, TORCH_COMPILE_BUDGETS)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/compare/compiled.md")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(opts.threads)
    budgets = tuple(float(b) for b in opts.budgets.split(","))
    rows: list[compare.Row] = []
    for name in opts.models.split(","):
        ref = compare.reference(zoo.build(name, size=opts.size))
        rows += compiled_rows(name, opts.size, ref, budgets, opts.repeats)
    table = markdown(rows)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(table + "\n", encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
