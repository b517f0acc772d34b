"""Depth table: planning deep, narrow transformers end to end (trace, solve, rewrite).

GPT-2 with 12, 24 and 48 layers and LLaMA with 32 layers, 64 wide, batch 2 x 64 tokens
(transformers configs, random weights), at 80%, 65% and 50% of the no-remat peak. Each
row is one `remat.plan(..., solver=s)`; solve s and rewrite s come from the planner's
own timings. Run through `python bench/solvers.py --depth` (or this file).

Columns: model, layers (found in the joint graph / in the config), nodes (problem
nodes), budget, solver, status, gap = (objective - lower bound) / objective over the
solver's plan space ('-' without a bound), solve s, rewrite s, objective (s).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    from solvers import Status

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


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=[f"{f}-{n}" for f, n in MODELS])
    parser.add_argument("--budgets", type=float, nargs="*", default=list(BUDGETS))
    parser.add_argument("--solvers", nargs="*", default=["auto"])
    parser.add_argument("--max-block-configs", type=int, default=None,
                        help="passed to layers (and auto's layers) when given")
    args = parser.parse_args(argv)
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
