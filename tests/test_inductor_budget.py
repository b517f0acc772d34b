"""The budget under inductor at tight budgets: what inductor runs, measured with the
profiler's allocation events, stays under the budget, and the prediction is never below
the measurement, up to the exact point where the backend refuses.

The model is built so inductor can break it: every layer gates with a pointwise function
of the same input `x`, so the backward recomputes one gate per layer, all reading `x`.
Inductor's scheduler fuses kernels that read a common buffer wherever they are, so its
own fusion computes every layer's gate at the first one's place and keeps them all alive
(measured 1,131,816 B at every budget tried, against remat's plan of 0.74 MB). With
fusion kept to neighbours the rest is local: lowering inlines pointwise ops into the
kernels that read them, and a kernel keeps its inputs to its end. At remat's floor
(656,408 B) the generated backward holds 49,932 B more than the same graph op by op;
the backend refuses anything below 706,340 B, and at 706,340 B the profiler measures
706,340 B. Compiles are shared through module fixtures (tens of seconds each here)."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.runtime.backend import backend


class Gated(nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.scales = nn.Parameter(torch.linspace(0.5, 2.0, depth))

    def forward(self, x):
        h = x
        for i, lin in enumerate(self.layers):
            gate = torch.sigmoid(x * self.scales[i])  # before the layer: the order measured
            h = torch.tanh(lin(h)) * gate
        return h.square().mean()


def _compiled(budget, **kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = Gated(), torch.randn(256, 64)
    eager = copy.deepcopy(model)
    be = backend(budget=budget, **kwargs)
    fn = torch.compile(model, backend=be)
    fn(x).backward()
    eager(x).backward()
    grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())]
    model.zero_grad(set_to_none=True)  # the profiler cannot see frees before the step
    measured = be.measure(lambda: fn(x).backward(), register=(model, x))
    (step,) = be.steps
    return be, step, measured, grads


@pytest.fixture(scope="module")
def edge():
    """The smallest budget the backend accepts (from its refusal of a lower one: lowering
    and code generation, no kernel compiled), then a compile and a step at exactly it."""
    torch._dynamo.reset()
    with pytest.raises(remat.InfeasibleBudgetError, match="does not hold under inductor") as info:
        torch.compile(Gated(), backend=backend(budget="60%"))(torch.randn(256, 64)).backward()
    return info.value, _compiled(info.value.min_peak_bytes)


def test_prediction_holds_the_measurement_at_the_refusal_point(edge):
    refusal, (be, step, measured, _) = edge
    assert refusal.min_peak_bytes > refusal.budget_bytes
    assert step.evaluation.recomputed_ids  # a tight plan: the gates are recomputed
    assert step.fusion_margin_bytes > 0  # inductor's kernels hold more than op by op...
    predicted = step.evaluation.peak_bytes + step.fusion_margin_bytes
    # ...the replan made room, and the prediction counts what the generated code holds
    assert measured.peak_bytes <= predicted <= step.budget_bytes == refusal.min_peak_bytes
    summary = be.summary()
    assert "WARNING" not in summary
    assert f"of which {step.fusion_margin_bytes / 2**20:.2f} MiB ({step.fusion_margin_bytes} B) is inductor's fusion" in summary
    assert "fusion:          neighbours" in summary
    (fw, bw) = be.fusion_estimates
    assert (fw.graph, bw.graph) == ("forward", "backward")


def test_the_replanned_step_computes_eager_gradients(edge):
    # the joint graph was partitioned several times (plan, replan under the margin, the
    # floor); the last partition is what runs. Tolerance: float32 rounding of inductor's
    # fused kernels (see test_backend_inductor.py).
    _, (_, _, _, grads) = edge
    for compiled_grad, eager_grad in grads:
        torch.testing.assert_close(compiled_grad, eager_grad)


def test_inductors_own_fusion_cannot_hold_the_same_budget():
    """The oracle that the model can break the budget: inductor's unrestricted fusion
    adds so much (every gate at once) that no plan fits; the backend refuses before
    anything runs, naming the smallest peak that holds under that fusion."""
    torch._dynamo.reset()
    be = backend(budget="70%", fusion="inductor")
    with pytest.raises(remat.InfeasibleBudgetError, match="does not hold under inductor") as info:
        torch.compile(Gated(), backend=be)(torch.randn(256, 64)).backward()
    assert info.value.min_peak_bytes > 1_000_000 > info.value.budget_bytes


def test_unknown_fusion_mode_is_refused():
    with pytest.raises(remat.RematError, match="fusion='all'"):
        backend(budget="80%", fusion="all")
    assert backend(budget="80%", fusion="inductor").uuid() != backend(budget="80%").uuid()

