"""Small random compositions of transformer-style blocks, for fuzzing every runtime path.

``composition(seed, kinds)`` draws a stack of residual blocks (an MLP, a gated MLP,
attention through SDPA or ``nn.MultiheadAttention``; LayerNorm, RMSNorm or none; the
norm before the branch, after the sum, or shared by both) and returns the model with
its input. `Kinds` says what may be drawn: `BACKEND` is what the inductor gradient guard
draws; `EAGER` adds `nn.MultiheadAttention`, blocks without a norm, token embeddings
with a tied or untied head and a cross-entropy loss, and what only an exact runtime can
compare bit for bit (dropout, attention dropout, stochastic depth as timm writes it);
`WIDE` is `EAGER` without the random ops, the loss inside or outside. The same seed and
kinds give the same model, input and parameters in any process.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from torch import nn

WIDTH = 32
VOCAB = 50


@dataclasses.dataclass(frozen=True, kw_only=True)
class Kinds:
    """What `composition` may draw."""

    mixers: tuple[str, ...] = ("mlp", "gated", "attention")
    """Block branches: "mlp" (Linear-GELU-Linear), "gated" (its up projection times SiLU
    of a gate), "attention" (causal SDPA), "mha" (`nn.MultiheadAttention`)."""
    norms: tuple[str, ...] = ("layernorm", "rmsnorm")
    """"layernorm", "rmsnorm" (written out: pow, mean, rsqrt), "none"."""
    depths: tuple[int, ...] = (2, 3)
    """Numbers of blocks."""
    random_ops: bool = False
    """Dropout in the MLPs and attention, and stochastic depth (a per-sample `torch.rand`
    mask on the branch), each drawn per model or block."""
    embedding: bool = False
    """Token ids in, an embedding, and a head tied to it or not (drawn)."""
    loss_inside: bool | None = None
    """Whether the module returns its scalar loss; None: drawn (else it returns the
    activations and the caller reduces them)."""


BACKEND = Kinds()
"""The inductor gradient guard's draw: no random ops (inductor draws other numbers)."""
EAGER = Kinds(mixers=("mlp", "gated", "attention", "mha"), norms=("layernorm", "rmsnorm", "none"),
              depths=(1, 2, 3, 4), random_ops=True, embedding=True, loss_inside=True)
"""The eager runtime's draw: everything, the loss inside (`remat.plan` needs it)."""
WIDE = dataclasses.replace(EAGER, depths=(1, 2, 3), random_ops=False, loss_inside=None)
"""Every block kind and head without random ops, the loss inside or outside: what the
backend guard draws besides `BACKEND`."""


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MLP(nn.Module):
    def __init__(self, gated: bool, dropout: float = 0.0):
        super().__init__()
        self.gated, self.dropout = gated, dropout
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.gate = nn.Linear(WIDTH, 2 * WIDTH) if gated else None
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        h = nn.functional.gelu(self.up(x))
        if self.gated:
            h = h * nn.functional.silu(self.gate(x))
        if self.dropout:  # no dropout op at p=0: the graph is the plain MLP's
            h = nn.functional.dropout(h, self.dropout, self.training)
        return self.down(h)


class Attention(nn.Module):
    def __init__(self, dropout: float = 0.0, heads: int = 4):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, WIDTH // self.heads).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       dropout_p=self.dropout if self.training else 0.0)
        return self.out(a.transpose(1, 2).reshape(b, t, WIDTH))


class MultiheadAttention(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.attention = nn.MultiheadAttention(WIDTH, 4, dropout=dropout, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class Block(nn.Module):
    """One residual block: `where` the norm is: "pre" (inside the branch), "post" (after
    the sum) or "shared" (before both: the branch and the residual read its output).
    `drop_path` > 0 drops the whole branch per sample in training, as timm's `drop_path`
    writes it (`keep + torch.rand(..., dtype=, device=)`, floored)."""

    def __init__(self, mixer: nn.Module, norm: nn.Module, where: str, drop_path: float = 0.0):
        super().__init__()
        self.mixer, self.norm, self.where, self.drop_path = mixer, norm, where, drop_path

    def branch(self, x):
        y = self.mixer(x)
        if self.drop_path and self.training:
            keep = 1.0 - self.drop_path
            mask = keep + torch.rand((y.shape[0],) + (1,) * (y.ndim - 1), dtype=y.dtype, device=y.device)
            y = y.div(keep) * mask.floor_()
        return y

    def forward(self, x):
        if self.where == "pre":
            return x + self.branch(self.norm(x))
        if self.where == "shared":
            h = self.norm(x)
            return h + self.branch(h)
        return self.norm(x + self.branch(x))


class Composition(nn.Module):
    def __init__(self, blocks: list[nn.Module], *, loss_inside: bool, embedding: bool = False, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH) if embedding else None
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False) if embedding else None
        if tied:
            self.head.weight = self.embed.weight
        self.loss_inside = loss_inside

    def forward(self, x):
        y = self.blocks(self.embed(x) if self.embed is not None else x)
        if self.head is not None:
            logits = self.head(y)
            if self.loss_inside:
                return nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten())
            return logits
        return y.pow(2).mean() if self.loss_inside else y


_MIXERS = {"mlp": lambda p: MLP(gated=False, dropout=p), "gated": lambda p: MLP(gated=True, dropout=p),
           "attention": lambda p: Attention(dropout=p), "mha": lambda p: MultiheadAttention(dropout=p)}
_NORMS = {"layernorm": lambda: nn.LayerNorm(WIDTH), "rmsnorm": lambda: RMSNorm(WIDTH), "none": nn.Identity}


def composition(seed: int, kinds: Kinds = BACKEND) -> tuple[Composition, torch.Tensor]:
    """A random stack of blocks drawn from `seed` under `kinds`, and its input (a batch
    of 4 sequences of 16: activations `WIDTH` wide, or token ids with `kinds.embedding`).
    Draws only what `kinds` allows, so `BACKEND`'s draws for a seed never change when
    other kinds are added."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    dropout = rng.choice((0.0, 0.0, 0.1)) if kinds.random_ops else 0.0
    blocks = []
    for _ in range(rng.choice(kinds.depths)):
        mixer = _MIXERS[rng.choice(kinds.mixers)](dropout)
        norm = _NORMS[rng.choice(kinds.norms)]()
        where = rng.choice(("pre", "post", "shared"))
        drop_path = rng.choice((0.0, 0.0, 0.2)) if kinds.random_ops else 0.0
        blocks.append(Block(mixer, norm, where, drop_path))
    loss_inside = rng.random() < 0.5 if kinds.loss_inside is None else kinds.loss_inside
    embedding = kinds.embedding and rng.random() < 0.4
    tied = embedding and rng.random() < 0.5
    model = Composition(blocks, loss_inside=loss_inside, embedding=embedding, tied=tied)
    x = torch.randint(0, VOCAB, (4, 16)) if embedding else torch.randn(4, 16, WIDTH)
    return model, x


def describe(model: Composition) -> str:
    """One line naming each block's branch, norm and placement, for failure messages."""
    parts = []
    for block in model.blocks:
        norm = type(block.norm).__name__
        extra = f" drop_path {block.drop_path}" if block.drop_path else ""
        parts.append(f"{type(block.mixer).__name__}/{norm}/{block.where}{extra}")
    head = ("embedding, tied head" if model.head.weight is model.embed.weight else "embedding, head") \
        if model.embed is not None else "activations"
    dropout = max(block.mixer.dropout for block in model.blocks)
    return (f"{head}: " + ", ".join(parts) + (f", dropout {dropout}" if dropout else "")
            + (", loss inside" if model.loss_inside else ", loss outside"))
