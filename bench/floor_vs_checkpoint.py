"""remat's floor against `gradient_checkpointing_enable()` at 8 layers.

GPT-2 and BERT from transformers configs: 8 layers, 64 wide, 4 heads, dropout 0.1, batch
2 x 64 tokens, vocabulary 128. For each: the peak of one training step (live-storage
tracker, the step's output dropped as in bench/compare.py) with transformers'
`gradient_checkpointing_enable()`; remat's smallest reachable peak
(`InfeasibleBudgetError.min_peak_bytes`), planned there and measured, with dropout
replayed (default) and with every random op saved (`replay_rng=False`). Gradients of
every remat row are compared with eager's (torch.equal).

    python bench/floor_vs_checkpoint.py [--models gpt2 bert]
"""

from __future__ import annotations

import argparse
import copy
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the repository first: bench/solvers.py would shadow the solvers package

import torch

import remat
from remat.errors import InfeasibleBudgetError
from remat.testing import zoo
from remat.testing.measure import measure_step

SPECS = {
    "gpt2": dict(n_layer=8, n_embd=64, n_head=4, vocab_size=128, batch=2, seq=64),
    "bert": dict(num_hidden_layers=8, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                 vocab_size=128, batch=2, seq=64),
}
SEED = 0
MIB = 1 << 20


def build(name: str) -> zoo.ModelCase:
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    model, args, kwargs, blocks = zoo._BUILDERS[name](dict(SPECS[name]), gen)
    model.train()
    return zoo.ModelCase(name=name, size="8-layer", model=model, args=args, kwargs=kwargs, blocks=blocks)


def step_of(module, case):
    def step():
        torch.manual_seed(SEED)
        module(*case.args, **case.kwargs).loss.backward()
    return step


def grads_after(step, case):
    case.model.zero_grad(set_to_none=True)
    step()
    out = {k: p.grad.clone() for k, p in case.model.named_parameters() if p.grad is not None}
    case.model.zero_grad(set_to_none=True)
    return out


def peak(step, case) -> int:
    case.model.zero_grad(set_to_none=True)
    measured = measure_step(step, register=(case.model, case.args, case.kwargs)).peak_bytes
    case.model.zero_grad(set_to_none=True)
    return measured


def remat_row(case, eager_grads, **options) -> str:
    t0 = time.perf_counter()
    try:
        remat.plan(case.model, case.args, case.kwargs, budget=1, solver="auto", **options)
        return "budget of 1 byte planned?"
    except InfeasibleBudgetError as e:
        floor = e.min_peak_bytes
    planned = remat.plan(case.model, case.args, case.kwargs, budget=floor, solver="auto", **options)
    measured = peak(step_of(planned, case), case)
    same = eager_grads.keys() == (g := grads_after(step_of(planned, case), case)).keys() and all(
        torch.equal(eager_grads[k], g[k]) for k in g)
    return (f"floor {floor / MIB:.2f} MiB, planned {planned.predicted_peak_bytes / MIB:.2f}, "
            f"measured {measured / MIB:.2f} (output dropped), grads == eager: {same}, "
            f"{time.perf_counter() - t0:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    opts = parser.parse_args()
    torch.set_num_threads(1)
    for name in opts.models:
        case = build(name)
        eager = peak(step_of(case.model, case), case)
        eager_grads = grads_after(step_of(case.model, case), case)
        hf_case = zoo.ModelCase(name=name, size="8-layer", model=copy.deepcopy(case.model), args=case.args,
                                kwargs=case.kwargs, blocks=case.blocks)
        model = hf_case.model  # transformers 5: gradient_checkpointing_enable() is an alias of this
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        hf = peak(step_of(hf_case.model, hf_case), hf_case)
        print(f"{name}: eager {eager / MIB:.2f} MiB, gradient_checkpointing_enable() {hf / MIB:.2f} MiB", flush=True)
        print(f"  remat (dropout replayed): {remat_row(case, eager_grads)}", flush=True)
        print(f"  remat (random ops saved): {remat_row(case, eager_grads, replay_rng=False)}", flush=True)


if __name__ == "__main__":
    main()
