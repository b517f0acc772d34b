"""`remat.plan` trains as eager, bit for bit, on small random compositions of blocks
(`remat.testing.compositions`, kinds `EAGER`: MLPs, gated MLPs, SDPA and
`nn.MultiheadAttention`, LayerNorm, RMSNorm or no norm before or after the residual or
shared, dropout, attention dropout, stochastic depth, token embeddings with a tied or
untied head): at the no-remat peak, at the floor, and at the floor with offload, two
steps each under different random seeds. `compile=True` at its floor on seeds 9 and 14
(in eval mode: inductor draws other random numbers than eager), to inductor's rounding
(rtol 1e-4, as `tests/runtime/inductor/test_backend_gradients.py` states why); the
backend's own fuzz is there."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from nets import assert_gradients_match, assert_trains_like_eager
from remat.testing.compositions import EAGER, composition, describe

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SEEDS = (0, 3, 5, 6, 9, 13, 16, 20, 27, 28)
"""Between them: every mixer and norm, every norm placement, one to four blocks;
dropout in MLPs, SDPA and `nn.MultiheadAttention` (5, 6, 27); stochastic depth (3, 5,
9, 13, 16, 28; every block of 13); a tied head (3, 28), an untied one (6). 20 (two
attention blocks, no norm) reaches its floor with a schedule that recomputes an owner of
two saved views (`tests/solver/test_shared_storage.py`)."""


def _floor(model, x, **kwargs) -> int:
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (x,), budget=1, **kwargs)
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


@pytest.mark.parametrize("seed", (9, 14))
def test_random_compositions_plan_through_inductor_to_its_rounding(seed):
    torch._dynamo.reset()
    model, x = composition(seed, EAGER)
    model.eval()  # inductor draws other random numbers than eager
    planned = remat.plan(model, (x,), budget=_floor(model, x, compile=True), compile=True)
    assert_gradients_match(model, lambda m: planned(x), lambda m: m(x), f"composition {seed} ({describe(model)})")
