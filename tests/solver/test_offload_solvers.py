"""OFFLOAD as a real choice in the solvers: below the recompute-only floor the solvers
offload; the transfer they pay is what `simulate` prices (only the exposed part)."""

from __future__ import annotations

import dataclasses

import pytest

from remat_solvers import Decision, Status, builders, simulate, solve

SOLVERS = ("greedy", "dp", "ilp", "auto")


def _twelve_layer_chain(bandwidth: float | None) -> "builders.Problem":
    """A 12-layer chain of 1 MiB activations and 1 ms layers, offloading at `bandwidth`
    bytes/s (None: no offload)."""
    return builders.chain(12, activation_bytes=1 << 20, compute_s=1e-3,
                          offload_bandwidth_bytes_per_s=bandwidth)


def _recompute_floor(problem) -> int:
    off = dataclasses.replace(problem, offload_bandwidth_bytes_per_s=None).with_budget(0)
    return solve(off, "ilp", time_limit_s=20).peak_bytes


@pytest.mark.parametrize("solver", SOLVERS)
def test_solvers_offload_below_the_recompute_floor(solver):
    problem = _twelve_layer_chain(bandwidth=1e9)
    floor = _recompute_floor(problem)
    below = problem.with_budget(floor - 1)
    plan = solve(below, solver, time_limit_s=20)
    assert plan.status is not Status.INFEASIBLE, (solver, plan.peak_bytes, floor)
    assert plan.count(Decision.OFFLOAD) > 0
    ev = simulate(below, plan)
    assert ev.fits and ev.peak_bytes == plan.peak_bytes <= floor - 1
    assert plan.objective_s == pytest.approx(ev.cost_s)
    assert ev.offload_s <= ev.transfer_s


@pytest.mark.parametrize("solver", SOLVERS)
def test_without_offload_the_same_budget_is_infeasible(solver):
    problem = _twelve_layer_chain(bandwidth=None)
    floor = _recompute_floor(problem)
    plan = solve(problem.with_budget(floor - 1), solver, time_limit_s=20)
    assert plan.status is Status.INFEASIBLE
    assert plan.count(Decision.OFFLOAD) == 0


def test_hidden_store_makes_offload_cheaper_than_the_full_round_trip():
    # A slow link: the exposed cost of an early value's store is smaller than its
    # transfer time, because the rest of the forward runs while it copies.
    problem = _twelve_layer_chain(bandwidth=2e9)
    first = problem.forward_ids[0]
    assert problem.store_overlap_s[first] > 0
    assert problem.store_s(first) < problem.transfer_s(first)
    assert problem.reload_s(first) == problem.transfer_s(first)
