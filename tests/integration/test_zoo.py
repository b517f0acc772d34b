"""The public test models build, train one step, and are deterministic."""

from __future__ import annotations

import math

import pytest
import torch

from remat.testing import zoo

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", zoo.NAMES)
def test_builds_and_trains_one_step(name):
    case = zoo.build(name)
    assert case.name == name and case.size == "tiny"
    assert case.model.training
    assert case.blocks and all(isinstance(b, torch.nn.Module) for b in case.blocks)
    block_params = {id(p) for b in case.blocks for p in b.parameters()}
    assert block_params <= {id(p) for p in case.model.parameters()}
    loss = case.model(*case.args, **case.kwargs).loss
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    grads = [p.grad for p in case.model.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_deterministic(name):
    a, b = zoo.build(name, seed=3), zoo.build(name, seed=3)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    for xa, xb in zip(a.args, b.args, strict=True):
        assert torch.equal(xa, xb)
    torch.manual_seed(0)
    loss_a = a.loss()
    torch.manual_seed(0)
    loss_b = b.loss()
    assert torch.equal(loss_a, loss_b)
    c = zoo.build(name, seed=4)
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))


def test_batchnorm_running_stats_update():
    for name in ("cnn", "resnet"):
        case = zoo.build(name)
        bns = [m for m in case.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert bns
        before = [bn.running_mean.clone() for bn in bns]
        case.loss().backward()
        assert all(not torch.equal(b, bn.running_mean) for b, bn in zip(before, bns))


def test_gpt2_dropout_is_on():
    case = zoo.build("gpt2")
    config = case.model.config
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.1)
    torch.manual_seed(0)
    first = case.loss()
    torch.manual_seed(1)
    assert not torch.equal(first, case.loss())


def test_gpt2_small_shape():
    case = zoo.build("gpt2", size="small")
    config = case.model.config
    assert (config.n_layer, config.n_embd) == (4, 256)
    assert tuple(case.args[0].shape) == (8, 256)


def test_unknown_names_and_sizes_are_rejected():
    with pytest.raises(ValueError, match="choose one of"):
        zoo.build("alexnet")
    with pytest.raises(ValueError, match="no size 'small'"):
        zoo.build("mlp", size="small")


def test_case_is_frozen():
    case = zoo.build("mlp")
    with pytest.raises(AttributeError):
        case.name = "x"
