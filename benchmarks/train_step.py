"""Drafter training-step throughput: tokens/s, MFU against a given peak, peak memory, host syncs.

    python benchmarks/train_step.py --preset llama3-8b --peak-tflops 785             # one GPU (H100/H200)
    python benchmarks/train_step.py --attention sdpa,varlen,flex --check             # each timed, checked first
    python benchmarks/train_step.py --preset kimi-k2.5 --engine deepspeed --zero-stage 2 --peak-tflops 785
    python benchmarks/train_step.py --preset smollm2 --seq 512 --steps 3             # small, on a CPU
    # the long-sample wall: one sample per step, 2K, 4K, ... until out of memory, then with the memory options
    python benchmarks/train_step.py --preset llama3-8b --peak-tflops 785 --sweep --steps 3 \
        [--loss-chunk-tokens 4096 --recompute-ttt-steps] --json $OUT/wall_8b.json

One step = `train.step.TrainStep` (the training loop's step: `ttt_forward`, backward, gradient clipping,
AdamW) on random features of one packed sequence, over the `torch` engine (weights in --dtype,
`train.step.adamw`) or `deepspeed` (`deepspeed.initialize` with the loop's `_ds_config`: bf16 with fp32
master weights, the given ZeRO stage, one rank in this process). `--sync-check` counts the host
synchronisations of one step (CUDA's sync debug mode), `--op-count` the operators it dispatches. Model FLOPs per step (`step_flops`, counted, not
measured): 3x the drafter's forward matmuls per TTT step (forward + backward); attention's QK^T and PV,
2 x 2 x heads x head_dim FLOPs per (query, key) pair over T/2 causal keys plus step k's k diagonal keys,
3x; 1x the no-grad target-logit matmuls. What the memory options recompute is not counted, so the MFU
shows what recomputation costs. --sweep / --lengths time one sample of each length per step: tokens/s,
MFU and peak memory per length, or the out-of-memory error, after which longer lengths are not tried.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

PRESETS = {
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256),
    "smollm2": dict(hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536, vocab=49152),
    # configs/kimi-k2.5.yaml's drafter (56 x 128 = H); target vocab 163,840
    "kimi-k2.5": dict(hidden=7168, heads=56, kv_heads=8, head_dim=128, intermediate=18432, vocab=163840),
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


def _check_modes(drafter, lm_head, a, dev, dtype, modes: list[tuple[str, str]]) -> dict:
    """Each (attention, loss kernel) of ``modes`` against sdpa with the torch loss on one packed row of
    3 samples + padding: loss and every gradient must agree (relative differences of the gradients'
    norms). Keys name a mode ``attention/kernel``. With the memory options on, each mode runs with them
    (loss chunks of at most 512 tokens, so that the 1900-token row is chunked), the reference without."""
    from eagle3_ray.drafter.ttt import ttt_forward

    g = torch.Generator().manual_seed(1)
    lengths, t = [700, 500, 600], 1900
    seq_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((t - sum(lengths),), -1)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(t - sum(lengths), dtype=torch.long)])
    batch = {"input_ids": torch.randint(0, a.vocab, (1, t), generator=g),
             "aux_hidden": torch.randn(1, t, 3 * a.hidden, generator=g).to(dtype),
             "last_hidden": torch.randn(1, t, a.hidden, generator=g).to(dtype),
             "loss_mask": (seq_ids >= 0)[None], "position_ids": pos[None], "seq_ids": seq_ids[None]}
    batch = {k: v.to(dev) for k, v in batch.items()}
    res, ref = {}, "sdpa/torch"
    options = _memory_options(a)
    if options["loss_chunk_tokens"]:
        options["loss_chunk_tokens"] = min(options["loss_chunk_tokens"], 512)
    plain = {"loss_chunk_tokens": 0, "recompute_steps": False}
    on = options != plain
    for attention, kernel in [("sdpa", "torch"), *[m for m in modes if on or m != ("sdpa", "torch")]]:
        drafter.zero_grad(set_to_none=True)
        mode = f"{attention}/{kernel}" + ("+options" if on and len(res) else "")
        out = ttt_forward(drafter, batch, lm_head, a.ttt_steps, 0.8, attention, loss_kernel=kernel,
                          **(options if len(res) else plain))
        out.loss.backward()
        res[mode] = (out.loss.item(), {n: p.grad.float().clone() for n, p in drafter.named_parameters()
                                       if p.grad is not None})
    drafter.zero_grad(set_to_none=True)
    check = {f"loss_{ref}": res[ref][0]}
    for m in res:
        if m == ref:
            continue
        rel = {n: ((res[m][1][n] - g0).norm() / g0.norm().clamp(min=1e-12)).item() for n, g0 in res[ref][1].items()}
        check.update({f"loss_{m}": res[m][0], f"grad_rel_diff_max_{m}": max(rel.values()), f"grad_rel_diff_{m}": rel})
    return check


def _memory_options(a) -> dict:
    """`ttt_forward`'s long-sample options from the command line (train.loss_chunk_tokens, train.recompute_ttt_steps)."""
    return {"loss_chunk_tokens": a.loss_chunk_tokens, "recompute_steps": a.recompute_ttt_steps}


def sweep_lengths(a) -> list[int]:
    """--lengths as given, or --sweep: --seq, then doubling up to --max-length."""
    if a.lengths:
        return [int(x) for x in a.lengths.split(",")]
    out = [a.seq] if a.sweep else []
    while out and out[-1] * 2 <= a.max_length:
        out.append(out[-1] * 2)
    return out


def parse_args(argv=None) -> argparse.Namespace:
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
    ap.add_argument("--dtype", default=None, help="torch engine weights (default bfloat16 on CUDA, else float32)")
    ap.add_argument("--engine", choices=["torch", "deepspeed"], default="torch")
    ap.add_argument("--zero-stage", type=int, default=1, help="--engine deepspeed: ZeRO stage")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak FLOP/s for MFU (e.g. 785 on H200)")
    ap.add_argument("--attention", default="auto", help="comma-separated, each timed: auto (the loop's choice: "
                    "varlen on CUDA, sdpa elsewhere), sdpa, varlen, flex")
    ap.add_argument("--loss-kernel", default="auto", help="comma-separated, each timed with each --attention: auto "
                    "(the loop's choice: triton on CUDA, torch elsewhere), triton, torch")
    ap.add_argument("--check", action="store_true", help="first compare loss and gradients of every mode with "
                    "sdpa's and the torch loss's on a packed batch of 3 samples")
    ap.add_argument("--sync-check", action="store_true", help="count one step's host synchronisations (CUDA)")
    ap.add_argument("--op-count", action="store_true", help="count the operators one step dispatches (torch.profiler, "
                    "top-level aten ops, forward and backward): each costs host time, so a small pack's step is "
                    "bound by their number, on any device")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N", help="then N steps synchronised between "
                    "forward, backward and optimizer step: the mean seconds of each")
    ap.add_argument("--sweep", action="store_true", help="one sample per step at --seq, twice as long, ... up to "
                    "--max-length, until out of memory (recorded; longer lengths are not tried)")
    ap.add_argument("--max-length", type=int, default=262144, help="--sweep: the longest sample tried")
    ap.add_argument("--lengths", help="comma-separated sample lengths to sweep instead of --sweep's doubling")
    ap.add_argument("--loss-chunk-tokens", type=int, default=0, help="train.loss_chunk_tokens (0 = off)")
    ap.add_argument("--recompute-ttt-steps", nargs="?", const=True, default=False, type=int, metavar="K",
                    help="train.recompute_ttt_steps: every step (no K) or the first K")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args(argv)
    if a.recompute_ttt_steps is not True and not 0 <= a.recompute_ttt_steps <= a.ttt_steps:
        ap.error(f"--recompute-ttt-steps {a.recompute_ttt_steps}: give no K (every step) or K from 0 to "
                 f"--ttt-steps ({a.ttt_steps})")
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.dtype is None:
        a.dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    return a


def build_drafter(a, dev: torch.device, dtype: torch.dtype):
    """(drafter, lm_head): random weights, built on ``dev`` (CPU initialisation of a Kimi-sized
    drafter and its 163,840-row embedding would take longer than the measurement)."""
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(
        hidden_size=a.hidden, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        intermediate_size=a.intermediate, vocab_size=a.vocab, draft_vocab_size=a.draft_vocab,
        target_hidden_size=a.hidden, aux_layers=[2, 16, 29],
        max_position_embeddings=max(4096, a.seq + 16, *(n + 16 for n in sweep_lengths(a))),
    )
    torch.manual_seed(0)
    with torch.device(dev):
        drafter = Eagle3Drafter(cfg)
        drafter.bind_embedding(torch.randn(a.vocab, a.hidden, dtype=dtype) * 0.02)
        lm_head = torch.randn(a.vocab, a.hidden, dtype=dtype) * 0.02
    return drafter.to(dtype=dtype), lm_head


def make_engine(a, drafter: torch.nn.Module, dev: torch.device):
    """The engine the step runs over: `TorchEngine` + `adamw` (the weights as built), or DeepSpeed's
    engine from the training loop's `_ds_config` (bf16 on CUDA, fp32 + gloo on CPU), one rank; the
    `train` section's defaults with this ZeRO stage."""
    from eagle3_ray.config import TrainConfig
    from eagle3_ray.train.step import TorchEngine, adamw

    t = TrainConfig(zero_stage=a.zero_stage, ttt_steps=a.ttt_steps)
    params = [p for p in drafter.parameters() if p.requires_grad]
    if a.engine == "torch":
        return TorchEngine(drafter, adamw(params, lr=t.lr, weight_decay=t.weight_decay), grad_clip=t.grad_clip)
    import deepspeed

    from eagle3_ray.train.loop import _ds_config, _without_shm_comm_op

    cuda = dev.type == "cuda"
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(k, v)
    if not cuda:
        _without_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    engine, *_ = deepspeed.initialize(model=drafter, model_parameters=params, config=_ds_config(t, cuda))
    return engine


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count_ops(fn) -> dict:
    """The aten operators one call of ``fn`` dispatches: top-level (not called from another aten op: what
    the step's Python and autograd issue, one dispatch and, on a GPU, at least one kernel launch each) and
    all, with the ten most frequent top-level ones."""
    from collections import Counter

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in aten if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"top_level": len(top), "aten": len(aten), "most_frequent": Counter(e.name for e in top).most_common(10)}


def count_syncs(fn) -> tuple[int | None, list[str]]:
    """Host synchronisations while ``fn()`` runs (CUDA's sync debug mode warns at each one), and
    where each came from (the warning's file:line, the Python line that synchronised)."""
    if not torch.cuda.is_available():
        return None, []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    return len(sites), sites


def breakdown(step, batch: dict, n: int, sync) -> dict[str, float]:
    """Mean seconds of `TrainStep.__call__`'s parts over ``n`` steps, the device synchronised after each:
    `forward` (unroll and loss), `backward` and `optimizer` (the engine's); their sum exceeds the timed
    step, which overlaps host and device work."""
    total = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        out = step.forward(batch)
        sync()
        t1 = time.perf_counter()
        step.engine.backward(out.loss)
        sync()
        t2 = time.perf_counter()
        step.engine.step()
        sync()
        t3 = time.perf_counter()
        for k, dt in (("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2)):
            total[k] += dt / n
    return total


def main(argv=None) -> int:
    a = parse_args(argv)
    from eagle3_ray.drafter.soft_ce import resolve_loss_kernel
    from eagle3_ray.train.step import StepConfig, TrainStep, resolve_attention

    dev = torch.device(a.device)
    # DeepSpeed keeps fp32 master weights and casts the module to bf16 itself (train/loop.py builds
    # the drafter in fp32); the torch engine trains the weights in --dtype.
    weights = torch.float32 if a.engine == "deepspeed" else getattr(torch, a.dtype)
    hidden_dtype = torch.bfloat16 if (a.engine == "deepspeed" and dev.type == "cuda") else getattr(torch, a.dtype)
    drafter, lm_head = build_drafter(a, dev, weights)
    lm_head = lm_head.to(hidden_dtype)
    engine = make_engine(a, drafter, dev)

    def one_sample(seq: int) -> dict:
        return {"input_ids": torch.randint(0, a.vocab, (1, seq), device=dev),
                "aux_hidden": torch.randn(1, seq, 3 * a.hidden, device=dev, dtype=hidden_dtype),
                "last_hidden": torch.randn(1, seq, a.hidden, device=dev, dtype=hidden_dtype),
                "loss_mask": torch.ones(1, seq, dtype=torch.bool, device=dev),
                "position_ids": torch.arange(seq, device=dev)[None],
                "seq_ids": torch.zeros(1, seq, dtype=torch.long, device=dev)}

    lengths = sweep_lengths(a)
    packed = None if lengths else one_sample(a.seq)

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    flops = step_flops(a, a.seq)
    attentions = list(dict.fromkeys(resolve_attention(m, dev.type) for m in a.attention.split(",")))
    kernels = list(dict.fromkeys(resolve_loss_kernel(m, dev.type) for m in a.loss_kernel.split(",")))
    check = None
    if a.check:
        check = _check_modes(engine.module, lm_head, a, dev, hidden_dtype, [(m, k) for m in attentions for k in kernels])
        print(f"check against sdpa: {json.dumps({k: v for k, v in check.items() if not isinstance(v, dict)})}")

    def time_mode(attention: str, kernel: str, packed: dict) -> dict:
        seq = packed["input_ids"].shape[1]
        flops = step_flops(a, seq)
        step = TrainStep(engine, lm_head, StepConfig(ttt_steps=a.ttt_steps, attention=attention, loss_kernel=kernel,
                                                     **_memory_options(a)))
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)  # each mode's own peak
        batch = dict(packed)
        if attention == "varlen":  # found on the host ahead of the step, as the loop's prefetch thread does
            from eagle3_ray.drafter.ttt_attention import Segments

            batch["segments"] = Segments.of(packed["seq_ids"].cpu(), dev)
        for _ in range(a.warmup):
            step(batch)
        sync()
        syncs, sync_sites = count_syncs(lambda: step(batch)) if a.sync_check else (None, [])
        ops = count_ops(lambda: step(batch)) if a.op_count else None
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step(batch)
        sync()
        seconds = (time.perf_counter() - t0) / a.steps
        parts = breakdown(step, batch, a.breakdown, sync) if a.breakdown else None
        cuda = dev.type == "cuda"
        r = {"step_seconds": seconds, "tokens_per_s": seq / seconds, "achieved_tflops": flops / seconds / 1e12,
             "mfu": (flops / seconds / 1e12) / a.peak_tflops if a.peak_tflops else None,
             # everything the step holds: weights, optimizer state (and master weights), activations
             "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None,
             "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30 if cuda else None,
             "host_syncs_per_step": syncs, "host_sync_sites": sync_sites, "breakdown_seconds": parts,
             "ops_per_step": ops}
        mfu = f", MFU {r['mfu']:.1%} of {a.peak_tflops} TFLOP/s" if r["mfu"] is not None else ""
        parts_s = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in (parts or {}).items())
        print(f"[{a.engine} {attention} {kernel} T={seq}] {r['tokens_per_s']:,.0f} tokens/s, {r['achieved_tflops']:.1f} TFLOP/s{mfu}, "
              f"peak {r['peak_memory_gib'] or 0:.1f} GiB, host syncs per step {syncs}"
              + (f" (at {', '.join(sync_sites)})" if sync_sites else "")
              + (f"; synchronised parts: {parts_s}" if parts else "")
              + (f"; {ops['top_level']:,} operators dispatched a step ({ops['aten']:,} aten calls in all)" if ops else ""),
              flush=True)
        return r

    if lengths:
        curves = {}
        for m in attentions:
            for k in kernels:
                curve = curves[m if len(kernels) == 1 else f"{m}/{k}"] = []
                for n in lengths:
                    curve.append(_sweep_point(functools.partial(time_mode, m, k), one_sample, n, engine, dev))
                    _write(a.json, _sweep_result(a, dev, curves, check))  # partial results survive a timeout
                    if curve[-1].get("oom"):
                        break
        print(json.dumps(_sweep_result(a, dev, curves, check), indent=2))
        return 0

    modes: dict[str, dict] = {}  # by attention, or attention/kernel when more than one loss kernel is timed
    for m in attentions:
        for k in kernels:
            modes[m if len(kernels) == 1 else f"{m}/{k}"] = time_mode(m, k, packed) | {"loss_kernel": k}
        _write(a.json, _result(a, dev, flops, modes, check))  # partial results survive a timeout
    print(json.dumps(_result(a, dev, flops, modes, check), indent=2))
    return 0


def _sweep_point(run, make_batch, seq: int, engine, dev) -> dict:
    """One length of a sweep: `run(make_batch(seq))`'s figures, or the out-of-memory error (the
    gradients and cached blocks it left freed, so that the next mode starts clean)."""
    import gc

    try:
        return {"length": seq, "oom": False, **run(make_batch(seq))}
    except Exception as e:  # only an out-of-memory error is recorded
        if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()):
            raise
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    engine.module.zero_grad(set_to_none=True)
    gc.collect()
    peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    print(f"T={seq}: out of memory ({error}); longer samples are not tried", flush=True)
    return {"length": seq, "oom": True, "error": error, "peak_memory_gib": peak}


def _header(a, dev, *shape_keys: str) -> dict:
    keys = ("hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "draft_vocab", *shape_keys, "ttt_steps")
    return {"shape": {k: getattr(a, k) for k in keys},
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "dtype": a.dtype, "engine": a.engine, "command": " ".join([sys.executable, *sys.argv])}


def _sweep_result(a, dev, curves: dict[str, list[dict]], check: dict | None) -> dict:
    longest = {m: max((p["length"] for p in c if not p["oom"]), default=None) for m, c in curves.items()}
    return {
        **_header(a, dev),
        "peak_tflops": a.peak_tflops,
        "memory_options": _memory_options(a),
        "flops_counted": "model FLOPs (benchmarks/train_step.py's docstring): recomputation not counted",
        "sweep": curves,  # per mode: one point per length, in order, up to the first out-of-memory one
        "longest_trained": longest,
        "check": check,
    }


def _write(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))


def _result(a, dev, flops: float, modes: dict, check: dict | None) -> dict:
    best = max(modes.values(), key=lambda r: r["tokens_per_s"])
    return {
        **_header(a, dev, "seq"),
        "zero_stage": a.zero_stage if a.engine == "deepspeed" else None,
        "model_tflops_per_step": flops / 1e12,
        "modes": modes,
        "check": check,
        **best,
        "best_mode": max(modes, key=lambda m: modes[m]["tokens_per_s"]),
    }


if __name__ == "__main__":
    sys.exit(main())
