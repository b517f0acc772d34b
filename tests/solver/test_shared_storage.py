"""One saved value per storage (`remat_solvers.shared_storage`): on random problems with views,
every plan comes out with no storage saved twice, the same peak and a valid schedule;
a hand-built value and its view; and the model that trained with a wrong weight
gradient under `remat.backend` (its LayerNorm output and the reshape the Linear reads
were both saved, both donated to inductor's backward, and the reshape read the buffer
after inductor reused it)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from remat_solvers import Decision, Node, Phase, PlanError, Problem, Status, evaluate, solve
from remat_solvers.base import finish
from remat_solvers.prefetch import prefetch
from remat_solvers.shared_storage import one_save_per_storage, shared_saves
from strategies import problems

S, R = Decision.SAVE, Decision.RECOMPUTE
F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT


def _value_and_view() -> Problem:
    """x -> a -> v = view(a) -> loss; the backward reads a and v."""
    return Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
            Node(name="v", inputs=(1,), out_bytes=100, phase=F, alias_of=1),
            Node(name="loss", inputs=(2,), out_bytes=4, phase=F, compute_s=1.0),
            Node(name="t", inputs=(), out_bytes=4, phase=B),
            Node(name="gv", inputs=(4, 1), out_bytes=100, phase=B, compute_s=1.0),
            Node(name="ga", inputs=(5, 2), out_bytes=100, phase=B, compute_s=1.0),
        ),
        outputs=(6,),
        budget_bytes=10_000,
    )


def test_a_saved_value_and_its_saved_view_become_the_value_saved_and_the_view_recomputed():
    problem = _value_and_view()
    plan = finish(problem, {1: S, 2: S}, "hand", started_s=0.0)
    assert shared_saves(problem, plan) == {1: [1, 2]}
    out = one_save_per_storage(problem, plan)
    assert out.decisions == {1: S, 2: R}
    assert shared_saves(problem, out) == {}
    assert out.peak_bytes == plan.peak_bytes
    assert out.objective_s == plan.objective_s  # a view costs nothing to recompute


def test_an_explicit_schedule_recomputes_the_view_just_before_its_first_reader():
    problem = _value_and_view()
    plan = finish(problem, {1: S, 2: S}, "hand", started_s=0.0, schedule=(4, 5, 6))
    out = one_save_per_storage(problem, plan)
    assert out.schedule == (4, 5, 2, 6)  # ga is v's first reader
    assert out.decisions == {1: S, 2: R}
    assert out.peak_bytes == plan.peak_bytes


def test_a_scheduled_owner_of_two_saved_views_is_saved_and_leaves_the_schedule():
    """x -> a -> v1, v2 (views of a) -> loss; the backward reads v1, v2, then a. A
    schedule that saves both views and recomputes a before its reader: a is saved instead
    and its recompute leaves the schedule (a saved value in a schedule is no plan), each
    view recomputed just before its reader (a random composition's attention, planned at
    its floor, met that schedule)."""
    problem = Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
            Node(name="v1", inputs=(1,), out_bytes=100, phase=F, alias_of=1),
            Node(name="v2", inputs=(1,), out_bytes=100, phase=F, alias_of=1),
            Node(name="loss", inputs=(2, 3), out_bytes=4, phase=F, compute_s=1.0),
            Node(name="t", inputs=(), out_bytes=4, phase=B),
            Node(name="g1", inputs=(5, 2), out_bytes=100, phase=B, compute_s=1.0),
            Node(name="g2", inputs=(6, 3), out_bytes=100, phase=B, compute_s=1.0),
            Node(name="g3", inputs=(7, 1), out_bytes=100, phase=B, compute_s=1.0),
        ),
        outputs=(8,),
        budget_bytes=10_000,
    )
    plan = finish(problem, {1: R, 2: S, 3: S}, "hand", started_s=0.0, schedule=(5, 6, 7, 1, 8))
    assert shared_saves(problem, plan) == {1: [2, 3]}
    out = one_save_per_storage(problem, plan)
    assert out.decisions == {1: S, 2: R, 3: R}
    assert out.schedule == (5, 2, 6, 3, 7, 8)
    assert shared_saves(problem, out) == {}
    assert out.peak_bytes <= plan.peak_bytes
    assert out.objective_s < plan.objective_s  # a is no longer recomputed


def test_a_saved_view_of_a_recomputed_view_is_recomputed_after_it():
    """x -> a -> r = view(a) -> c = view(r) -> loss; the backward reads c, then r, then a.
    A schedule that saves a and c and recomputes r for its own reader: c, now recomputed,
    has its first reader before r's recompute, so r comes forward with it and is not
    recomputed twice (a random composition's attention, its qkv projection saved, one
    chunk of its reshape saved and the reshape recomputed, planned under inductor at its
    floor, met that schedule)."""
    problem = Problem(
        nodes=(
            Node(name="x", inputs=(), out_bytes=10, phase=I),
            Node(name="a", inputs=(0,), out_bytes=100, phase=F, compute_s=1.0),
            Node(name="r", inputs=(1,), out_bytes=100, phase=F, alias_of=1),
            Node(name="c", inputs=(2,), out_bytes=100, phase=F, alias_of=2),
            Node(name="loss", inputs=(3,), out_bytes=4, phase=F, compute_s=1.0),
            Node(name="t", inputs=(), out_bytes=4, phase=B),
            Node(name="g1", inputs=(5, 3), out_bytes=100, phase=B, compute_s=1.0),
            Node(name="g2", inputs=(6, 2), out_bytes=100, phase=B, compute_s=1.0),
            Node(name="g3", inputs=(7, 1), out_bytes=100, phase=B, compute_s=1.0),
        ),
        outputs=(8,),
        budget_bytes=10_000,
    )
    plan = finish(problem, {1: S, 2: R, 3: S}, "hand", started_s=0.0, schedule=(5, 6, 2, 7, 8))
    assert shared_saves(problem, plan) == {1: [1, 3]}
    out = one_save_per_storage(problem, plan)
    assert out.decisions == {1: S, 2: R, 3: R}
    assert out.schedule == (5, 2, 3, 6, 7, 8)
    assert shared_saves(problem, out) == {}
    assert out.peak_bytes == plan.peak_bytes


def test_a_plan_without_shared_storage_is_returned_as_it_is():
    problem = _value_and_view()
    plan = finish(problem, {1: S, 2: R}, "hand", started_s=0.0)
    assert one_save_per_storage(problem, plan) is plan


@settings(max_examples=300)
@given(problems(), st.data())
def test_every_plan_saves_each_storage_once_at_the_same_peak(problem, data):
    ids = problem.decision_ids
    decisions = {i: data.draw(st.sampled_from(problem.allowed(i)), label=f"d{i}") for i in ids}
    try:
        ev = evaluate(problem, decisions)
    except PlanError:  # drops a value that cannot be recomputed
        assume(False)
    plan = finish(problem.with_budget(max(problem.budget_bytes, ev.peak_bytes)), decisions, "drawn",
                  started_s=0.0)
    problem = problem.with_budget(max(problem.budget_bytes, ev.peak_bytes))
    out = one_save_per_storage(problem, plan)
    after = evaluate(problem, out.decisions, out.schedule)  # a valid plan: no PlanError
    groups = shared_saves(problem, plan)
    if groups and out is plan:  # a view that reads another forward value: left to the rewrite's refusal
        views = [i for i, d in plan.decisions.items() if d is S and problem.storage_of[i] in groups]
        assert any(not problem.nodes[i].recomputable
                   or any(j != problem.nodes[i].alias_of and problem.nodes[j].phase is F
                          for j in problem.nodes[i].inputs)
                   for i in views if i not in groups)
    else:
        assert shared_saves(problem, out) == {}
    assert after.peak_bytes == ev.peak_bytes
    assert out.status is plan.status


@settings(max_examples=150)
@given(problems())
def test_solvers_plans_and_their_prefetched_schedules_keep_their_peak(problem):
    for name in ("greedy", "chen-greedy", "brute"):
        plan = prefetch(problem, solve(problem, name))  # an explicit schedule where it reloads
        out = one_save_per_storage(problem, plan)
        assert out.peak_bytes == plan.peak_bytes
        if plan.status is not Status.INFEASIBLE:
            assert out.status is not Status.INFEASIBLE


class _NormMLP(torch.nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear with a residual, the loss inside."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.ln(x)
        return (x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))).pow(2).mean()


@pytest.mark.usefixtures("one_thread")
def test_backend_trains_the_layer_norm_block_with_eager_gradients():
    import remat

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _NormMLP(), torch.randn(4, 64, 64)
    eager = copy.deepcopy(model)
    eager(x).backward()
    be = remat.backend(budget="100%")
    torch.compile(model, backend=be)(x).backward()
    (step,) = be.steps
    assert shared_saves(step.graph_problem.problem, step.plan) == {}
    for (name, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-7, msg=f"gradient of {name}")
