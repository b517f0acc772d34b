"""The exhaustive oracle: simulate every combination of allowed decisions.

Exact over the canonical-schedule plan space by construction, so the exact solvers are
tested against it on small problems. Cost: prod(|allowed(i)|) simulations.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator

from remat_solvers.base import Options, finish
from remat_solvers.problem import Decision, Evaluation, Plan, Problem
from remat_solvers.registry import UnsupportedProblem
from remat_solvers.simulate import PlanError, evaluate

MAX_VARIABLES = 18
"""More decision values than this are refused (2**18 simulations of a ~50-node problem
take about 40 s)."""
MAX_COMBINATIONS = 2**MAX_VARIABLES
"""With OFFLOAD allowed a value has three choices; the product is capped the same way."""


class TooLargeForBrute(UnsupportedProblem):
    """The problem has too many decision values to enumerate."""


def solve_brute(problem: Problem, options: Options) -> Plan:
    """Every combination of `problem.allowed(i)` over the decision values; the cheapest
    valid plan that fits (ties: lower peak, then the lexicographically first decisions in
    `allowed` order) is OPTIMAL, else the smallest-peak valid plan is INFEASIBLE."""
    started = time.perf_counter()
    ids = problem.decision_ids
    choices = [problem.allowed(i) for i in ids]
    combinations = math.prod(len(c) for c in choices)
    if len(ids) > MAX_VARIABLES or combinations > MAX_COMBINATIONS:
        raise TooLargeForBrute(
            f"brute force over {len(ids)} decision values ({combinations} combinations) exceeds "
            f"its limit of {MAX_VARIABLES} values / {MAX_COMBINATIONS} combinations; "
            "use an exact solver ('ilp', 'dp') or a heuristic ('chen-greedy') instead"
        )
    best_fit = best_any = None
    for decisions, ev in valid_plans(problem):
        # Strict comparisons keep the first combination in product (= lexicographic) order.
        if ev.fits and (best_fit is None or (ev.cost_s, ev.peak_bytes) < best_fit[0]):
            best_fit = ((ev.cost_s, ev.peak_bytes), decisions)
        if best_any is None or (ev.peak_bytes, ev.cost_s) < best_any[0]:
            best_any = ((ev.peak_bytes, ev.cost_s), decisions)
    if best_fit is not None:
        return finish(problem, best_fit[1], "brute", started_s=started, optimal=True,
                      lower_bound_s=best_fit[0][0])
    # The all-SAVE plan is always valid, so best_any exists.
    return finish(problem, best_any[1], "brute", started_s=started)


def valid_plans(problem: Problem) -> Iterator[tuple[dict[int, Decision], Evaluation]]:
    """(decisions, simulate's evaluation) of every valid combination of allowed
    decisions, in product (= lexicographic) order; invalid ones (e.g. dropping a
    non-recomputable value backward needs) are skipped."""
    ids = problem.decision_ids
    for combo in itertools.product(*(problem.allowed(i) for i in ids)):
        decisions = dict(zip(ids, combo))
        try:
            yield decisions, evaluate(problem, decisions)
        except PlanError:
            continue
