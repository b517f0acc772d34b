"""The cost models: "eager" (every op its own kernel, roofline) and "compiled" (inductor
fuses pointwise ops into their consumers: recomputing one costs only the bytes it reads
from memory)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat.errors import RematError
from remat.frontend import costs

SPEED = costs.DeviceSpeed(peak_flops_per_s=1e12, bandwidth_bytes_per_s=1e10)


def _graph():
    def f(x, w):
        h = torch.mm(x, w)       # matmul: same cost in both models
        a = torch.tanh(h)        # pointwise, reads the matmul's output from memory
        return torch.mul(a, 2.0)  # pointwise, reads a fused value (in registers)

    return make_fx(f)(torch.randn(64, 32), torch.randn(32, 16))


def _node(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def test_compiled_model_charges_pointwise_ops_their_memory_reads_only():
    gm = _graph()
    aten = torch.ops.aten
    mm, tanh, mul = _node(gm, aten.mm.default), _node(gm, aten.tanh.default), _node(gm, aten.mul.Tensor)
    eager, compiled = costs.cost_function("eager", SPEED), costs.cost_function("compiled", SPEED)
    assert compiled(mm) == eager(mm) > 0
    out_bytes = 64 * 16 * 4
    assert eager(tanh) == pytest.approx(2 * out_bytes / SPEED.bandwidth_bytes_per_s)  # read + write
    assert compiled(tanh) == pytest.approx(out_bytes / SPEED.bandwidth_bytes_per_s)  # read h only
    assert compiled(mul) == 0.0  # its input is a fused pointwise value


def test_compiled_model_charges_the_write_of_a_pointwise_value_a_matmul_reads():
    """A matmul (or attention, a convolution) cannot fuse its pointwise producer, so
    inductor writes the value out, recomputed or not: it costs its reads plus its write.
    Reductions and other pointwise ops fuse it (no write), and views are looked through."""

    def f(x, w):
        a = torch.tanh(x)                 # read by a matmul through a view: written
        b = torch.sigmoid(x)              # read by a reduction and a pointwise op: fused
        return torch.mm(a.t().t(), w), b.sum(), b * 2.0

    gm = make_fx(f)(torch.randn(64, 32), torch.randn(32, 16))
    aten = torch.ops.aten
    compiled = costs.cost_function("compiled", SPEED)
    x_bytes = 64 * 32 * 4
    assert compiled(_node(gm, aten.tanh.default)) == pytest.approx(2 * x_bytes / SPEED.bandwidth_bytes_per_s)
    assert compiled(_node(gm, aten.sigmoid.default)) == pytest.approx(x_bytes / SPEED.bandwidth_bytes_per_s)


def test_unknown_cost_model_is_refused_with_the_valid_ones():
    with pytest.raises(RematError, match="valid cost models: \\['eager', 'compiled', 'compiled-traffic'\\]"):
        costs.cost_function("fast", SPEED)


def test_remat_plan_takes_the_cost_model_and_refuses_an_unknown_one_before_tracing():
    import remat
    from remat.frontend.costs import COST_MODELS

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 32)

        def forward(self, x):
            return torch.tanh(self.lin(x)).sum()

    torch.manual_seed(0)
    model, x = Net(), torch.randn(8, 16)
    with pytest.raises(RematError, match="valid cost models"):
        remat.plan(model, (x,), budget="100%", cost_model="fused")
    planned = remat.plan(model, (x,), budget="100%", solver="none", cost_model="compiled")
    eager = remat.plan(model, (x,), budget="100%", solver="none", cost_model="eager")

    def tanh_s(p):  # the planned problem's cost of the pointwise tanh
        names = p.step.graph_problem.value_name
        return next(p.problem.nodes[i].compute_s for i, name in enumerate(names) if name.startswith("tanh"))

    # the plan's problem was costed by the model asked for: tanh reads the matmul's output
    # only (fused), where eager also writes its own
    assert 0 < tanh_s(planned) < tanh_s(eager)
    assert set(COST_MODELS) >= {"eager", "compiled", "compiled-traffic"}
    planned(x).backward()
    assert model.lin.weight.grad is not None
