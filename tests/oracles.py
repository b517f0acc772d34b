"""Oracle checks shared by the exact-solver tests."""

import pytest

from remat_solvers import Problem, Status, StepKind, solve

REL = dict(rel=1e-9, abs=1e-12)


def assert_equals_brute(problem: Problem, plan) -> None:
    oracle = solve(problem, "brute")
    assert plan.status is oracle.status
    if oracle.status is Status.OPTIMAL:
        assert plan.objective_s == pytest.approx(oracle.objective_s, **REL)
        assert plan.lower_bound_s == plan.objective_s
    else:
        assert plan.peak_bytes == oracle.peak_bytes  # on INFEASIBLE: the smallest reachable peak


def node_step_bytes(problem: Problem, ev) -> list[int]:
    """simulate's live bytes at each node step, in node-step order (the ilp model's time)."""
    at = {st.node_id: ev.timeline[k] for k, st in enumerate(ev.steps) if st.kind in (StepKind.FORWARD, StepKind.BACKWARD)}
    return [at[i] for i in (*problem.forward_ids, *problem.backward_ids)]
