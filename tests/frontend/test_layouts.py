"""Traced layouts equal eager CPU layouts for BatchNorm (pytorch/pytorch#192668): the
fake value of every BatchNorm op's output and grad_input has the strides the CPU kernel
gives, so a planned step over a transposed (B, D, T) view runs (it failed with "view
size is not compatible", any solver) and equals eager bit for bit, through remat.plan
(recompute and offload) and through remat.backend."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import remat
from remat.compile_backend import backend
from remat.frontend.layouts import eager_cpu_layouts
from remat.testing.measure import measure_step
from remat_solvers import Decision
from nets import assert_trains_like_eager

aten = torch.ops.aten

LAYOUTS = {
    "3d-transposed": lambda: torch.randn(4, 16, 6).transpose(1, 2),
    "2d-transposed": lambda: torch.randn(8, 6).t(),
    "4d-channels-last": lambda: torch.randn(2, 6, 5, 7).to(memory_format=torch.channels_last),
    "4d-permuted": lambda: torch.randn(2, 5, 7, 6).permute(0, 3, 2, 1),
    "4d-sliced": lambda: torch.randn(2, 6, 10, 7)[:, :, ::2],
    "5d-channels-last": lambda: torch.randn(2, 6, 3, 4, 5).to(memory_format=torch.channels_last_3d),
}


def _batch_norm_ops(x: torch.Tensor):
    """(name, output or grad_input) of every BatchNorm op AOTAutograd may record."""
    c = x.shape[1]
    w, b = torch.ones(c), torch.zeros(c)
    stats = lambda: (torch.zeros(c), torch.ones(c))  # noqa: E731
    out = aten._native_batch_norm_legit_functional(x, w, b, *stats(), True, 0.1, 1e-5)
    grad = aten.native_batch_norm_backward(
        torch.ones_like(x), x, w, *stats(), out[1], out[2], True, 1e-5, [True, True, True])
    return {
        "legit_functional": out[0],
        "legit": aten._native_batch_norm_legit(x, w, b, *stats(), True, 0.1, 1e-5)[0],
        "legit_no_stats": aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)[0],
        "legit_no_training": aten._native_batch_norm_legit_no_training(x, w, b, *stats(), 0.1, 1e-5)[0],
        "native": aten.native_batch_norm(x, w, b, *stats(), True, 0.1, 1e-5)[0],
        "with_update": aten._batch_norm_with_update(x, w, b, *stats(), 0.1, 1e-5)[0],
        "with_update_functional": aten._batch_norm_with_update_functional(x, w, b, *stats(), 0.1, 1e-5)[0],
        "no_update": aten._batch_norm_no_update(x, w, b, *stats(), 0.1, 1e-5)[0],
        "backward": grad[0],
    }


def _fake_strides(x: torch.Tensor):
    with FakeTensorMode() as mode:
        return {k: v.stride() for k, v in _batch_norm_ops(mode.from_tensor(x)).items()}


def test_fake_batch_norm_layouts_equal_the_cpu_kernels():
    for layout, make in LAYOUTS.items():
        x = make()
        real = {k: v.stride() for k, v in _batch_norm_ops(x).items()}
        with eager_cpu_layouts():
            assert _fake_strides(x) == real, layout
        if layout == "3d-transposed":  # torch 2.13's own fake kernel differs: why this exists
            assert _fake_strides(x)["legit_functional"] != real["legit_functional"]


class TransposedNorm(nn.Module):
    """BatchNorm1d over a transposed (B, D, T) view, as sequence models write it."""

    def __init__(self, d: int = 16, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth)])
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        x = self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x).square().mean()


def _grads_and_buffers_equal(planned_step, model, x):
    eager = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    loss_p = planned_step(x)
    loss_p.backward()
    loss_e = eager(x)
    loss_e.backward()
    assert_trains_like_eager(loss_p, loss_e, model, eager)


@pytest.mark.parametrize("offload", [False, True])
def test_planned_step_over_a_transposed_batch_norm_equals_eager(offload):
    torch.manual_seed(0)
    model, x = TransposedNorm(), torch.randn(8, 24, 16)
    planned = remat.plan(model, (x,), budget="75%", solver="greedy", offload=offload)
    budget = planned.budget_bytes
    moved = planned.plan.count(Decision.OFFLOAD if offload else Decision.RECOMPUTE)
    assert moved > 0
    m = measure_step(lambda: planned(x).backward(), register=(model, x))
    assert m.peak_bytes <= planned.predicted_peak_bytes <= budget
    _grads_and_buffers_equal(planned, model, x)


def test_backend_step_over_a_transposed_batch_norm_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = TransposedNorm(), torch.randn(8, 24, 16)
    be = backend(budget="70%", solver="greedy", compiler="eager")
    compiled = torch.compile(model, backend=be, fullgraph=True)
    _grads_and_buffers_equal(compiled, model, x)
    (step,) = be.steps
    assert len(step.evaluation.recomputed_ids) > 0
