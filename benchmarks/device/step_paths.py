"""Where the product's training time goes: the one training step (eagle3_ray/train/step.py) on the
packs of a feature store, through three engines and two feature placements, in one process, no Ray.

    python benchmarks/device/step_paths.py -c configs/demo-smollm2.yaml --features RUN/features \
        --vocab RUN/vocab --out $OUT/step_paths.json [--steps 60] [--device cuda] [section.field=value ...]

Paths (tokens/s = the packs' sample tokens per second, as the product's metrics.jsonl counts them):
  deepspeed_on_device   the product's engine: DeepSpeed (the product's _ds_config, bf16 on CUDA), one
                        rank, the packs already on the device (the Ray Train loop minus Ray Data,
                        prefetch and the has-data vote)
  torch_on_device       the quality benchmark's engine: fp32 weights, bf16 autocast, fused AdamW
                        (TorchEngine), packs already on the device
  torch_from_host       the same, each pack copied from host memory in the step (no prefetch)
Compare them with the product run's own `tokens_per_s` and `input_wait` (metrics.jsonl): the
difference between the product loop and `deepspeed_on_device` is what Ray Data, the prefetch thread
and the loop cost; `input_wait` is the share the step waited for its pack.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from eagle3_ray.config import load_config
from eagle3_ray.train.data import LoadPackUDF, pack_rows, row_to_batch
from eagle3_ray.train.loop import _ds_config, _without_shm_comm_op, build_drafter
from eagle3_ray.train.schedule import warmup_cosine
from eagle3_ray.train.step import StepConfig, TorchEngine, TrainStep, adamw, resolve_attention
from eagle3_ray.train.trainer import plan_training


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _host_batches(features: str, packs, row_tokens: int | None, hidden_dtype) -> list[tuple[dict, int]]:
    """(batch on the host, sample tokens) per pack: read by the product's pack loader (LoadPackUDF)
    and laid out as the worker's prefetch thread does (row_to_batch)."""
    loader, out = LoadPackUDF(features), []
    for p, row in zip(packs, pack_rows(packs)):
        rows = loader({"key": np.asarray([row["key"]]), "samples": _one([row["samples"]])})
        batch = {k: rows[k][0] for k in rows if k != "key"}
        out.append((row_to_batch(batch, torch.device("cpu"), hidden_dtype, row_tokens), p.tokens))
    return out


def _one(arrays) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    for i, x in enumerate(arrays):
        out[i] = x
    return out


def _time(step: TrainStep, batches, steps: int, device: torch.device, warmup: int, to_device: bool) -> dict:
    def run(n: int, start: int) -> int:
        tokens = 0
        for k in range(n):
            batch, t = batches[(start + k) % len(batches)]
            if to_device:
                batch = {key: v.to(device, non_blocking=False) for key, v in batch.items()}
            out = step(batch)
            tokens += t
        _sync(device)
        float(out.loss.detach())  # the last step done
        return tokens

    run(warmup, 0)
    t0 = time.perf_counter()
    tokens = run(steps, warmup)
    seconds = time.perf_counter() - t0
    return {"steps": steps, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_single_rank(device: torch.device) -> None:
    """One-rank torch.distributed for DeepSpeed (nccl on CUDA, gloo on CPU)."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")}.items():
        os.environ.setdefault(k, v)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--features", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", required=True, help="results JSON (written after every path)")
    ap.add_argument("--work", default="/tmp/step_paths", help="the frozen target heads are written here")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per path")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, cuDNN plans)")
    ap.add_argument("--max-packs", type=int, default=64, help="packs held in memory (cycled)")
    ap.add_argument("--paths", default="deepspeed_on_device,torch_on_device,torch_from_host")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = load_config(a.config, a.overrides)
    t = cfg.train
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    job, packs, _, _ = plan_training(cfg, a.features, a.vocab, work)
    job.use_gpu = device.type == "cuda"
    attention = resolve_attention(t.attention, device.type)
    row_tokens = t.row_tokens if attention == "sdpa" else None
    hidden_dtype = torch.bfloat16 if job.use_gpu else torch.float32
    packs = packs[: a.max_packs]
    host = _host_batches(a.features, packs, row_tokens, hidden_dtype)
    if device.type == "cuda":
        host = [({k: v.pin_memory() for k, v in b.items()}, n) for b, n in host]
    on_device = [({k: v.to(device) for k, v in b.items()}, n) for b, n in host]
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "config": a.config, "overrides": a.overrides, "batch_tokens": t.batch_tokens,
               "row_tokens": row_tokens, "attention": attention, "ttt_steps": t.ttt_steps,
               "packs_in_memory": len(packs), "mean_pack_tokens": sum(n for _, n in host) / len(host),
               "command": " ".join([sys.executable, *sys.argv]), "paths": {}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log(f"{len(packs)} packs of <= {t.batch_tokens} tokens in memory; attention {attention}")

    def lr_lambda(step: int) -> float:
        return warmup_cosine(step, t.warmup_steps, job.total_steps, t.min_lr_ratio)

    for path in a.paths.split(","):
        torch.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        if path == "deepspeed_on_device":
            import deepspeed

            _init_single_rank(device)
            if device.type != "cuda":
                _without_shm_comm_op()
            drafter, lm_head = build_drafter(job, device)
            engine, _, _, _ = deepspeed.initialize(
                model=drafter, model_parameters=[p for p in drafter.parameters() if p.requires_grad],
                config=_ds_config(t.model_dump(), job.use_gpu),
                lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda))
            step = TrainStep(engine, lm_head, StepConfig.from_train(t, attention))
            batches, copy = on_device, False
        elif path in ("torch_on_device", "torch_from_host"):
            job.use_gpu = False  # build_drafter: fp32 weights and lm_head (autocast runs the matmuls in bf16)
            drafter, lm_head = build_drafter(job, device)
            job.use_gpu = device.type == "cuda"
            opt = adamw([p for p in drafter.parameters() if p.requires_grad], lr=t.lr, weight_decay=t.weight_decay)
            engine = TorchEngine(drafter, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda),
                                 grad_accum=t.grad_accum, grad_clip=t.grad_clip)
            step = TrainStep(engine, lm_head.to(hidden_dtype), StepConfig.from_train(t, attention, autocast=True))
            batches, copy = (on_device, False) if path == "torch_on_device" else (host, True)
        else:
            raise SystemExit(f"unknown path {path!r}")
        r = _time(step, batches, a.steps, device, a.warmup, copy)
        results["paths"][path] = r
        log(f"{path}: {r['tokens_per_s']:,.0f} tokens/s over {r['steps']} steps"
            + (f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""))
        out.write_text(json.dumps(results, indent=2))
        del step, engine, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
