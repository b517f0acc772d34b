"""remat as a torch.compile backend: same gradients as eager, less memory, a report."""

import copy

import pytest
import torch
from torch import nn

import remat
from remat.compile_backend import backend
from remat.testing.measure import measure_step
from nets import step_from_cleared_grads


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.Tanh(), nn.Dropout(0.1)) for _ in range(6)],
                         nn.Linear(128, 1))


def _squared_mean_step(fn, module, x):
    """`step_from_cleared_grads` on the squared mean of `fn(x)`, under seed 3 (the
    dropout's draws)."""
    return step_from_cleared_grads(lambda x: fn(x).square().mean(), module, x, seed=3)


def test_compiled_step_equals_eager_and_uses_less_memory():
    torch._dynamo.reset()
    model, x = _model(), torch.randn(512, 128)
    eager = copy.deepcopy(model)
    be = backend(budget="80%", solver="chen-greedy", compiler="eager")
    compiled = torch.compile(model, backend=be, fullgraph=True)
    loss = _squared_mean_step(compiled, model, x)
    assert torch.equal(loss, _squared_mean_step(eager, eager, x))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    (step,) = be.steps
    assert step.evaluation.peak_bytes <= step.budget_bytes < step.baseline_peak_bytes
    assert len(step.evaluation.recomputed_ids) > 0
    assert "remat plan (chen-greedy" in be.summary()
    assert "compiled with eager (cost model: eager)" in be.summary()
    # Profiler allocation events (the instrument that works under torch.compile) also
    # count CPU kernels' internal workspace, so compare against eager, not the model.
    planned_peak = measure_step(lambda: _squared_mean_step(compiled, model, x), register=(model, x),
                                instrument="profiler")
    eager_peak = measure_step(lambda: _squared_mean_step(eager, eager, x), register=(eager, x),
                              instrument="profiler")
    assert planned_peak.peak_bytes < eager_peak.peak_bytes


def test_backend_rejects_bad_arguments_before_compiling():
    with pytest.raises(remat.UnknownSolverError):
        backend(budget="50%", solver="nope")
    with pytest.raises(remat.BudgetError):
        backend(budget="fifty percent", solver="chen-greedy")


def test_dynamic_shapes_one_plan_for_every_size_bit_exact():
    """Symbolic sizes are costed by their hint (no guard, so no recompile) and the
    backward gets the SymInts it needs as saved_sym_nodes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)], nn.Linear(32, 1))
    eager = copy.deepcopy(model)
    be = backend(budget="95%", solver="chen-greedy", compiler="eager")
    # The loss inside the graph: mean's backward needs the batch size, a SymInt.
    compiled = torch.compile(lambda x: model(x).square().mean(), backend=be, dynamic=True)
    for batch in (64, 96, 128):
        x = torch.randn(batch, 32)
        loss = step_from_cleared_grads(compiled, model, x, seed=3)
        assert torch.equal(loss.detach(), _squared_mean_step(eager, eager, x))
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), eager.parameters()))
    (step,) = be.steps
    assert len(step.evaluation.recomputed_ids) > 0
    assert any(n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)
               for n in step.backward.graph.nodes)
