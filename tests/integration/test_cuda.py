"""CUDA: the paths a GPU adds, on a small GPT-2 (dropout 0.1, SDPA's fused kernels with
their Philox seeds). Skipped without a CUDA device; on a GPU machine run them alone:
`python -m pytest -q -m cuda tests/integration/test_cuda.py` (a few minutes).

They check what CPU cannot: the planned step at the floor with offload (pinned buffers,
a side stream, events) and with SDPA's dropout replayed, bit for bit against eager;
the measured `torch.cuda.max_memory_allocated` under the prediction; and the backend
with inductor generating Triton kernels."""

from __future__ import annotations

import copy

import pytest
import torch

import remat
from remat.testing.measure import measure_step_cuda
from nets import step_and_take_grads

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _gpt2(layers: int = 2, batch: int = 2, seq: int = 128):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=512, n_positions=seq,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).cuda().train()
    ids = torch.randint(0, 512, (batch, seq), device="cuda")
    return model, ids


def _step_on_host(model, ids):
    """Loss and gradients of one step under seed 1 (`step_and_take_grads`), copied to the
    host: nothing of them stays on the GPU."""
    loss, grads = step_and_take_grads(model, (ids,), {"labels": ids}, seed=1)
    return loss.cpu(), [g.cpu() for g in grads.values()]


def _peak(model, ids) -> int:
    """`torch.cuda.max_memory_allocated` over one step (`measure_step_cuda`), with only
    `model`, `ids` and what torch holds for the process (the cuBLAS workspaces) on the GPU
    before it."""
    def step():
        torch.manual_seed(1)
        model(ids, labels=ids).loss.backward()

    peak = measure_step_cuda(step).peak_bytes
    model.zero_grad(set_to_none=True)
    return peak


def _at_the_floor(model, ids, **kwargs):
    with pytest.raises(remat.InfeasibleBudgetError) as refused:
        remat.plan(model, (ids,), {"labels": ids}, budget=1, **kwargs)
    return remat.plan(model, (ids,), {"labels": ids}, budget=refused.value.min_peak_bytes, **kwargs)


@pytest.mark.parametrize("offload", [False, True])
def test_the_floor_runs_bit_exact_and_under_its_prediction(offload):
    model, ids = _gpt2()
    eager = copy.deepcopy(model)
    loss, grads = _step_on_host(eager, ids)
    del eager
    planned = _at_the_floor(model, ids, offload=offload)
    got_loss, got_grads = _step_on_host(planned, ids)  # the first step: nothing crashes
    assert torch.equal(got_loss, loss)
    for a, b in zip(got_grads, grads, strict=True):
        assert torch.equal(a, b)
    peak = _peak(planned, ids)
    assert peak <= planned.predicted_peak_bytes <= planned.budget_bytes
    assert planned.predicted_peak_bytes <= 1.03 * peak  # and within 3% of it


def test_the_backend_with_inductor_trains_as_eager():
    model, ids = _gpt2()
    model.eval()  # inductor draws other random numbers than eager
    eager = copy.deepcopy(model)
    eager(ids, labels=ids).loss.backward()
    compiled = torch.compile(model, backend=remat.backend(budget="100%", outputs="loss"))
    compiled(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
