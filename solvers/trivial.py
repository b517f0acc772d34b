"""The two extremes: `none` keeps every value, `all` recomputes everything it may."""

from __future__ import annotations

import time

from remat_solvers.base import Options, finish
from remat_solvers.problem import Decision, Plan, Problem, decisions_all


def solve_none(problem: Problem, options: Options) -> Plan:
    """Save every decision value: the no-remat baseline."""
    started = time.perf_counter()
    return finish(problem, decisions_all(problem, Decision.SAVE), "none", started_s=started)


def solve_all(problem: Problem, options: Options) -> Plan:
    """Recompute every recomputable value; save the rest (random, mutating, ...)."""
    started = time.perf_counter()
    return finish(problem, decisions_all(problem, Decision.RECOMPUTE), "all", started_s=started)
