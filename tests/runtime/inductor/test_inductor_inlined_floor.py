"""Where no plan fits under inductor, the closed loop also tries the floors solved against
the graph as inductor's lowering runs it (`remat.planning.inlining`), of the plans that
recompute each value once and of all plans (schedules included), and names the lowest
(`remat.runtime.inductor.closed_loop`). On the tiny MLP the inlined plan peaks lower under
inductor than every plan solved op by op (747,864 B against 751,704 B at one thread).
On a stack of LayerNorm → Linear → GELU → Linear blocks, whose backward inductor
decomposes into pointwise chains, the inlined floor with schedules peaks lowest
(2,839,816 B against 3,101,192 B without it, where the plan at the floor has no
schedule): the plan at that budget is that one and runs under it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.runtime.inductor import closed_loop
from remat.testing import zoo

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _floor_under_inductor() -> int:
    torch._dynamo.reset()
    case = zoo.build("mlp", size="tiny")
    compiled = torch.compile(case.model, backend=remat.backend(budget=1, outputs="loss", whole_step=False))
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        compiled(*case.args, **case.kwargs).loss.backward()
    return refused.value.min_peak_bytes


def test_the_floor_named_under_inductor_is_the_inlined_plans_where_it_peaks_lower(monkeypatch):
    floor = _floor_under_inductor()
    monkeypatch.setattr(closed_loop, "_inlined_floors", lambda partitioner, plan: {})
    assert floor < _floor_under_inductor()


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))


def _blocks(budget: int):
    """The compiled stack of four blocks at `budget`, its backend, model and input."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = nn.Sequential(*[Block() for _ in range(4)]), torch.randn(8, 64, 64)
    be = remat.backend(budget=budget, whole_step=False)
    return torch.compile(model, backend=be), be, model, x


def _blocks_floor() -> int:
    compiled, _, _, x = _blocks(1)
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        compiled(x).pow(2).mean().backward()
    return refused.value.min_peak_bytes


def test_the_inlined_floor_with_schedules_is_named_where_it_peaks_lowest_and_runs_under_it():
    """The plan at the named floor is the inlined one with schedules (only over the plans
    that recompute each value once, the floor named is 3,101,192 B and its plan has no
    schedule), and its step runs under it."""
    floor = _blocks_floor()
    compiled, be, model, x = _blocks(floor)
    compiled(x).pow(2).mean().backward()
    (step,) = be.steps
    assert step.plan.schedule is not None and step.planned_peak_bytes is not None  # solved as lowering inlines
    model.zero_grad(set_to_none=True)  # the profiler cannot see frees before the step
    measured = be.measure(lambda: compiled(x).pow(2).mean().backward(), register=(model, x))
    assert measured.peak_bytes <= step.evaluation.peak_bytes + step.fusion_margin_bytes <= floor
