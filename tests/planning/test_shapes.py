"""Variable-length inputs under one byte budget: each sequence length gets its own plan
under the same bytes; a length whose recompute-only floor is above the budget offloads;
a length nothing fits is refused before anything runs (no gradient accumulated, no
buffer changed); lengths can be planned ahead, and the summary says what ran."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import remat
from remat.errors import InfeasibleBudgetError
from remat.testing.measure import measure_step
from remat_solvers import Decision
from nets import assert_trains_like_eager

# Measured for Seq below (batch 4): recompute-only floor / offload floor in bytes:
# T=32 502440 / 486056, T=64 733864 / 701096, T=96 965288 / 916136,
# T=128 1227560 / 1131176. BUDGET sits between T=96's two floors.
BUDGET = 940_000
PEAK_TOLERANCE = 0.03


class Seq(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32, depth: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(depth)])
        self.norm = nn.BatchNorm1d(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids, labels):
        h = self.emb(ids)
        for block in self.blocks:
            h = h + block(h)
        # BatchNorm over the flattened tokens (a transposed (B, D, T) view is
        # tests/frontend/test_layouts.py's model; the floors above are measured for this one)
        h = self.norm(h.flatten(0, 1))
        return nn.functional.cross_entropy(self.head(h), labels.flatten())


def _batch(length: int):
    g = torch.Generator().manual_seed(length)
    return torch.randint(0, 50, (4, length), generator=g), torch.randint(0, 50, (4, length), generator=g)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def planned_seq():
    torch.manual_seed(0)
    model = Seq()
    planned = remat.plan(model, _batch(64), budget=BUDGET, solver="greedy", offload=True)
    return model, planned


def _step_matches_eager(model, planned, length):
    eager = copy.deepcopy(model)
    for p in model.parameters():
        p.grad = None
    batch = _batch(length)
    loss_p = planned(*batch)
    loss_p.backward()
    loss_e = eager(*batch)
    loss_e.backward()
    assert_trains_like_eager(loss_p, loss_e, model, eager, where=f"T={length}")


@pytest.mark.parametrize("length", [32, 96, 64])
def test_every_length_runs_under_the_same_bytes_and_equals_eager(planned_seq, length):
    model, planned = planned_seq
    planned.prepare(_batch(length))
    step = planned.__dict__["_remat_cache"][
        remat.api.FlatSignature.of(_batch(length), {}, True).key][0]
    assert step.budget_bytes == BUDGET
    assert step.evaluation.peak_bytes <= BUDGET
    if length == 96:  # above its recompute-only floor: only offload fits
        assert step.plan.count(Decision.OFFLOAD) > 0
    for p in model.parameters():
        p.grad = None
    batch = _batch(length)
    m = measure_step(lambda: planned(*batch).backward(), register=(model, batch))
    assert m.peak_bytes <= BUDGET
    assert abs(step.evaluation.peak_bytes - m.peak_bytes) <= PEAK_TOLERANCE * m.peak_bytes
    _step_matches_eager(model, planned, length)


def test_a_length_nothing_fits_is_refused_before_anything_runs(planned_seq):
    model, planned = planned_seq
    planned(*_batch(64)).backward()  # a step whose gradients must stay as they are
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InfeasibleBudgetError) as info:
        planned(*_batch(128))
    assert info.value.budget_bytes == BUDGET
    assert info.value.min_peak_bytes > BUDGET
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    # remembered: the second refusal does not plan again
    before = len(planned.shapes)
    with pytest.raises(InfeasibleBudgetError):
        planned(*_batch(128))
    assert len(planned.shapes) == before
    assert "refused" in planned.summary()


def test_prepare_lengths_plans_ahead_and_the_summary_says_what_ran():
    torch.manual_seed(0)
    model = Seq()
    planned = remat.plan(model, _batch(64), budget=BUDGET, solver="greedy", offload=True)
    ahead = planned.prepare_lengths(_batch(64), lengths=[32, 96])
    assert set(ahead) == {32, 96}
    assert all(s.plan_s > 0 and s.predicted_peak_bytes <= BUDGET for s in ahead.values())
    assert ahead[96].offload_bytes > 0
    cached = len(planned.__dict__["_remat_cache"])
    planned(*_batch(96)).backward()
    assert len(planned.__dict__["_remat_cache"]) == cached  # no planning stall
    text = planned.summary()
    assert "shapes (one plan each, same budget):" in text
    assert "*[(4, 96) int64, (4, 96) int64]" in text and "ran 1 times" in text
    assert "hidden" in text and "planned in" in text
    with pytest.raises(InfeasibleBudgetError):
        planned.prepare_lengths(_batch(64), lengths=[128])


def test_offload_fallback_recomputes_where_that_fits_and_offloads_the_long_length():
    torch.manual_seed(0)
    model = Seq()
    planned = remat.plan(model, _batch(64), budget=BUDGET, solver="greedy", offload="fallback")
    ahead = planned.prepare_lengths(_batch(64), lengths=[32, 96])
    assert planned.plan.count(Decision.OFFLOAD) == 0 and ahead[32].offload_bytes == 0
    assert ahead[96].offload_bytes > 0  # above T=96's recompute-only floor
    for p in model.parameters():
        p.grad = None
    batch = _batch(96)
    m = measure_step(lambda: planned(*batch).backward(), register=(model, batch))
    assert m.peak_bytes <= BUDGET
    _step_matches_eager(model, planned, 96)


def _fresh_grads(model):
    for p in model.parameters():
        p.grad = None


@pytest.mark.parametrize("instrument", ["dispatch", "profiler"])
def test_the_first_call_at_a_new_length_holds_the_budget(instrument):
    """The first call at a new length plans inside the step: its tracing is symbolic
    (fake tensors hold no memory), and op workspace is measured only within what the
    budget leaves (under a recording profiler, not at all: its figures are bounded from
    the shapes measured before). Measured by the dispatch tracker and by the profiler's
    allocator events, first call and second, a shorter length and a longer one that
    offloads."""
    torch.manual_seed(0)
    model = Seq()
    planned = remat.plan(model, _batch(64), budget=BUDGET, solver="greedy", offload=True)
    for length in (32, 96):
        batch = _batch(length)
        peaks = []
        for _ in range(2):
            _fresh_grads(model)
            m = measure_step(lambda: planned(*batch).backward(), register=(model, batch),
                             instrument=instrument)
            peaks.append(m.peak_bytes)
        assert max(peaks) <= BUDGET, (length, peaks)
        # the first call's measurement holds the whole step (a profiler session opened
        # by planning would have ended this one)
        assert peaks[0] >= peaks[1], (length, peaks)
    assert len(planned.shapes) == 3


def test_a_fake_tensor_holds_no_memory_for_the_tracker():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(1000)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)

    def step():
        with mode:
            traced = (fake * 2).sum()
        return traced, real * 2

    m = measure_step(step, register=(real,))
    assert m.peak_bytes == real.untyped_storage().nbytes() * 2
