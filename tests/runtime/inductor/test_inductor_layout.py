"""Where a plan over the budget peaks lower with inductor's layout optimization off, the
closed loop compiles it so (`remat.runtime.inductor.closed_loop._layout_alternative`).

ResNet tiny under inductor runs its convolutions channels-last when layout optimization
is on, and converts around them. Its floor plan holds 998,232 B under inductor with the
option on and 925,144 B with it off (one thread): inductor's code holds less than
remat's model op by op (1,031,736 B) either way, and at the floor, where no replan is
left, the closed loop still tries the other lowerings for the lowest plan it found. At
a budget between the two the backend plans, the compile's config patch carries the
choice to both graphs' lowering (the backward is compiled lazily, after the backend's
patch has ended), and the step measures what was predicted, no more; without the choice
the budget is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.testing import zoo

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


BUDGET = 960_000
"""Between ResNet tiny's floors under inductor with layout optimization on (998,232 B)
and off (925,144 B), each from a fresh process."""


def test_a_budget_only_layout_optimization_off_reaches_plans_and_measures_under_it():
    torch._dynamo.reset()
    case = zoo.build("resnet", size="tiny")
    eager = copy.deepcopy(case.model)
    be = remat.backend(budget=BUDGET, outputs="loss", whole_step=False)
    compiled = torch.compile(case.model, backend=be)
    compiled(*case.args, **case.kwargs).loss.backward()
    eager(*case.args, **case.kwargs).loss.backward()
    (step,) = be.steps
    assert step.inductor_settings == (("layout_optimization", False),)
    assert "layout_optimization=False" in be.summary()
    for (name, p), q in zip(case.model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    case.model.zero_grad(set_to_none=True)  # the profiler cannot see frees before the step
    measured = be.measure(lambda: compiled(*case.args, **case.kwargs).loss.backward(),
                          register=(case.model, case.args, case.kwargs))
    predicted = step.evaluation.peak_bytes + step.fusion_margin_bytes
    assert measured.peak_bytes <= predicted <= BUDGET
