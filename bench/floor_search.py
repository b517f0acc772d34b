"""The floor search on graphs without repeated layers: what `ilp`'s smallest-peak loop
finds, how long it takes, when its last lower peak came, and what the descent after it
(`least_peak.descend`) adds.

    HF_HUB_OFFLINE=1 python bench/floor_search.py               # seeds 0-39, about 15 min
    HF_HUB_OFFLINE=1 python bench/floor_search.py --seeds 0 3 16

Models: `remat.testing.compositions.composition(seed, EAGER)` (random stacks of 1-4 MLP,
gated-MLP and attention blocks, dropout and stochastic depth drawn), traced once each.
Seeds whose graphs `auto` gives to brute or dp at budget 0 are listed (that solver in
parentheses) but not searched.
For each, `ilp` at budget 0 (the floor search's query), warm-started as
`least_peak_plan` warm-starts it, once with its default `least_peak_stall` and once
with the stall rule off; then `least_peak_plan`, the floor remat states (ilp with the
stall, then the descent). Columns: decision values; the smallest peak each found; the
CPU seconds of each; the min-peak model's solutions, and the one that gave the last
lower peak (0: none beat the warm start's plan). One thread, so the seconds are one core's.
"""

from __future__ import annotations

import argparse
import time

import torch

import remat
from remat.testing.compositions import EAGER, composition, describe
from remat_solvers import Decision, UnsupportedProblem, decisions_all, solve
from remat_solvers.auto import AutoOptions, choose
from remat_solvers.ilp import solver as ilp
from remat_solvers.least_peak import least_peak_plan
from remat_solvers.simulate import evaluate

NEVER = 10**9


def search(problem, stall: int) -> dict:
    """`ilp` at budget 0 from the recompute-everything plan; counts the min-peak model's
    solutions (`_least_peak` simulates its start, then each solution once) and the one
    that gave the last lower peak (0: none beat the start)."""
    zero = problem.with_budget(0)
    peaks: list[int] = []
    simulate, least_peak = ilp._simulate, ilp._least_peak
    inside = []

    def counting(p, decisions, clock=None):
        ev = simulate(p, decisions, clock)
        if inside:
            peaks.append(ev.peak_bytes if ev is not None else None)
        return ev

    def searching(*args):
        inside.append(True)
        try:
            return least_peak(*args)
        finally:
            inside.pop()

    ilp._simulate, ilp._least_peak = counting, searching
    try:
        started = time.process_time()
        plan = solve(zero, "ilp", hint=decisions_all(zero, Decision.RECOMPUTE), least_peak_stall=stall)
        seconds = time.process_time() - started
    finally:
        ilp._simulate, ilp._least_peak = simulate, least_peak
    best, last = None, 0
    for k, peak in enumerate(peaks):
        if peak is not None and (best is None or peak < best):
            best, last = peak, k
    return {"peak": evaluate(zero, plan.decisions).peak_bytes, "s": seconds,
            "solutions": max(0, len(peaks) - 1), "last": last}


def searched_by(zero) -> str:
    """The solver `auto` gives the floor search's query to: the first in its order that
    does not decline the problem."""
    for name in choose(zero, AutoOptions()):
        if name == "ilp":
            return name
        try:
            solve(zero, name)
        except UnsupportedProblem:
            continue
        return name
    return "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="*", default=list(range(40)))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| seed | model | values | ilp, stall 8 (B) | CPU s | solutions (last lower) | ilp, no stall (B) | CPU s "
          "| solutions (last lower) | stated floor (B) | CPU s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        model, x = composition(seed, EAGER)
        problem = remat.plan(model, (x,), budget="100%", solver="none").problem
        n = len(problem.decision_ids)
        first = searched_by(problem.with_budget(0))
        if first != "ilp":
            print(f"| {seed} | {describe(model)} | {n} | ({first}) | | | | | | | |", flush=True)
            continue
        a, b = search(problem, ilp.ILPOptions().least_peak_stall), search(problem, NEVER)
        started = time.process_time()
        stated = least_peak_plan(problem).peak_bytes
        stated_s = time.process_time() - started
        print(f"| {seed} | {describe(model)} | {n} | {a['peak']:,} | {a['s']:.1f} | {a['solutions']} ({a['last']}) "
              f"| {b['peak']:,} | {b['s']:.1f} | {b['solutions']} ({b['last']}) | {stated:,} | {stated_s:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
