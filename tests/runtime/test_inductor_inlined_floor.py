"""Where no plan fits under inductor, the closed loop also tries the floor solved against
the graph as inductor's lowering runs it (`remat.planning.inlining`), and names the lower
(`remat.runtime.inductor.closed_loop`). On the tiny MLP the inlined plan peaks lower under
inductor than every plan solved op by op (747,864 B against 751,704 B at one thread):
the refusal of a 1-byte budget names it, and without that plan it names more."""

from __future__ import annotations

import pytest
import torch

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
    at_canonical_floor = closed_loop._at_canonical_floor
    monkeypatch.setattr(closed_loop, "_at_canonical_floor",
                        lambda partitioner, plan, inline_pointwise=False: at_canonical_floor(partitioner, plan))
    assert floor < _floor_under_inductor()
