"""Drafter training-step throughput: tokens/s, MFU against a given peak, peak memory.

    # Llama-3.1-8B-shaped drafter on one H200 (peak = the measured bf16 matmul figure)
    python benchmarks/train_step.py --device cuda --dtype bfloat16 --peak-tflops 785
    # both attention implementations in one run, after checking they agree (loss and gradients)
    python benchmarks/train_step.py --peak-tflops 785 --attention sdpa,flex --check
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


def _check_flex(drafter, lm_head, a, dev, dtype) -> dict:
    """sdpa vs flex on one packed row of 3 samples + padding: loss and every gradient must agree."""
    from eagle3_ray.drafter.ttt import ttt_forward

    g = torch.Generator().manual_seed(1)
    lengths, t = [700, 500, 600], 1900
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((t - sum(lengths),), -1)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(t - sum(lengths), dtype=torch.long)])
    batch = {
        "input_ids": torch.randint(0, a.vocab, (1, t), generator=g),
        "aux_hidden": torch.randn(1, t, 3 * a.hidden, generator=g).to(dtype),
        "last_hidden": torch.randn(1, t, a.hidden, generator=g).to(dtype),
        "loss_mask": (seq_ids >= 0)[None],
        "position_ids": pos[None],
        "seq_ids": seq_ids[None],
    }
    batch = {k: v.to(dev) for k, v in batch.items()}
    res = {}
    for attention in ("sdpa", "flex"):
        drafter.zero_grad(set_to_none=True)
        out = ttt_forward(drafter, batch, lm_head, a.ttt_steps, 0.8, attention)
        out.loss.backward()
        res[attention] = (out.loss.item(), {n: p.grad.float().clone() for n, p in drafter.named_parameters()
                                            if p.grad is not None})
    drafter.zero_grad(set_to_none=True)
    rel = {n: ((res["flex"][1][n] - g0).norm() / g0.norm().clamp(min=1e-12)).item() for n, g0 in res["sdpa"][1].items()}
    return {"loss_sdpa": res["sdpa"][0], "loss_flex": res["flex"][0], "grad_rel_diff_max": max(rel.values()),
            "grad_rel_diff": rel}


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
    ap.add_argument("--attention", default="sdpa", help="comma-separated: sdpa, flex (each timed in this run)")
    ap.add_argument("--check", action="store_true",
                    help="first compare loss and gradients of sdpa and flex on a packed batch of 3 samples")
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

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    flops = step_flops(a, seq)
    if a.check:
        check = _check_flex(drafter, lm_head, a, dev, dtype)
        print(f"check sdpa vs flex: {json.dumps(check)}", flush=True)

    def time_mode(attention: str) -> dict:
        def step():
            out = ttt_forward(drafter, batch, lm_head, a.ttt_steps, 0.8, attention)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)

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
        r = {
            "step_seconds": seconds,
            "tokens_per_s": seq / seconds,
            "achieved_tflops": flops / seconds / 1e12,
            "mfu": (flops / seconds / 1e12) / a.peak_tflops if a.peak_tflops else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None,
        }
        mfu = f", MFU {r['mfu']:.1%} of {a.peak_tflops} TFLOP/s" if r["mfu"] is not None else ""
        print(f"[{attention}] {r['tokens_per_s']:,.0f} tokens/s, {r['achieved_tflops']:.1f} TFLOP/s{mfu}, "
              f"peak {r['peak_memory_gib'] or 0:.1f} GiB", flush=True)
        return r

    modes: dict[str, dict] = {}
    for m in a.attention.split(","):
        modes[m] = time_mode(m)
        _write(a.json, _result(a, dev, flops, modes, check if a.check else None))  # partial results survive a timeout
    print(json.dumps(_result(a, dev, flops, modes, check if a.check else None), indent=2))
    return 0


def _write(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def _result(a, dev, flops: float, modes: dict, check: dict | None) -> dict:
    best = max(modes.values(), key=lambda r: r["tokens_per_s"])
    return {
        "shape": {k: getattr(a, k) for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                                             "draft_vocab", "seq", "ttt_steps")},
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "dtype": a.dtype,
        "compile": a.compile,
        "model_tflops_per_step": flops / 1e12,
        "modes": modes,
        "check": check,
        **best,
        "best_mode": max(modes, key=lambda m: modes[m]["tokens_per_s"]),
        "command": " ".join([sys.executable, *sys.argv]),
    }


if __name__ == "__main__":
    sys.exit(main())
