"""Drafter training-step throughput: tokens/s, MFU against a given peak, peak memory.

    # Llama-3.1-8B-shaped drafter on one H200 (peak = the measured bf16 matmul figure)
    python benchmarks/train_step.py --device cuda --dtype bfloat16 --peak-tflops 785
    # small and quick on a CPU
    python benchmarks/train_step.py --preset smollm2 --seq 512 --steps 3

One step = `ttt_forward` (TTT unroll, target distribution from the frozen lm_head) + backward +
AdamW on random features of one packed sequence. Model FLOPs per step (counted, not measured):
3x the drafter's forward matmuls per TTT step (forward + backward), attention scores over the
causal prefix plus the TTT diagonal, and 1x the no-grad target-logit matmuls.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

PRESETS = {
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152),
    "kimi-k2.5": dict(hidden=7168, heads=64, kv_heads=8, head_dim=128, intermediate=18432, vocab=163840),
}


def step_flops(a, seq: int) -> float:
    h, i, vd, v = a.hidden, a.intermediate, a.draft_vocab, a.vocab
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    per_token_layer = 2 * (2 * h) * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * i + 2 * h * vd  # qkv, o, mlp, lm_head
    fc = 2 * 3 * h * h
    attn = sum(2 * 2 * q * (seq / 2 + k) for k in range(a.ttt_steps))  # QK^T and PV per query token
    train = 3 * seq * (a.ttt_steps * per_token_layer + fc) + 3 * seq * attn
    target = seq * (2 * h * vd + 2 * h * v)  # draft-column softmax + full-vocab argmax, no grad
    return train + target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b")
    for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        ap.add_argument(f"--{k.replace('_', '-')}", type=int)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU (e.g. 785 on H200)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the drafter layer and head")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)

    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.drafter.ttt import ttt_forward

    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    cfg = DrafterConfig(
        hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        intermediate_size=a.intermediate, vocab_size=a.vocab, draft_vocab_size=a.draft_vocab,
        target_hidden_size=a.hidden, aux_layers=[2, 16, 29], max_position_embeddings=max(4096, a.seq + 16),
    )
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.bind_embedding(torch.randn(a.vocab, a.hidden) * 0.02)
    drafter = drafter.to(device=dev, dtype=dtype)
    lm_head = (torch.randn(a.vocab, a.hidden) * 0.02).to(device=dev, dtype=dtype)
    if a.compile:
        drafter.midlayer = torch.compile(drafter.midlayer, dynamic=True)
        drafter.norm = torch.compile(drafter.norm, dynamic=True)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4, fused=dev.type == "cuda")
    seq = a.seq
    batch = {
        "input_ids": torch.randint(0, a.vocab, (1, seq), device=dev),
        "aux_hidden": torch.randn(1, seq, 3 * a.hidden, device=dev, dtype=dtype),
        "last_hidden": torch.randn(1, seq, a.hidden, device=dev, dtype=dtype),
        "loss_mask": torch.ones(1, seq, dtype=torch.bool, device=dev),
        "position_ids": torch.arange(seq, device=dev)[None],
        "seq_ids": torch.zeros(1, seq, dtype=torch.long, device=dev),
    }

    def step():
        out = ttt_forward(drafter, batch, lm_head, a.ttt_steps, 0.8)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(a.warmup):
        step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    seconds = (time.perf_counter() - t0) / a.steps
    flops = step_flops(a, seq)
    result = {
        "shape": {k: getattr(a, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                                             "draft_vocab", "seq", "ttt_steps")},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "dtype": a.dtype,
        "compile": a.compile,
        "step_seconds": seconds,
        "tokens_per_s": seq / seconds,
        "model_tflops_per_step": flops / 1e12,
        "achieved_tflops": flops / seconds / 1e12,
        "mfu": (flops / seconds / 1e12) / a.peak_tflops if a.peak_tflops else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    print(json.dumps(result, indent=2))
    mfu = f", MFU {result['mfu']:.1%} of {a.peak_tflops} TFLOP/s" if result["mfu"] is not None else ""
    print(f"{result['tokens_per_s']:,.0f} tokens/s, {result['achieved_tflops']:.1f} TFLOP/s{mfu}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
