"""The memory instruments: exact byte counts on CPU, views once, frees seen, repeatable."""

from __future__ import annotations

import gc

import pytest
import torch

from remat.testing.measure import (
    LiveBytesTracker,
    MemoryMeasurement,
    measure_step,
    measure_step_profiler,
)

F32 = 4


def test_known_allocations_exact_peak():
    def step():
        a = torch.ones(1000)  # 4000
        b = torch.ones(250)  # 1000 -> 5000
        c = a * 2  # 4000 -> 9000 (peak)
        del a, c  # -> 1000
        d = torch.ones(100)  # 400 -> 1400
        return b, d

    m = measure_step(step)
    assert m.peak_bytes == 9000
    assert m.end_bytes == 1400
    assert m.baseline_bytes == 0
    assert m.instrument == "dispatch"


def test_views_are_counted_once():
    def step():
        a = torch.zeros(10, 100)
        views = [a.view(100, 10), a[0], a.t(), a.reshape(1000), a.expand(3, 10, 100), a.narrow(1, 0, 5)]
        return a, views

    m = measure_step(step)
    assert m.peak_bytes == 1000 * F32
    assert m.end_bytes == 1000 * F32


def test_freed_temporaries_leave_and_timeline_shows_them():
    def step():
        x = torch.ones(256)  # 1024
        y = (x + 1) * 3  # temp 1024, y 1024; temp dies after mul
        return x, y

    m = measure_step(step, timeline=True)
    assert m.peak_bytes == 3 * 1024
    assert m.end_bytes == 2 * 1024
    assert [p.op for p in m.timeline] == ["aten.ones.default", "aten.add.Tensor", "aten.mul.Tensor"]
    assert [p.live_bytes for p in m.timeline] == [1024, 2048, 3072]


def test_registered_tensors_count_from_the_start():
    weight = torch.ones(100, 100)  # 40_000
    x = torch.ones(8, 100)  # 3_200

    m = measure_step(lambda: x @ weight, register=(weight, x))
    assert m.baseline_bytes == 43_200
    assert m.peak_bytes == 43_200 + 8 * 100 * F32
    assert m.end_bytes == m.peak_bytes


def test_unregistered_inputs_are_discovered_as_preexisting():
    x = torch.ones(100)

    with LiveBytesTracker(timeline=True) as tracker:
        y = torch.ones(50)  # 200 bytes
        z = x[:50] + y  # x (400) discovered here: it was live all along
    assert tracker.discovered_bytes == 400
    assert tracker.peak_bytes == 400 + 200 + 200
    # slice (a view), then add; ones() is shifted by x's bytes.
    assert [p.live_bytes for p in tracker.timeline] == [600, 600, 800]
    tracker.close()
    del z


def test_tensor_literals_are_new_not_discovered():
    with LiveBytesTracker() as tracker:
        t = torch.tensor([1.0, 2.0, 3.0])
    assert tracker.discovered_bytes == 0
    assert tracker.peak_bytes == 3 * F32
    tracker.close()
    del t


def test_in_place_resize_is_counted():
    def step():
        out = torch.empty(0)
        torch.cat([torch.ones(10), torch.ones(20)], out=out)
        return out

    m = measure_step(step)
    assert m.end_bytes == 30 * F32
    assert m.peak_bytes == 60 * F32


def test_backward_ops_and_grads_are_seen():
    x = torch.ones(100, requires_grad=True)

    def step():
        (x * 3).sum().backward()

    m = measure_step(step, register=(x,))
    assert x.grad is not None
    # x, the product, its sum, the grad seed and the new .grad: 400 + 400 + 4 + ...
    assert m.end_bytes == 400 + 400  # x and x.grad
    assert m.peak_bytes >= 400 + 400 + 4
    x.grad = None


def test_existing_grads_are_registered_with_their_module():
    model = torch.nn.Linear(10, 10)  # 400 + 40 bytes
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    m = measure_step(lambda: None, register=(model,))
    assert m.baseline_bytes == 2 * (400 + 40)


def _mlp_step(model, x):
    def step():
        model(x).square().mean().backward()

    return step


def test_mlp_forward_backward_peak_bounds_and_repeatable():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    params = sum(p.numel() for p in model.parameters()) * F32
    peaks = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        gc.collect()
        peaks.append(measure_step(_mlp_step(model, x), register=(model, x)))
    assert peaks[0] == peaks[1]
    m = peaks[0]
    assert m.baseline_bytes == params + x.numel() * F32
    # At the end: params, their grads, the input.
    assert m.end_bytes == 2 * params + x.numel() * F32
    # At least: params + input + all grads, or params + input + saved hidden (pre- and
    # post-ReLU) + output during forward.
    hidden = 32 * 256 * F32
    assert m.peak_bytes >= 2 * params + x.numel() * F32
    assert m.peak_bytes >= params + x.numel() * F32 + 2 * hidden + 32 * 64 * F32


def test_profiler_agrees_with_tracker_without_autograd():
    x = torch.randn(64, 64)

    def step():
        a = x @ x
        b = torch.relu(a) + 1
        c = torch.cat([a, b])
        del a, b
        return c.sum(0)

    tracked = measure_step(step, register=(x,))
    profiled = measure_step_profiler(step, register=(x,))
    assert profiled.peak_bytes == tracked.peak_bytes
    assert profiled.baseline_bytes == tracked.baseline_bytes == 64 * 64 * F32


def test_profiler_sees_backward():
    model = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)
    profiled = measure_step_profiler(_mlp_step(model, x), register=(model, x))
    tracked_model = torch.nn.Linear(32, 32)
    tracked_model.load_state_dict(model.state_dict())
    tracked = measure_step(_mlp_step(tracked_model, x), register=(tracked_model, x))
    # No value is used twice, so autograd runs the same ops under both instruments.
    assert profiled.peak_bytes == tracked.peak_bytes
    assert profiled.end_bytes == tracked.end_bytes


def test_unknown_instrument_is_rejected():
    with pytest.raises(ValueError, match="use one of"):
        measure_step(lambda: None, instrument="nvml")


def test_measurement_validates():
    with pytest.raises(ValueError, match="inconsistent"):
        MemoryMeasurement(peak_bytes=1, end_bytes=5, baseline_bytes=0, instrument="dispatch")
