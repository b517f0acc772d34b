"""What `ilp`'s model building and CP-SAT calls cost on the deterministic clock.

CP-SAT's own deterministic time undercounts its work on big models: on the deep
transformer joint graphs of bench/depth.py (GPT-2 with 12-48 layers, LLaMA with 32;
937-3,565 decision values) one deterministic second took 4-7 CPU seconds of the rows
model and 25-85 of the full model (its Cumulative over 1,080-4,104 intervals), where
`base.CPSAT_DET_PER_S` assumes 2 (measured on graphs of 100-340 values). Charged by
deterministic time alone, `ilp`'s default 10 s limit would take 12-78 CPU s a row there
(bench/README.md, "The ILP's clock on deep graphs"). Counting what CP-SAT reports instead (one worker: deterministic
counts) matches each call's CPU time within 1.5x on those graphs:

  cost = constraints / CONSTRAINTS_PER_S                       (presolve and loading)
       + integer propagations * (1 + intervals / 200) / PROPAGATIONS_PER_S
       + branches / BRANCHES_PER_S

charged as the larger of that and the deterministic time at CPSAT_DET_PER_S (on the
small graphs the deterministic time is usually the larger: on random_dag(40-300) and the
zoo's tiny GPT-2, LLaMA and ViT their plans are the same under either charge). Each call's deterministic
limit converts the nominal seconds left at a ratio from the model's size, or lower where
the model's earlier calls showed less deterministic time per charged second, so a solve
stops near its limit; a call whose fixed cost the time left cannot pay for is not made.
Building the model is charged up front per decision value, and declined the same way.
Every count is deterministic: the same problem and options give the same plan under any
load.
"""

from __future__ import annotations

from ortools.sat.python import cp_model

from remat_solvers.base import CPSAT_DET_PER_S, WorkClock

CONSTRAINTS_PER_S = 70_000
"""Model constraints per nominal second of a call's fixed cost (presolve, loading):
calls that stopped before any search took 10-27 us a constraint (0.4-2.0 CPU s at
18,911-73,492 constraints) on the depth graphs."""
PROPAGATIONS_PER_S = 950_000
"""CP-SAT integer propagations per nominal second (1.05 us each): fitted with
BRANCHES_PER_S to the rows models' calls on GPT-2-12, GPT-2-24 and LLaMA-32 (10.8, 27.9
and 2.5 CPU s for 8.3M, 9.7M and 1.7M propagations with 71k, 590k and 27k branches)."""
INTERVALS_PER_PROPAGATION = 200
"""With a Cumulative of n intervals, an integer propagation costs 1 + n / 200
propagations: the full models' calls took 5.3, 12.7 and 14.7 us a propagation at
1,080, 2,088 and 2,642 intervals (GPT-2-12, GPT-2-24, LLaMA-32; k = 1/270, 1/188, 1/203)."""
BRANCHES_PER_S = 33_000
"""CP-SAT branches per nominal second (30 us each: the LP of hundreds of components is
solved again at each node); see PROPAGATIONS_PER_S."""
VALUES_PER_S = 2_500
"""Decision values per nominal second of building a CanonicalModel: 0.73, 1.05, 1.24
and 1.32 CPU s for 937, 1,813, 2,689 and 3,565 values (0.37-0.78 ms each)."""
HINT_DEFS_PER_S = 150_000
"""Implied variables per nominal second of a complete hint (CanonicalModel.hint): 0.07-
0.25 CPU s for 10,944-41,534 of them."""


def cumulative_intervals(model) -> int:
    """Intervals in the model's Cumulative (0 before `add_cumulative`)."""
    return len(model.intervals) if model.cumulative else 0


def fixed_cost_s(model) -> float:
    """Nominal seconds a CP-SAT call on `model` costs before it searches."""
    return len(model.model.proto.constraints) / CONSTRAINTS_PER_S


def call_cost_s(model, response) -> float:
    """Nominal seconds of a finished CP-SAT call on `model` (see the module docstring)."""
    counted = (fixed_cost_s(model)
               + response.num_integer_propagations * (1 + cumulative_intervals(model) / INTERVALS_PER_PROPAGATION)
               / PROPAGATIONS_PER_S
               + response.num_branches / BRANCHES_PER_S)
    return max(response.deterministic_time / CPSAT_DET_PER_S, counted)


PRIOR_CONSTRAINTS = 16_000
PRIOR_INTERVALS = 212
"""The first call on a model assumes CPSAT_DET_PER_S / (1 + constraints / 16,000 +
(intervals / 212) ** 1.5) deterministic seconds per nominal second: within 2x of the
ratio the calls show on the depth graphs' rows models, about 3x low at most on their
full models, a little low on BERT tiny's (bench/README.md, "The ILP's clock on deep
graphs"). A prior too low only ends the first call early: `ilp` calls again at the
ratio it showed."""


def det_per_s(model) -> float:
    """CP-SAT deterministic seconds per nominal second for the next call on `model`: the
    prior from its size (PRIOR_CONSTRAINTS), or the ratio of its earlier calls'
    deterministic to charged seconds where that is lower. Never higher than the prior: a
    call that stopped in presolve shows a ratio far above its search's (GPT-2-24's full
    model: 0.1 against 0.017), and a second call at that ratio ran to twice the limit."""
    size = (1 + len(model.model.proto.constraints) / PRIOR_CONSTRAINTS
            + (cumulative_intervals(model) / PRIOR_INTERVALS) ** 1.5)
    prior = CPSAT_DET_PER_S / size
    if model.cpsat_charged_s > 0:
        return min(prior, model.cpsat_det_s / model.cpsat_charged_s)
    return prior


def affords_call(model, clock: WorkClock, seconds: float) -> bool:
    """Whether `seconds` of nominal time (what a phase has left) pays a call's fixed cost."""
    return seconds > 0 and seconds >= fixed_cost_s(model) and not clock.expired


def run(solver: cp_model.CpSolver, model, clock: WorkClock) -> int:
    """Solve and charge the call's cost to the clock (and to the model's own tally)."""
    status = solver.solve(model.model)
    response = solver.response_proto
    cost = call_cost_s(model, response)
    model.cpsat_det_s += response.deterministic_time
    model.cpsat_charged_s += cost
    clock.charge_s(cost)
    return status


def build_cost_s(problem) -> float:
    """Nominal seconds charged for building a CanonicalModel of `problem`, before it is built."""
    return len(problem.decision_ids) / VALUES_PER_S


def charge_build(problem, clock: WorkClock, left_s: float, at_least_s: float = 0.0) -> bool:
    """Charge building a CanonicalModel of `problem` when `left_s` (what the phase has
    left) pays for it and is at least `at_least_s`; False, charging nothing, otherwise."""
    build_s = build_cost_s(problem)
    if left_s < max(at_least_s, build_s):
        return False
    clock.charge_s(build_s)
    return True


def hint(model, decisions, clock: WorkClock) -> None:
    """A complete hint, charged per implied variable."""
    model.hint(decisions)
    clock.charge_s(len(model.defs) / HINT_DEFS_PER_S)
