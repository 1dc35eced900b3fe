"""Drafter quality on real weights, in one process on one GPU (no Ray): SmolLM2-135M-Instruct.

    python benchmarks/quality_smollm2.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts .gg/train_prompts.jsonl --eval-dir .gg/eval --out $OUT/quality.json

self-distill (target answers several thousand training prompts, greedy) -> tokenize with loss
masks -> capture aux/last hidden states -> vocab map -> TTT training (time-bounded) -> evaluate
chain(K) and tree speculative decoding against plain generation on held-out sets (MT-bench etc.),
batch 1, temperature 0, same prompts in the same run. Uses the package's own modules throughout.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def distill(engine, tok, prompts_path: Path, work: Path, a) -> list:
    from eagle3_ray.data.distill import self_distill
    from eagle3_ray.data.sources import Sample, read_samples

    samples = [s for s in read_samples(prompts_path, max_samples=a.num_prompts) if isinstance(s, Sample)]
    out = work / "distilled.jsonl"
    t = time.perf_counter()
    self_distill(engine, tok, samples, out, max_new_tokens=a.max_new_tokens, batch_size=a.gen_batch)
    log(f"self-distilled {len(samples)} prompts in {time.perf_counter() - t:.0f}s")
    return [s for s in read_samples(out) if isinstance(s, Sample)]


def featurize(engine, tok, convs, a):
    from eagle3_ray.data.chat import tokenize_conversation
    from eagle3_ray.errors import SampleRejected

    toks = []
    for s in convs:
        try:
            toks.append(tokenize_conversation(tok, s, a.max_length, truncate=True))
        except SampleRejected:
            pass
    t = time.perf_counter()
    records = []
    for start in range(0, len(toks), 256):
        chunk = toks[start : start + 256]
        caps = engine.capture([c.input_ids for c in chunk])
        for c, cap in zip(chunk, caps):
            records.append({
                "input_ids": torch.tensor(c.input_ids), "loss_mask": torch.tensor(c.loss_mask, dtype=torch.uint8),
                "aux_hidden": cap.aux_hidden.to(torch.bfloat16).clone(),
                "last_hidden": cap.last_hidden.to(torch.bfloat16).clone(),
            })
    n = sum(r["input_ids"].numel() for r in records)
    log(f"captured {len(records)} samples, {n:,} tokens in {time.perf_counter() - t:.0f}s")
    return records


def train(engine, records, a, device):
    from eagle3_ray.data.vocab import build_vocab_map, count_tokens, vocab_coverage
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.drafter.ttt import ttt_forward
    from eagle3_ray.train.packing import collate, plan
    from eagle3_ray.train.schedule import warmup_cosine

    model = engine.target.model
    V = model.get_input_embeddings().num_embeddings
    counts = sum(count_tokens(r["input_ids"], r["loss_mask"], V) for r in records)
    d2t, t2d = build_vocab_map(counts, a.draft_vocab)
    cfg = DrafterConfig.from_target(model.config, a.draft_vocab, engine.info.aux_layers)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.bind_embedding(model.get_input_embeddings().weight.float())
    drafter.set_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d))
    drafter.to(device)
    lm_head = model.get_output_embeddings().weight.detach().float()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0, fused=device.type == "cuda")
    lengths = np.array([r["input_ids"].numel() for r in records])
    packs = plan(lengths, a.batch_tokens, a.epochs, seed=0)
    total = len(packs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, a.warmup, total, 0.05))
    log(f"training: {len(records)} samples, {total} packs of <= {a.batch_tokens} tokens over {a.epochs} epochs; "
        f"draft vocab {a.draft_vocab} covers {vocab_coverage(counts, t2d):.1%} of loss tokens")
    t0 = time.perf_counter()
    hist, tokens = [], 0
    for step, pack in enumerate(packs):
        if time.perf_counter() - t0 > a.train_seconds:
            log(f"training time budget reached at step {step}/{total}")
            break
        batch = {k: v.to(device) for k, v in collate([records[i] for i in pack.samples]).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = ttt_forward(drafter, batch, lm_head, a.ttt_steps, 0.8)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        tokens += pack.tokens
        if step % 50 == 0 or step == total - 1:
            m = out.metrics
            hist.append({"step": step, "loss": m["loss"], "tau": m["tau"], "acc_0": m["acc_0"],
                         "epoch": pack.epoch, "lr": sched.get_last_lr()[0]})
            log(f"step {step}/{total} ep {pack.epoch} loss {m['loss']:.3f} acc0 {m['acc_0']:.3f} "
                f"tau {m['tau']:.2f} {tokens / (time.perf_counter() - t0):,.0f} tok/s")
    return drafter.eval(), hist, {"steps": step + 1, "seconds": time.perf_counter() - t0,
                                   "tokens_per_s": tokens / (time.perf_counter() - t0),
                                   "coverage": vocab_coverage(counts, t2d)}


def eval_sets(eval_dir: Path, per_set: int) -> dict[str, list[list[str]]]:
    """name -> list of turn lists; single-turn sets give one-turn lists."""
    sets = {}
    for name, key in (("mt_bench", "turns"), ("spec_bench", "turns"), ("gsm8k_test", "question"),
                      ("humaneval", "prompt")):
        path = eval_dir / f"{name}.jsonl"
        if not path.is_file():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        random.Random(0).shuffle(rows)
        sets[name] = [r[key] if isinstance(r[key], list) else [r[key]] for r in rows[:per_set]]
    return sets


def evaluate(model, tok, drafter, sets, a) -> dict:
    import eagle3_ray.spec as spec
    from eagle3_ray.data.chat import render_generation_prompt

    modes = {"chain": dict(mode="chain", num_steps=a.chain_k),
             "tree": dict(mode="tree", topk=a.topk, depth=a.depth, total_tokens=a.total_tokens)}
    warm = torch.tensor(render_generation_prompt(tok, [{"role": "user", "content": "Hello"}]))
    spec.target_generate(model, warm, 16)
    for p in modes.values():
        spec.generate(model, drafter, warm, 16, **p)
    results = {}
    t_start = time.perf_counter()
    for name, convs in sets.items():
        agg = {m: {"tokens": 0, "verified": 0, "steps": 0, "seconds": 0.0} for m in ["baseline", *modes]}
        for turns in convs:
            if time.perf_counter() - t_start > a.eval_seconds:
                break
            messages = []
            for turn in turns[: a.max_turns]:
                messages.append({"role": "user", "content": turn})
                ids = torch.tensor(render_generation_prompt(tok, messages)[-a.max_length:])
                base, st = spec.target_generate(model, ids, a.eval_new_tokens)
                agg["baseline"]["tokens"] += len(base)
                agg["baseline"]["seconds"] += st.seconds
                for m, p in modes.items():
                    out, st = spec.generate(model, drafter, ids, a.eval_new_tokens, **p)
                    if out != base:
                        log(f"WARNING {name} {m}: output differs from greedy baseline")
                    agg[m]["tokens"] += st.new_tokens
                    agg[m]["verified"] += st.new_tokens - 1  # the prefill's token is no verify step
                    agg[m]["steps"] += st.verify_steps
                    agg[m]["seconds"] += st.seconds
                messages.append({"role": "assistant", "content": tok.decode(base, skip_special_tokens=True)})
        if agg["baseline"]["tokens"] == 0:  # the evaluation time budget ran out before this set
            continue
        base_tps = agg["baseline"]["tokens"] / max(agg["baseline"]["seconds"], 1e-9)
        results[name] = {m: {"tau": v["verified"] / max(v["steps"], 1) if m != "baseline" else None,
                             "tokens_per_s": v["tokens"] / max(v["seconds"], 1e-9),
                             "speedup": (v["tokens"] / max(v["seconds"], 1e-9)) / base_tps,
                             "tokens": v["tokens"]} for m, v in agg.items()}
        log(f"{name}: " + ", ".join(f"{m} tau {r['tau'] or 1:.2f} x{r['speedup']:.2f}" for m, r in results[name].items()))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--eval-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/quality")
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke test of this script")
    ap.add_argument("--num-prompts", type=int, default=4000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--train-seconds", type=float, default=150)
    ap.add_argument("--chain-k", type=int, default=3)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--total-tokens", type=int, default=48)
    ap.add_argument("--per-set", type=int, default=10)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--eval-new-tokens", type=int, default=192)
    ap.add_argument("--eval-seconds", type=float, default=200)
    a = ap.parse_args(argv)

    from eagle3_ray.config import TargetConfig
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.engines.hf import HFEngine

    t0 = time.perf_counter()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = TargetConfig(model=a.gguf, device=a.device, dtype="bfloat16" if a.device == "cuda" else "float32",
                       cache_dir=str(work / "cache"))
    engine = HFEngine(cfg, batch_tokens=65536)
    tok, model, device = engine.tokenizer, engine.target.model, engine.target.device
    log(f"target loaded ({time.perf_counter() - t0:.0f}s), aux layers {engine.info.aux_layers}")
    convs = distill(engine, tok, Path(a.prompts), work, a)
    records = featurize(engine, tok, convs, a)
    drafter, hist, train_info = train(engine, records, a, device)
    del records
    save_drafter_weights(drafter, work / "ckpt")
    export_drafter(work / "ckpt", work / "drafter", engine="sglang")
    drafter = drafter.to(torch.bfloat16)
    drafter.bind_embedding(model.get_input_embeddings())
    sets = eval_sets(Path(a.eval_dir), a.per_set)
    results = evaluate(model, tok, drafter, sets, a)

    def overall(mode, key):
        vals = [(r[mode][key], r[mode]["tokens"]) for r in results.values() if r[mode][key] is not None]
        return sum(v * w for v, w in vals) / max(sum(w for _, w in vals), 1)

    summary = {
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, bf16)",
        "train_prompts": a.num_prompts, "train": train_info, "history": hist,
        "eval": results,
        "tau_chain": overall("chain", "tau"), "tau_tree": overall("tree", "tau"),
        "tau_chain_mtbench": results.get("mt_bench", {}).get("chain", {}).get("tau"),
        "tau_tree_mtbench": results.get("mt_bench", {}).get("tree", {}).get("tau"),
        "speedup_chain": overall("chain", "speedup"), "speedup_tree": overall("tree", "speedup"),
        "args": vars(a), "seconds": time.perf_counter() - t0,
        "command": " ".join([sys.executable, *sys.argv]),
    }
    Path(a.out).write_text(json.dumps(summary, indent=2))
    log(json.dumps({k: v for k, v in summary.items() if k.startswith(("tau", "speedup"))}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
