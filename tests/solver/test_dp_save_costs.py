"""dp and layers with save costs (`Node.save_s`, the "compiled-traffic" cost model): the
block decomposition still reproduces simulate (cost included), dp equals brute where its
exact pruning rules would fire without the save costs (and where they still fire), the
exchange skip keeps every table identical, and layers equals the enumeration of its
plan space (a kept value's save cost included)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from remat_solvers import Phase, Problem, Status, builders, solve
from remat_solvers.dp.configs import _save_dominated
from remat_solvers.dp.structure import analyze
from remat_solvers.dp.tables import _signature
from oracles import assert_equals_brute
from strategies import problems
from test_dp import assert_predicts, feeder_chains
from test_dp_save_instead import _fires as _exchange_fires, _tables, rotary_blocks
from test_layered import _oracle, assert_layers_agrees_with_its_space, stack
from test_solver_invariants import check_plan

SAVES = [0.0, 0.0, 0.125, 0.5, 1.0, 3.0, 8.0]
"""Save seconds: often none, some below and some above the recompute costs (COSTS)."""


def _with_save_costs(problem: Problem, draw) -> Problem:
    """save_s drawn for every plain forward value (simulate charges only the needed ones)."""
    nodes = tuple(dataclasses.replace(n, save_s=draw(st.sampled_from(SAVES)))
                  if n.phase is Phase.FORWARD and n.alias_of is None else n for n in problem.nodes)
    return dataclasses.replace(problem, nodes=nodes)


@settings(max_examples=60)
@given(problem=problems(max_forward=7, save=True), data=st.data())
def test_decomposition_equals_simulate_with_save_costs(problem, data):
    for _ in range(8):
        decisions = {i: data.draw(st.sampled_from(problem.allowed(i))) for i in problem.decision_ids}
        assert_predicts(problem, decisions)


@settings(max_examples=150)
@given(problem=problems(max_forward=7, save=True))
def test_dp_equals_brute_with_save_costs(problem):
    assert_equals_brute(problem, solve(problem, "dp"))


@settings(max_examples=80)
@given(problem=feeder_chains(), data=st.data())
def test_save_dominance_with_save_costs_keeps_dp_equal_to_brute(problem, data):
    """Feeder chains where the SAVE dominance would fire without save costs: with them
    (saving the reader may now cost more than recomputing it) dp still equals brute."""
    assume(any(_save_dominated(problem, b, set(problem.needed_ids)) for b in analyze(problem).blocks))
    charged = _with_save_costs(problem, data.draw)
    assert_equals_brute(charged, solve(charged, "dp"))


@settings(max_examples=40, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(problem=rotary_blocks(layers=1, links=3), data=st.data())
def test_exchange_with_save_costs_keeps_dp_equal_to_brute(problem, data):
    """Blocks where the exchange skip fires without save costs."""
    assume(_exchange_fires(problem))
    charged = _with_save_costs(problem, data.draw)
    assert_equals_brute(charged, solve(charged, "dp"))


@settings(max_examples=40, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(problem=rotary_blocks(), data=st.data())
def test_exchange_with_save_costs_keeps_every_table_identical(problem, data):
    charged = _with_save_costs(problem, data.draw)
    with pytest.MonkeyPatch.context() as mp:
        _exchange_fires(charged)  # the mask agrees with the rule, and each skip names a tabulated one
        assert _tables(charged, mp, skip=True) == _tables(charged, mp, skip=False)


def test_save_costs_are_part_of_the_table_signature():
    problem = builders.transformer(2, batch=1, seq=16, d_model=32, n_heads=2, vocab=64)
    block = analyze(problem).blocks[1]
    v = next(v for v in block.values if v in problem.needed_ids and problem.nodes[v].alias_of is None)
    charged = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(n, save_s=1e-3) if i == v else n for i, n in enumerate(problem.nodes)))
    assert _signature(problem, block) != _signature(charged, analyze(charged).blocks[1])


@pytest.mark.parametrize("solver", ["dp", "layers"])
def test_dp_and_layers_plan_with_save_costs_as_brute_does(solver):
    """Saving every needed value costs more than recomputing it on a layered stack: both
    solvers accept the problem and find the cheapest plan."""
    problem = builders.with_budget_fraction(stack(2, seed=1), 1.0)
    charged = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(n, save_s=4.0) if i in problem.needed_ids and n.alias_of is None else n
        for i, n in enumerate(problem.nodes)))
    plan = solve(charged, solver)
    check_plan(charged, plan, solver)
    assert plan.status is Status.OPTIMAL
    if solver == "dp":
        assert_equals_brute(charged, plan)
    else:
        assert plan.objective_s == pytest.approx(_oracle(charged), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fraction", (1.0, 0.85))
@pytest.mark.parametrize("save", (0.25, 2.0))
def test_layers_with_save_costs_agrees_with_enumeration_of_its_plan_space(seed, fraction, save):
    """The shared mask is kept (saved) in every plan of the space: its save cost is
    charged too."""
    base = builders.with_budget_fraction(stack(3, seed=seed), fraction)
    problem = dataclasses.replace(base, nodes=tuple(
        dataclasses.replace(n, save_s=save * (1 + k % 3)) if n.phase is Phase.FORWARD and n.alias_of is None else n
        for k, n in enumerate(base.nodes)))
    assert any(problem.nodes[v].save_s for v, _ in problem.save_charged
               if problem.nodes[v].name == "mask")
    assert_layers_agrees_with_its_space(problem)

