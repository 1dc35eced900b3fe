"""Extraction throughput: the Ray Data pipeline against the engine called in-process, same samples.

    python benchmarks/extract_cpu.py -c configs/demo-smollm2.yaml --samples 120 [--json out.json]

Both paths do the same work per sample: capture (HF engine, one forward per token budget), bf16
conversion, validation and an atomic shard write. The in-process figure excludes model loading; the
pipeline is reported end to end (actor start + model load included) and in steady state (tokens
committed after the first shard over the time since it). Goal: steady-state ratio >= 0.85.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def _prepared(cfg, tmp: Path, samples: int, answer_words: int) -> Path:
    """Conversations from the shipped demo prompts with a synthetic answer: throughput depends on
    the token count, not on what the answer says."""
    from eagle3_ray.data.sources import Sample, read_samples, resolve_data_path
    from eagle3_ray.extract.prepare_stage import run_prepare

    words = ("the drafter reads three target layers and predicts the next tokens " * answer_words).split()
    src = tmp / "conversations.jsonl"
    with open(src, "w", encoding="utf-8") as f:
        for item in read_samples(resolve_data_path("builtin:demo_prompts"), max_samples=samples):
            if isinstance(item, Sample):
                answer = " ".join(words[: answer_words + len(item.sample_id) % 7 * 10])
                conv = item.messages + [{"role": "assistant", "content": answer}]
                f.write(json.dumps({"id": item.sample_id, "conversations": conv}) + "\n")
    return Path(run_prepare(cfg, str(src), tmp / "prepare").prepared)


def in_process(cfg, prepared: Path, out: Path) -> dict:
    import pyarrow.parquet as pq

    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.engines.hf import HFEngine
    from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta

    table = pq.read_table(prepared)
    ids = table.column("input_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    sids = table.column("sample_id").to_pylist()
    info = describe_target(cfg.target)
    engine = HFEngine(cfg.target, batch_tokens=cfg.extract.batch_tokens)
    writer = FeatureStoreWriter(out, StoreMeta.from_engine_info(info), "bench", cfg.extract.shard_max_bytes)
    rows = max(1, int(cfg.extract.batch_tokens // (sum(map(len, ids)) / len(ids))))
    t0 = time.perf_counter()
    for start in range(0, len(ids), rows):
        caps = engine.capture(ids[start : start + rows])
        for j, cap in enumerate(caps):
            i = start + j
            writer.add({
                "sample_id": sids[i],
                "input_ids": torch.tensor(ids[i], dtype=torch.int32),
                "loss_mask": torch.tensor(masks[i], dtype=torch.uint8),
                "aux_hidden": cap.aux_hidden.to(torch.bfloat16),
                "last_hidden": cap.last_hidden.to(torch.bfloat16),
            })
    writer.close()
    seconds = time.perf_counter() - t0
    tokens = sum(map(len, ids))
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def pipeline(cfg, prepared: Path, out: Path) -> dict:
    from eagle3_ray.extract.pipeline import run_extract
    t0 = time.perf_counter()
    summary = run_extract(cfg, prepared, out)
    seconds = time.perf_counter() - t0
    # Steady state: tokens committed after the first shard, over the time between first and last commit.
    marks = sorted((Path(out) / "shards").glob("*.done.json"), key=lambda p: p.stat().st_mtime)
    steady = None
    if len(marks) > 1:
        later = sum(int(json.loads(p.read_text())["tokens"]) for p in marks[1:])
        span = marks[-1].stat().st_mtime - marks[0].stat().st_mtime
        steady = later / span if span > 0 else None
    return {"tokens": summary.tokens, "seconds": seconds, "tokens_per_s": summary.tokens / seconds,
            "steady_tokens_per_s": steady, "shards": len(marks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--config", default="configs/demo-smollm2.yaml")
    ap.add_argument("--samples", type=int, default=120)
    ap.add_argument("--answer-words", type=int, default=200, help="synthetic answer length")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)

    from eagle3_ray.config import load_config
    from eagle3_ray.ray_session import init_ray

    cfg = load_config(args.config, args.overrides)
    init_ray(cfg.ray)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        prepared = _prepared(cfg, tmp, args.samples, args.answer_words)
        ref = in_process(cfg, prepared, tmp / "inproc")
        pipe = pipeline(cfg, prepared, tmp / "pipeline")
    result = {
        "config": args.config, "overrides": args.overrides, "samples": args.samples,
        "in_process": ref, "pipeline": pipe,
        "ratio_end_to_end": pipe["tokens_per_s"] / ref["tokens_per_s"],
        "ratio_steady": (pipe["steady_tokens_per_s"] or 0) / ref["tokens_per_s"],
        "machine": f"{platform.node()} {platform.machine()} {torch.get_num_threads()} torch threads",
        "command": " ".join([sys.executable, *sys.argv]),
    }
    print(json.dumps(result, indent=2))
    print(f"in-process {ref['tokens_per_s']:,.0f} tok/s | pipeline end-to-end {pipe['tokens_per_s']:,.0f} tok/s "
          f"(x{result['ratio_end_to_end']:.2f}), steady {pipe['steady_tokens_per_s'] or 0:,.0f} tok/s "
          f"(x{result['ratio_steady']:.2f}; goal >= 0.85)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
