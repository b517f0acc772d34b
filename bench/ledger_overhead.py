"""What the whole-step ledger (`remat.runtime.step.ledger`) costs per graph call, in Python.

`torch.compile(model, backend=remat.backend(budget="100%"))` runs every compiled graph
through `LedgeredGraph.__call__`, which asks the ledger what is live outside the graph
(`begin`, `future_grad_bytes`) and records what the call left behind (`record`). This
script times those entry points (perf_counter sums over the timed steps; the wrappers
add about 0.1 µs each) and the step time of remat+inductor against plain torch.compile
(min of N steps, the two alternating so that machine drift hits both alike), 1 thread.

It also prints the ledger's byte counts after the timed steps (budget, no-remat and
predicted step peaks, each call's outside/held/peak bytes): a change that makes the
ledger faster must leave them identical. `--save FILE` writes them, `--check FILE`
fails when they differ from a saved run. `--count-calls` counts the Python and C function
calls each entry point makes instead of timing it: a deterministic measure of its work,
which the load of a shared machine does not move.

    HF_HUB_OFFLINE=1 python bench/ledger_overhead.py --models llama,gpt2 --steps 40
    HF_HUB_OFFLINE=1 python bench/ledger_overhead.py --steps 5 --count-calls
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.runtime.step.graph import LedgeredGraph  # noqa: E402
from remat.runtime.step.ledger import StepLedger  # noqa: E402
from remat.testing import zoo  # noqa: E402

ENTRY_POINTS = ("begin", "future_grad_bytes", "record")
"""The ledger's methods `LedgeredGraph.__call__` calls once per graph call."""

_timing = {"on": False, "count": False}
_spent: dict[str, float] = collections.defaultdict(float)
_calls: dict[str, int] = collections.defaultdict(int)
_fastest: dict[str, float] = collections.defaultdict(lambda: float("inf"))
_graphs: list[LedgeredGraph] = []


def _count_calls(frame: Any, event: str, arg: Any) -> None:
    if event in ("call", "c_call"):
        _ops["n"] += 1


_ops = {"n": 0}


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _timing["on"]:
            return fn(*args, **kwargs)
        if _timing["count"] and name in ENTRY_POINTS:  # function calls made inside, not time
            _ops["n"] = 0
            sys.setprofile(_count_calls)
            try:
                return fn(*args, **kwargs)
            finally:
                sys.setprofile(None)
                _spent[name] += _ops["n"]
                _calls[name] += 1
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - started
            _spent[name] += took
            _calls[name] += 1
            _fastest[name] = min(_fastest[name], took)

    return wrapper


def _instrument() -> None:
    """Time the ledger's entry points, the whole `LedgeredGraph.__call__`, and (see
    `_time_compiled`) the compiled graphs inside it."""
    for name in ENTRY_POINTS:
        setattr(StepLedger, name, _timed(name, getattr(StepLedger, name)))
    LedgeredGraph.__call__ = _timed("graph call", LedgeredGraph.__call__)
    init = LedgeredGraph.__init__

    def register(self: LedgeredGraph, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _graphs.append(self)

    LedgeredGraph.__init__ = register


def _time_compiled() -> None:
    """Wrap the compiled callables the ledgered graphs planned so far (after warm-up)."""
    for graph in _graphs:
        graph.variants = [(_timed("compiled", c), s) for c, s in graph.variants]


def _step(case: zoo.ModelCase, compiled: Any):
    def step() -> None:
        case.model.zero_grad(set_to_none=True)
        compiled(*case.args, **case.kwargs).loss.backward()

    return step


def ledger_facts(ledger: StepLedger) -> dict[str, Any]:
    """The ledger's byte counts: what a faster ledger must leave unchanged."""
    def calls(step: tuple) -> list[dict[str, int]]:
        return [{"graph": c.graph, "outside": c.outside_bytes, "pending": list(c.pending), "share": c.share_bytes,
                 "peak": c.peak_bytes, "baseline": c.baseline_bytes, "held": c.held_bytes,
                 "boundary": c.boundary_bytes, "params": len(c.params), "with_grad": len(c.with_grad),
                 "counted": len(c.counted)} for c in step]

    return {"budget_bytes": ledger.budget_bytes,
            "no_remat_step_bytes": ledger.no_remat_step_bytes, "predicted_step_bytes": ledger.predicted_step_bytes,
            "first_step": calls(ledger.first_step), "last_step": calls(ledger.last_step)}


def run(name: str, size: str, steps: int, warmup: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Step times (min of `steps`) of torch.compile and remat+inductor, alternating; the
    ledger's per-call times over remat's timed steps; its byte counts."""
    torch._dynamo.reset()
    _graphs.clear()
    plain_case, remat_case = zoo.build(name, size=size), zoo.build(name, size=size)
    plain = _step(plain_case, torch.compile(plain_case.model))
    backend = remat.backend(budget="100%")
    ledgered = _step(remat_case, torch.compile(remat_case.model, backend=backend))
    for _ in range(warmup):  # compiles; the ledger learns the step and splits the budget
        plain()
        ledgered()
    _time_compiled()
    _spent.clear()
    _calls.clear()
    _fastest.clear()
    times: dict[str, list[float]] = {"torch.compile": [], "remat+inductor": []}
    for _ in range(steps):
        for label, step in (("torch.compile", plain), ("remat+inductor", ledgered)):
            _timing["on"] = label == "remat+inductor"
            started = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - started)
            _timing["on"] = False
    result = {"model": f"{name} {size}", "graphs": len(_graphs), "calls_per_step": _calls["graph call"] / steps,
              "torch_ms": min(times["torch.compile"]) * 1e3, "remat_ms": min(times["remat+inductor"]) * 1e3,
              "per_call": {k: _spent[k] / _calls[k] for k in _spent},  # seconds (function calls)
              "per_call_us": {k: _spent[k] / _calls[k] * 1e6 for k in _spent},
              "fastest_call_us": {k: v * 1e6 for k, v in _fastest.items()},
              "per_step_ms": {k: _spent[k] / steps * 1e3 for k in _spent}}
    wrapper = _spent["graph call"] - _spent["compiled"]
    result["per_step_ms"]["ledger (call - compiled)"] = wrapper / steps * 1e3
    return result, ledger_facts(backend.ledger)


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | graphs | calls/step | torch.compile ms | remat+inductor ms | ledger ms/step "
             "(call - compiled) | " + " | ".join(f"{k} µs/call (min)" for k in ENTRY_POINTS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(ENTRY_POINTS)]
    for r in results:
        per_call = " | ".join(f"{r['per_call_us'].get(k, 0.0):.1f} ({r['fastest_call_us'].get(k, 0.0):.1f})"
                              for k in ENTRY_POINTS)
        lines.append(f"| {r['model']} | {r['graphs']} | {r['calls_per_step']:g} | {r['torch_ms']:.2f} | "
                     f"{r['remat_ms']:.2f} | {r['per_step_ms']['ledger (call - compiled)']:.3f} | {per_call} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,gpt2")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per method (min of them)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", help="write the ledger's byte counts to this JSON file")
    parser.add_argument("--check", help="fail when the ledger's byte counts differ from this JSON file's")
    parser.add_argument("--count-calls", action="store_true",
                        help="count the Python and C function calls each entry point makes per call "
                             "(deterministic; load-independent) instead of timing")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    _timing["count"] = opts.count_calls
    _instrument()
    results, facts = [], {}
    for name in opts.models.split(","):
        result, facts[name] = run(name, opts.size, opts.steps, opts.warmup)
        results.append(result)
    if opts.count_calls:
        for r in results:
            print(f"{r['model']}: function calls per graph call: "
                  + ", ".join(f"{k} {r['per_call'].get(k, 0):.0f}" for k in ENTRY_POINTS))
    else:
        print(table(results))
    for name, f in facts.items():
        print(f"{name}: budget {f['budget_bytes']} B, no-remat step {f['no_remat_step_bytes']} B, "
              f"predicted step {f['predicted_step_bytes']} B, calls {[c['outside'] for c in f['last_step']]} B outside")
    if opts.save:
        Path(opts.save).write_text(json.dumps(facts, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if opts.check:
        saved = json.loads(Path(opts.check).read_text(encoding="utf-8"))
        differ = [n for n in facts if saved.get(n) != facts[n]]
        if differ:
            sys.exit(f"the ledger's byte counts differ from {opts.check} on {differ}")
        print(f"ledger byte counts identical to {opts.check}")


if __name__ == "__main__":
    main()
