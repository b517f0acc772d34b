"""What every solver shares: the options base class and the one way to build a Plan."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

from remat_solvers.problem import Decision, Plan, Problem, Status
from remat_solvers.simulate import evaluate


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """Options every solver accepts."""

    time_limit_s: float | None = None
    """Limit on the search in nominal seconds of deterministic work (`WorkClock`), never
    wall-clock seconds, so that the same problem and options give the same plan under any machine
    load; None: the solver's own default (or none)."""
    seed: int = 0
    """Seed for any randomized choice; the same seed gives the same plan."""
    workers: int = 1
    """Threads a solver may use (exact solvers only); 1 keeps runs deterministic."""


WORK_STEPS_PER_S = 500_000
"""Rate of the deterministic clock for the Python searches: this many simulated steps
(or evaluated block configurations times their size, in dp) count as one second.
`simulate` runs about 1e6 steps/s of a random_dag(400) on one idle core, fewer under
load; CP-SAT's own deterministic time (`max_deterministic_time`) is charged as it
reports it."""


TABLE_STEPS_PER_S = 4_000_000
"""Rate of the deterministic clock for dp's block tables (solvers/dp/tables.py): this many
charged table steps (a block's configurations times its values times the contexts of
a_{b-1}, charged each time a solve uses a table, built or cached) count as one second.
A cold `layers` solve builds about 3.5-5e6 charged steps per CPU second of
`block_tables` on the bench's GPT-2 and LLaMA graphs (bench/README.md, "The tables'
clock"), so a nominal second is about a second of one core. A charged step is less than
a step of work: a cold solve builds each attention table once for the several uses it
charges (layer 0's table comes in the same pass, and `layers`' two models share the
tables); charged at WORK_STEPS_PER_S, those tables would overrun auto's default 10 s."""


CPSAT_DET_PER_S = 0.5
"""CP-SAT deterministic seconds per nominal second, at most: its deterministic time runs
slower than CPU time on these models (LP-heavy search). 0.5 is below the median ratio
(0.63 deterministic seconds per CPU second, one worker, idle core) over the bench's
random DAGs and GPT-2 and LLaMA joint graphs, so a nominal second is about one second of
a core on the median problem (bench/README.md, "The ILP's clock"). On bigger models the
ratio falls far lower (bench/README.md, "The ILP's clock on deep graphs"), so `ilp`
charges a call the larger of this and a count of what CP-SAT reports
(solvers/ilp/clock.py)."""


class WorkClock:
    """A deterministic clock in nominal seconds: solvers charge the work they do
    (simulated steps at WORK_STEPS_PER_S, dp's table steps at TABLE_STEPS_PER_S, CP-SAT's
    calls by their deterministic time and counts (solvers/ilp/clock.py), what sub-solvers
    report in `Plan.work_s`) and stop when it runs
    out. Unlike the wall clock it does not depend on the machine's load, so a search cut
    by its limit still returns the same plan every time; on an idle machine a nominal
    second is roughly a second of one core, on a loaded one it takes longer."""

    def __init__(self, limit_s: float | None) -> None:
        self.limit_s = math.inf if limit_s is None else float(limit_s)
        self.spent_s = 0.0

    def charge_steps(self, steps: int) -> None:
        self.spent_s += steps / WORK_STEPS_PER_S

    def charge_table_steps(self, steps: int) -> None:
        self.spent_s += steps / TABLE_STEPS_PER_S

    def affords_table_steps(self, steps: int) -> bool:
        """Whether charging `steps` table steps would leave the clock within its limit."""
        return not self.spent_s + steps / TABLE_STEPS_PER_S > self.limit_s

    def charge_s(self, seconds: float) -> None:
        self.spent_s += max(0.0, seconds)

    @property
    def left_s(self) -> float:
        return self.limit_s - self.spent_s

    @property
    def expired(self) -> bool:
        return self.spent_s > self.limit_s


def hint_decisions(hint: object) -> dict[int, Decision] | None:
    """A `hint` option as decisions: a Plan, a mapping of decisions, or None."""
    if hint is None:
        return None
    if isinstance(hint, Plan):
        return dict(hint.decisions)
    return dict(hint)  # type: ignore[call-overload]


def finish(
    problem: Problem,
    decisions: Mapping[int, Decision],
    solver: str,
    *,
    started_s: float,
    optimal: bool = False,
    lower_bound_s: float | None = None,
    schedule: Sequence[int] | None = None,
    work_s: float = 0.0,
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
        work_s=work_s,
    )
