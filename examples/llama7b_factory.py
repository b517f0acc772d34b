"""A LLaMA-7B-shaped model for `remat report --fake` (built on the meta device: no
weight is ever allocated). `--set layers=N` plans fewer layers of the same width.

    remat report examples/llama7b_factory.py:build --fake --device h100 --budget 40GiB
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build(layers=32, batch_size=1, seq_len=2048):
    # LLaMA-7B (Touvron et al. 2023, table 2)
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                         num_key_value_heads=32, num_hidden_layers=layers, vocab_size=32000,
                         max_position_embeddings=seq_len, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 32000, (batch_size, seq_len))
    return model, (ids,), {"labels": ids}
