"""A random-weight Llama-shaped target for speed benchmarks (speed depends on the shape, not the weights)."""

from __future__ import annotations

import argparse

import torch


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    """--layers/--hidden/--heads/--kv-heads/--intermediate/--vocab, defaults: SmolLM2-135M."""
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=49152)


SHAPE_KEYS = ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab")


def random_llama(a: argparse.Namespace, device: torch.device):
    """(config, model): seeded random weights on ``device``, bf16 on CUDA else fp32, sdpa, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=8192, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return cfg, model
