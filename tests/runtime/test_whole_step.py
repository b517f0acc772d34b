"""One budget for the whole step when torch.compile splits it into graphs
(remat.runtime.step.ledger, remat.runtime.step.split): a model with two graph breaks (three
graphs) under remat.backend(compiler="eager"), the profiler's measured peak of the
whole step under the budget and under the ledger's prediction, gradients bit-equal to
eager, and a percentage that is of the whole step's no-remat peak (per graph, the
head's would be below its floor). One compiled model is shared by the assertions."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.budget import resolve_budget
from remat.planning.floor import lowest_found
from remat.testing.measure import measure_step
from remat_solvers import solve
from nets import step_from_cleared_grads

BUDGET = "70%"


class Broken(nn.Module):
    """Two MLP stacks and a head, with a graph break between each: three graphs."""

    def __init__(self, layers: int = 8, width: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)

        def stack():
            return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])

        self.a, self.b, self.head = stack(), stack(), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        h = self.b(h)
        torch._dynamo.graph_break()
        return self.head(h).square().mean()


@pytest.fixture(scope="module")
def run():
    """Three compiled steps against eager; the backend after them."""
    torch._dynamo.reset()
    model, x = Broken(), torch.randn(1024, 64)
    eager = copy.deepcopy(model)
    be = remat.backend(budget=BUDGET, solver="chen-greedy", compiler="eager")
    compiled = torch.compile(model, backend=be)
    equal, plans = [], []
    for _ in range(3):
        loss = step_from_cleared_grads(compiled, model, x)
        same = torch.equal(loss, step_from_cleared_grads(eager, eager, x))
        equal.append(same and all(torch.equal(a.grad, b.grad)
                                  for a, b in zip(model.parameters(), eager.parameters())))
        plans.append(len(be.steps))
    return model, eager, x, be, compiled, equal, plans


def test_every_step_bit_equal_to_eager(run):
    *_, equal, _ = run
    assert equal == [True, True, True]


def test_the_split_is_known_after_the_first_step_and_stays(run):
    _, _, _, be, _, _, plans = run
    ledger = be.ledger
    assert ledger.steps >= 2 and len(ledger.first_step) == 3
    assert [c.graph for c in ledger.last_step] == [0, 1, 2]
    assert plans[1] == plans[2]  # nothing planned after the second step
    assert ledger.budget_bytes == resolve_budget(BUDGET, ledger.no_remat_step_bytes)
    # every call's plan fits what is live outside it
    assert all(c.outside_bytes + c.peak_bytes <= ledger.budget_bytes for c in ledger.last_step)
    # the second graph runs while the first one's saved activations are held
    assert ledger.last_step[1].outside_bytes > ledger.last_step[0].outside_bytes
    assert sum(len(s.evaluation.recomputed_ids) for s in be.steps) > 0
    assert "whole-step budget '70%' shared by 3 graph calls" in be.summary()


def test_the_percentage_is_of_the_whole_step(run):
    """Per graph, 70% of the head graph's own no-remat peak is below its floor (the
    refusal the per-graph budget gave embedding and head graphs); of the whole step it
    plans."""
    _, _, _, be, *_ = run
    head = be.ledger.graphs[2][0]
    problem = head.graph_problem.problem
    floor = lowest_found(problem, solve(problem.with_budget(0), "chen-greedy")).peak_bytes
    assert floor > resolve_budget(BUDGET, head.baseline_peak_bytes)


def test_measured_whole_step_peak_under_the_budget(run):
    model, eager, x, be, compiled, *_ = run

    def step(fn):
        return lambda: fn(x).backward()

    model.zero_grad(set_to_none=True)  # frees before the step are invisible to the profiler
    measured = be.measure(step(compiled), register=(model, x))
    eager.zero_grad(set_to_none=True)
    unplanned = measure_step(step(eager), register=(eager, x), instrument="profiler")
    ledger = be.ledger
    assert measured.peak_bytes <= ledger.predicted_step_bytes <= ledger.budget_bytes
    assert measured.peak_bytes < 0.8 * unplanned.peak_bytes
    assert "WARNING" not in be.summary()


def test_a_known_step_runs_no_simulation(run, monkeypatch):
    """Once the split is known, a step only measures and runs: each variant's boundary
    bytes are simulated once (a simulate per call cost LLaMA tiny a third of its step)."""
    from remat.runtime.step import split

    model, _, x, be, compiled, *_ = run
    simulated = []
    real = split.simulate
    monkeypatch.setattr(split, "simulate", lambda *a, **k: simulated.append(a) or real(*a, **k))
    planned = len(be.steps)
    step_from_cleared_grads(compiled, model, x)
    assert len(be.steps) == planned and simulated == []


def test_the_ledger_forgets_dead_storages(run):
    """What a step leaves (its activations, saved for backward) dies with it: the ledger
    drops it at the next step's first call, so it holds as many storages after every
    step, and measures the same bytes outside each call."""
    model, _, x, be, compiled, *_ = run
    ledger = be.ledger
    held, outside = [], []
    for _ in range(3):
        step_from_cleared_grads(compiled, model, x)
        held.append(len(ledger._tracked.bytes))
        outside.append([c.outside_bytes for c in ledger.current])
    assert held[0] == held[1] == held[2] > 0
    assert outside[0] == outside[1] == outside[2]


def test_a_budget_no_split_fits_is_refused_as_the_first_step_ends():
    torch._dynamo.reset()
    model = Broken(layers=2)
    be = remat.backend(budget="20%", solver="chen-greedy", compiler="eager")
    with pytest.raises(remat.InfeasibleBudgetError, match="smallest reachable peak") as info:
        torch.compile(model, backend=be)(torch.randn(256, 64)).backward()
    assert info.value.min_peak_bytes > info.value.budget_bytes == be.ledger.budget_bytes

