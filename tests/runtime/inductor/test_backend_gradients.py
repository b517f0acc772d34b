"""Every parameter's gradient through `torch.compile(model, backend=remat.backend(...))`
with inductor equals eager's, on small random compositions of blocks (norms before or
after the residual, gated MLPs, attention, the loss inside or outside the compiled
module), with nothing recomputed (budget "100%") and with everything recomputed that can
be (solver "all"); on zoo models in `test_backend_gradients_zoo.py`.

Tolerance: relative 1e-4 (absolute 1e-6 for gradients near zero). Inductor's generated
kernels vectorize transcendental functions and reorder reductions, so its float32
results differ from eager's in the last bits (1e-7 relative on these models); a wrong
buffer or a wrong schedule is off by orders of magnitude (the donated-buffer bug left a
weight gradient at 1e-4 of its norm)."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import remat
from nets import PLANS, assert_gradients_match

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
D = 32


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MLP(nn.Module):
    def __init__(self, gated: bool):
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(D, 2 * D)
        self.gate = nn.Linear(D, 2 * D) if gated else None
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        h = nn.functional.gelu(self.up(x))
        if self.gated:
            h = h * nn.functional.silu(self.gate(x))
        return self.down(h)


class Attention(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, D // self.heads).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, t, D))


class Block(nn.Module):
    """One residual block: `where` the norm is: "pre" (inside the branch), "post" (after
    the sum) or "shared" (before both: the branch and the residual read its output)."""

    def __init__(self, mixer: nn.Module, norm: nn.Module, where: str):
        super().__init__()
        self.mixer, self.norm, self.where = mixer, norm, where

    def forward(self, x):
        if self.where == "pre":
            return x + self.mixer(self.norm(x))
        if self.where == "shared":
            h = self.norm(x)
            return h + self.mixer(h)
        return self.norm(x + self.mixer(x))


class Composition(nn.Module):
    def __init__(self, blocks: list[nn.Module], loss_inside: bool):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.loss_inside = loss_inside

    def forward(self, x):
        y = self.blocks(x)
        return y.pow(2).mean() if self.loss_inside else y


def composition(seed: int) -> tuple[Composition, torch.Tensor]:
    """A random stack of 2-3 blocks, drawn from `seed`."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    blocks = []
    for _ in range(rng.choice((2, 3))):
        mixer = rng.choice((lambda: MLP(gated=False), lambda: MLP(gated=True), Attention))()
        norm = rng.choice((lambda: nn.LayerNorm(D), lambda: RMSNorm(D)))()
        blocks.append(Block(mixer, norm, rng.choice(("pre", "post", "shared"))))
    return Composition(blocks, loss_inside=rng.random() < 0.5), torch.randn(4, 16, D)


SEEDS = (0, 1, 4, 6, 7, 9)
"""Compositions covering post-, pre- and shared norms, gated MLPs, attention, the loss
inside and outside; 7 and 9 (the loss inside, a shared LayerNorm last) gave a wrong
weight gradient when a value and its view were both saved (`remat_solvers.shared_storage`)."""


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("seed", SEEDS)
def test_random_compositions_train_as_eager_through_the_backend(seed, plan):
    torch._dynamo.reset()
    model, x = composition(seed)
    be = remat.backend(**PLANS[plan])
    compiled = torch.compile(model, backend=be)
    assert_gradients_match(model, lambda m: compiled(x), lambda m: m(x), f"composition {seed}, {plan}")
    assert be.steps  # remat planned what ran
    for step in be.steps:  # a percentage is of inductor's no-remat peak: "100%" is that peak
        assert step.no_remat_margin_bytes is not None
        assert step.budget_bytes == step.no_remat_peak_bytes
        assert step.evaluation.peak_bytes + step.fusion_margin_bytes <= step.budget_bytes
    if plan == "all recomputed":
        assert any(step.evaluation.recomputed_ids for step in be.steps)
