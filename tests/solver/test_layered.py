"""`layers`: the layer structure as data, and the layered DP against an exhaustive oracle
over its own plan space (values shared between layers kept), on small stacks."""

from __future__ import annotations

import random

import pytest

from remat_solvers import Decision, Phase, Problem, Status, UnsupportedProblem, solve
from remat_solvers import builders
from remat_solvers.brute import valid_plans
from remat_solvers.builders import FwdOp, joint_from_forward
from remat_solvers.layers import kept_values
from remat_solvers.layer_structure import OUTSIDE, LayerStructure
from test_solver_invariants import check_plan


def stack(n_layers: int, seed: int, *, mask_bytes: int = 8, mask_in_backward: bool = True) -> Problem:
    """x -> mask (built once, read by every layer); per layer: a = f(h, w, mask),
    b = g(a), h = h + b; loss. Sizes and costs drawn from `seed`."""
    rng = random.Random(seed)
    ops = [FwdOp(name="x", out_bytes=64, phase=Phase.INPUT)]
    ops += [FwdOp(name=f"w_{k}", out_bytes=16, phase=Phase.PARAM) for k in range(n_layers)]
    ops.append(FwdOp(name="mask", out_bytes=mask_bytes, inputs=(0,), compute_s=1.0, differentiable=False))
    mask, h = len(ops) - 1, 0
    for k in range(n_layers):
        size = rng.choice((32, 64, 96))
        ops.append(FwdOp(name=f"a_{k}", out_bytes=size, inputs=(h, 1 + k, mask), compute_s=rng.choice((1.0, 3.0)),
                         grad_reads=(h, 1 + k, mask) if mask_in_backward else (h, 1 + k)))
        a = len(ops) - 1
        ops.append(FwdOp(name=f"b_{k}", out_bytes=64, inputs=(a,), compute_s=rng.choice((0.5, 2.0)),
                         grad_reads=(a,)))
        ops.append(FwdOp(name=f"h_{k}", out_bytes=64, inputs=(h, len(ops) - 1), compute_s=0.25,
                         grad_alias=True))
        h = len(ops) - 1
    ops.append(FwdOp(name="loss", out_bytes=4, inputs=(h,), compute_s=0.5, grad_reads=(h,)))
    problem = joint_from_forward(ops)
    return _with_layers(problem, n_layers)


def _with_layers(problem: Problem, n_layers: int) -> Problem:
    """Layer k: the forward nodes whose name ends in _k."""
    suffixes = {f"_{k}": k for k in range(n_layers)}
    layer_of = []
    for node in problem.nodes:
        k = next((v for s, v in suffixes.items() if node.name.endswith(s)), OUTSIDE)
        layer_of.append(k if node.phase is Phase.FORWARD else OUTSIDE)
    names = tuple(f"h.{k}" for k in range(n_layers))
    return Problem(nodes=problem.nodes, outputs=problem.outputs, budget_bytes=problem.budget_bytes,
                   layers=LayerStructure(layer_of=tuple(layer_of), names=names))


def _oracle(problem: Problem) -> float | None:
    """Cheapest fitting plan of the layered plan space (kept values SAVE), by enumeration."""
    kept = kept_values(problem)
    costs = [ev.cost_s for d, ev in valid_plans(problem)
             if ev.fits and all(d[v] is Decision.SAVE for v in kept)]
    return min(costs, default=None)


def assert_layers_agrees_with_its_space(problem: Problem) -> None:
    """`layers` against `_oracle`: infeasible exactly when its space has no fitting plan,
    a real lower bound, a plan inside the space, and the optimum when OPTIMAL."""
    plan = solve(problem, "layers")
    check_plan(problem, plan, "layers")
    best = _oracle(problem)
    if best is None:
        assert plan.status is Status.INFEASIBLE
        return
    assert plan.status is not Status.INFEASIBLE
    assert plan.lower_bound_s is not None and plan.lower_bound_s <= best + 1e-9
    assert plan.objective_s >= best - 1e-9  # the plan lies in the space
    if plan.status is Status.OPTIMAL:
        assert plan.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)


def test_structure_names_the_shared_values():
    problem = stack(3, seed=0)
    names = {problem.nodes[v].name for v in problem.layers.shared_values(problem)}
    assert names == {"mask"}  # the residual stream h_k is read by its own and the next layer only
    assert problem.layers.segments() == tuple(
        (problem.nodes.index(next(n for n in problem.nodes if n.name == f"a_{k}")),
         problem.nodes.index(next(n for n in problem.nodes if n.name == f"h_{k}"))) for k in range(3))


def test_structure_is_validated():
    with pytest.raises(ValueError, match="contiguous"):
        LayerStructure(layer_of=(0, 1, 0), names=("h.0", "h.1"))
    with pytest.raises(ValueError, match="in -1..1"):
        LayerStructure(layer_of=(0, 2), names=("h.0", "h.1"))
    problem = stack(2, seed=0)
    with pytest.raises(ValueError, match="entries for"):
        Problem(nodes=problem.nodes, outputs=problem.outputs, budget_bytes=1,
                layers=LayerStructure(layer_of=(0, 1), names=("h.0", "h.1")))


def test_without_structure_layers_declines():
    with pytest.raises(UnsupportedProblem, match="layer structure"):
        solve(builders.transformer(2, seq=32, d_model=32, n_heads=2, vocab=64), "layers")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fraction", (1.0, 0.9, 0.85, 0.8))
def test_layers_agrees_with_enumeration_of_its_plan_space(seed, fraction):
    problem = builders.with_budget_fraction(stack(3, seed=seed), fraction)
    assert_layers_agrees_with_its_space(problem)


@pytest.mark.parametrize("seed", range(4))
def test_a_mask_read_only_in_forward_keeps_the_bound_below_the_space(seed):
    """Backward never reads the mask: the optimistic model counts it only until the last
    layer begins (fewer bytes than simulate); a bound stays at or below every fitting plan
    of the space and OPTIMAL plans are the space's optimum. (At tighter budgets the
    conservative model, which holds the 64-byte mask to the end, may find no plan where
    the space has one: the known cost of keeping shared values.)"""
    optimal = 0
    for fraction in (1.0, 0.95):
        problem = builders.with_budget_fraction(stack(3, seed=seed, mask_bytes=64, mask_in_backward=False),
                                                fraction)
        plan = solve(problem, "layers")
        check_plan(problem, plan, "layers")
        best = _oracle(problem)
        assert best is not None and plan.objective_s >= best - 1e-9
        if plan.lower_bound_s is not None:
            assert plan.lower_bound_s <= best + 1e-9
        if plan.status is Status.OPTIMAL:
            assert plan.objective_s == pytest.approx(best, rel=1e-9, abs=1e-12)
            optimal += 1
    assert optimal >= 1


def test_a_large_shared_value_costs_a_gap_not_a_wrong_bound():
    """A kept mask as large as a layer's activations: the bound allows for the bytes the
    reduced model holds it longer, and stays below every fitting plan of the space."""
    for seed in range(4):
        problem = builders.with_budget_fraction(stack(3, seed=seed, mask_bytes=64), 0.9)
        plan = solve(problem, "layers")
        check_plan(problem, plan, "layers")
        best = _oracle(problem)
        if best is not None:
            assert plan.lower_bound_s <= best + 1e-9 <= plan.objective_s + 2e-9


def test_shared_block_tables_charge_the_clock_as_building_them_did():
    """Tables are reused across solves; the deterministic clock is charged the same, so a
    limit cuts the same search whether or not the tables were cached."""
    import remat_solvers.dp.tables as dp

    problem = builders.with_budget_fraction(builders.transformer(3, seq=64, d_model=64, n_heads=2, vocab=64), 0.6)
    dp._TABLES.clear()
    first = solve(problem, "dp")
    second = solve(problem, "dp")
    assert first.decisions == second.decisions and first.status is second.status
    assert first.work_s == second.work_s > 0
    tight = first.work_s / 2  # less than building the tables takes: declined, cached or not
    for _ in range(2):
        with pytest.raises(UnsupportedProblem, match="time limit") as declined:
            solve(problem, "dp", time_limit_s=tight)
        # the table it cannot pay for is neither built nor charged
        assert 0 <= declined.value.work_s <= tight


def test_block_tables_are_charged_at_the_table_rate(monkeypatch):
    """dp's tables charge the clock at TABLE_STEPS_PER_S (configurations x values x
    contexts of a_{b-1}, per table used), nothing else of dp does: twice the rate, half
    the nominal seconds, the same plan, cold or cached."""
    import remat_solvers.base as base
    import remat_solvers.dp.tables as dp

    problem = builders.with_budget_fraction(builders.transformer(3, seq=64, d_model=64, n_heads=2, vocab=64), 0.6)
    dp._TABLES.clear()
    cold = solve(problem, "dp")
    monkeypatch.setattr(base, "TABLE_STEPS_PER_S", 2 * base.TABLE_STEPS_PER_S)
    dp._TABLES.clear()
    built = solve(problem, "dp")
    for fast in (built, solve(problem, "dp")):  # cold, then from this process's tables
        assert fast.decisions == cold.decisions and fast.status is cold.status
        assert fast.work_s == cold.work_s / 2 > 0


def test_layers_admits_traced_attention_blocks_and_auto_passes_the_same_limit(monkeypatch):
    """`layers` enumerates blocks up to 2^17 configurations (GPT-2's 57,600 and LLaMA's
    95,040 attention blocks); `auto` hands it the same 2^17 (those tables build cold in
    about 2.5 and 6 cpu s, within auto's default limit: test_layered_traced.py)."""
    import dataclasses

    from remat_solvers import SOLVERS
    from remat_solvers.auto import AutoOptions
    from remat_solvers.dp.solver import DPOptions
    from remat_solvers.layers import LayersOptions

    assert LayersOptions().max_block_configs == 1 << 17 > DPOptions().max_block_configs
    seen = []
    spec = SOLVERS["layers"]

    def run(problem, options):
        seen.append(options.max_block_configs)
        return spec.run(problem, options)

    import remat_solvers.auto as auto

    monkeypatch.setattr(auto, "SOLVERS", {**SOLVERS, "layers": dataclasses.replace(spec, run=run)})
    problem = builders.with_budget_fraction(stack(3, 0), 0.8)
    assert solve(problem, "auto", brute_max=0).solver == "auto"
    assert seen == [AutoOptions().layers_max_block_configs] == [LayersOptions().max_block_configs]
    # at budget 0 (the floor search's) nothing fits and layers' answer would be dropped
    assert solve(problem.with_budget(0), "auto", brute_max=0).status is Status.INFEASIBLE
    assert len(seen) == 1
