"""OFFLOAD executed: below the recompute-only floor, plans move activations to the host
store; the measured peak stays under the budget and within 3% of the prediction, and the
step stays bit-for-bit equal to eager (dropout and BatchNorm included)."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.errors import InfeasibleBudgetError, RematError
from remat.offload.costing import OffloadError, offload_device, resolve_bandwidth
from remat.offload.host import StoredLayout, reload, store
from remat.report.data import build_report
from remat.report.text import render
from remat.testing import zoo
from remat.testing.measure import LiveBytesTracker, measure_step, measure_step_profiler
from remat_solvers import Decision

PEAK_TOLERANCE = 0.03


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _floor(case: zoo.ModelCase) -> InfeasibleBudgetError:
    """The canonical recompute-only floor, as remat states it (offload off: the CPU
    default), with `schedules=False`: offload plans recompute each value at most once
    (the rewriter does not combine reloads with a value recomputed twice), so the
    premise here is "below every plan of that space", and the plans that recompute a
    value twice (which can reach below offload's floor on cnn) are left out of it. A
    short floor search (its deterministic work limit) keeps the test quick."""
    with pytest.raises(InfeasibleBudgetError) as info:
        remat.plan(case.model, case.args, case.kwargs, budget=1, solver="chen-greedy", time_limit_s=2,
                   schedules=False)
    return info.value


# cnn: BatchNorm and dropout. mlp's floor search (ilp's smallest-peak loop) alone takes
# 20-30 s here and vit's offload plan ~90 s, so they are measured in bench/offload.py;
# tests/planning/test_shapes.py measures another model that only offload fits.
@pytest.mark.parametrize("name", ["cnn"])
def test_offload_below_the_recompute_floor_is_exact_and_within_budget(name):
    case = zoo.build(name, size="tiny")
    model = case.model
    floor = _floor(case).min_peak_bytes
    budget = int(floor * 0.9)
    planned = remat.plan(model, case.args, case.kwargs, budget=budget, solver="auto", offload=True)
    assert planned.plan.count(Decision.OFFLOAD) > 0
    assert planned.step.evaluation.offload_bytes > 0
    assert planned.predicted_peak_bytes <= budget
    # the emitted modules really store and reload
    assert any(node.target is store for node in planned.step.forward.graph.nodes)
    assert any(node.target is reload for node in planned.step.backward.graph.nodes)

    # The allocator (profiler events) is trusted: the budget is what it serves, kernel
    # scratch included; the host store is numpy's memory, which it does not see, as a
    # device allocator would not. The tracker (storages only) never reads above it.
    peaks = []
    for measure in (measure_step_profiler, measure_step):
        torch.manual_seed(1)
        peaks.append(measure(lambda: planned(*case.args, **case.kwargs).loss.backward(),
                             register=(model, case.args, case.kwargs)).peak_bytes)
        for p in model.parameters():
            p.grad = None
    allocator, tracker = peaks
    assert allocator <= budget
    assert allocator <= planned.predicted_peak_bytes <= (1 + PEAK_TOLERANCE) * allocator
    assert tracker <= allocator

    for p in model.parameters():
        p.grad = None
    eager = copy.deepcopy(model)  # after the measured step, which moved BatchNorm's stats
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_p = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(2):
        torch.manual_seed(10 + k)
        out_e = eager(*case.args, **case.kwargs)
        out_e.loss.backward()
        torch.manual_seed(10 + k)
        out_p = planned(*case.args, **case.kwargs)
        out_p.loss.backward()
        assert torch.equal(out_p.loss, out_e.loss)
        for (pname, a), b in zip(eager.named_parameters(), model.parameters(), strict=True):
            assert torch.equal(b.grad, a.grad), f"step {k}: gradient of {pname} differs"
        opt_e.step(), opt_p.step()
        opt_e.zero_grad(set_to_none=True), opt_p.zero_grad(set_to_none=True)
    for key, value in eager.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key

    # reported: the summary and the report show the bytes, the transfer and its hidden part
    ev = planned.step.evaluation
    assert ev.transfer_s > 0 and 0 <= ev.hidden_transfer_s <= ev.transfer_s
    assert ev.offload_s == pytest.approx(ev.transfer_s - ev.hidden_transfer_s)
    assert "  offload:" in planned.summary() and "hidden behind compute" in planned.summary()
    report = build_report(planned.step, model, pareto_points=0)
    assert (report.offloaded_bytes, report.transfer_s, report.offload_s) == (
        ev.offload_bytes, ev.transfer_s, ev.offload_s)
    assert "hidden behind compute" in render(report)


def test_infeasible_without_offload_names_the_offload_floor():
    case = zoo.build("cnn", size="tiny")
    err = _floor(case)
    assert "offload=True" in str(err)
    # the floor it names is reachable with offload on
    floor = int(str(err).split("would reach")[1].split("(")[1].split(" B)")[0])
    assert floor < err.min_peak_bytes
    planned = remat.plan(case.model, case.args, case.kwargs, budget=floor, solver="auto", offload=True)
    assert planned.predicted_peak_bytes <= floor


@pytest.mark.parametrize("bad", ["yes", 1, None, "cuda"])
def test_unknown_offload_value_is_refused_before_tracing(bad):
    case = zoo.build("mlp", size="tiny")
    with pytest.raises(OffloadError, match="offload="):
        remat.plan(case.model, case.args, case.kwargs, budget="100%", offload=bad)
    assert issubclass(OffloadError, RematError)


def test_offload_default_is_off_on_cpu_and_a_device_without_host_link_is_refused():
    assert resolve_bandwidth("auto", torch.device("cpu")) is None
    assert resolve_bandwidth(False, torch.device("cpu")) is None
    assert resolve_bandwidth(True, torch.device("cpu")) > 0
    with pytest.raises(OffloadError, match="cannot offload from device meta"):
        resolve_bandwidth(True, torch.device("meta"))
    mixed = [torch.zeros(1), torch.zeros(1, device="meta")]
    with pytest.raises(OffloadError, match="one device"):
        offload_device(mixed, True)
    assert offload_device(mixed, "auto") is None  # auto: off, not an error
    assert resolve_bandwidth("auto", None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_host_store_round_trips_bits_and_is_invisible_to_the_tracker(dtype):
    base = torch.randn(64, 48).to(dtype)
    x = base.t()  # non-contiguous: the whole storage travels with its strides
    layout = StoredLayout.of(x)
    with LiveBytesTracker(register=(x,)) as tracker:
        handle = store(x)
        before = tracker.current_bytes
        back = reload(handle, *layout.as_args())
        after = tracker.current_bytes
    assert before == x.untyped_storage().nbytes()  # the host copy is not device memory
    assert after - before == layout.nbytes  # the reload is
    assert back.stride() == x.stride() and back.dtype == x.dtype
    assert torch.equal(back, x)
    assert back.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
