"""A TARGET for the command line: a GPT-2 (random weights, dropout on) built from a
config, with its batch size and sequence length as factory arguments.

    remat report examples/gpt2_factory.py:build --budget 60% --out report/
    remat fit examples/gpt2_factory.py:build --budget 150MiB --vary batch_size --max 64
    remat report examples/gpt2_factory.py:build --budget 90% --fake --device h100 \\
        --set n_layer=24 --set n_embd=1024 --set n_head=16 --set vocab_size=50257 --set seq_len=1024
"""

from __future__ import annotations

import torch


def build(batch_size: int = 4, seq_len: int = 256, n_layer: int = 4, n_embd: int = 256, n_head: int = 4,
          vocab_size: int = 1024):
    """(model, args, kwargs): GPT2LMHeadModel on `batch_size` x `seq_len` random tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    last = vocab_size - 1  # the default special ids (50256) lie outside a small vocabulary
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=seq_len, bos_token_id=last, eos_token_id=last, use_cache=False,
                        attn_implementation="sdpa")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return model, (ids,), {"labels": ids}
