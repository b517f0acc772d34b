"""What every solver shares: the options base class and the one way to build a Plan."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence

from solvers.problem import Decision, Plan, Problem, Status
from solvers.simulate import evaluate


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Options every solver accepts."""

    time_limit_s: float | None = None
    """Wall-clock limit for the search; None: the solver's own default (or none)."""
    seed: int = 0
    """Seed for any randomized choice; the same seed gives the same plan."""
    workers: int = 1
    """Threads a solver may use (exact solvers only); 1 keeps runs deterministic."""


def finish(
    problem: Problem,
    decisions: Mapping[int, Decision],
    solver: str,
    *,
    started_s: float,
    optimal: bool = False,
    lower_bound_s: float | None = None,
    schedule: Sequence[int] | None = None,
) -> Plan:
    """Simulate `decisions` and wrap them in a Plan whose claims are simulate's numbers.

    Status is INFEASIBLE when the plan does not fit, else OPTIMAL if the caller proved
    optimality, else FEASIBLE."""
    ev = evaluate(problem, decisions, schedule)
    if not ev.fits:
        status = Status.INFEASIBLE
    elif optimal:
        status = Status.OPTIMAL
    else:
        status = Status.FEASIBLE
    return Plan(
        decisions=dict(decisions),
        status=status,
        solver=solver,
        objective_s=ev.cost_s,
        peak_bytes=ev.peak_bytes,
        schedule=None if schedule is None else tuple(schedule),
        lower_bound_s=lower_bound_s,
        solve_s=time.perf_counter() - started_s,
    )
