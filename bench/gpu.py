"""One prepared command for a GPU machine: remat against eager, checkpointing and
torch.compile on CUDA, each row in a fresh process (its own allocator statistics; a crash
costs one row), the table printed and written as JSON.

    python bench/gpu.py                          # both models, every row, ~8 min budget
    python bench/gpu.py --models gpt2 --quick    # small configs: the flow, on CPU too

Rows (per model): eager; `gradient_checkpointing_enable()`; `torch.compile` at
`activation_memory_budget` 1.0 and 0.5; `remat.plan` at checkpointing's measured peak,
at 1.2x it and at its floor; `remat.plan(offload=True)` at 0.8x the recompute-only floor;
`remat.backend` at torch.compile 0.5's measured peak. Columns: measured peak
(`torch.cuda.max_memory_allocated` over one step after `reset_peak_memory_stats`; on CPU
remat's storage tracker or the profiler), remat's prediction, the budget, the step time
as a ratio to eager's in the same process (medians of interleaved steps), the plan or
compile time, and whether every gradient is `torch.equal` to eager's (else the largest
difference, beside eager's own run-to-run difference on this device; for a model traced
on its library's compile path, also whether they equal eager's on that path). While a
row's peak is measured only its own model, inputs and step are on the device.

Models: transformers GPT-2 12x768, batch 4 x 512, fp32, dropout 0.1; a LLaMA-style
model of about 1B parameters (16 layers, 2048 wide) under bf16 autocast, batch 1 x 2048.

The GPU image has no ortools; bring its wheel and install it into a folder first
(bench/README.md, "GPU"). Nothing here has a GPU in CI.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROWS = ("eager", "checkpointing", "compile@1.0", "compile@0.5", "remat@checkpointing",
        "remat@1.2x checkpointing", "remat@floor", "remat offload@0.8x floor", "backend@compile 0.5")


def build(model: str, quick: bool, device: str):
    """(model, batch, autocast dtype or None) with seeded weights and tokens."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if model == "gpt2":
        layers, width, batch, seq = (2, 128, 2, 128) if quick else (12, 768, 4, 512)
        config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(width // 64, 2), n_positions=seq,
                            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
                            attn_implementation="sdpa")
        net, vocab, dtype = GPT2LMHeadModel(config), config.vocab_size, None
    else:
        layers, width, inner, batch, seq = (2, 128, 256, 1, 128) if quick else (16, 2048, 5632, 1, 2048)
        config = LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=inner,
                             num_attention_heads=max(width // 128, 2), num_key_value_heads=max(width // 256, 1),
                             vocab_size=32000, max_position_embeddings=seq, use_cache=False,
                             attn_implementation="sdpa")
        net, vocab, dtype = LlamaForCausalLM(config), config.vocab_size, torch.bfloat16
    ids = torch.randint(0, vocab, (batch, seq))
    return net.to(device).train(), ids.to(device), dtype


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One row, in this process. While its peak is measured only the row's own model, its
    inputs and its step live on the device: the eager reference is parked on the host and
    every gradient compared is copied there."""
    import torch

    import remat

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, ids, dtype = build(args.model, args.quick, device)
    eager = copy.deepcopy(model).to("cpu")  # before checkpointing changes `model`

    def run(fn):
        def step():
            torch.manual_seed(1)
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = fn(ids, labels=ids).loss
            loss.backward()
        return step

    def grads(net, step):
        net.zero_grad(set_to_none=True)
        step()
        out = [p.grad.to("cpu", copy=True) for p in net.parameters()]
        net.zero_grad(set_to_none=True)
        return out

    started = time.perf_counter()
    predicted = budget = None
    fn, measure_with = model, "dispatch"
    if args.row == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.row.startswith("compile@"):
        torch._functorch.config.activation_memory_budget = float(args.row.split("@")[1])
        fn, measure_with = torch.compile(model), "profiler"
    elif args.row.startswith("backend@"):
        be = remat.backend(budget=args.budget, outputs="loss")
        fn, measure_with = torch.compile(model, backend=be), "profiler"
    elif args.row.startswith("remat"):
        offload = "offload" in args.row
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            fn = remat.plan(model, (ids,), {"labels": ids}, budget=args.budget, outputs="loss", offload=offload)
        predicted, budget = fn.predicted_peak_bytes, fn.budget_bytes
    step = run(fn)
    ours = grads(model, step)  # compiles / plans the shapes first
    prepare_s = time.perf_counter() - started
    if args.row.startswith("backend@"):
        predicted, budget = be.ledger.predicted_step_bytes, be.ledger.budget_bytes
    peak = measure(step, model, ids, device, measure_with)
    eager.to(device)
    reference = run(eager)
    theirs, again = grads(eager, reference), grads(eager, reference)
    diff, noise = largest_difference(ours, theirs), largest_difference(again, theirs)
    equal = all(torch.equal(a, b) for a, b in zip(ours, theirs))
    traced_path = getattr(getattr(fn, "step", None), "library_trace_path", "")
    if traced_path:  # the model was traced on its library's compile path: eager on that path too
        from remat.compat import compiling_state_context

        with compiling_state_context():
            same_path = grads(eager, reference)
        equal_on_path = all(torch.equal(a, b) for a, b in zip(ours, same_path))
    ratios = []
    for _ in range(args.steps):
        t_ours, t_eager = timed(step, device), timed(reference, device)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        ratios.append(t_ours / t_eager)
    return {"model": args.model, "row": args.row, "peak_bytes": peak, "predicted_bytes": predicted,
            "budget_bytes": budget, "step_ratio": statistics.median(ratios), "prepare_s": prepare_s,
            "grads_equal": equal, "max_grad_diff": diff, "eager_vs_itself": noise,
            "equal_to_eager_on_the_traced_path": equal_on_path if traced_path else None}


def largest_difference(xs, ys) -> float:
    """The largest element-wise difference between two lists of gradients."""
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(xs, ys))


def measure(step, model, ids, device: str, instrument: str) -> int:
    """One step's peak: the CUDA allocator's on a GPU, else remat's CPU instrument."""
    from remat.testing.measure import measure_step

    model.zero_grad(set_to_none=True)
    return measure_step(step, register=(model, ids), instrument="cuda" if device == "cuda" else instrument).peak_bytes


def timed(step, device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def floor_of(model: str, quick: bool) -> dict[str, int]:
    """remat's recompute-only floor for `model` (the refusal of a 1-byte budget)."""
    import torch

    import remat

    device = "cuda" if torch.cuda.is_available() else "cpu"
    net, ids, dtype = build(model, quick, device)
    try:
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            remat.plan(net, (ids,), {"labels": ids}, budget=1, outputs="loss", offload=False)
    except remat.InfeasibleBudgetError as e:
        return {"floor_bytes": e.min_peak_bytes}
    raise RuntimeError("a 1-byte budget planned")


def parent(args: argparse.Namespace) -> list[dict[str, Any]]:
    deadline = time.monotonic() + args.limit_s
    results: list[dict[str, Any]] = []
    for model in args.models.split(","):
        peaks: dict[str, int] = {}
        floor: list[int] = []  # remat's recompute-only floor, found once per model

        def in_child(what: str, budget: int | None = None) -> dict[str, Any]:
            left = deadline - time.monotonic()
            if left < 20:
                return {"error": "skipped: out of time"}
            cmd = [sys.executable, __file__, "--child", what, "--model", model, "--steps", str(args.steps)]
            cmd += ["--quick"] if args.quick else []
            cmd += ["--budget", str(budget)] if budget is not None else []
            limit_s = min(left, args.row_limit_s)
            cmd += ["--dump-after-s", str(max(1, int(limit_s) - 5))]  # where a slow row is, in its log
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s)
            except subprocess.TimeoutExpired as e:
                if args.log:
                    err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
                    with open(args.log, "a", encoding="utf-8") as log:
                        log.write(f"### {model} {what} (timed out after {limit_s:.0f} s)\n{err}\n")
                return {"error": "timed out"}
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            if args.log:
                with open(args.log, "a", encoding="utf-8") as log:
                    log.write(f"### {model} {what} (exit {done.returncode})\n{done.stderr}\n")
            if done.returncode != 0 or not lines:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}
            return json.loads(lines[-1])

        for row in [r for r in ROWS if args.rows is None or r in args.rows.split(",")]:
            if "floor" in row and not floor:
                found = in_child("floor")
                if "floor_bytes" not in found:
                    results.append({"model": model, "row": row, **found})
                    continue
                floor.append(found["floor_bytes"])
            budget = row_budget(row, peaks, floor[0] if floor else None)
            if row.startswith(("remat", "backend")) and budget is None:
                results.append({"model": model, "row": row, "error": "its reference row failed"})
                continue
            result = {"model": model, "row": row, **in_child(row, budget)}
            if "error" not in result:
                peaks[row] = result["peak_bytes"]
            results.append(result)
            print(format_row(result), flush=True)
    return results


def row_budget(row: str, peaks: dict[str, int], floor: int | None) -> int | None:
    """The budget of a remat row, from the rows measured before it (None: not a remat row,
    or its reference row failed)."""
    if row == "remat@checkpointing":
        return peaks.get("checkpointing")
    if row == "remat@1.2x checkpointing":
        return int(1.2 * peaks["checkpointing"]) if "checkpointing" in peaks else None
    if row == "remat@floor":
        return floor
    if row == "remat offload@0.8x floor":
        return None if floor is None else int(0.8 * floor)
    if row == "backend@compile 0.5":
        return peaks.get("compile@0.5")
    return None


def format_row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"| {r['model']} | {r['row']} | {r['error']} | | | | | |"
    mib = lambda b: "" if b is None else f"{b / 2**20:,.1f}"  # noqa: E731
    grads = "equal" if r["grads_equal"] else f"max diff {r['max_grad_diff']:.1e}"
    if r.get("eager_vs_itself"):
        grads += f" (eager vs itself {r['eager_vs_itself']:.1e})"
    if r.get("equal_to_eager_on_the_traced_path") is not None:
        grads += "; on the traced path: " + ("equal" if r["equal_to_eager_on_the_traced_path"] else "differ")
    return (f"| {r['model']} | {r['row']} | {mib(r['peak_bytes'])} | {mib(r['predicted_bytes'])} | "
            f"{mib(r['budget_bytes'])} | {r['step_ratio']:.3f} | {r['prepare_s']:.1f} | {grads} |")


HEADER = ("| model | row | peak MiB | predicted MiB | budget MiB | step / eager | plan or compile s | gradients |\n"
          "|---|---|---:|---:|---:|---:|---:|---|")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--quick", action="store_true", help="small configs (the flow, in seconds)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per row")
    parser.add_argument("--limit-s", type=float, default=480.0, help="the whole run")
    parser.add_argument("--row-limit-s", type=float, default=150.0, help="one row")
    parser.add_argument("--out", default="gpu.json")
    parser.add_argument("--rows", default=None, help="a comma-separated subset of the rows")
    parser.add_argument("--log", default=None, help="append every row's stderr here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dump-after-s", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        args.row = args.child
        # each stage's start in stderr, and every thread's stack just before the parent's timeout
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
        logging.getLogger("remat").setLevel(logging.DEBUG)
        if args.dump_after_s:
            faulthandler.dump_traceback_later(args.dump_after_s)
        print(json.dumps(floor_of(args.model, args.quick) if args.child == "floor" else child(args)))
        return
    print(HEADER, flush=True)
    results = parent(args)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print("\n" + HEADER)
    print("\n".join(format_row(r) for r in results))


if __name__ == "__main__":
    main()
