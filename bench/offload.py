"""Offload below the recompute-only floor, on the zoo models (CPU host store).

Per model: the recompute-only floor remat states (offload off), then plans with
offload=True at fractions of that floor; for each, the predicted and measured peak,
the bytes offloaded, the transfer (full, hidden, exposed) and the predicted extra time
next to recompute-only at its floor, and whether the gradients equal eager's.

    HF_HUB_OFFLINE=1 python bench/offload.py [--models mlp,cnn,gpt2] [--size tiny]
        [--fractions 0.95,0.9,0.8] [--solver auto]

The table goes to stdout and results/offload.md (gitignored). Times are predictions
(the CPU host store is a memcpy; there is no link to hide behind compute here).
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import remat  # noqa: E402
from remat.budget import format_bytes  # noqa: E402
from remat.errors import InfeasibleBudgetError  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat.testing.measure import measure_step  # noqa: E402
from remat_solvers import Decision  # noqa: E402

HEADER = ("| model | budget | / recompute floor | predicted peak | measured peak | offloaded "
          "| transfer ms (hidden) | extra ms: offload plan | extra ms: recompute-only at floor | grads == eager |")


def _step(planned, case, seed):
    torch.manual_seed(seed)
    planned(*case.args, **case.kwargs).loss.backward()


def _exact(model, planned, case) -> bool:
    eager = copy.deepcopy(model)
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
    _step(planned, case, 7)
    _step(eager, case, 7)
    return all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))


def rows(name: str, size: str, fractions: list[float], solver: str) -> list[str]:
    case = zoo.build(name, size=size)
    model = case.model
    try:
        remat.plan(model, case.args, case.kwargs, budget=1, solver="chen-greedy", time_limit_s=2)
    except InfeasibleBudgetError as e:
        floor = e.min_peak_bytes
    at_floor = remat.plan(model, case.args, case.kwargs, budget=floor, solver=solver)
    recompute_ms = at_floor.step.evaluation.cost_s * 1e3
    out = []
    for f in fractions:
        budget = int(floor * f)
        try:
            planned = remat.plan(model, case.args, case.kwargs, budget=budget, solver=solver, offload=True)
        except InfeasibleBudgetError as e:
            out.append(f"| {name} | {format_bytes(budget)} | {f:.2f} | refused: floor with offload "
                       f"{format_bytes(e.min_peak_bytes)} | | | | | {recompute_ms:.3f} | |")
            continue
        ev = planned.step.evaluation
        model.zero_grad(set_to_none=True)  # the budget covers a step that makes its gradients
        m = measure_step(lambda: _step(planned, case, 1), register=(model, case.args, case.kwargs))
        exact = _exact(model, planned, case)
        out.append(
            f"| {name} | {format_bytes(budget)} | {f:.2f} | {format_bytes(ev.peak_bytes)} | "
            f"{format_bytes(m.peak_bytes)} | {planned.plan.count(Decision.OFFLOAD)} values, "
            f"{format_bytes(ev.offload_bytes)} | {ev.transfer_s * 1e3:.3f} ({ev.hidden_transfer_s * 1e3:.3f}) | "
            f"{ev.cost_s * 1e3:.3f} | {recompute_ms:.3f} | {exact} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,cnn,gpt2")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--fractions", default="0.95,0.9,0.8")
    parser.add_argument("--solver", default="auto")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fractions = [float(x) for x in args.fractions.split(",")]
    lines = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for name in args.models.split(","):
        lines += rows(name, args.size, fractions, args.solver)
        print("\n".join(lines), flush=True)
    Path("results").mkdir(exist_ok=True)
    Path("results/offload.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
