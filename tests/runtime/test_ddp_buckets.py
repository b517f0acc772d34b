"""The whole-step ledger's view of DistributedDataParallel's reducer buckets, in this
process (a real one-rank gloo group; no spawn): the buckets are counted once, and with
`gradient_as_bucket_view=True` the gradients, views of them, are not counted again."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel as DDP

from remat.runtime.step.ledger import StepLedger


@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():  # pragma: no cover - another test left a group up
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _after_a_step(bucket_view: bool) -> tuple[DDP, int, StepLedger]:
    """A DDP-wrapped MLP after one backward; the ledger's outside bytes for a graph call
    that takes its parameters (as DDPOptimizer's bucket graphs do)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    ddp(torch.randn(8, 64)).sum().backward()
    ledger = StepLedger("100%")
    params = list(model.parameters())
    return ddp, ledger.begin(params).outside_bytes, ledger


def test_gradients_that_are_bucket_views_are_counted_once(group):
    grad_bytes = sum(p.numel() * p.element_size() for p in nn.Sequential(
        nn.Linear(64, 64), nn.Linear(64, 64)).parameters())
    # default: gradients are their own tensors, copied into the buckets: both are live
    ddp, outside, ledger = _after_a_step(bucket_view=False)
    assert ledger.ddp.bucket_bytes() == grad_bytes and not ledger.ddp.grads_in_buckets()
    assert outside == 2 * grad_bytes
    # gradient_as_bucket_view: every gradient is a view of a bucket (torch's reducer makes
    # it one after the backward), so the buckets are all there is
    ddp, outside, ledger = _after_a_step(bucket_view=True)
    buckets = {StorageWeakRef(p.grad.untyped_storage()): p.grad.untyped_storage().nbytes()
               for p in ddp.module.parameters()}
    assert len(buckets) < len(list(ddp.parameters())) and sum(buckets.values()) == grad_bytes
    assert len(ledger.ddp.grads_in_buckets()) == len(list(ddp.parameters()))
    assert outside == grad_bytes
