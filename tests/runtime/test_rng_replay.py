"""Dropout recomputed by replaying the generator state (remat.frontend.random_ops and
rng_ops, remat.runtime.rng): bit for bit equal to eager, the random stream after the
step where eager leaves it, measured peak equal to the prediction, and a lower floor
than saving every mask."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs; never download

import pytest
import torch

import remat
from remat.testing import zoo
from remat.testing.measure import measure_step, measure_step_profiler
from remat.frontend import rng_ops as rng
from remat_solvers import Decision, solve
from nets import step_and_take_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
SEED = 123


def _step_and_next_draw(model, args, kwargs=None):
    """One step under SEED (`step_and_take_grads`): loss, gradients by name, and the next
    draw of the global stream: where the step left it."""
    loss, grads = step_and_take_grads(model, args, kwargs, seed=SEED)
    return loss, grads, torch.rand(4)


BUDGET = {"gpt2": "45%", "bert": "50%"}
"""Of the no-remat peak: below what any plan reaches with every mask saved (gpt2: 47.9%,
bert: 55.0%, InfeasibleBudgetError.min_peak_bytes with replay_rng=False), above the floor
with replay (38.7%, 46.9%). Measured with op workspace (the default), tiny size, torch
2.13 CPU, one thread."""
SOLVER = "chen-greedy"  # fast; the floor machinery (budget=1) takes ~30 s per model here


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def planned(request):
    """(case, eager step, a plan under BUDGET)."""
    case = zoo.build(request.param, size="tiny")
    eager = _step_and_next_draw(case.model, case.args, case.kwargs)
    return case, eager, remat.plan(case.model, case.args, case.kwargs, budget=BUDGET[request.param], solver=SOLVER)


def test_plan_replays_dropout(planned):
    case, _, p = planned
    gp = p.step.graph_problem
    replayed = [i for i, d in p.plan.decisions.items()
                if d is Decision.RECOMPUTE and gp.value_name[i].startswith("dropout_mask")]
    assert replayed, "the plan replays no dropout mask"
    states = {i for i in p.plan.decisions if gp.value_name[i].startswith("generator_state")}
    for i in replayed:
        state = next(j for j in gp.problem.nodes[i].inputs if j in states)
        assert p.plan.decisions[state] is Decision.SAVE  # read in forward, never recomputed
    targets = [n.target for n in p.step.backward.graph.nodes if n.op == "call_function"]
    assert targets.count(rng.dropout_mask_replay) == len(replayed)
    assert rng.generator_state not in targets
    # forward runs eager's native_dropout, one kernel per dropout
    fw_targets = [n.target for n in p.step.forward.graph.nodes if n.op == "call_function"]
    assert rng.dropout_mask not in fw_targets
    assert torch.ops.aten.native_dropout.default in fw_targets


def test_replayed_step_equals_eager_bit_for_bit(planned):
    case, (loss, grads, next_draw), p = planned
    loss_r, grads_r, next_r = _step_and_next_draw(p, case.args, case.kwargs)
    assert torch.equal(loss, loss_r)
    assert grads.keys() == grads_r.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_r[name]), name
    assert torch.equal(next_draw, next_r), "the step left the global random stream elsewhere than eager"


def test_measured_peak_equals_prediction(planned):
    case, _, p = planned

    def step():
        torch.manual_seed(SEED)
        out = p(*case.args, **case.kwargs)
        out.loss.backward()
        return out  # kept alive, as the prediction assumes (outputs live at the end)

    # the allocator is trusted (the budget is what it serves, op workspace included, which
    # the prediction counts); the tracker sees tensor storages only, never more
    register = (case.model, *case.args, *case.kwargs.values())
    peaks = []
    for measure in (measure_step_profiler, measure_step):
        peaks.append(measure(step, register=register).peak_bytes)
        for q in case.model.parameters():
            q.grad = None
    allocator, tracker = peaks
    assert allocator == p.predicted_peak_bytes <= p.budget_bytes
    assert tracker <= allocator


def test_saving_every_mask_cannot_fit(planned):
    """The same problem with the masks never replayed (their outputs may still be
    recomputed from a saved mask): neither chen-greedy nor recomputing everything fits
    the budget the replaying plan fits."""
    _, _, p = planned
    gp, problem = p.step.graph_problem, p.problem
    masks_saved = dataclasses.replace(problem, nodes=tuple(
        dataclasses.replace(node, recomputable=False) if gp.value_name[i].startswith("dropout_mask") else node
        for i, node in enumerate(problem.nodes)))
    for solver in (SOLVER, "all"):
        assert solve(masks_saved, solver).peak_bytes > p.budget_bytes >= p.predicted_peak_bytes


@pytest.mark.parametrize("shape,p", [((8, 4, 64, 64), 0.1), ((2, 64, 64), 0.1), ((3, 5), 0.5), ((1000,), 0.3)])
def test_dropout_split_is_eager_dropout(shape, p):
    """The split the planner sees: mask by replay, output by native_dropout_backward,
    both equal to one native_dropout; the replay leaves the stream where it was."""
    torch.manual_seed(0)
    x = torch.randn(shape)
    state = rng.generator_state("cpu")
    out, mask = torch.ops.aten.native_dropout(x, p, True)
    after = torch.get_rng_state()
    mask_r = rng.dropout_mask_replay(state, x, p, True)
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(mask, mask_r)
    assert torch.equal(out, rng.DROPOUT_APPLY(x, mask_r, 1.0 / (1.0 - p)))


class _StochasticMasks(torch.nn.Module):
    """Random ops other than dropout: a rand_like threshold mask and a bernoulli draw."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = h * (torch.rand_like(h) > 0.2).to(h.dtype) / 0.8
        h = torch.relu(self.b(h)) * torch.bernoulli(torch.full_like(h, 0.9))
        return torch.nn.functional.cross_entropy(self.head(h), y)


def test_other_random_ops_replay_bit_for_bit():
    torch.manual_seed(0)
    model, x, y = _StochasticMasks(), torch.randn(256, 64), torch.randint(0, 10, (256,))

    def step(module):
        loss, grads, next_draw = _step_and_next_draw(module, (x, y))
        return loss, list(grads.values()), next_draw

    loss, grads, next_draw = step(model)
    planned = remat.plan(model, (x, y), budget="100%", solver="all")
    replays = [n for n in planned.step.backward.graph.nodes if n.target is rng.random_op_replay]
    assert {n.args[2] for n in replays} == {torch.ops.aten.rand_like.default, torch.ops.aten.bernoulli.default}
    loss_r, grads_r, next_r = step(planned)
    assert torch.equal(loss, loss_r) and torch.equal(next_draw, next_r)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_r))
    measured = measure_step(lambda: planned(x, y).backward(), register=(model, x, y)).peak_bytes
    assert measured == planned.predicted_peak_bytes


def test_a_replay_holds_the_generator_state_and_the_problem_counts_it(planned):
    """A replay copies the generator's current state (to put it back after), outside the
    dispatcher: the allocator sees those bytes while the op runs, a tensor tracker does
    not. Each replayable op's workspace in the problem includes them."""
    state = rng.generator_state("cpu")
    x = torch.randn(64, 64)
    allocated = measure_step_profiler(lambda: rng.random_op_replay(state, "cpu", torch.ops.aten.rand_like.default, x))
    assert allocated.peak_bytes == x.nbytes + state.nbytes
    _, _, p = planned
    gp, nodes = p.step.graph_problem, p.problem.nodes
    replayable = [i for i, name in enumerate(gp.value_name) if name.startswith("dropout_mask")]
    assert replayable
    for i in replayable:
        dropped_output = 4 * nodes[i].out_bytes  # fp32 output, bool mask: made and dropped
        assert nodes[i].workspace_bytes >= dropped_output + state.nbytes, gp.value_name[i]


class _WideDropout(torch.nn.Module):
    """One dropout on a wide activation whose replay is the step's peak: the gradient
    of `mean` is a broadcast (no bytes), so at the replay the input, the mask, the
    output made and dropped, and the op's own scratch are all live at once."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 512)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(torch.relu(self.a(x))).mean()


def test_a_replay_fits_its_prediction_with_the_allocator():
    """CPU's native_dropout makes a float copy of its mask beside its output; a replay
    holds it too. Without it counted (measure_workspace on) the allocator reads 10,100 B
    over the prediction here, as on T5 tiny at its floor."""
    torch.manual_seed(0)
    model, x = _WideDropout(), torch.randn(256, 64)
    planned = remat.plan(model, (x,), budget=10**8, solver="all", measure_workspace=True)
    assert any(n.target is rng.dropout_mask_replay for n in planned.step.backward.graph.nodes)
    measured = measure_step_profiler(lambda: planned(x).backward(), register=(model, x)).peak_bytes
    state_bytes = rng.generator_state("cpu").nbytes
    assert measured <= planned.predicted_peak_bytes <= measured + state_bytes
