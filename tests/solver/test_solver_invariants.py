"""Every registered solver through the same invariant checks, brute force against an
independent enumeration, and metamorphic properties."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remat_solvers import SOLVERS, Decision, Phase, Plan, PlanError, Problem, Status, UnsupportedProblem, simulate, solve
from remat_solvers import builders
from remat_solvers.brute import TooLargeForBrute
from remat_solvers.chen import cut_candidates, keep_required
from strategies import problems


def check_plan(problem: Problem, plan: Plan, solver: str) -> None:
    """The contract every solver's Plan must meet (DESIGN.md, "Contract")."""
    assert plan.solver == solver
    assert tuple(plan.decisions) == problem.decision_ids, "a plan decides exactly problem.decision_ids"
    for i, d in plan.decisions.items():
        assert d in problem.allowed(i), f"node {i}: {d} not allowed"
    ev = simulate(problem, plan)  # raises PlanError for an invalid plan
    assert plan.objective_s == ev.cost_s, "objective_s must be simulate's cost"
    assert plan.peak_bytes == ev.peak_bytes, "peak_bytes must be simulate's peak"
    if plan.status in (Status.OPTIMAL, Status.FEASIBLE):
        assert ev.fits, f"{plan.status.value} plan does not fit: {ev.peak_bytes} > {problem.budget_bytes}"
    else:
        assert plan.status is Status.INFEASIBLE
        assert not ev.fits, "INFEASIBLE plan that fits the budget"
    if plan.lower_bound_s is not None:
        assert plan.lower_bound_s <= plan.objective_s + 1e-9 * max(1.0, abs(plan.objective_s))
    assert plan.solve_s >= 0.0


def run_checked(problem: Problem, solver: str) -> Plan | None:
    """solve + check_plan; None when the solver declares the structure unsupported."""
    try:
        plan = solve(problem, solver)
    except UnsupportedProblem:
        return None
    check_plan(problem, plan, solver)
    return plan


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@settings(max_examples=40)
@given(problem=problems(max_forward=5))
def test_every_solver_meets_the_contract(solver, problem):
    plan = run_checked(problem, solver)
    if plan is None:
        return
    if SOLVERS[solver].exact and problem.offload_bandwidth_bytes_per_s is None:
        _agrees_with_brute(problem, plan)


@pytest.mark.parametrize("solver", sorted(SOLVERS))
@settings(max_examples=25)
@given(problem=problems(max_forward=5, save=True))
def test_every_solver_meets_the_contract_when_saving_costs(solver, problem):
    """Node.save_s (the "compiled-traffic" cost model) is in every objective: simulate's
    cost, the plan's claim, and the exact solvers' optimum (dp and layers decline)."""
    plan = run_checked(problem, solver)
    if plan is None:
        return
    if SOLVERS[solver].exact and problem.offload_bandwidth_bytes_per_s is None:
        _agrees_with_brute(problem, plan)


def _agrees_with_brute(problem: Problem, plan: Plan) -> None:
    """"Exact solvers equal brute on small problems" (DESIGN.md). Brute covers every
    SAVE/RECOMPUTE plan under the canonical schedule; a solver with explicit schedules
    searches a larger space and may only do better."""
    oracle = solve(problem, "brute")
    if plan.status is Status.INFEASIBLE:
        assert oracle.status is Status.INFEASIBLE, "an exact solver found nothing, brute did"
    elif plan.status is Status.OPTIMAL and plan.schedule is None:
        assert oracle.status is Status.OPTIMAL
        assert plan.objective_s == pytest.approx(oracle.objective_s, rel=1e-9, abs=1e-12)
    elif plan.status is Status.OPTIMAL and oracle.status is Status.OPTIMAL:
        assert plan.objective_s <= oracle.objective_s + 1e-9


_BUILT = {
    "chain8": lambda: builders.chain(8),
    "hetero": lambda: builders.heterogeneous_chain([4, 64, 8, 128, 16], [1.0, 4.0, 0.5, 8.0, 2.0], param_bytes=2),
    "dag": lambda: builders.random_dag(9, seed=3, skip_prob=0.5, nonrecomputable_prob=0.2, view_prob=0.2),
    "transformer1": lambda: builders.transformer(1, batch=1, seq=16, d_model=32, n_heads=2, vocab=64, dropout=True),
    "unet1": lambda: builders.unet(1, batch=1, channels=4, resolution=16),
}


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9, 1.0])
@pytest.mark.parametrize("built", sorted(_BUILT))
@pytest.mark.parametrize("solver", sorted(SOLVERS))
def test_every_solver_on_built_problems(solver, built, fraction):
    problem = builders.with_budget_fraction(_BUILT[built](), fraction)
    try:
        run_checked(problem, solver)
    except TooLargeForBrute:
        assert solver == "brute" and len(problem.decision_ids) > 18


# ---- brute force ----


def _enumerate(problem: Problem) -> tuple[Status, float, int, dict[int, Decision]]:
    """An independent oracle: every valid plan's (cost, peak), then the best."""
    ids = problem.decision_ids
    rows = []
    for index, combo in enumerate(itertools.product(*map(problem.allowed, ids))):
        try:
            ev = simulate(problem, dict(zip(ids, combo)))
        except PlanError:
            continue
        rows.append((ev.fits, ev.cost_s, ev.peak_bytes, index, dict(zip(ids, combo))))
    fitting = [r for r in rows if r[0]]
    if fitting:
        _, cost, peak, _, decisions = min(fitting, key=lambda r: r[1:4])
        return Status.OPTIMAL, cost, peak, decisions
    _, cost, peak, _, decisions = min(rows, key=lambda r: (r[2], r[1], r[3]))
    return Status.INFEASIBLE, cost, peak, decisions


@settings(max_examples=150)
@given(problem=problems())
def test_brute_equals_independent_enumeration(problem):
    plan = solve(problem, "brute")
    status, cost, peak, decisions = _enumerate(problem)
    assert (plan.status, plan.objective_s, plan.peak_bytes) == (status, cost, peak)
    assert dict(plan.decisions) == decisions
    if status is Status.OPTIMAL:
        assert plan.lower_bound_s == plan.objective_s


def test_brute_refuses_large_problems():
    problem = builders.chain(19)
    assert len(problem.decision_ids) == 19  # every layer's output is read by backward
    with pytest.raises(UnsupportedProblem) as err:
        solve(problem, "brute")
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert "19 decision values" in message and "limit of 18" in message and "chen-greedy" in message


def test_brute_refuses_too_many_combinations_with_offload():
    problem = builders.chain(13, offload_bandwidth_bytes_per_s=1e9)  # 13 values, 3**13 plans
    with pytest.raises(TooLargeForBrute, match="1594323 combinations"):
        solve(problem, "brute")


# ---- metamorphic ----


def _scaled(problem: Problem, k: float) -> Problem:
    """All compute ×k and the link bandwidth ÷k: every cost ×k, exactly (k a power of 2)."""
    nodes = tuple(dataclasses.replace(n, compute_s=n.compute_s * k) for n in problem.nodes)
    bw = problem.offload_bandwidth_bytes_per_s
    return dataclasses.replace(problem, nodes=nodes, offload_bandwidth_bytes_per_s=None if bw is None else bw / k)


@settings(max_examples=60)
@given(problem=problems(), k=st.sampled_from([2.0, 0.5, 4.0]))
def test_scaling_costs_scales_brute_objective(problem, k):
    base, scaled = solve(problem, "brute"), solve(_scaled(problem, k), "brute")
    assert scaled.status is base.status
    if base.status is Status.OPTIMAL:
        assert scaled.objective_s == k * base.objective_s
        assert scaled.decisions == base.decisions


@settings(max_examples=60)
@given(problem=problems(), extra=st.integers(1, 200))
def test_more_budget_never_makes_brute_worse(problem, extra):
    tight, loose = solve(problem, "brute"), solve(problem.with_budget(problem.budget_bytes + extra), "brute")
    if tight.status is Status.OPTIMAL:
        assert loose.status is Status.OPTIMAL
        assert loose.objective_s <= tight.objective_s
    else:
        # tight's peak is the smallest reachable one: no plan, loose's included, goes lower.
        assert loose.peak_bytes >= tight.peak_bytes
        if loose.status is Status.INFEASIBLE:
            assert loose.peak_bytes == tight.peak_bytes


@settings(max_examples=80)
@given(problem=problems())
def test_chen_greedy_never_worse_than_none_or_all(problem):
    greedy = solve(problem, "chen-greedy")
    for baseline in ("none", "all"):
        other = solve(problem, baseline)
        if other.status is not Status.INFEASIBLE:
            assert greedy.status is not Status.INFEASIBLE
            assert greedy.objective_s <= other.objective_s
    assert greedy.peak_bytes <= max(solve(problem, "none").peak_bytes, solve(problem, "all").peak_bytes)


@settings(max_examples=60)
@given(problem=problems(offload=False), data=st.data())
def test_keep_required_makes_any_assignment_valid(problem, data):
    choice = st.sampled_from([Decision.SAVE, Decision.RECOMPUTE])
    decisions = {i: data.draw(choice) for i in problem.decision_ids}
    kept = keep_required(problem, decisions)
    simulate(problem, kept)  # no PlanError
    changed = {i for i in decisions if kept[i] is not decisions[i]}
    assert all(decisions[i] is Decision.RECOMPUTE and not problem.nodes[i].recomputable for i in changed)


# ---- chen specifics ----


def test_cut_candidates_on_a_chain_and_with_a_skip():
    chain = builders.chain(5)
    assert cut_candidates(chain) == chain.decision_ids
    # x -> a -> b -> c -> loss with a skip a -> c: no cut after b (a crosses it).
    ops = [builders.FwdOp(name="x", out_bytes=8, phase=Phase.INPUT, requires_grad=True),
           builders.FwdOp(name="a", out_bytes=8, inputs=(0,), grad_reads=(0,)),
           builders.FwdOp(name="b", out_bytes=8, inputs=(1,), grad_reads=(1,)),
           builders.FwdOp(name="c", out_bytes=8, inputs=(2, 1), grad_reads=(2, 1)),
           builders.FwdOp(name="loss", out_bytes=4, inputs=(3,), grad_reads=(3,))]
    problem = builders.joint_from_forward(ops)
    assert problem.decision_ids == (1, 2, 3)
    assert cut_candidates(problem) == (1, 3)


def test_chen_sqrt_falls_back_when_nothing_can_be_cut():
    # f0 is read only by the final add, so it crosses every cut between a and d.
    ops = [builders.FwdOp(name="x", out_bytes=8, phase=Phase.INPUT, requires_grad=True),
           builders.FwdOp(name="f0", out_bytes=8, inputs=(0,)),
           builders.FwdOp(name="a", out_bytes=8, inputs=(0,), grad_reads=(0,)),
           builders.FwdOp(name="b", out_bytes=8, inputs=(2,), grad_reads=(2,)),
           builders.FwdOp(name="c", out_bytes=8, inputs=(3,), grad_reads=(3,)),
           builders.FwdOp(name="d", out_bytes=8, inputs=(4,), grad_reads=(4,)),
           builders.FwdOp(name="s", out_bytes=8, inputs=(5, 1), grad_alias=True),
           builders.FwdOp(name="loss", out_bytes=4, inputs=(6,))]
    problem = builders.joint_from_forward(ops)
    assert problem.decision_ids == (2, 3, 4) and cut_candidates(problem) == ()
    # Every decision value becomes a candidate: round(sqrt(3)) = 2 saved, evenly spaced.
    S, R = Decision.SAVE, Decision.RECOMPUTE
    assert solve(problem, "chen-sqrt").decisions == {2: S, 3: S, 4: R}


def test_chen_sqrt_saves_about_sqrt_n_on_a_chain():
    problem = builders.chain(100)  # 101 decision values, all cut points
    plan = solve(problem, "chen-sqrt")
    assert plan.count(Decision.SAVE) == 10
    assert plan.peak_bytes < solve(problem, "none").peak_bytes / 4


def test_chen_greedy_fits_on_10k_nodes():
    problem = builders.with_budget_fraction(builders.random_dag(2500, seed=1, nonrecomputable_prob=0.05, view_prob=0.1), 0.5)
    assert len(problem.nodes) > 10_000
    plan = solve(problem, "chen-greedy")  # ~2 s unloaded: a benchmark fact, not asserted
    assert plan.status is Status.FEASIBLE


# ---- registry ----


def test_unknown_solver_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        solve(builders.chain(2), "chen-sqrtt")
    assert "'chen-sqrtt'" in str(err.value)
    for name in SOLVERS:
        assert repr(name) in str(err.value)


def test_unknown_option_is_named():
    with pytest.raises(TypeError) as err:
        solve(builders.chain(2), "brute", time_limit=3)
    assert "'time_limit'" in str(err.value) and "time_limit_s" in str(err.value)
