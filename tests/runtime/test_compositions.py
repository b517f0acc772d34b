"""`remat.plan` trains as eager, bit for bit, on small random compositions of blocks
(`remat.testing.compositions`, kinds `EAGER`: MLPs, gated MLPs, SDPA and
`nn.MultiheadAttention`, LayerNorm, RMSNorm or no norm before or after the residual or
shared, dropout, attention dropout, stochastic depth, token embeddings with a tied or
untied head): at the no-remat peak, at the floor, and at the floor with offload, two
steps each under different random seeds. `compile=True` at its floor on seeds 14 and 22
(in eval mode: inductor draws other random numbers than eager), to inductor's rounding
(rtol 1e-4, as `tests/runtime/inductor/test_backend_gradients.py` states why); the
backend's own fuzz is there, and here one `BACKEND` composition through the backend at
the floor it names."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from nets import assert_gradients_match, assert_trains_like_eager
from remat.testing.compositions import BACKEND, EAGER, composition, describe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SEEDS = (0, 3, 5, 6, 9, 13, 16, 20, 27, 28)
"""Between them: every mixer and norm, every norm placement, one to four blocks;
dropout in MLPs, SDPA and `nn.MultiheadAttention` (5, 6, 27); stochastic depth (3, 5,
9, 13, 16, 28; every block of 13); a tied head (3, 28), an untied one (6). 20 (two
attention blocks, no norm) reaches its floor with a schedule that recomputes an owner of
two saved views (`tests/solver/test_shared_storage.py`)."""


def _floor(model, x, **kwargs) -> int:
    args = x if isinstance(x, tuple) else (x,)
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, args, budget=1, **kwargs)
    return refused.value.min_peak_bytes


def _steps_match(planned, model, eager, x, where: str) -> None:
    for seed in (1, 2):  # a second step: the replayed random state is where eager leaves it
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        loss_eager = eager(x)
        loss_eager.backward()
        torch.manual_seed(seed)
        loss = planned(x)
        loss.backward()
        assert_trains_like_eager(loss.detach(), loss_eager.detach(), model, eager, f"{where}, step {seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_random_compositions_plan_bit_exact_from_the_no_remat_peak_to_the_floor(seed):
    model, x = composition(seed, EAGER)
    where = f"composition {seed} ({describe(model)})"
    eager = copy.deepcopy(model)
    full = remat.plan(model, (x,), budget="100%")
    _steps_match(full, model, eager, x, f"{where}, 100%")
    floor = _floor(model, x)
    at_floor = remat.plan(model, (x,), budget=floor)
    assert at_floor.predicted_peak_bytes <= floor  # the search at a budget may find lower
    assert at_floor.predicted_peak_bytes < full.predicted_peak_bytes  # something was recomputed
    _steps_match(at_floor, model, eager, x, f"{where}, floor")
    offload_floor = _floor(model, x, offload=True)
    assert offload_floor <= floor
    offloaded = remat.plan(model, (x,), budget=offload_floor, offload=True)
    _steps_match(offloaded, model, eager, x, f"{where}, floor with offload")


@pytest.mark.parametrize("seed", (14,))
def test_random_compositions_plan_through_inductor_to_its_rounding(seed):
    torch._dynamo.reset()
    model, x = composition(seed, EAGER)
    model.eval()  # inductor draws other random numbers than eager
    planned = remat.plan(model, (x,), budget=_floor(model, x, compile=True), compile=True)
    assert_gradients_match(model, lambda m: planned(x), lambda m: m(x), f"composition {seed} ({describe(model)})")


def test_compile_true_refuses_with_the_floor_inductor_holds():
    """Composition 22 (two blocks): op by op its floor is lower than any plan inductor's
    code holds, so `remat.plan(..., compile=True)` asks inductor's closed loop at plan
    time (compiling, not running, the step) and names inductor's floor. Planned at that
    floor, the first call runs under it: the prediction, inductor's margin included, is
    within the budget and the profiler's measure is within the prediction."""
    from remat.testing.measure import measure_step_profiler

    torch._dynamo.reset()
    model, x = composition(22, EAGER)
    model.eval()
    floor = _floor(model, x, compile=True)
    assert _floor(model, x) < floor  # op by op: a plan inductor cannot hold
    assert all(p.grad is None for p in model.parameters())  # the refusals ran nothing
    planned = remat.plan(model, (x,), budget=floor, compile=True)
    assert_gradients_match(model, lambda m: planned(x), lambda m: m(x), f"composition 22 ({describe(model)})")
    model.zero_grad(set_to_none=True)
    # compiled outside the profiler (under it, workspace is not measured: `workspace.measure`)
    measured = measure_step_profiler(lambda: planned(x).backward(), register=(model, x)).peak_bytes
    assert measured <= planned.predicted_peak_bytes <= planned.budget_bytes == floor


def _composition_25_under_backend(budget):
    """Composition 25 (eval mode) compiled through `remat.backend(budget=budget)`:
    (model, x, the backend, the compiled model), nothing run yet."""
    torch._dynamo.reset()
    model, x = composition(25, EAGER)
    model.eval()
    be = remat.backend(budget=budget)
    return model, x, be, torch.compile(model, backend=be, fullgraph=True)


def _trains_under(model, x, be, compiled, budget: int):
    """The compiled step's gradients match eager's, and its measured peak is at most its
    prediction, which is at most `budget`. Returns the planned step."""
    from remat.runtime.step.ledger import predicted_peak
    from remat.testing.measure import measure_step_profiler

    assert_gradients_match(model, lambda m: compiled(x), lambda m: m(x), f"composition 25 ({describe(model)})")
    model.zero_grad(set_to_none=True)
    # compiled outside the profiler (under it, workspace is not measured: `workspace.measure`)
    measured = measure_step_profiler(lambda: compiled(x).backward(), register=(model, x)).peak_bytes
    (step,) = be.steps
    assert measured <= predicted_peak(step) <= budget
    return step


def test_backend_keeps_a_plan_that_fits_when_the_room_it_tries_is_below_the_floor():
    """Composition 25 under inductor at 135,560 B: the plan found first fits (inductor's
    code holds 24,576 B less than its 160,136 B op by op), so the closed loop tries
    plans with that room; the second target falls below the floor op by op, whose
    refusal must end the search with the fitting plan, not the compile."""
    step = _trains_under(*_composition_25_under_backend(135_560), 135_560)
    assert step.evaluation.peak_bytes > 135_560  # op by op over: inductor's code holds less


def test_the_floor_the_backend_names_plans_in_the_same_process():
    """Composition 25 under inductor: the floor a 1-byte budget is refused with (below
    the floor op by op, 160,136 B: inductor's code holds less) plans when asked for in
    the same process, where the floor plan op by op is remembered by then
    (`remat.planning.floor.solve_with_floor`), and runs under it."""
    _, x, _, compiled = _composition_25_under_backend(1)
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        compiled(x).backward()
    floor = refused.value.min_peak_bytes
    _trains_under(*_composition_25_under_backend(floor), floor)


def test_compile_true_plans_below_the_floor_op_by_op_where_inductor_holds_it():
    """The zoo's MLP (tiny): inductor's code holds less than its floor op by op, so a
    budget between the two, refused op by op, plans with `compile=True`: inductor's
    closed loop, asked at plan time, holds it, and the first call runs under it."""
    from remat.testing import zoo

    torch._dynamo.reset()
    case = zoo.build("mlp", size="tiny")
    model, args = case.model.eval(), case.args
    op_by_op = _floor(model, args, outputs="loss")
    under_inductor = _floor(model, args, outputs="loss", compile=True)
    assert under_inductor < op_by_op
    planned = remat.plan(model, args, budget=under_inductor, outputs="loss", compile=True)
    assert planned.budget_bytes == under_inductor  # before the first call: the floor op by op, over it
    assert_gradients_match(model, lambda m: planned(*args).loss, lambda m: m(*args).loss, "zoo mlp")
    assert planned.predicted_peak_bytes <= under_inductor  # inductor's plan, its margin counted


def test_a_composition_trains_as_eager_through_the_backend_at_its_floor():
    """Composition 13 (a shared-norm MLP, a pre-norm MLP, pre-norm attention, the loss
    inside), planned for each graph at the floor the backend names: its attention's qkv
    projection is saved with one chunk of its reshape while the reshape itself is
    recomputed, so the saved chunk, recomputed from the projection
    (`remat_solvers.shared_storage`), needs the reshape recomputed before it."""
    torch._dynamo.reset()
    model, x = composition(13, BACKEND)
    model.eval()
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        torch.compile(model, backend=remat.backend(budget=1, whole_step=False))(x)
    floor = refused.value.min_peak_bytes
    torch._dynamo.reset()
    be = remat.backend(budget=floor, whole_step=False)
    compiled = torch.compile(model, backend=be)
    assert_gradients_match(model, lambda m: compiled(x), lambda m: m(x),
                           f"composition 13 ({describe(model)}) at {floor} B")
    (step,) = be.steps
    assert step.evaluation.recomputed_ids
    assert step.evaluation.peak_bytes + step.fusion_margin_bytes <= floor
