"""remat as a torch.compile backend: same gradients as eager, less memory, a report."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.runtime.backend import backend
from remat.measure import measure_step


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Dropout(0.1)) for _ in range(6)],
                         nn.Linear(128, 1))


def _step(fn, module, x):
    module.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    loss = fn(x).square().mean()
    loss.backward()
    return loss.detach()


def test_compiled_step_equals_eager_and_uses_less_memory():
    torch._dynamo.reset()
    model, x = _model(), torch.randn(512, 128)
    eager = copy.deepcopy(model)
    be = backend(budget="80%", solver="chen-greedy", compiler="eager")
    compiled = torch.compile(model, backend=be, fullgraph=True)
    loss = _step(compiled, model, x)
    assert torch.equal(loss, _step(eager, eager, x))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    (step,) = be.steps
    assert step.evaluation.peak_bytes <= step.budget_bytes < step.baseline_peak_bytes
    assert len(step.evaluation.recomputed_ids) > 0
    assert "remat plan (chen-greedy" in be.summary()
    assert "compiled with eager (cost model: eager)" in be.summary()
    # Profiler allocation events (the instrument that works under torch.compile) also
    # count CPU kernels' internal workspace, so compare against eager, not the model.
    planned_peak = measure_step(lambda: _step(compiled, model, x), register=(model, x), instrument="profiler")
    eager_peak = measure_step(lambda: _step(eager, eager, x), register=(eager, x), instrument="profiler")
    assert planned_peak.peak_bytes < eager_peak.peak_bytes


def test_backend_rejects_bad_arguments_before_compiling():
    with pytest.raises(remat.UnknownSolverError):
        backend(budget="50%", solver="nope")
    with pytest.raises(remat.BudgetError):
        backend(budget="fifty percent", solver="chen-greedy")
