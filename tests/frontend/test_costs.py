"""Cost model: exact FLOPs of ATen nodes, bytes moved, roofline, cached device speed."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from remat.frontend import costs
from remat.frontend.costs import DeviceSpeed, estimate_s, flop_counter_mode, node_bytes_moved, node_cost_s, node_flops

B, H, S, D = 2, 4, 16, 8


def _mixed_ops_grads(q, k, v, w, b, x, img, cw):
    """Gradients of a loss over SDPA, linear, bmm and conv2d: the function traced (`graph`)
    and run eagerly under the FLOP counters, not a training step of a model."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    y = F.linear(x, w, b)  # addmm forward, mm backward
    z = torch.bmm(q[0], k[0].transpose(-1, -2))
    c = F.conv2d(img, cw, padding=1)
    loss = o.sum() + y.sum() + z.sum() + c.sum()
    return torch.autograd.grad(loss, [q, k, v, w, cw])


def _inputs():
    torch.manual_seed(0)
    qkv = [torch.randn(B, H, S, D, requires_grad=True) for _ in range(3)]
    w = torch.randn(32, 8, requires_grad=True)
    return (*qkv, w, torch.randn(32), torch.randn(5, 8), torch.randn(2, 3, 10, 10),
            torch.randn(6, 3, 3, 3, requires_grad=True))


@pytest.fixture(scope="module")
def graph():
    return make_fx(_mixed_ops_grads, tracing_mode="fake")(*_inputs()).graph


def _flops_by_op(graph) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for node in graph.nodes:
        flops = node_flops(node)
        if flops:
            found.setdefault(str(node.target), []).append(flops)
    return found


def test_exact_flops_per_node(graph):
    attention = 2 * B * H * S * S * D  # one of QK^T or AV
    assert _flops_by_op(graph) == {
        "aten.addmm.default": [2 * 5 * 8 * 32],
        "aten.bmm.default": [2 * 4 * 16 * 8 * 16] * 3,  # forward, grad of both operands
        "aten.convolution.default": [2 * (2 * 6 * 10 * 10) * (3 * 3 * 3)],
        "aten.convolution_backward.default": [2 * (2 * 6 * 10 * 10) * (3 * 3 * 3)],  # weight grad only
        "aten.mm.default": [2 * 32 * 5 * 8],  # weight grad
        "aten._scaled_dot_product_flash_attention_for_cpu.default": [2 * attention],
        # recomputed QK^T, then grads of V, of the scores, of Q and of K (torch's convention)
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default": [5 * attention],
    }


def test_graph_flops_equal_flop_counter_mode_on_eager(graph):
    with flop_counter_mode() as counter:
        _mixed_ops_grads(*_inputs())
    assert sum(node_flops(n) for n in graph.nodes) == counter.get_total_flops()


def test_flop_counter_equals_flop_counter_mode():
    with flop_counter_mode() as reference:
        _mixed_ops_grads(*_inputs())
    with costs.FlopCounter() as counter:
        _mixed_ops_grads(*_inputs())
    assert counter.total_flops == reference.get_total_flops() > 0
    assert counter.by_op["aten.mm"] == 2 * 32 * 5 * 8


def test_flop_counter_through_aot_autograd_runtime():
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def fn(x, w):
        return (x @ w.t()).relu().sum()

    compiled = aot_function(fn, fw_compiler=lambda gm, _: make_boxed_func(gm), bw_compiler=lambda gm, _: make_boxed_func(gm),
                            partition_fn=min_cut_rematerialization_partition)
    x, w = torch.randn(4, 8), torch.randn(16, 8, requires_grad=True)
    compiled(x, w).backward()  # compile outside the counter
    with costs.FlopCounter() as counter:
        compiled(x, w).backward()
    assert counter.total_flops == 2 * (2 * 4 * 8 * 16)  # forward mm and weight-grad mm


def test_torch_registry_misses_cpu_flash_attention():
    # Why the extra formula exists; if torch adds it, the extra mapping becomes empty.
    packet = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert (packet in torch.utils.flop_counter.flop_registry) != (packet in costs.EXTRA_FLOP_FORMULAS)


def test_composite_ops_are_costed_through_their_decomposition():
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake = FakeTensorMode()
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    with fake:
        a.meta["val"] = torch.empty(3, 7, 5)
        b.meta["val"] = torch.empty(5, 11)
    node = graph.call_function(torch.ops.aten.matmul.default, (a, b))
    with fake:
        node.meta["val"] = torch.empty(3, 7, 11)
    assert node_flops(node) == 2 * 3 * 7 * 5 * 11
    assert node_flops(a) == 0


def test_bytes_moved(graph):
    by_op = {str(n.target): n for n in graph.nodes if n.op == "call_function"}
    mm = by_op["aten.mm.default"]  # (32, 5) @ (5, 8) -> (32, 8)
    assert node_bytes_moved(mm) == 4 * (32 * 5 + 5 * 8 + 32 * 8)
    assert node_bytes_moved(by_op["aten.transpose.int"]) == 0  # a view moves nothing
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    assert node_bytes_moved(placeholder) == 0


def test_roofline():
    speed = DeviceSpeed(peak_flops_per_s=1e9, bandwidth_bytes_per_s=1e8)
    assert estimate_s(2e9, 1e6, speed) == pytest.approx(2.0)  # compute bound
    assert estimate_s(1e3, 5e8, speed) == pytest.approx(5.0)  # memory bound


def test_node_cost_uses_flops_and_bytes(graph):
    speed = DeviceSpeed(peak_flops_per_s=1e6, bandwidth_bytes_per_s=1e12)
    mm = next(n for n in graph.nodes if n.target == torch.ops.aten.mm.default)
    assert node_cost_s(mm, speed) == pytest.approx(2 * 32 * 5 * 8 / 1e6)


def test_device_speed_validates():
    with pytest.raises(ValueError, match="peak_flops_per_s"):
        DeviceSpeed(peak_flops_per_s=0.0, bandwidth_bytes_per_s=1.0)


def test_measure_device_speed_small():
    speed = costs.measure_device_speed(matmul_n=64, copy_bytes=2**20, repeats=2)
    assert speed.peak_flops_per_s > 0 and speed.bandwidth_bytes_per_s > 0


def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv(costs.CACHE_ENV, str(tmp_path))
    calls = []

    def fake_measure(device, *, dtype):
        calls.append(device)
        return DeviceSpeed(peak_flops_per_s=1.5e10, bandwidth_bytes_per_s=2.5e9)

    monkeypatch.setattr(costs, "measure_device_speed", fake_measure)
    first = costs.device_speed("cpu")
    second = costs.device_speed("cpu")
    assert first == second == DeviceSpeed(peak_flops_per_s=1.5e10, bandwidth_bytes_per_s=2.5e9)
    assert len(calls) == 1
    table = json.loads((tmp_path / costs.CACHE_FILE).read_text())
    assert table == {costs.device_key("cpu"): {"peak_flops_per_s": 1.5e10, "bandwidth_bytes_per_s": 2.5e9}}
    costs.device_speed("cpu", refresh=True)
    assert len(calls) == 2


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv(costs.CACHE_ENV, str(tmp_path))
    (tmp_path / costs.CACHE_FILE).write_text("{not json")
    monkeypatch.setattr(costs, "measure_device_speed",
                        lambda device, *, dtype: DeviceSpeed(peak_flops_per_s=1.0, bandwidth_bytes_per_s=1.0))
    assert costs.device_speed("cpu").peak_flops_per_s == 1.0
    assert json.loads((tmp_path / costs.CACHE_FILE).read_text())


def test_a_cuda_graph_is_priced_with_its_gpus_own_figures(monkeypatch):
    """Without `device_speed`, a graph on a GPU is priced with that GPU's measured figures
    (what a recompute really costs there), everything else with this CPU's."""
    asked = []
    monkeypatch.setattr(costs, "device_speed", lambda device="cpu", **_: asked.append(str(device)) or DeviceSpeed(
        peak_flops_per_s=1.0, bandwidth_bytes_per_s=1.0))
    for device in (torch.device("cuda", 0), torch.device("cpu"), torch.device("meta"), None):
        costs.speed_on(device)
    assert asked == ["cuda:0", "cpu", "cpu", "cpu"]
