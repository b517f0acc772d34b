"""auto: the documented choice (brute if tiny, dp for block sequences, else ilp), the
chosen solver's answer under the name "auto", and no exception for an impossible budget."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from remat_solvers import SOLVERS, Node, Phase, Problem, Status, solve
from remat_solvers import builders
from remat_solvers.auto import AutoOptions, choose
from strategies import problems


@settings(max_examples=40)
@given(problem=problems(max_forward=6))
def test_tiny_problems_go_to_brute(problem):
    assert choose(problem, AutoOptions())[0] == "brute"
    plan, oracle = solve(problem, "auto"), solve(problem, "brute")
    assert plan.solver == "auto"
    assert (plan.status, plan.objective_s, plan.peak_bytes) == (oracle.status, oracle.objective_s, oracle.peak_bytes)


def test_block_sequences_go_to_dp():
    problem = builders.with_budget_fraction(builders.transformer(3, seq=128), 0.9)
    assert choose(problem, AutoOptions())[0] == "dp"
    plan, dp = solve(problem, "auto"), solve(problem, "dp")
    assert plan.solver == "auto" and plan.status is Status.OPTIMAL
    assert plan.decisions == dp.decisions and plan.lower_bound_s == dp.lower_bound_s


def _not_a_block_sequence() -> Problem:
    """A backward node reads t(a): dp refuses it, auto hands over to ilp."""
    F, B, I = Phase.FORWARD, Phase.BACKWARD, Phase.INPUT
    nodes = [Node(name="x", inputs=(), out_bytes=8, phase=I)]
    for k in range(14):
        nodes.append(Node(name=f"a{k}", inputs=(len(nodes) - 1,), out_bytes=8 + k, phase=F, compute_s=1.0))
    last = len(nodes) - 1
    nodes += [Node(name="loss", inputs=(last,), out_bytes=4, phase=F),
              Node(name="tangent", inputs=(), out_bytes=4, phase=B)]
    grad = len(nodes) - 1
    for k in reversed(range(14)):
        a = k + 1
        nodes.append(Node(name=f"t{k}", inputs=(a,), out_bytes=8 + k, phase=B, alias_of=a))
        nodes.append(Node(name=f"g{k}", inputs=(grad, len(nodes) - 1), out_bytes=8 + k, phase=B))
        grad = len(nodes) - 1
    return Problem(nodes=tuple(nodes), outputs=(last + 1, grad), budget_bytes=10**6)


def test_other_problems_go_to_ilp_then_chen_greedy():
    problem = _not_a_block_sequence()
    assert choose(problem, AutoOptions()) == ["dp", "ilp", "chen-greedy"]
    problem = problem.with_budget(solve(problem, "none").peak_bytes * 7 // 10)
    plan = solve(problem, "auto", time_limit_s=5.0)
    assert plan.solver == "auto" and plan.status in (Status.OPTIMAL, Status.FEASIBLE)
    assert plan.objective_s <= solve(problem, "chen-greedy").objective_s


def test_impossible_budget_is_infeasible_not_an_error():
    problem = builders.with_budget_fraction(builders.transformer(3, seq=128), 0.01)
    plan = solve(problem, "auto")
    assert plan.status is Status.INFEASIBLE and plan.peak_bytes > problem.budget_bytes


def test_registered_as_exact_with_documented_options():
    spec = SOLVERS["auto"]
    assert spec.exact and spec.options_type is AutoOptions
    assert AutoOptions().brute_max == 12
    with pytest.raises(TypeError, match="'budget'"):
        solve(builders.chain(2), "auto", budget=3)
