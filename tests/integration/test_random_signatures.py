"""Every random op, written as eager code writes it, planned at the floor of a small
residual stack (where remat replays what it can from the saved generator state):
outputs and gradients bit for bit equal to eager's, and the global random stream left
where eager leaves it. Keyword `device`, `dtype`, `layout` and `generator` arguments
included: the wrapper that replays an op passes the op's own keywords through (a
`device=` keyword once collided with the wrapper's own parameter), and an op drawing
from a generator of its own is saved, never replayed."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat import compat
from remat_solvers import Decision
from nets import step_and_take_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
D = 32
_GENERATOR = torch.Generator().manual_seed(7)


def _noise(kind: str, x: torch.Tensor) -> torch.Tensor:
    """`x` times one random factor, drawn as eager code draws it."""
    if kind == "dropout":
        return torch.nn.functional.dropout(x, p=0.2, training=True)
    return x * _factor(kind, x)


def _factor(kind: str, x: torch.Tensor) -> torch.Tensor:
    row = (x.shape[0],) + (1,) * (x.ndim - 1)
    if kind == "drop_path":  # timm's and transformers' stochastic depth
        keep = 0.9
        return (keep + torch.rand(row, dtype=x.dtype, device=x.device)).floor_() / keep
    if kind == "randn":
        return 1 + 0.1 * torch.randn(x.shape, device=x.device, dtype=x.dtype, layout=torch.strided)
    if kind == "rand_like":
        return torch.rand_like(x)
    if kind == "bernoulli":
        return torch.bernoulli(torch.full_like(x, 0.8))
    if kind == "randint":
        return torch.randint(1, 3, x.shape, device=x.device).to(x.dtype)
    if kind == "generator":
        return torch.rand(row, generator=_GENERATOR, dtype=x.dtype, device=x.device)
    raise ValueError(kind)


class Block(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.fc1 = torch.nn.Linear(D, 2 * D)
        self.fc2 = torch.nn.Linear(2 * D, D)

    def forward(self, x):
        y = self.fc2(torch.nn.functional.gelu(self.fc1(x)))
        return x + _noise(self.kind, y)


class Net(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(kind) for _ in range(4)])

    def forward(self, x):
        return self.blocks(x).pow(2).mean()


def _step_and_next_draw(model, x):
    """One step (`step_and_take_grads`) with both streams reseeded, and the next draw of
    the global stream: where the step left it."""
    _GENERATOR.manual_seed(7)
    loss, grads = step_and_take_grads(model, (x,), seed=0)
    return loss, list(grads.values()), torch.rand(3)


@pytest.mark.parametrize("kind", ["drop_path", "randn", "rand_like", "bernoulli", "randint", "dropout",
                                  "generator"])
def test_a_random_op_at_the_floor_trains_as_eager(kind):
    torch.manual_seed(0)
    model, x = Net(kind).train(), torch.randn(8, 16, D)
    eager = copy.deepcopy(model)
    loss, grads, after = _step_and_next_draw(eager, x)
    if kind == "generator" and not compat.traces_generators():
        with pytest.raises(remat.TraceError, match="generator="):
            remat.plan(model, (x,), budget=1, solver="chen-greedy")
        return
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (x,), budget=1, solver="chen-greedy")
    planned = remat.plan(model, (x,), budget=refused.value.min_peak_bytes, solver="chen-greedy")
    got_loss, got_grads, got_after = _step_and_next_draw(planned, x)
    assert torch.equal(got_loss, loss)
    for a, b in zip(got_grads, grads, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_after, after)  # the global stream is where eager leaves it
    gp = planned.step.graph_problem
    replayed = [gp.value_name[i] for i, d in planned.plan.decisions.items()
                if d is Decision.RECOMPUTE and gp.value_name[i].startswith(("random_op", "dropout_mask"))]
    if kind == "generator":
        assert not replayed  # its own generator: saved
    else:
        assert replayed, "the floor replays no random op"
