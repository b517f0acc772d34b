"""Depth table: planning deep, narrow transformers end to end (trace, solve, rewrite).

GPT-2 with 12, 24 and 48 layers and LLaMA with 32 layers, 64 wide, batch 2 x 64 tokens
(transformers configs, random weights), at 80%, 65% and 50% of the no-remat peak. Each
row is one `remat.plan(..., solver=s)`; solve s and rewrite s come from the planner's
own timings. Run through `python bench/solvers.py --depth` (or this file).

Columns: model, layers (found in the joint graph / in the config), nodes (problem
nodes), budget, solver, status, gap = (objective - lower bound) / objective over the
solver's plan space ('-' without a bound), solve s, rewrite s, objective (s).

`--solve-only` times the solver alone, reproducibly: each model is traced once
(`remat.plan` at 100% with solver "none") and its Problem pickled under --problem-dir
(reused while the file exists; --retrace rebuilds it), then one fresh process per model
runs `remat_solvers.solve(problem.with_budget(f * no-remat peak), solver)` for each budget in
turn (the first budget is cold: no block table cached in the process) and reports CPU
and wall seconds of that call only, and the plan's `work_s` (the nominal seconds its
deterministic clock charged).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = (("gpt2", 12), ("gpt2", 24), ("gpt2", 48), ("llama", 32))
BUDGETS = (0.8, 0.65, 0.5)
WIDTH, BATCH, SEQ, VOCAB = 64, 2, 64, 128


def build(family: str, n_layers: int):
    """A narrow model from its transformers config, its inputs and labels."""
    import torch

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=n_layers, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                            resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=VOCAB - 1,
                            eos_token_id=VOCAB - 1, use_cache=False, attn_implementation="sdpa")
        model = GPT2LMHeadModel(config)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(num_hidden_layers=n_layers, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                             max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa")
        model = LlamaForCausalLM(config)
    return model.train(), (ids,), {"labels": ids}


def row(family: str, n_layers: int, fraction: float, solver: str, options: dict) -> dict:
    import remat
    from remat.errors import InfeasibleBudgetError
    from remat_solvers import Status

    model, args, kwargs = build(family, n_layers)
    started = time.perf_counter()
    out = {"model": f"{family}-{n_layers}", "budget": fraction, "solver": solver}
    try:
        planned = remat.plan(model, args, kwargs, budget=f"{fraction:.0%}", solver=solver, **options)
    except InfeasibleBudgetError as error:
        return out | {"status": "inf", "why": f"smallest peak {error.min_peak_bytes} B"}
    except Exception as error:  # a solver that declines the problem: report, go on
        return out | {"status": "n/a", "why": f"{type(error).__name__}: {str(error)[:120]}",
                      "seconds": time.perf_counter() - started}
    plan, step = planned.plan, planned.step
    layers = planned.problem.layers
    gap = None
    if plan.lower_bound_s is not None and plan.status is not Status.INFEASIBLE:
        gap = 0.0 if plan.objective_s <= 0 else max(0.0, (plan.objective_s - plan.lower_bound_s) / plan.objective_s)
    return out | {
        "layers": layers.n_layers if layers else 0, "nodes": len(planned.problem.nodes),
        "status": {Status.OPTIMAL: "opt", Status.FEASIBLE: "feas", Status.INFEASIBLE: "inf"}[plan.status],
        "gap": gap, "solve_s": step.timings.solve_s, "rewrite_s": step.timings.rewrite_s,
        "objective_s": plan.objective_s, "by": plan.solver,
    }


HEADER = ("| model | layers | nodes | budget | solver | status | gap | solve s | rewrite s | objective (s) |\n"
          "|---|---:|---:|---:|---|---|---:|---:|---:|---:|")


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def line(r: dict) -> str:
    if r["status"] in ("n/a", "inf") and "nodes" not in r:
        return (f"| {r['model']} | - | - | {r['budget']:.0%} | {r['solver']} | {r['status']} | - | "
                f"{_fmt(r.get('seconds'), '.1f')} | - | {r.get('why', '')} |")
    return (f"| {r['model']} | {r['layers']} | {r['nodes']} | {r['budget']:.0%} | {r['solver']} | {r['status']} | "
            f"{_fmt(r['gap'], '.1%')} | {r['solve_s']:.1f} | {r['rewrite_s']:.1f} | {r['objective_s']:.4g} |")


PROBLEM_DIR = Path(os.environ.get("REMAT_DEPTH_PROBLEMS", "/tmp/remat-depth-problems"))

SOLVE_HEADER = ("| model | layers | nodes | decisions | budget | solver | status | gap | solve cpu s | solve wall s "
                "| work s | objective (s) |\n|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")


def traced_problem(spec: str, directory: Path, retrace: bool = False) -> Path:
    """The pickled Problem of `spec` (budget: its no-remat peak), traced if missing."""
    path = directory / f"{spec}.pkl"
    if path.exists() and not retrace:
        return path
    import remat

    family, n = spec.rsplit("-", 1)
    model, args, kwargs = build(family, int(n))
    planned = remat.plan(model, args, kwargs, budget="100%", solver="none")
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(planned.problem.with_budget(planned.step.baseline_peak_bytes), f)
    tmp.replace(path)
    return path


def solve_rows(path: Path, budgets: list[float], solver: str, options: dict) -> list[dict]:
    """In this process: solve the pickled problem at each budget, timing the solve only."""
    from remat_solvers import Status, solve

    with open(path, "rb") as f:
        problem = pickle.load(f)
    base = problem.budget_bytes
    layers = problem.layers.n_layers if problem.layers else 0
    rows = []
    for fraction in budgets:
        q = problem.with_budget(int(base * fraction))
        out = {"model": path.stem, "budget": fraction, "solver": solver, "layers": layers,
               "nodes": len(problem.nodes), "decisions": len(problem.decision_ids)}
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            plan = solve(q, solver, **options)
        except Exception as error:  # a solver that declines: report, go on
            rows.append(out | {"status": "n/a", "why": f"{type(error).__name__}: {str(error)[:120]}",
                               "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall})
            continue
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        gap = None
        if plan.lower_bound_s is not None and plan.status is not Status.INFEASIBLE:
            gap = 0.0 if plan.objective_s <= 0 else max(0.0, (plan.objective_s - plan.lower_bound_s) / plan.objective_s)
        rows.append(out | {
            "status": {Status.OPTIMAL: "opt", Status.FEASIBLE: "feas", Status.INFEASIBLE: "inf"}[plan.status],
            "gap": gap, "cpu_s": cpu, "wall_s": wall, "objective_s": plan.objective_s,
            "lower_bound_s": plan.lower_bound_s, "peak_bytes": plan.peak_bytes, "budget_bytes": q.budget_bytes,
            "work_s": plan.work_s})
    return rows


def solve_line(r: dict) -> str:
    head = (f"| {r['model']} | {r['layers']} | {r['nodes']} | {r['decisions']} | {r['budget']:.0%} | "
            f"{r['solver']} | {r['status']} |")
    if r["status"] == "n/a":
        return f"{head} - | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | - | {r['why']} |"
    return (f"{head} {_fmt(r['gap'], '.1%')} | {r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['work_s']:.1f} | "
            f"{r['objective_s']:.7g} |")


def solve_only(args: argparse.Namespace) -> list[dict]:
    """Trace (or reuse) each model's problem, then one fresh process per (model, solver)."""
    directory = Path(args.problem_dir)
    print(SOLVE_HEADER, flush=True)
    rows = []
    for spec in args.models:
        path = traced_problem(spec, directory, args.retrace)
        for solver in args.solvers:
            options = {}
            if args.max_block_configs and solver == "layers":
                options["max_block_configs"] = args.max_block_configs
            if args.time_limit is not None:
                options["time_limit_s"] = args.time_limit
            request = json.dumps({"path": str(path), "budgets": args.budgets, "solver": solver, "options": options})
            done = subprocess.run([sys.executable, __file__, "--solve-child", request], check=True,
                                  stdout=subprocess.PIPE, text=True)
            for text in done.stdout.splitlines():
                if text.startswith("{"):
                    r = json.loads(text)
                    rows.append(r)
                    print(solve_line(r), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=[f"{f}-{n}" for f, n in MODELS])
    parser.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    parser.add_argument("--solvers", nargs="*", default=None,
                        help="default: auto (end to end), layers (--solve-only)")
    parser.add_argument("--max-block-configs", type=int, default=None,
                        help="passed to layers (and auto's layers) when given")
    parser.add_argument("--solve-only", action="store_true",
                        help="time the solver alone on pickled problems, one fresh process per model")
    parser.add_argument("--problem-dir", default=str(PROBLEM_DIR),
                        help="where --solve-only keeps the traced problems (env REMAT_DEPTH_PROBLEMS)")
    parser.add_argument("--retrace", action="store_true", help="trace again even if a pickled problem exists")
    parser.add_argument("--time-limit", type=float, default=None, help="time_limit_s passed to the solver")
    parser.add_argument("--solve-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.solve_child:  # the fresh process of --solve-only
        request = json.loads(args.solve_child)
        for r in solve_rows(Path(request["path"]), request["budgets"], request["solver"], request["options"]):
            print(json.dumps(r), flush=True)
        return []
    if args.solve_only:
        args.solvers = args.solvers or ["layers"]
        return solve_only(args)
    args.solvers = args.solvers or ["auto"]
    print(HEADER, flush=True)
    rows = []
    for spec in args.models:
        family, n = spec.rsplit("-", 1)
        for fraction in args.budgets:
            for solver in args.solvers:
                options = {}
                if args.max_block_configs and solver == "layers":
                    options["max_block_configs"] = args.max_block_configs
                r = row(family, int(n), fraction, solver, options)
                rows.append(r)
                print(line(r), flush=True)
    return rows


if __name__ == "__main__":
    main()
