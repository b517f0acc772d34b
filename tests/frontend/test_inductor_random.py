"""What inductor's random draws cost in the compiled cost models
(`remat.frontend.inductor_random`): a draw is priced per element, not as traffic, and a
dropout mask saved straight from a draw is charged its draw once more."""

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat.frontend import costs, inductor_random
from remat.frontend.inductor_random import is_inductor_random, is_stored_mask, random_s_per_element

pytestmark = pytest.mark.usefixtures("one_thread")

SPEED = costs.DeviceSpeed(peak_flops_per_s=1e11, bandwidth_bytes_per_s=1e10)
R = 1e-8  # seconds per element, about what this machine measures


def _dropout_graph():
    import torch._inductor.inductor_prims  # noqa: F401  (prims.inductor_random)

    def f(x, seed):
        mask = torch.ops.prims.inductor_random.default([4, 1024], seed, "rand") > 0.1
        return x * mask * 1.1, mask, x > 0

    gm = make_fx(f, tracing_mode="fake")(torch.randn(4, 1024), torch.tensor(7))
    return {n.name: n for n in gm.graph.nodes}


def test_a_draw_costs_its_elements_not_its_traffic():
    nodes = _dropout_graph()
    (draw,) = [n for n in nodes.values() if is_inductor_random(n)]
    traffic = costs.compiled_node_cost_s(draw, SPEED)
    assert traffic == costs.node_cost_s(draw, SPEED) < 4096 * R  # 16 KiB over 10 GB/s
    assert costs.compiled_node_cost_s(draw, SPEED, R) == pytest.approx(4096 * R)
    assert costs.cost_function("compiled-traffic", SPEED, random_s_per_element=R)(draw) == pytest.approx(4096 * R)
    # nothing else changes: the mask's comparison still costs its traffic only
    (mask,) = [n for n in nodes.values() if is_stored_mask(n)]
    assert costs.compiled_node_cost_s(mask, SPEED, R) == costs.compiled_node_cost_s(mask, SPEED)


def test_a_saved_mask_of_a_draw_pays_its_draw_again():
    nodes = _dropout_graph()
    (mask,) = [n for n in nodes.values() if is_stored_mask(n)]
    (other,) = [n for n in nodes.values() if n.op == "call_function" and not is_stored_mask(n)
                and n.meta["val"].dtype == torch.bool]  # x > 0: a mask, not of a draw
    traffic = 2 * 4096 / SPEED.bandwidth_bytes_per_s  # 4,096 bools written and read back
    assert costs.save_cost_s(mask, SPEED) == pytest.approx(traffic)
    assert costs.save_cost_s(mask, SPEED, R) == pytest.approx(traffic + 4096 * R)
    assert costs.save_cost_s(other, SPEED, R) == costs.save_cost_s(other, SPEED) == pytest.approx(traffic)


def test_the_figure_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(costs.CACHE_ENV, str(tmp_path))
    measured = random_s_per_element("cpu")
    assert 1e-11 < measured < 1e-6
    table = json.loads((tmp_path / inductor_random.CACHE_FILE).read_text())
    assert table == {costs.device_key("cpu"): measured}

    def no_measuring(device):
        raise AssertionError("measured again")

    monkeypatch.setattr(inductor_random, "_measure", no_measuring)
    assert random_s_per_element("cpu") == measured


class _Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.b(torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.1, self.training)).sum()


def test_the_backend_prices_inductors_draws(tmp_path, monkeypatch):
    import torch._dynamo

    monkeypatch.setenv(costs.CACHE_ENV, str(tmp_path))
    (tmp_path / inductor_random.CACHE_FILE).write_text(json.dumps({costs.device_key("cpu"): R}))
    torch._dynamo.reset()
    torch.manual_seed(0)
    be = remat.backend(budget="100%")
    assert be.cost_model == "compiled-traffic" and "random=1e-08" in be.uuid()
    torch.compile(_Dropout(), backend=be)(torch.randn(16, 32)).backward()
    (step,) = be.steps
    problem, names = step.graph_problem.problem, step.graph_problem.value_name
    (draw,) = [i for i, name in enumerate(names) if name.startswith("inductor_random")]
    assert problem.nodes[draw].compute_s == pytest.approx(16 * 64 * R)
    # the mask (a bool per element, read by the dropout's backward) pays the draw to be saved
    (mask,) = [i for i, node in enumerate(problem.nodes) if draw in node.inputs and node.out_bytes == 16 * 64]
    assert 16 * 64 * R < problem.nodes[mask].save_s < 2 * 16 * 64 * R
