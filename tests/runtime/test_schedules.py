"""Backward schedules that recompute a value more than once (solvers/segmented.py),
simulated and executed (remat/runtime/schedule.py rebuilds the backward from the steps)."""

from __future__ import annotations

import dataclasses


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from nets import Tower, assert_gradients_match, assert_trains_like_eager
from remat.testing.measure import measure_step
from remat_solvers import Decision, Node, Options, Phase, Problem, Status, StepKind, decisions_all, simulate, solve
from remat_solvers.base import finish
from remat_solvers import registry
from remat_solvers.registry import SolverSpec
from remat_solvers.segmented import per_reader_segments, segmented_schedule
from remat_solvers.simulate import evaluate
from strategies import problems


def _recomputed(evaluation) -> list[int]:
    return [s.node_id for s in evaluation.steps if s.kind is StepKind.RECOMPUTE]


def _two_readers() -> Problem:
    """v (100 B, cheap) is read by the first backward op and by the last; a 100 B
    gradient lives between them. Every canonical plan holds v (saved, or recomputed once
    and held to its last reader) across that gradient; recomputing v twice does not."""
    f, b = Phase.FORWARD, Phase.BACKWARD
    nodes = (
        Node(name="x", inputs=(), out_bytes=10, phase=Phase.INPUT),
        Node(name="v", inputs=(0,), out_bytes=100, phase=f, compute_s=1.0),
        Node(name="loss", inputs=(1,), out_bytes=1, phase=f),
        Node(name="tangent", inputs=(), out_bytes=1, phase=b),
        Node(name="b1", inputs=(3, 1), out_bytes=10, phase=b),
        Node(name="b2", inputs=(4,), out_bytes=100, phase=b),
        Node(name="c", inputs=(5,), out_bytes=1, phase=b),
        Node(name="b3", inputs=(6, 1), out_bytes=10, phase=b),
    )
    return Problem(nodes=nodes, outputs=(2, 7), budget_bytes=0)


def test_recomputing_twice_peaks_below_every_canonical_plan():
    problem = _two_readers()
    canonical = solve(problem, "brute")  # exhaustive over the canonical plan space
    decisions = {1: Decision.RECOMPUTE}
    schedule = segmented_schedule(problem, decisions, per_reader_segments(problem))
    assert schedule == (3, 1, 4, 5, 6, 1, 7)
    ev = evaluate(problem, decisions, schedule)
    assert _recomputed(ev) == [1, 1]
    # twice: the peak is at b1 (x, loss, tangent, v, b1); canonical: at b2, where v is
    # still held beside b1 and b2 (x, loss, v, b1, b2)
    assert (ev.peak_bytes, canonical.peak_bytes) == (10 + 1 + 1 + 100 + 10, 10 + 1 + 100 + 10 + 100)


@settings(max_examples=60, deadline=None)
@given(problem=problems(max_forward=6), data=st.data())
def test_segmented_schedules_run_and_never_recompute_less(problem, data):
    """Any segmentation of backward gives a schedule simulate accepts, with the plan's
    decisions, recomputing at least what the canonical schedule does."""
    decisions = decisions_all(problem, Decision.RECOMPUTE)
    n = len(problem.nodes)
    segments = data.draw(st.lists(st.sampled_from([None, 0, 1, 2]), min_size=n, max_size=n))
    for segment_of in (segments, per_reader_segments(problem)):
        schedule = segmented_schedule(problem, decisions, segment_of)
        ev = evaluate(problem, decisions, schedule)
        canonical = evaluate(problem, decisions)
        assert ev.recompute_s >= canonical.recompute_s
        assert set(_recomputed(ev)) == set(_recomputed(canonical))


@pytest.fixture(scope="module")
def per_reader():
    """A solver that recomputes every value afresh before each backward reader."""
    def run(problem: Problem, options: Options):
        decisions = decisions_all(problem, Decision.RECOMPUTE)
        return finish(problem, decisions, "test-per-reader", started_s=0.0,
                      schedule=segmented_schedule(problem, decisions, per_reader_segments(problem)))

    spec = SolverSpec(name="test-per-reader", run=run, options_type=Options, exact=False, summary="test")
    with pytest.MonkeyPatch.context() as mp:  # registered for this module only
        mp.setitem(registry._REGISTRY, spec.name, spec)
        yield spec.name


@pytest.mark.parametrize("solver", ["test-per-reader", "checkpoint"])
def test_schedules_run_as_simulated(solver, per_reader):
    """Executed: gradients torch.equal eager, measured peak (tensor tracker) equal to
    simulate's; a value recomputed twice runs as two copies."""
    torch.manual_seed(0)
    model, x = Tower(64, 4), torch.randn(32, 64)
    eager = Tower(64, 4)
    eager.load_state_dict(model.state_dict())
    eager(x).backward()
    planned = remat.plan(model, (x,), budget=10**9, solver=solver)
    assert planned.plan.schedule is not None
    recomputed = _recomputed(planned.step.evaluation)
    if solver == "test-per-reader":
        assert len(recomputed) > len(set(recomputed))
        assert any(n.name.endswith("_recomputed1") for n in planned.step.backward.graph.nodes)
    loss = planned(x)
    loss.backward()
    assert_trains_like_eager(loss.detach(), eager(x).detach(), model, eager)
    for p in model.parameters():
        p.grad = None
    measured = measure_step(lambda: planned(x).backward(), register=(model, x)).peak_bytes
    assert measured == planned.predicted_peak_bytes


def test_a_value_recomputed_twice_runs_under_inductor(per_reader):
    """`remat.backend` plans schedules too: inductor compiles the backward's copies of a
    value recomputed twice like any other nodes. Gradients as eager's up to inductor's
    rounding (`assert_gradients_match`), and the profiler's peak at most the prediction
    (remat's peak plus what the generated code adds, `closed_loop`)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Tower(64, 4), torch.randn(32, 64)
    be = remat.backend(budget=10**9, solver=per_reader, whole_step=False)
    compiled = torch.compile(model, backend=be)
    assert_gradients_match(model, lambda m: compiled(x), lambda m: m(x), "Tower under inductor")
    (step,) = be.steps
    recomputed = _recomputed(step.evaluation)
    assert len(recomputed) > len(set(recomputed))
    model.zero_grad(set_to_none=True)  # the profiler cannot see frees before the step
    measured = be.measure(lambda: compiled(x).backward(), register=(model, x))
    assert measured.peak_bytes <= step.evaluation.peak_bytes + step.fusion_margin_bytes <= step.budget_bytes


def test_below_every_canonical_plan_the_cheapest_fitting_schedule_is_planned():
    """With repeated layers and `schedules` (the eager runtime's default), a budget no
    canonical plan fits gets the cheapest scheduled plan that fits; the floor stated
    below that is the least over canonical and scheduled plans. Without `schedules`
    the floor is the canonical one (remat.planning.floor)."""
    from remat.planning import floor as remat_floor
    from remat.frontend.problem import GraphProblem
    from remat_solvers.least_peak import least_peak_plan, scheduled_plans
    from remat_solvers.layer_structure import OUTSIDE, LayerStructure

    base = _two_readers()
    layer_of = [OUTSIDE] * len(base.nodes)
    layer_of[1] = 0
    problem = dataclasses.replace(base, layers=LayerStructure(layer_of=layer_of, names=("layer.0",)))
    canonical = least_peak_plan(problem, time_limit_s=0.5)
    assert canonical.schedule is None and canonical.peak_bytes == solve(problem, "brute").peak_bytes == 221
    blank = tuple("" for _ in problem.nodes)

    def at(budget: int, schedules: bool):
        p = problem.with_budget(budget)
        gp = GraphProblem(problem=p, fx_names=tuple(() for _ in blank), value_name=blank, source=blank,
                          never_replay={})
        failed = solve(p, "ilp", time_limit_s=0.5)
        assert failed.status is Status.INFEASIBLE  # no canonical plan reaches it
        remat_floor._FLOOR_PLANS.clear()
        return p, remat_floor.at_the_floor(gp, failed, solver="ilp", options={"time_limit_s": 0.5},
                                           baseline_bytes=221, schedules=schedules)

    least = min(p.peak_bytes for p in scheduled_plans(problem.with_budget(0), canonical.decisions))
    assert least == 122
    p, (plan, err) = at(122, schedules=True)
    fitting = [q for q in scheduled_plans(p, canonical.decisions) if q.status is not Status.INFEASIBLE]
    assert err is None and plan.schedule is not None and simulate(p, plan).fits
    assert plan.objective_s == min(q.objective_s for q in fitting)
    assert at(121, schedules=True)[1][1].min_peak_bytes == 122
    assert at(122, schedules=False)[1][1].min_peak_bytes == 221


def test_gpt2_at_its_scheduled_floor_runs_other_outputs_of_a_split():
    """GPT-2 with dropout saved (replay_rng=False): the floor is a scheduled plan that
    recomputes another output of attention's qkv `split` while the split's first output
    stays saved; the rebuilt backward runs the split again for it (it read a split no
    step made before). Measured <= predicted, gradients those of eager on the same code
    path (transformers' traced path)."""
    import copy

    from torch._export.utils import _compiling_state_context

    from remat.testing import zoo

    case = zoo.build("gpt2", size="tiny")
    eager = copy.deepcopy(case.model)
    with pytest.raises(remat.InfeasibleBudgetError) as info:
        remat.plan(case.model, case.args, case.kwargs, budget=1, replay_rng=False)
    assert info.value.min_peak_plan.schedule is not None
    planned = remat.plan(case.model, case.args, case.kwargs, budget=info.value.min_peak_bytes, replay_rng=False)
    assert planned.plan.schedule is not None
    torch.manual_seed(0)
    measured = measure_step(lambda: planned(*case.args, **case.kwargs).loss.backward(),
                            register=(case.model, case.args, case.kwargs)).peak_bytes
    assert measured <= planned.predicted_peak_bytes
    torch.manual_seed(0)
    with _compiling_state_context():
        eager(*case.args, **case.kwargs).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), case.model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
