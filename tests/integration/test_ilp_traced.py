"""ilp's strengthened rows on traced joint graphs, which have what the synthetic builders
lack (backward views, outputs inside decision storages, masks shared by every layer):
for the plans the solvers find, no row counts more bytes than simulate has live at any
node step (a row that did would let ilp call a plan optimal that is not)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")

import remat  # noqa: E402
from remat.testing import zoo  # noqa: E402
from remat_solvers import builders, simulate, solve  # noqa: E402
from remat_solvers.ilp import model as ilp_model  # noqa: E402
from oracles import node_step_bytes  # noqa: E402


@pytest.fixture(scope="module", params=["gpt2", "bert", "llama", "vit"])
def traced(request):
    case = zoo.build(request.param, size="tiny")
    return remat.plan(case.model, case.args, case.kwargs, budget="100%", solver="none").problem


def test_rows_never_count_more_than_simulate_on_traced_graphs(traced):
    model = ilp_model.CanonicalModel(traced, cumulative=False)  # rows do not depend on the budget
    checked = 0
    for fraction in (0.5, 0.7):
        problem = builders.with_budget_fraction(traced, fraction)
        for name in ("chen-greedy", "greedy"):
            plan = solve(problem, name)
            ev = simulate(traced, plan.decisions)
            for t, (counted, live) in enumerate(zip(model.row_bytes(plan.decisions), node_step_bytes(traced, ev))):
                assert counted <= live, (name, fraction, t)
            checked += 1
    assert checked == 4
