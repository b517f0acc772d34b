"""ilp: its CP-SAT model alone (no warm start) equals brute on small random DAGs, its
no-good loop repairs what the model cannot see, its bounds are honest, and it is never
worse than its warm start or than dp and chen-greedy."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from remat_solvers import Node, Phase, Problem, Status, UnsupportedProblem, simulate, solve
from remat_solvers import builders
from remat_solvers.ilp import model as ilp_model
from remat_solvers.brute import valid_plans
from remat_solvers.dp.structure import analyze
from remat_solvers.ilp.solver import ILPOptions
from oracles import REL, assert_equals_brute, node_step_bytes
from strategies import problems

MODEL_ONLY = dict(warm_start=())  # the CP-SAT model by itself, no heuristic seed




@settings(max_examples=150)
@given(problem=problems(max_forward=7))
def test_model_equals_brute_on_small_problems(problem):
    assert_equals_brute(problem, solve(problem, "ilp", **MODEL_ONLY))


@st.composite
def random_dags(draw, max_values: int = 14) -> Problem:
    """Layered DAGs with skips (mostly not block sequences), views, non-recomputable ops
    and sometimes offload, with at most `max_values` decision values."""
    offload = draw(st.booleans())
    n = draw(st.integers(3, 8 if offload else max_values))
    problem = builders.random_dag(
        n, seed=draw(st.integers(0, 10_000)), skip_prob=draw(st.sampled_from([0.3, 0.6, 0.9])),
        max_skip=draw(st.integers(2, 8)), view_prob=draw(st.sampled_from([0.0, 0.3])),
        nonrecomputable_prob=draw(st.sampled_from([0.0, 0.2])),
        offload_bandwidth_bytes_per_s=draw(st.sampled_from([2e8, 1e9])) if offload else None,
    )
    return builders.with_budget_fraction(problem, draw(st.floats(0.2, 1.0)))


@settings(max_examples=40)
@given(problem=random_dags())
# Nothing fits and the smallest peak lies inside a recomputation run, where the
# min-peak model does not look: ilp once returned a peak 30 B above brute's.
@example(problem=builders.with_budget_fraction(builders.random_dag(7, seed=728, skip_prob=0.3, max_skip=2), 0.5))
def test_model_equals_brute_on_random_dags_up_to_14_values(problem):
    assert len(problem.decision_ids) <= 14
    assert_equals_brute(problem, solve(problem, "ilp", **MODEL_ONLY))


@settings(max_examples=30)
@given(problem=random_dags(max_values=9), seed=st.integers(0, 2**16))
def test_every_strengthened_row_holds_for_every_fitting_plan(problem, seed):
    """The rows row generation adds (at every node step here) are valid: each fitting
    plan, fixed with all that it implies (the hint rules), satisfies the whole model."""
    model = _strengthened_everywhere(problem)
    fitting = sorted(((ev.peak_bytes, k, plan) for k, (plan, ev) in enumerate(valid_plans(problem)) if ev.fits),
                     key=lambda r: r[:2], reverse=True)
    tight = [plan for _, _, plan in fitting[:8]]  # the rows bind near the budget
    others = [plan for _, _, plan in fitting]
    for plan in tight + random.Random(seed).sample(others, min(4, len(others))):
        assert _admits(model, plan), plan


@settings(max_examples=25)
@given(problem=random_dags(max_values=8))
# A view of a saved value, offloaded: it is reloaded into a storage of its own, so the
# saved base does not keep the view's storage live (the rows once counted it).
@example(problem=builders.with_budget_fraction(builders.random_dag(
    3, seed=199, skip_prob=0.3, max_skip=2, view_prob=0.3, offload_bandwidth_bytes_per_s=2e8), 1.0))
def test_strengthened_rows_never_count_more_than_simulate(problem):
    """Every plan (fitting or not), every node step: the strengthened row counts no more
    bytes than simulate has live there."""
    model = ilp_model.CanonicalModel(problem, cumulative=False)
    for plan, ev in valid_plans(problem):
        for t, (counted, live) in enumerate(zip(model.row_bytes(plan), node_step_bytes(problem, ev))):
            assert counted <= live, (t, plan)


@pytest.mark.parametrize("n", [3, 5, 7])
def test_strengthened_rows_are_exact_on_chains(n):
    """On a chain the strengthened rows count exactly simulate's live bytes at every node
    step, for every plan. Dropping a run of values makes the first backward read of its
    end recompute the whole run at once, and each value then lives until its own read:
    a cascade of any depth, which the rows follow through the "brought back" literals."""
    problem = builders.with_budget_fraction(builders.chain(n), 0.5)
    model = ilp_model.CanonicalModel(problem, cumulative=False)
    for plan, ev in valid_plans(problem):
        assert model.row_bytes(plan) == node_step_bytes(problem, ev), plan


@pytest.mark.parametrize("n", [3, 4])
def test_constraints_force_the_exact_rows_on_chains(n):
    """What the constraints force, not only what the hint rules compute: with a plan's
    decisions fixed, the least each strengthened row can count is simulate's live bytes
    (a budget no row binds, so that every plan is admitted)."""
    problem = builders.with_budget_fraction(builders.chain(n), 100.0)
    model = ilp_model.CanonicalModel(problem, cumulative=False)
    rows = [model.row_terms(t) for t in range(model.data.n_steps)]
    for plan, ev in valid_plans(problem):
        plan = model.canonical(plan)
        for (fixed, terms), live in zip(rows, node_step_bytes(problem, ev)):
            least = model.model.clone()
            var = least.get_bool_var_from_proto_index
            for v in model.data.decision:
                for d in problem.allowed(v):
                    least.add(var(model.literal(v, d).index) == int(plan[v] is d))
            least.minimize(sum(b * var(lit.index) for b, lit in terms))
            solver = cp_model.CpSolver()
            solver.parameters.num_workers = 1
            assert solver.solve(least) == cp_model.OPTIMAL
            assert fixed + round(solver.objective_value) == live, plan


@pytest.mark.parametrize("fraction", [0.4, 0.5, 0.6, 0.7])
@pytest.mark.parametrize("build", [lambda: builders.transformer(2, seq=64), lambda: builders.random_dag(40, seed=5)],
                         ids=["transformer-2", "dag-40"])
def test_strengthened_rows_hold_for_the_plans_solvers_find(build, fraction):
    """The same on bigger graphs (long recomputation chains), for every fitting plan the
    heuristics and ilp without row generation find."""
    problem = builders.with_budget_fraction(build(), fraction)
    model = _strengthened_everywhere(problem)
    plans = [solve(problem, name) for name in ("chen-greedy", "greedy")]
    plans.append(solve(problem, "ilp", rows_share=0.0, warm_start=(), time_limit_s=2.0))
    for plan in plans:
        if plan.peak_bytes <= problem.budget_bytes:
            assert _admits(model, plan.decisions), plan.solver


def _strengthened_everywhere(problem: Problem) -> ilp_model.CanonicalModel:
    """The knapsack-rows model (no cumulative) with every node step's row strengthened."""
    model = ilp_model.CanonicalModel(problem, cumulative=False)
    for t in range(model.data.n_steps):
        model.strengthen(t)
    return model


def _admits(model: ilp_model.CanonicalModel, decisions) -> bool:
    """The model is satisfiable with every variable fixed to what `decisions` imply."""
    model.hint(decisions)
    solver = cp_model.CpSolver()
    solver.parameters.fix_variables_to_their_hinted_value = True
    solver.parameters.num_workers = 1
    return solver.solve(model.model) in (cp_model.OPTIMAL, cp_model.FEASIBLE)


@settings(max_examples=40)
@given(problem=problems(max_forward=6), extra=st.integers(1, 300))
def test_more_budget_never_makes_ilp_worse(problem, extra):
    tight = solve(problem, "ilp", **MODEL_ONLY)
    loose = solve(problem.with_budget(problem.budget_bytes + extra), "ilp", **MODEL_ONLY)
    if tight.status is Status.OPTIMAL:
        assert loose.status is Status.OPTIMAL and loose.objective_s <= tight.objective_s + 1e-12
    else:
        assert loose.peak_bytes >= tight.peak_bytes


# ---- the no-good loop ----


def _transient_problem(budget: int) -> Problem:
    """x -> a -> b -> d -> loss where a is read only to recompute b: the model checks
    node steps, and only simulate sees a (40 bytes) coexist with b's recomputation
    after a large gradient (50 bytes, an output) appeared."""
    F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT
    nodes = (
        Node(name="x", inputs=(), out_bytes=4, phase=I),
        Node(name="a", inputs=(0,), out_bytes=40, phase=F, compute_s=1.0),
        Node(name="b", inputs=(1,), out_bytes=8, phase=F, compute_s=1.0),
        Node(name="d", inputs=(2,), out_bytes=20, phase=F, compute_s=1.0),
        Node(name="loss", inputs=(3,), out_bytes=4, phase=F),
        Node(name="tangent", inputs=(), out_bytes=4, phase=B),
        Node(name="grad_d", inputs=(5, 3), out_bytes=50, phase=B),
        Node(name="grad_b", inputs=(6, 2), out_bytes=4, phase=B),
        Node(name="grad_x", inputs=(7,), out_bytes=4, phase=B),
    )
    return Problem(nodes=nodes, outputs=(4, 6, 8), budget_bytes=budget)


def test_a_plan_simulate_rejects_is_cut_and_the_answer_still_equals_brute(monkeypatch):
    cuts = []
    original = ilp_model.CanonicalModel.forbid
    monkeypatch.setattr(ilp_model.CanonicalModel, "forbid", lambda self, d: (cuts.append(d), original(self, d)))
    problem = _transient_problem(82)
    plan = solve(problem, "ilp", **MODEL_ONLY)
    assert cuts, "the model's first answer should need simulate's correction here"
    for rejected in cuts:
        assert not simulate(problem, rejected).fits
    assert_equals_brute(problem, plan)


# ---- bounds, warm start, time limit, determinism ----


@pytest.mark.parametrize("fraction", [0.5, 0.7])
def test_bounds_are_honest_under_a_short_time_limit(fraction):
    problem = builders.with_budget_fraction(builders.random_dag(300, seed=3, view_prob=0.1), fraction)
    plan = solve(problem, "ilp", time_limit_s=2.0)
    assert plan.status in (Status.OPTIMAL, Status.FEASIBLE)
    assert plan.lower_bound_s is not None and plan.lower_bound_s <= plan.objective_s
    if plan.status is Status.OPTIMAL:
        assert plan.lower_bound_s == plan.objective_s
    # The limit is deterministic work, honoured up to the last CP-SAT call's overshoot
    # (its deterministic limit is checked between propagation rounds).
    assert 0.0 < plan.work_s < 2.0 * 1.1
    greedy = solve(problem, "chen-greedy")
    assert plan.objective_s <= greedy.objective_s  # never worse than its warm start


def test_ilp_is_at_most_dp_at_most_chen_greedy_on_block_sequences():
    problem = builders.with_budget_fraction(builders.transformer(4, seq=128), 0.9)
    assert len(analyze(problem).blocks) > 4
    ilp, dp, greedy = (solve(problem, s) for s in ("ilp", "dp", "chen-greedy"))
    assert dp.status is Status.OPTIMAL
    assert ilp.objective_s <= dp.objective_s + 1e-12 <= greedy.objective_s + 2e-12


def test_model_alone_reaches_dp_optimum_on_a_small_transformer():
    problem = builders.with_budget_fraction(builders.transformer(2, batch=1, seq=32, d_model=16, n_heads=2,
                                                                 vocab=16), 0.8)
    ilp = solve(problem, "ilp", **MODEL_ONLY)
    assert ilp.status is Status.OPTIMAL
    assert ilp.objective_s == pytest.approx(solve(problem, "dp").objective_s, **REL)


def test_ilp_handles_what_dp_refuses():
    problem = builders.with_budget_fraction(builders.random_dag(40, seed=1, skip_prob=0.9, max_skip=30), 0.9)
    with pytest.raises(UnsupportedProblem):
        solve(problem, "dp", max_block_configs=64)
    plan = solve(problem, "ilp", time_limit_s=5.0)
    assert plan.status in (Status.OPTIMAL, Status.FEASIBLE)


def test_deterministic_by_default():
    problem = builders.with_budget_fraction(builders.random_dag(40, seed=8, view_prob=0.2), 0.6)
    a, b = (solve(problem, "ilp", time_limit_s=3.0, warm_start=("chen-greedy",)) for _ in range(2))
    assert a.decisions == b.decisions and a.status is b.status


def test_infeasible_budget_is_a_status_with_the_smallest_peak():
    problem = builders.with_budget_fraction(builders.chain(8), 0.05)
    plan = solve(problem, "ilp", **MODEL_ONLY)
    assert plan.status is Status.INFEASIBLE
    assert plan.peak_bytes == solve(problem, "brute").peak_bytes


def test_options_are_frozen_and_validated_by_name():
    opts = ILPOptions()
    assert opts.workers == 1 and opts.seed == 0 and opts.time_limit_s == 10.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="'time_limit'"):
        solve(builders.chain(2), "ilp", time_limit=1)


@settings(max_examples=80)
@given(problem=st.booleans().flatmap(lambda save: problems(max_forward=7, save=save)), seed=st.integers(0, 2**16))
def test_repair_never_raises_the_peak_and_keeps_a_fitting_plan_fitting(problem, seed):
    """`greedy.repair`, the ILP's repair of its relaxation's optimum: from any plan it
    never peaks higher (but into the budget's slack), a plan that fits stays fitting and
    never costs more."""
    from remat_solvers import greedy
    from remat_solvers.base import WorkClock
    from remat_solvers.problem import Decision

    rng = random.Random(seed)
    start = {i: rng.choice([d for d in problem.allowed(i)
                            if d is not Decision.RECOMPUTE or problem.nodes[i].recomputable])
             for i in problem.decision_ids}
    before = simulate(problem, start)
    fixed = greedy.repair(problem, start, WorkClock(None))
    after = simulate(problem, fixed)
    assert after.peak_bytes <= max(before.peak_bytes, problem.budget_bytes)  # the trim may use slack
    if before.fits:
        assert after.fits and after.cost_s <= before.cost_s * (1 + REL["rel"]) + REL["abs"]
