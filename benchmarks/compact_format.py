"""Compact (fp8) feature format against the full bf16 format: bytes per token and drafter quality.

    python benchmarks/compact_format.py --store /tmp/demo1/features \
        --out benchmarks/results/compact_format_cpu.json

1. Splits the store's samples into train (~85%) and held-out (~15%) by a hash of the sample id.
2. Writes every sample to two temporary stores, extract.compact=none and =fp8, and measures bytes
   per token from their shard files.
3. Trains drafters in-process (no Ray) through the product's training step (`TrainStep` over a
   torch engine: AdamW, clipping, warmup-cosine) from the same seed for the same packs: one on the
   full features, one on the fp8 store's (dequantized) features; the full format is also trained
   from a second seed, so the fp8 drop can be read against seed noise.
4. Evaluates each on the held-out samples in the FULL format with the step's forward under no_grad:
   acc_i pooled over held-out tokens (token-weighted), simulated tau = 1 + sum_k prod_{j<=k} acc_j,
   and compact_tau_drop = 1 - tau_fp8 / tau_full (same seed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.machine())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def split(sample_ids: list[str], heldout_pct: int) -> tuple[list[int], list[int]]:
    """Indices (train, held-out); a sample's side depends only on its id, not on store order."""
    def bucket(sid: str) -> int:
        return int.from_bytes(hashlib.sha256(sid.encode()).digest()[:4], "little") % 100

    held = [i for i, sid in enumerate(sample_ids) if bucket(sid) < heldout_pct]
    held_set = set(held)
    return [i for i in range(len(sample_ids)) if i not in held_set], held


def write_store(src, root: Path, compact: str) -> dict:
    """Copy every sample of ``src`` into a new store of format ``compact``; bytes from the shards."""
    from dataclasses import replace

    from eagle3_ray.features import FeatureStoreWriter

    t = time.perf_counter()
    with FeatureStoreWriter(root, replace(src.meta, compact=compact), "bench") as w:
        for rec in src:
            w.add(rec)
    nbytes = sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors"))
    tokens = w.tokens_written
    log(f"wrote compact={compact}: {len(w.shards_written)} shards, {nbytes:,} B, {nbytes / tokens:,.1f} B/token "
        f"({time.perf_counter() - t:.1f}s)")
    return {"bytes": nbytes, "tokens": tokens, "bytes_per_token": nbytes / tokens, "shards": len(w.shards_written)}


def hidden_error(full, fp8, indices: list[int]) -> dict:
    """Round-trip error of the fp8 store's hidden states against the full store's, per field."""
    out = {}
    for name in ("aux_hidden", "last_hidden"):
        err = ref = 0.0
        worst = 0.0
        for i in indices:
            a, b = full[i][name].float(), fp8[i][name].float()
            err += float(((a - b) ** 2).sum())
            ref += float((a**2).sum())
            worst = max(worst, float(((a - b).abs().amax(dim=-1) / a.abs().amax(dim=-1).clamp(min=1e-30)).max()))
        out[name] = {"rel_rms_error": (err / ref) ** 0.5, "max_error_over_row_absmax": worst}
    return out


def build_drafter(target: str, vocab: Path, store_meta, seed: int, work: Path):
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.data.vocab import load_vocab_map
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.engines.describe import describe
    from eagle3_ray.engines.heads import load_target_heads, save_target_heads

    target_cfg = TargetConfig(model=target)
    described = describe(target_cfg)  # any target.model, built-in ones too
    embed, lm_head = load_target_heads(save_target_heads(target_cfg, described.resolved, work))
    d2t, t2d, _ = load_vocab_map(vocab)
    cfg = DrafterConfig.from_target(described.hf_config, len(d2t), store_meta.aux_layers)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg)
    drafter.bind_embedding(embed.float())
    drafter.set_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d))
    return drafter, lm_head.float()


def make_step(drafter, lm_head, a, total_steps: int):
    """The product's training step (eagle3_ray/train/step.py) over a plain torch engine: the drafter's
    AdamW (weight decay 0), gradient clipping 0.5 and the warmup-cosine schedule (floor 5%) over
    ``total_steps`` optimizer steps, one pack per step."""
    from eagle3_ray.train.schedule import warmup_cosine
    from eagle3_ray.train.step import StepConfig, TorchEngine, TrainStep, adamw

    opt = adamw([p for p in drafter.parameters() if p.requires_grad], lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, a.warmup, total_steps, 0.05))
    return TrainStep(TorchEngine(drafter, opt, sched, grad_accum=1, grad_clip=0.5), lm_head,
                     StepConfig(ttt_steps=a.ttt_steps, loss_decay=0.8))


def train(drafter, lm_head, store, indices: list[int], a, seed: int, tag: str):
    """Train through `TrainStep`; returns (the step, for the held-out evaluation; the training figures)."""
    from eagle3_ray.train.packing import collate, plan

    records = [store[i] for i in indices]  # bf16, dequantized for an fp8 store
    lengths = np.array([r["input_ids"].numel() for r in records])
    packs = plan(lengths, a.batch_tokens, a.epochs, seed=seed)[: a.steps]
    step_fn = make_step(drafter, lm_head, a, len(packs))
    drafter.train()
    t0 = time.perf_counter()
    for step, pack in enumerate(packs):
        out = step_fn(collate([records[i] for i in pack.samples]))
        if step % a.log_every == 0 or step == len(packs) - 1:
            m = out.metrics
            log(f"{tag} step {step + 1}/{len(packs)} loss {m['loss']:.3f} acc0 {m['acc_0']:.3f} "
                f"tau {m['tau']:.3f} ({time.perf_counter() - t0:.0f}s)")
    return step_fn, {"steps": len(packs), "tokens": int(sum(p.tokens for p in packs)),
                     "seconds": time.perf_counter() - t0, "final_train_loss": out.metrics["loss"]}


def evaluate(step_fn, store, indices: list[int], a) -> dict:
    """acc_i pooled over every held-out position (token-weighted), tau from the pooled acc_i; the
    forward is the training step's (`TrainStep.forward`), without gradients, in eval mode."""
    from eagle3_ray.train.packing import collate, plan

    drafter = step_fn.drafter
    was_training = drafter.training
    drafter.eval()
    records = [store[i] for i in indices]
    lengths = np.array([r["input_ids"].numel() for r in records])
    hits = np.zeros(a.ttt_steps)
    count = np.zeros(a.ttt_steps)
    loss = 0.0
    try:
        with torch.no_grad():
            for pack in plan(lengths, a.batch_tokens, 1, seed=0):
                m = step_fn.forward(collate([records[i] for i in pack.samples])).metrics
                for i in range(a.ttt_steps):
                    hits[i] += m[f"acc_{i}"] * m[f"tokens_{i}"]
                    count[i] += m[f"tokens_{i}"]
                loss += m["loss"] * m["tokens_0"]
    finally:
        drafter.train(was_training)
    acc = hits / np.maximum(count, 1)
    tau = 1.0 + float(np.cumprod(acc).sum())
    return {"tau": tau, **{f"acc_{i}": float(acc[i]) for i in range(a.ttt_steps)},
            "tokens": int(count[0]), "loss": loss / max(count[0], 1)}


def run_arm(tag: str, train_store, eval_store, train_idx, held_idx, seed: int, a, work: Path) -> dict:
    drafter, lm_head = build_drafter(a.target, a.vocab, eval_store.meta, seed, work)
    step_fn, info = train(drafter, lm_head, train_store, train_idx, a, seed, tag)
    ev = evaluate(step_fn, eval_store, held_idx, a)
    log(f"{tag}: held-out tau {ev['tau']:.4f} " + " ".join(f"acc_{i} {ev[f'acc_{i}']:.4f}" for i in range(a.ttt_steps)))
    return {"format": tag.split("-")[0], "seed": seed, "train": info, "heldout": ev}


def markdown(r: dict) -> str:
    rows = "\n".join(
        f"| {x['format']} | {x['seed']} | {x['heldout']['tau']:.4f} | "
        + " | ".join(f"{x['heldout'][f'acc_{i}']:.4f}" for i in range(r["args"]["ttt_steps"]))
        + f" | {x['heldout']['loss']:.3f} |" for x in r["arms"]
    )
    acc_cols = " | ".join(f"acc_{i}" for i in range(r["args"]["ttt_steps"]))
    b = r["bytes"]
    noise = r.get("seed_noise_tau")
    drops = ", ".join(f"seed {s}: {d:.4f}" for s, d in r["compact_tau_drop_by_seed"].items())
    noise_line = (f"- Seed noise of the full format (seeds {r['args']['seeds'][:2]}): |1 - tau_seed_b / tau_seed_a| = "
                  f"{noise:.4f}. One full-vs-full difference is a rough noise estimate, not a confidence "
                  "interval.\n" if noise is not None else "")
    return f"""# Compact (fp8) feature format, measured on CPU

Command: `{r['command']}`
Machine: {r['machine']}; torch {r['torch']}. Wall time {r['seconds']:.0f}s; 1-min load average
{r['load_average'][0]:.1f} at start, {r['load_average'][1]:.1f} at the end (the cores are shared with other work, so
wall times here are not throughput figures).

Store: `{r['args']['store']}` ({r['samples']} samples, {r['tokens']:,} tokens, H = {r['hidden_size']}).
Split by sha256(sample_id): {r['train_samples']} train / {r['heldout_samples']} held-out samples
({r['heldout_tokens']:,} held-out tokens).

## Bytes per token (measured from the shard files)

| format | bytes | bytes/token |
|---|---|---|
| none (bf16) | {b['none']['bytes']:,} | {b['none']['bytes_per_token']:.1f} |
| fp8 | {b['fp8']['bytes']:,} | {b['fp8']['bytes_per_token']:.1f} |

Ratio fp8 / none: **{r['bytes_ratio']:.4f}** (target: <= 0.55) (formula, hidden states only: (4H+16)/8H = {r['bytes_ratio_formula']:.4f};
the shard files also hold input ids, masks, offsets and the header).

fp8 round trip on the training samples: relative RMS error aux_hidden
{r['roundtrip']['aux_hidden']['rel_rms_error']:.4f}, last_hidden {r['roundtrip']['last_hidden']['rel_rms_error']:.4f};
worst |error| / absmax of its whole row {r['roundtrip']['aux_hidden']['max_error_over_row_absmax']:.4f} /
{r['roundtrip']['last_hidden']['max_error_over_row_absmax']:.4f}.

## Drafter quality (simulated acceptance on held-out full-format features)

{r['args']['steps']} optimizer steps of <= {r['args']['batch_tokens']} tokens, ttt_steps {r['args']['ttt_steps']},
lr {r['args']['lr']} (warmup {r['args']['warmup']}, cosine), same packs and init per seed; the target distribution of
each arm is recomputed from its own (full or fp8) last_hidden. tau = 1 + sum_k prod_(j<=k) acc_j from acc_i pooled
over held-out tokens.

| train features | seed | tau | {acc_cols} | loss |
|---|---|---|{'---|' * r['args']['ttt_steps']}---|
{rows}

- **compact_tau_drop = 1 - tau_fp8 / tau_full, same seed: {drops}** (target: <= 0.03).
{noise_line}- Not measured here: acceptance in real speculative decoding, larger targets (e.g. H = 7168), longer
  training.{'' if r['complete'] else ' This run was cut short: only the arms listed above finished.'}
"""


def report(out: Path, context: dict, arms: list[dict], t0: float, load_start: float) -> dict:
    """Write the JSON and markdown results for the arms run so far."""
    tau = {(x["format"], x["seed"]): x["heldout"]["tau"] for x in arms}
    seeds = list(dict.fromkeys(x["seed"] for x in arms))
    drops = {s: 1 - tau[("fp8", s)] / tau[("none", s)] for s in seeds if ("fp8", s) in tau and ("none", s) in tau}
    full_taus = [tau[("none", s)] for s in seeds if ("none", s) in tau]
    h = context["hidden_size"]
    b = context["bytes"]
    result = {
        **context,
        "load_average": [load_start, os.getloadavg()[0]],
        "bytes_ratio": b["fp8"]["bytes_per_token"] / b["none"]["bytes_per_token"],
        "bytes_ratio_formula": (4 * h + 16) / (8 * h),
        "arms": arms,
        "compact_tau_drop": next(iter(drops.values()), None),
        "compact_tau_drop_by_seed": {str(s): d for s, d in drops.items()},
        "seed_noise_tau": abs(1 - full_taus[1] / full_taus[0]) if len(full_taus) > 1 else None,
        "complete": len(arms) == 2 * len(context["args"]["seeds"]),
        "seconds": time.perf_counter() - t0,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    if result["compact_tau_drop"] is not None:
        out.with_suffix(".md").write_text(markdown(result))
        log(f"bytes ratio {result['bytes_ratio']:.4f}, compact_tau_drop by seed {result['compact_tau_drop_by_seed']}, "
            f"full-format seed noise {result['seed_noise_tau']}; wrote {out} and {out.with_suffix('.md')}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", type=Path, default=Path("/tmp/demo1/features"))
    ap.add_argument("--vocab", type=Path, default=Path("/tmp/demo1/vocab/vocab_map.safetensors"))
    ap.add_argument("--target", default="smollm2", help="target.model of the store (for lm_head/embedding)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compact_format_cpu.json"))
    ap.add_argument("--work", type=Path, default=None, help="temp dir for the two stores (default: mkdtemp)")
    ap.add_argument("--heldout-pct", type=int, default=15)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--epochs", type=int, default=4, help="packing plan length; --steps cuts it")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                    help="both formats are trained from each seed; two full-format seeds give the seed noise")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    from eagle3_ray.features import open_store

    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    src = open_store(a.store)
    train_idx, held_idx = split(src.sample_ids, a.heldout_pct)
    log(f"{a.store}: {len(src)} samples, {src.num_tokens:,} tokens; {len(train_idx)} train / {len(held_idx)} held-out")
    work = a.work or Path(tempfile.mkdtemp(prefix="compact-bench-"))
    try:
        nbytes = {c: write_store(src, work / f"store-{c}", c) for c in ("none", "fp8")}
        full, fp8 = open_store(work / "store-none", verify=True), open_store(work / "store-fp8", verify=True)
        assert full.sample_ids == fp8.sample_ids == src.sample_ids
        context = {
            "command": " ".join([sys.executable, *sys.argv]) if argv is None else "compact_format.main(...)",
            "machine": f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()}, CPU only, "
                       f"{torch.get_num_threads()} torch threads",
            "torch": torch.__version__,
            "samples": len(src), "tokens": src.num_tokens, "hidden_size": src.meta.hidden_size,
            "train_samples": len(train_idx), "heldout_samples": len(held_idx),
            "heldout_tokens": int(src.lengths[held_idx].sum()),
            "bytes": nbytes, "roundtrip": hidden_error(full, fp8, train_idx),
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        }
        # full and fp8 per seed, first seed first: a run cut short still holds a comparable pair
        arms = []
        for seed in a.seeds:
            for fmt, store in (("fp8", fp8), ("none", full)):
                arms.append(run_arm(f"{fmt}-s{seed}", store, full, train_idx, held_idx, seed, a, work))
                report(a.out, context, arms, t0, load_start)
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)

    return 0


if __name__ == "__main__":
    sys.exit(main())
