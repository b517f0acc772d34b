"""A floor that plans: the smallest reachable peak comes with the plan that reaches it,
does not depend on the budget asked for, and planning at exactly that budget returns
that plan or a cheaper one (warm-started with it)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strategies import problems

import remat
from remat.errors import InfeasibleBudgetError
from remat.planning import floor as remat_floor
from remat.testing import zoo
from remat_solvers import Decision, Status, builders, decisions_all, simulate, solve
from remat_solvers.base import WorkClock
from remat_solvers.least_peak import descend, least_peak_plan, peak_lower_bound, scheduled_plans
from remat_solvers.simulate import PlanError, evaluate


@settings(max_examples=40)
@given(problem=problems(max_forward=7))
def test_floor_is_brutes_least_peak_on_small_problems(problem):
    plan = least_peak_plan(problem)
    assert plan.peak_bytes == solve(problem.with_budget(0), "brute").peak_bytes
    assert simulate(problem.with_budget(plan.peak_bytes), plan).fits


@settings(max_examples=40)
@given(problem=problems(max_forward=7, offload=None), start=st.sampled_from([Decision.SAVE, Decision.RECOMPUTE]))
def test_the_descent_ends_where_no_one_change_lowers_the_peak_and_never_rises(problem, start):
    zero = problem.with_budget(0)
    begin = decisions_all(zero, start)
    assume(_key(zero, begin) is not None)
    end = descend(zero, begin, WorkClock(None))
    assert _key(zero, end) <= _key(zero, begin)
    for i in zero.decision_ids:  # a local minimum of (peak, cost)
        for decision in zero.allowed(i):
            key = _key(zero, {**end, i: decision})
            assert key is None or key >= _key(zero, end), (i, decision)


def _key(problem, decisions):
    try:
        ev = evaluate(problem, decisions)
    except PlanError:
        return None
    return ev.peak_bytes, ev.cost_s


@settings(max_examples=40)
@given(problem=problems(max_forward=7))
def test_no_plan_peaks_below_the_lower_bound(problem):
    """`peak_lower_bound` (parameters, inputs and outputs, live at the last step of
    every plan) is at most brute's least peak and the floor of the scheduled plans."""
    bound = peak_lower_bound(problem)
    assert bound <= solve(problem.with_budget(0), "brute").peak_bytes
    assert all(bound <= plan.peak_bytes for plan in scheduled_plans(problem, least_peak_plan(problem).decisions))


def test_a_budget_below_the_lower_bound_is_refused_without_a_solve(monkeypatch):
    """The planner answers such a budget from the floor search alone: no solve at the
    budget asked for, and the same floor as a budget above the bound but below the floor."""
    from remat import partitioner

    case = _case()
    solves, bounds = [], []
    solve_at, refused = partitioner.Partitioner._solve, partitioner.refused_without_solving
    monkeypatch.setattr(partitioner.Partitioner, "_solve", lambda self, problem, options: solves.append(
        problem.budget_bytes) or solve_at(self, problem, options))
    monkeypatch.setattr(partitioner, "refused_without_solving", lambda problem, *a, **k: bounds.append(
        peak_lower_bound(problem)) or refused(problem, *a, **k))
    with pytest.raises(InfeasibleBudgetError) as below:
        remat.plan(case.model, case.args, case.kwargs, budget=1, **LIMIT)
    assert solves == []
    floor, bound = below.value.min_peak_bytes, bounds[0]
    assert bound < floor  # gpt2 tiny: activations above the weights, gradients and logits
    with pytest.raises(InfeasibleBudgetError) as between:
        remat.plan(case.model, case.args, case.kwargs, budget=bound, **LIMIT)
    assert solves == [bound] and between.value.min_peak_bytes == floor


def test_floor_does_not_depend_on_the_budget_and_plans_at_itself():
    base = builders.random_dag(60, seed=4, view_prob=0.1)
    a = least_peak_plan(base.with_budget(0), time_limit_s=0.5)
    b = least_peak_plan(base.with_budget(10**12), time_limit_s=0.5)
    assert a.decisions == b.decisions and a.peak_bytes == b.peak_bytes
    for other in ("all", "chen-greedy", "greedy"):
        assert a.peak_bytes <= solve(base.with_budget(0), other).peak_bytes
    at_floor = base.with_budget(a.peak_bytes)
    for solver in ("ilp", "auto"):
        plan = solve(at_floor, solver, hint=a, time_limit_s=0.5)
        assert plan.status is not Status.INFEASIBLE
        assert plan.peak_bytes <= a.peak_bytes and plan.objective_s <= a.objective_s


def test_the_floor_without_its_descent_is_the_searchs_plan_and_is_remembered_apart():
    """`descend_floor=False` (inductor's closed loop tries both floors,
    `PlannerSettings.descend_floor`): the plan the search found, which the descent starts
    from and never raises. The process's floor cache keeps the two apart: a solve is
    warm-started only with the floor of its own setting."""
    base = builders.random_dag(60, seed=4, view_prob=0.1)
    zero = base.with_budget(0)
    found = least_peak_plan(base, time_limit_s=0.5, descend_floor=False)
    descended = least_peak_plan(base, time_limit_s=0.5)
    assert found.decisions != descended.decisions  # on this graph the descent changes the plan
    assert _key(zero, descended.decisions) <= _key(zero, found.decisions)
    remat_floor._FLOOR_PLANS.clear()
    assert remat_floor.least_peak(base, time_limit_s=0.5).decisions == descended.decisions
    assert remat_floor.least_peak(base, time_limit_s=0.5, descend_floor=False).decisions == found.decisions
    assert remat_floor._remembered(zero, True).decisions == descended.decisions
    assert remat_floor._remembered(zero, False).decisions == found.decisions
    remat_floor._FLOOR_PLANS.clear()


LIMIT = dict(time_limit_s=0.5)  # the floor search and the solves share it (deterministic)


def _case():
    return zoo.build("gpt2", size="tiny")


def test_planning_at_the_reported_floor_succeeds_and_is_no_costlier():
    case = _case()
    with pytest.raises(InfeasibleBudgetError) as info:
        remat.plan(case.model, case.args, case.kwargs, budget=1, **LIMIT)
    err = info.value
    floor_plan = err.min_peak_plan
    assert floor_plan is not None and floor_plan.peak_bytes == err.min_peak_bytes
    planned = remat.plan(case.model, case.args, case.kwargs, budget=err.min_peak_bytes, **LIMIT)
    assert planned.predicted_peak_bytes <= err.min_peak_bytes
    assert planned.plan.objective_s <= floor_plan.objective_s
    # Another process remembers nothing: the deterministic search reaches the same
    # floor, and the error's plan can be handed over as a hint.
    remat_floor._FLOOR_PLANS.clear()
    again = remat.plan(case.model, case.args, case.kwargs, budget=err.min_peak_bytes, **LIMIT)
    assert again.predicted_peak_bytes <= err.min_peak_bytes
    remat_floor._FLOOR_PLANS.clear()
    hinted = remat.plan(case.model, case.args, case.kwargs, budget=err.min_peak_bytes, hint=floor_plan, **LIMIT)
    assert hinted.plan.objective_s <= floor_plan.objective_s
    # One byte below, it is refused with the same floor.
    with pytest.raises(InfeasibleBudgetError) as below:
        remat.plan(case.model, case.args, case.kwargs, budget=err.min_peak_bytes - 1, **LIMIT)
    assert below.value.min_peak_bytes == err.min_peak_bytes


def _graph_problem(problem):
    from remat.frontend.problem import GraphProblem

    blank = tuple("" for _ in problem.nodes)
    return GraphProblem(problem=problem, fx_names=tuple(() for _ in problem.nodes), value_name=blank,
                        source=blank, never_replay={})


def test_the_reported_floor_does_not_depend_on_the_failed_solve():
    """The failed solve's plan depends on the budget asked for; the floor must not (Whisper
    tiny's differs between a 60% and a 1-byte budget, and planning at the smaller one in a
    new process would be refused). With a search this short the floor is the
    recompute-everything plan, and greedy's plan at 30% peaks far lower: handed over as
    the failed solve, it would become the floor."""
    base = builders.random_dag(60, seed=4, view_prob=0.1)
    options = {"time_limit_s": 1e-3}
    save = simulate(base, solve(base, "none")).peak_bytes
    low = solve(base.with_budget(save * 3 // 10), "greedy")
    floors = set()
    for failed in (solve(base.with_budget(1), "all"), low):
        remat_floor._FLOOR_PLANS.clear()
        _, err = remat_floor.at_the_floor(_graph_problem(base.with_budget(1)), failed, solver="ilp",
                                          options=options, baseline_bytes=save)
        floors.add(err.min_peak_bytes)
    assert floors == {least_peak_plan(base, **options).peak_bytes} and low.peak_bytes < min(floors)
    remat_floor._FLOOR_PLANS.clear()  # a new process, planning at the floor
    at_floor = base.with_budget(floors.pop())
    failed = solve(at_floor, "ilp", **options)
    plan, err = remat_floor.at_the_floor(_graph_problem(at_floor), failed, solver="ilp", options=options,
                                         baseline_bytes=save) if failed.status is Status.INFEASIBLE else (failed, None)
    assert err is None and simulate(at_floor, plan).fits
