"""The public test models: seeded, random-weight models with their inputs and blocks.

Shared by the tests, the examples and the benchmarks. ``build(name, size=...)`` returns
a `ModelCase`; ``case.model(*case.args, **case.kwargs).loss`` is a scalar loss.

Transformers models are built from configs (no downloads) with
``attn_implementation="sdpa"``, the library default: it traces with ``make_fx`` and
AOTAutograd, and on CPU it runs ``_scaled_dot_product_flash_attention_for_cpu`` (the
math path when attention dropout is on, as in ``gpt2``).

Causal LMs have ``use_cache=False`` (training needs no KV cache; a cache mutated inside a
checkpointed block would be appended to twice).

Sizes: ``"tiny"`` for unit tests (a forward+backward well under 0.5 s on a 2-core CPU),
``"bench"`` for benchmarks (well under a few seconds per step), and for ``gpt2`` also
``"small"`` (4 layers, 256 wide, batch 8, sequence 256). ``"micro"`` is ``"tiny"`` with
fewer blocks (one layer for the transformers), for tests that compile with inductor: a
compile's time follows the graph's node count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

NAMES = ("mlp", "cnn", "gpt2", "llama", "bert", "vit", "resnet")
SIZES = ("tiny", "bench", "small", "micro")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class ModelCase:
    """A model ready for one training step: ``model(*args, **kwargs).loss``."""

    name: str
    """One of `NAMES`."""
    size: str
    """One of `SIZES`."""
    model: nn.Module
    """In train mode, weights seeded."""
    args: tuple[Any, ...]
    """Positional inputs."""
    kwargs: dict[str, Any]
    """Keyword inputs (labels for the transformers models). A plain dict, so that pytree
    utilities (tracing, ``torch.export``) can flatten it; treat it as read-only."""
    blocks: tuple[nn.Module, ...]
    """The repeated blocks, in forward order (the unit of per-block checkpointing)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "args", tuple(self.args))
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        object.__setattr__(self, "blocks", tuple(self.blocks))
        if not self.blocks:
            raise ValueError(f"model case {self.name!r} has no blocks")

    def loss(self) -> torch.Tensor:
        """Run the forward pass and return the scalar loss."""
        return self.model(*self.args, **self.kwargs).loss


class Output(NamedTuple):
    """What the custom models return (the transformers ones return a ModelOutput)."""

    loss: torch.Tensor
    logits: torch.Tensor


# --- custom models ---------------------------------------------------------------------


class MLP(nn.Module):
    """Linear+ReLU blocks, a linear head, cross-entropy loss."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return Output(nn.functional.cross_entropy(logits, labels), logits)


class CNN(nn.Module):
    """Conv+BatchNorm+ReLU+Dropout blocks, global pooling, a linear head."""

    def __init__(self, channels: tuple[int, ...], classes: int, dropout: float = 0.1) -> None:
        super().__init__()
        blocks = []
        for c_in, c_out in zip((3, *channels[:-1]), channels):
            blocks.append(nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(),
                nn.Dropout(dropout),
            ))
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        return Output(nn.functional.cross_entropy(logits, labels), logits)


# --- sizes -----------------------------------------------------------------------------
# Each entry: (model hyper-parameters, batch, sequence length or image side). "tiny"
# batches are large enough that activations, not parameters, dominate the peak, so
# that 50% of the no-remat peak is reachable and the tests exercise recomputation.

_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "tiny": dict(width=64, depth=4, classes=10, batch=512),
        "micro": dict(width=64, depth=2, classes=10, batch=512),
        "bench": dict(width=1024, depth=8, classes=100, batch=256),
    },
    "cnn": {
        "tiny": dict(channels=(8, 16, 16), classes=10, batch=16, image=16),
        "micro": dict(channels=(8, 16), classes=10, batch=16, image=16),
        "bench": dict(channels=(32, 64, 64, 128), classes=100, batch=16, image=32),
    },
    "gpt2": {
        "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, batch=8, seq=64),
        "micro": dict(n_layer=1, n_embd=64, n_head=4, vocab_size=128, batch=8, seq=64),
        "small": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, batch=8, seq=256),
        # Half of "small" (batch 4), so that `bench/compare.py --quick` stays under 2 minutes.
        "bench": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, batch=4, seq=256),
    },
    "llama": {
        "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128, batch=8, seq=64),
        "micro": dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, batch=8, seq=64),
        "bench": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, batch=8, seq=256),
    },
    "bert": {
        "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     vocab_size=128, batch=8, seq=64),
        "micro": dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      vocab_size=128, batch=8, seq=64),
        "bench": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                      vocab_size=1024, batch=8, seq=256),
    },
    "vit": {
        "tiny": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     patch_size=4, num_labels=10, batch=16, image=16),
        "micro": dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                      patch_size=4, num_labels=10, batch=16, image=16),
        "bench": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                      patch_size=8, num_labels=100, batch=8, image=128),
    },
    "resnet": {
        "tiny": dict(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], num_labels=10,
                     batch=16, image=32),
        # Two stages: the first keeps the identity shortcut, the second the strided conv one.
        "micro": dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10,
                      batch=16, image=32),
        # ResNet-18 layout (basic layers, depths 2-2-2-2, 64..512 channels).
        "bench": dict(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                      num_labels=100, batch=16, image=64),
    },
}


def _split(spec: dict[str, Any], *keys: str) -> tuple[dict[str, Any], list[Any]]:
    spec = dict(spec)
    return spec, [spec.pop(k) for k in keys]


def _tokens(gen: torch.Generator, vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def _images(gen: torch.Generator, batch: int, image: int) -> torch.Tensor:
    return torch.randn(batch, 3, image, image, generator=gen)


def _labels(gen: torch.Generator, classes: int, batch: int) -> torch.Tensor:
    return torch.randint(0, classes, (batch,), generator=gen)


def _mlp(spec, gen):
    spec, (batch,) = _split(spec, "batch")
    model = MLP(**spec)
    x = torch.randn(batch, spec["width"], generator=gen)
    return model, (x, _labels(gen, spec["classes"], batch)), {}, tuple(model.blocks)


def _cnn(spec, gen):
    spec, (batch, image) = _split(spec, "batch", "image")
    model = CNN(**spec)
    return model, (_images(gen, batch, image), _labels(gen, spec["classes"], batch)), {}, tuple(model.blocks)


def _gpt2(spec, gen):
    from transformers import GPT2Config, GPT2LMHeadModel

    spec, (batch, seq) = _split(spec, "batch", "seq")
    last = spec["vocab_size"] - 1  # the default special ids (50256) lie outside a small vocabulary
    config = GPT2Config(**spec, n_positions=seq, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                        bos_token_id=last, eos_token_id=last, use_cache=False, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config)
    ids = _tokens(gen, spec["vocab_size"], batch, seq)
    return model, (ids,), {"labels": ids}, tuple(model.transformer.h)


def _llama(spec, gen):
    from transformers import LlamaConfig, LlamaForCausalLM

    spec, (batch, seq) = _split(spec, "batch", "seq")
    config = LlamaConfig(**spec, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config)
    ids = _tokens(gen, spec["vocab_size"], batch, seq)
    return model, (ids,), {"labels": ids}, tuple(model.model.layers)


def _bert(spec, gen):
    from transformers import BertConfig, BertForMaskedLM

    spec, (batch, seq) = _split(spec, "batch", "seq")
    config = BertConfig(**spec, max_position_embeddings=seq, attn_implementation="sdpa")
    model = BertForMaskedLM(config)
    ids = _tokens(gen, spec["vocab_size"], batch, seq)
    return model, (ids,), {"labels": ids}, tuple(model.bert.encoder.layer)


def _vit(spec, gen):
    from transformers import ViTConfig, ViTForImageClassification

    spec, (batch, image) = _split(spec, "batch", "image")
    config = ViTConfig(**spec, image_size=image, attn_implementation="sdpa")
    model = ViTForImageClassification(config)
    pixels = _images(gen, batch, image)
    return model, (pixels,), {"labels": _labels(gen, spec["num_labels"], batch)}, tuple(model.vit.layers)


def _resnet(spec, gen):
    from transformers import ResNetConfig, ResNetForImageClassification

    spec, (batch, image) = _split(spec, "batch", "image")
    model = ResNetForImageClassification(ResNetConfig(**spec, layer_type="basic"))
    pixels = _images(gen, batch, image)
    blocks = tuple(layer for stage in model.resnet.encoder.stages for layer in stage.layers)
    return model, (pixels,), {"labels": _labels(gen, spec["num_labels"], batch)}, blocks


_BUILDERS: dict[str, Callable[[dict[str, Any], torch.Generator], tuple]] = {
    "mlp": _mlp, "cnn": _cnn, "gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "resnet": _resnet,
}


def sizes(name: str) -> tuple[str, ...]:
    """The sizes `name` comes in."""
    if name not in _SIZES:
        raise ValueError(f"unknown model {name!r}; choose one of {NAMES}")
    return tuple(_SIZES[name])


def build(name: str, *, size: str = "tiny", seed: int = 0) -> ModelCase:
    """Build model `name` at `size` with weights and inputs seeded by `seed`.

    The same (name, size, seed) gives bit-identical weights, inputs and (for a fresh
    global RNG state) dropout masks.
    """
    available = sizes(name)
    if size not in available:
        raise ValueError(f"model {name!r} has no size {size!r}; choose one of {available}")
    torch.manual_seed(seed)  # weight init uses the global generator
    gen = torch.Generator().manual_seed(seed + 1)
    model, args, kwargs, blocks = _BUILDERS[name](dict(_SIZES[name][size]), gen)
    model.train()
    return ModelCase(name=name, size=size, model=model, args=args, kwargs=kwargs, blocks=blocks)
