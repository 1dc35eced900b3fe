"""Self-distillation throughput: the product's generate-stage code path vs the static generator
called as benchmarks/quality_smollm2.py calls it, on the same prompts, one engine, in-process.

    source benchmarks/device/session.sh env      # after the session's base + gg1/gg2 steps
    python3 benchmarks/device/generate_throughput.py --out $OUT            # H200, ~100-130 s; carry [".gq"]
    python3 benchmarks/device/generate_throughput.py --cpu --out /tmp/o    # CPU smoke run of every path

The first ``--num-prompts`` prompt-only samples of ``--prompts`` (the project's train_prompts.jsonl),
256 new tokens, batch 512 (configs/smollm2-h200.yaml's generate section), greedy; each path starts
from a fresh StaticBatchGenerator (no kept storages or graphs) after one shared warm-up:

- ``product``: ``DistillActor.run`` with ``data.max_length``, exactly what each generate-stage actor
  runs (order by turns and prompt length, too-long prompts rejected, then ``self_distill``);
- ``side_script``: quality_smollm2.py's ``distill``: prompts whose prompt + 256 new tokens per turn
  exceed ``data.max_length`` dropped, shuffled (seed 0), sorted by characters within windows of
  8 batches, ``self_distill`` in chunks of 4 batches; the generator as it was when that script
  measured 119 answers/s (one group per call, one kept shape);
- ``before``: the stage before this change: input order, no rejects, that same generator.

Writes ``<out>/generate_h200.json`` after every path (a run cut short keeps what it measured):
per path seconds, samples answered, answers (turns) and new tokens, samples/s and answers/s, the
generator's storages built and graphs captured; prints one line per path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def side_script_order(samples, tok, a) -> list:
    """quality_smollm2.distill's selection and order (that script, lines 'Prompts whose answers would
    not fit' through the window sort)."""
    from eagle3_ray.data.chat import render_generation_prompt

    kept = [s for s in samples if len(render_generation_prompt(tok, s.messages)) +
            a.new_tokens * sum(m["role"] == "user" for m in s.messages) <= a.max_length]
    random.Random(0).shuffle(kept)
    window = 8 * a.batch
    return [s for w in range(0, len(kept), window)
            for s in sorted(kept[w : w + window], key=lambda s: sum(len(m["content"]) for m in s.messages))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=".gq/train_prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--max-length", type=int, default=2048, help="data.max_length")
    ap.add_argument("--paths", default="product,side_script,before")
    ap.add_argument("--cpu", action="store_true", help="smoke run: CPU fp32, 2 prompts, 4 new tokens, batch 2")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/generate_h200"))
    a = ap.parse_args()
    if a.cpu:
        a.num_prompts, a.new_tokens, a.batch = min(a.num_prompts, 2), min(a.new_tokens, 4), min(a.batch, 2)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    import eagle3_ray.engines.static_generate as sg
    from eagle3_ray.config import GenerateConfig, TargetConfig
    from eagle3_ray.data.distill import self_distill
    from eagle3_ray.data.sources import Sample, read_samples
    from eagle3_ray.extract.generate_stage import DistillActor

    device = "cpu" if a.cpu else "cuda"
    cfg = TargetConfig(model=a.gguf, device=device, dtype="float32" if a.cpu else "bfloat16")
    actor = DistillActor(cfg, 65536)
    engine, tok = actor.engine, actor.tokenizer
    engine.static_generate = True  # on CPU too (it runs the same step eagerly there)
    samples = [s for s in read_samples(Path(a.prompts), max_samples=a.num_prompts) if isinstance(s, Sample)]
    log(f"target loaded; {len(samples)} prompts ({sum(len(s.messages) > 1 for s in samples)} with several turns)")
    gen = GenerateConfig(max_new_tokens=a.new_tokens, batch_size=a.batch)
    res: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "target": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized, bf16)" if not a.cpu else "SmolLM2 GGUF, fp32, CPU",
        "command": " ".join([sys.executable, *sys.argv]), "args": vars(a), "paths": {},
    }
    engine.generate([[1, 2, 3, 4]] * 8, 4)  # CUDA context, kernels' lazy init: outside every path

    old_keep = sg.KEEP_SHAPES
    for name in a.paths.split(","):
        engine.release_generate_state()
        generator = engine._static_generator()
        old = name in ("side_script", "before")
        generator.step_overhead_slots = 2**62 if old else sg.STEP_OVERHEAD_SLOTS  # 2**62: never split
        sg.KEEP_SHAPES = 1 if old else old_keep
        part = Path(tempfile.mkdtemp()) / "part.jsonl"
        t = time.perf_counter()
        if name == "product":
            summary = actor.run(samples, str(part), gen, a.max_length)
            rejected = len(summary.pop("rejected"))
        elif name == "side_script":
            chosen = side_script_order(samples, tok, a)
            rejected = len(samples) - len(chosen)
            chunk = 4 * a.batch
            summary = {"new_tokens": 0}
            for start in range(0, len(chosen), chunk):
                s = self_distill(engine, tok, chosen[start : start + chunk], part, a.new_tokens, batch_size=a.batch)
                summary["new_tokens"] += s.new_tokens
        elif name == "before":
            summary = vars(self_distill(engine, tok, samples, part, a.new_tokens, batch_size=a.batch, seed=0))
            rejected = 0
        else:
            raise SystemExit(f"--paths: unknown path {name!r} (product, side_script, before)")
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        sg.KEEP_SHAPES = old_keep
        rows = [json.loads(x) for x in part.read_text().split("\n") if x.strip()]
        answers = sum(m["role"] == "assistant" for r in rows for m in r["conversations"])
        r = {"seconds": round(dt, 2), "samples": len(rows), "rejected": rejected, "answers": answers,
             "new_tokens": summary["new_tokens"], "samples_per_s": round(len(rows) / dt, 3),
             "answers_per_s": round(answers / dt, 3), "new_tokens_per_s": round(summary["new_tokens"] / dt, 1),
             "storages_built": generator.builds, "graphs_captured": generator.captures}
        res["paths"][name] = r
        log(f"{name}: {r}")
        (out / "generate_h200.json").write_text(json.dumps(res, indent=1))
    p = res["paths"]
    for other in ("side_script", "before"):  # samples/s ratio (the product log's figure)
        if "product" in p and other in p:
            res[f"product_vs_{other}"] = round(p[other]["seconds"] / p["product"]["seconds"]
                                               * p["product"]["samples"] / max(1, p[other]["samples"]), 2)
    (out / "generate_h200.json").write_text(json.dumps(res, indent=1))
    log(f"done: product/side_script {res.get('product_vs_side_script')}, product/before {res.get('product_vs_before')}"
        f" -> {out / 'generate_h200.json'}")
    actor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
