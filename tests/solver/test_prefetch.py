"""Reload prefetch: reloads issued early overlap backward compute; simulate holds their
bytes from the early step on and prices only the exposed part; the budget bounds how
early. Hand-computed cases, an exhaustive oracle on random problems, and the executed
step on CPU with the host store (measured peak equal to the prediction, bit-exact)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat.testing.measure import measure_step
from remat_solvers import Decision, Plan, Problem, Status, StepKind, evaluate, simulate, solve
from remat_solvers.prefetch import prefetch, prefetched_ids
from chains import chain
from nets import Tower
from strategies import problems

S, O = Decision.SAVE, Decision.OFFLOAD


def _chain_at_prefetch_costs(gc_s: float, gb_s: float, budget: int) -> Problem:
    """The chain of tests/chains.py at prefetch's costs (kept here: its timeline is what
    these tests work from): gc gc_s s, gb gb_s s, ga 1 s; bandwidth 50 B/s: a's 100 bytes
    take 2 s each way.

    With a OFFLOAD, b and c SAVE, canonical timeline (tests/solver/test_simulate.py):
    Fa 110, Fb 210 (a leaves -> 110), Fc 210, Fd 214; Bt 218; Bgc 318 (t, c die -> 214);
    Bgb 314 (gc, b die -> 114); Ra 214; Bga 314. Peak 318; the reload shows in full, 2 s.
    Reload before gb: Bgc 318 -> 214; Ra 314; Bgb 414 -> 214; Bga 314. Peak 414.
    Reload before gc: Bt 218; Ra 318; Bgc 418 -> 314; Bgb 414; Bga 314. Peak 418."""
    return chain(gc_s=gc_s, gb_s=gb_s, ga_s=1.0, bandwidth=50.0, budget=budget)


def _offload_a(problem: Problem) -> Plan:
    plan = solve(problem.with_budget(10_000), "all")  # any plan; decisions replaced below
    return dataclasses.replace(plan, decisions={1: O, 2: S, 3: S}, schedule=None)


@pytest.mark.parametrize(
    ("gc_s", "gb_s", "budget", "schedule", "peak", "exposed_s"),
    [
        # gb alone (2 s) hides the 2 s copy: issued before gb, no earlier
        (1.0, 2.0, 10_000, (5, 6, 1, 7, 8), 414, 0.0),
        # gb (1 s) hides half; before gc, gc + gb (2 s) hide it all
        (1.0, 1.0, 10_000, (5, 1, 6, 7, 8), 418, 0.0),
        # the budget allows only "before gb": 1 s of the copy stays exposed
        (1.0, 1.0, 414, (5, 6, 1, 7, 8), 414, 1.0),
    ],
)
def test_prefetch_issues_the_reload_as_late_as_hides_it_within_the_budget(
        gc_s, gb_s, budget, schedule, peak, exposed_s):
    problem = _chain_at_prefetch_costs(gc_s, gb_s, budget)
    canonical = evaluate(problem, {1: O, 2: S, 3: S})
    assert (canonical.peak_bytes, canonical.offload_s) == (318, 2.0)  # the store is hidden
    plan = prefetch(problem, _offload_a(problem))
    assert plan.schedule == schedule and plan.decisions == {1: O, 2: S, 3: S}
    ev = simulate(problem, plan)
    assert (ev.peak_bytes, ev.offload_s, ev.transfer_s) == (peak, exposed_s, 4.0)
    assert (plan.peak_bytes, plan.objective_s) == (peak, exposed_s)
    assert prefetched_ids(problem, ev) == (1,)


def test_a_budget_at_the_canonical_peak_keeps_the_plan():
    problem = _chain_at_prefetch_costs(1.0, 2.0, 318)
    plan = _offload_a(problem)
    assert prefetch(problem, plan) is plan


def test_the_canonical_order_written_out_prices_as_the_canonical_schedule():
    # before gb: reload a, recompute b from it, then gb: the recompute waits for the
    # copy, which shows in full in both (an explicit schedule prices its waits)
    problem = _chain_at_prefetch_costs(1.0, 2.0, 10_000)
    decisions = {1: O, 2: Decision.RECOMPUTE, 3: S}
    canonical = evaluate(problem, decisions)
    order = tuple(s.node_id for s in canonical.steps[len(problem.forward_ids):])
    assert [s.kind for s in canonical.steps[-4:-1]] == [StepKind.RELOAD, StepKind.RECOMPUTE, StepKind.BACKWARD]
    assert canonical.offload_s == 2.0
    assert evaluate(problem, decisions, order) == canonical


def _positions(problem: Problem, plan: Plan) -> list[tuple[int, ...]]:
    """Every backward schedule that moves the plan's one reload to an earlier step."""
    ev = evaluate(problem, plan.decisions)
    back = [s.node_id for s in ev.steps[len(problem.forward_ids):]]
    p = [s.kind for s in ev.steps[len(problem.forward_ids):]].index(StepKind.RELOAD)
    out = []
    for q in range(p + 1):
        moved = list(back)
        moved.insert(q, moved.pop(p))
        out.append(tuple(moved))
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(problem=problems(max_forward=6, offload=True), data=st.data())
def test_prefetch_is_the_best_fitting_position_for_one_reload(problem, data):
    """Oracle: over every earlier position of a single reload, prefetch's schedule fits,
    has the least exposed seconds among those that fit, and among those the latest."""
    offloadable = [i for i in problem.decision_ids if Decision.OFFLOAD in problem.allowed(i)]
    if not offloadable:
        return
    target = data.draw(st.sampled_from(offloadable))
    decisions = {i: (O if i == target else S) for i in problem.decision_ids}
    base = evaluate(problem, decisions)
    if not any(s.kind is StepKind.RELOAD for s in base.steps):
        return
    # a budget from the just-in-time peak up to room for the value anywhere
    room = problem.nodes[target].out_bytes
    problem = problem.with_budget(base.peak_bytes + data.draw(st.integers(0, room)))
    plan = dataclasses.replace(solve(problem.with_budget(10**12), "all"), decisions=decisions, schedule=None)
    got = prefetch(problem, plan)
    assert got.decisions == decisions
    got_ev = simulate(problem, got)
    assert got_ev.fits and got_ev.cost_s <= base.cost_s
    fitting = [(k, evaluate(problem, decisions, s)) for k, s in enumerate(_positions(problem, plan))]
    fitting = [(k, ev) for k, ev in fitting if ev.fits]
    best = min(ev.offload_s for _, ev in fitting)
    assert got_ev.offload_s == pytest.approx(best, abs=1e-12)
    if got is not plan:
        latest = max(k for k, ev in fitting if ev.offload_s <= best)
        assert got.schedule == _positions(problem, plan)[latest]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(problem=problems(max_forward=6, offload=True))
def test_prefetch_never_breaks_the_budget_nor_raises_the_cost(problem):
    plan = solve(problem, "greedy")
    if plan.status is Status.INFEASIBLE:
        return
    got = prefetch(problem, plan)
    ev = simulate(problem, got)
    assert got.decisions == plan.decisions
    assert ev.fits and got.peak_bytes == ev.peak_bytes
    assert ev.cost_s <= simulate(problem, plan).cost_s
    assert got.objective_s == ev.cost_s


# ---- executed: CPU, host store -----------------------------------------------------------

@pytest.mark.usefixtures("one_thread")  # conftest.py
def test_prefetched_step_peaks_as_predicted_and_equals_eager():
    torch.manual_seed(0)
    model, x = Tower(depth=6), torch.randn(1024, 64)
    planned = remat.plan(model, (x,), budget="80%", solver="greedy", offload=True)
    step = planned.step
    problem = step.graph_problem.problem
    assert step.plan.schedule is not None and step.plan.count(O) > 0
    assert len(prefetched_ids(problem, step.evaluation)) > 0
    just_in_time = simulate(problem, step.plan.decisions)
    assert step.evaluation.offload_s < just_in_time.offload_s
    assert step.evaluation.hidden_transfer_s > just_in_time.hidden_transfer_s
    # the reloads run where the schedule puts them: before a backward op that precedes
    # the value's first reader, with the wait just before that reader
    code = step.backward.code
    assert "reload_wait" in code
    assert f"{len(prefetched_ids(problem, step.evaluation))} reloads prefetched" in planned.summary()
    model.zero_grad(set_to_none=True)
    m = measure_step(lambda: planned(x).backward(), register=(model, x))
    assert m.peak_bytes == planned.predicted_peak_bytes <= planned.budget_bytes
    eager = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss_p, loss_e = planned(x), eager(x)
    loss_p.backward()
    loss_e.backward()
    assert torch.equal(loss_p, loss_e)
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)

