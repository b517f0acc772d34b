"""ilp's deterministic clock (solvers/ilp/clock.py): a CP-SAT call is charged the larger of
its deterministic time and a count of what it reports, the next call's deterministic
limit follows the ratio the model's calls showed, and a model the limit cannot pay for
is not built."""

from __future__ import annotations

from types import SimpleNamespace


from remat_solvers import Status, builders, simulate, solve
from remat_solvers.base import CPSAT_DET_PER_S, WorkClock
from remat_solvers.ilp import clock as cost
from remat_solvers.ilp import solver as ilp_solver
from remat_solvers.ilp.model import CanonicalModel
from remat_solvers.ilp.solver import ILPOptions


def _full_model():
    problem = builders.with_budget_fraction(builders.random_dag(60, seed=3, view_prob=0.2), 0.5)
    model = CanonicalModel(problem)  # with the Cumulative (102 intervals)
    cost.hint(model, solve(problem, "chen-greedy").decisions, WorkClock(None))
    return problem, model


def _counted_s(model, response) -> float:
    return (len(model.model.proto.constraints) / cost.CONSTRAINTS_PER_S
            + response.num_integer_propagations * (1 + len(model.intervals) / cost.INTERVALS_PER_PROPAGATION)
            / cost.PROPAGATIONS_PER_S
            + response.num_branches / cost.BRANCHES_PER_S)


def test_a_call_is_charged_the_larger_of_its_deterministic_time_and_its_counts():
    problem, model = _full_model()
    assert cost.cumulative_intervals(model) == len(model.intervals) == 102
    clock = WorkClock(None)
    solver = ilp_solver._solver(ILPOptions(), 0.05, len(problem.decision_ids))
    cost.run(solver, model, clock)
    r = solver.response_proto
    assert r.num_integer_propagations > 0 and r.num_branches > 0  # it searched
    assert clock.spent_s == model.cpsat_charged_s == max(r.deterministic_time / CPSAT_DET_PER_S, _counted_s(model, r))
    assert model.cpsat_det_s == r.deterministic_time
    # A call that propagates through many intervals per deterministic second (the deep
    # graphs' full models: 1,080-4,104 intervals) is charged its counts.
    heavy = SimpleNamespace(deterministic_time=0.1, num_integer_propagations=1_000_000, num_branches=30_000)
    assert cost.call_cost_s(model, heavy) == _counted_s(model, heavy) > 0.1 / CPSAT_DET_PER_S


def test_the_next_limit_follows_the_ratio_of_earlier_calls():
    problem, model = _full_model()
    # The first call: a prior from the model's size, below CPSAT_DET_PER_S.
    size = 1 + len(model.model.proto.constraints) / cost.PRIOR_CONSTRAINTS + (102 / cost.PRIOR_INTERVALS) ** 1.5
    prior = CPSAT_DET_PER_S / size
    assert cost.det_per_s(model) == prior < CPSAT_DET_PER_S
    # Later calls: the ratio earlier calls showed where lower, never above the prior.
    model.cpsat_det_s, model.cpsat_charged_s = 0.3, 6.0
    assert cost.det_per_s(model) == 0.3 / 6.0 < prior
    model.cpsat_det_s, model.cpsat_charged_s = 3.0, 1.0
    assert cost.det_per_s(model) == prior
    # A call whose fixed cost the time left cannot pay for is not made.
    clock = WorkClock(None)
    assert not cost.affords_call(model, clock, 0.5 * cost.fixed_cost_s(model))
    assert cost.affords_call(model, clock, cost.fixed_cost_s(model))


def test_the_cumulative_starts_a_fresh_tally():
    problem = builders.with_budget_fraction(builders.transformer(2, seq=64), 0.6)
    model = CanonicalModel(problem, cumulative=False)
    model.cpsat_det_s, model.cpsat_charged_s = 1.0, 4.0
    model.add_cumulative()
    assert (model.cpsat_det_s, model.cpsat_charged_s) == (0.0, 0.0)


def test_a_model_the_limit_cannot_pay_for_is_not_built(monkeypatch):
    problem = builders.with_budget_fraction(builders.random_dag(300, seed=3, view_prob=0.1), 0.7)
    limit_s = 0.1
    assert cost.build_cost_s(problem) == 300 / cost.VALUES_PER_S > limit_s
    built = []
    monkeypatch.setattr(ilp_solver, "CanonicalModel", lambda *a, **k: built.append(a) or CanonicalModel(*a, **k))
    plan = solve(problem, "ilp", time_limit_s=limit_s)
    assert built == []
    assert 0.0 < plan.work_s <= limit_s
    assert plan.status is Status.FEASIBLE and simulate(problem, plan.decisions).fits
    assert plan.lower_bound_s == 0.0
    # With the limit to pay for it, the model is built (rows, then the full model).
    solve(problem, "ilp", time_limit_s=2.0)
    assert len(built) == 1


def test_building_and_hints_are_charged():
    problem = builders.with_budget_fraction(builders.random_dag(300, seed=3, view_prob=0.1), 0.7)
    clock = WorkClock(None)
    model = CanonicalModel(problem, cumulative=False)
    cost.hint(model, solve(problem, "chen-greedy").decisions, clock)
    assert clock.spent_s == len(model.defs) / cost.HINT_DEFS_PER_S > 0
