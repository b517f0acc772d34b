"""More transformers models for `bench/allocator.py`, built from tiny configs (random
weights, no downloads), each with the issue's settings: dropout 0.1 where the model has
it, Whisper's layerdrop 0, an 8-layer LLaMA. Each builder returns (model in train mode,
args, kwargs) whose call returns an output with a scalar `.loss`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _ids(gen: torch.Generator, vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=gen)


def convnext(gen: torch.Generator):
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=10,
                            drop_path_rate=0.1)
    pixels = torch.randn(8, 3, 32, 32, generator=gen)
    return ConvNextForImageClassification(config), (pixels,), {"labels": torch.randint(0, 10, (8,), generator=gen)}


def clip(gen: torch.Generator):
    from transformers import CLIPConfig, CLIPModel

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  attention_dropout=0.1)
    config = CLIPConfig(text_config=dict(common, vocab_size=128, max_position_embeddings=16),
                        vision_config=dict(common, image_size=32, patch_size=4), projection_dim=32)
    ids = _ids(gen, 128, 8, 16)
    pixels = torch.randn(8, 3, 32, 32, generator=gen)
    return CLIPModel(config), (), {"input_ids": ids, "pixel_values": pixels, "return_loss": True}


def t5(gen: torch.Generator):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0)
    ids = _ids(gen, 128, 8, 32)
    return T5ForConditionalGeneration(config), (ids,), {"labels": _ids(gen, 128, 8, 16)}


def whisper(gen: torch.Generator):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(vocab_size=128, num_mel_bins=16, d_model=64, encoder_layers=4, decoder_layers=4,
                           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=32, max_target_positions=32,
                           dropout=0.1, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                           decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    features = torch.randn(4, 16, 64, generator=gen)
    return WhisperForConditionalGeneration(config), (features,), {"labels": _ids(gen, 128, 4, 16)}


def llama8(gen: torch.Generator):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=8, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, use_cache=False,
                         attention_dropout=0.1, attn_implementation="sdpa")
    ids = _ids(gen, 128, 4, 32)
    return LlamaForCausalLM(config), (ids,), {"labels": ids}


def mamba(gen: torch.Generator):
    from transformers import MambaConfig, MambaForCausalLM

    config = MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, use_cache=False)
    ids = _ids(gen, 128, 2, 16)
    return MambaForCausalLM(config), (ids,), {"labels": ids}


BUILDERS: dict[str, Callable[[torch.Generator], tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]]] = {
    "convnext": convnext, "clip": clip, "t5": t5, "whisper": whisper, "llama8": llama8, "mamba": mamba,
}
