"""Extraction throughput vs engine-actor pool size on one machine (the elastic pool's scaling).

    python benchmarks/elastic_extract.py --pools 1 2 --samples 48 \
        --out benchmarks/results/elastic_extract_cpu

Prepares `--samples` conversations (the shipped ci_tiny set, repeated under new ids) once, then runs
`run_extract` into a fresh store per pool size with `extract.num_actors = extract.max_actors = N`
and reports samples/s and tokens/s of the whole stage (actor start-up included, as a user sees it).
On a CPU machine each actor owns one core (torch threads = extract.num_cpus_per_actor), so the pool
can only grow up to the core count; on a cluster every joining node adds actors up to max_actors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_samples(n: int, path: Path) -> Path:
    src = (ROOT / "eagle3_ray/resources/ci_tiny.jsonl").read_text().splitlines()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            rec = json.loads(src[i % len(src)])
            rec["id"] = f"bench-{i:05d}"
            f.write(json.dumps(rec) + "\n")
    return path


def measure(cfg, prepared: Path, pool: int, work: Path) -> dict:
    from eagle3_ray.extract.pipeline import run_extract

    run_cfg = cfg.model_copy(deep=True)
    run_cfg.extract.num_actors = pool
    run_cfg.extract.max_actors = pool
    t0 = time.monotonic()
    summary = run_extract(run_cfg, prepared, work / f"features-pool{pool}")
    seconds = time.monotonic() - t0
    return {"pool": pool, "samples": summary.samples, "tokens": summary.tokens, "seconds": round(seconds, 2),
            "samples_per_s": round(summary.samples / seconds, 3), "tokens_per_s": round(summary.tokens / seconds, 1)}


def machine() -> dict:
    import ray
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "ray": ray.__version__,
            "torch": torch.__version__}


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    rows = "\n".join(f"| {r['pool']} | {r['samples']} | {r['tokens']} | {r['seconds']} | {r['samples_per_s']} | "
                     f"{r['tokens_per_s']} |" for r in result["runs"])
    m = result["machine"]
    out.with_suffix(".md").write_text(
        f"# Elastic extraction: throughput vs engine-actor pool size\n\n"
        f"Command: `{result['command']}`\n\n"
        f"Machine: {m['cpus']} CPU(s), {m['cpu']}; Python {m['python']}, Ray {m['ray']}, torch {m['torch']}.\n"
        f"Target: `{result['target']}`, {result['samples']} samples, extract.batch_tokens {result['batch_tokens']}.\n\n"
        f"| actors | samples | tokens | seconds | samples/s | tokens/s |\n|---|---|---|---|---|---|\n{rows}\n\n"
        f"Throughput ratio (largest pool / pool 1): **{result['ratio']:.2f}x**.\n\n"
        f"{result['note']}\n",
        encoding="utf-8",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pools", type=int, nargs="+", default=[1, 2])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--config", default="configs/ci-tiny.yaml")
    p.add_argument("--out", default="benchmarks/results/elastic_extract_cpu")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. target.model=smollm2")
    args = p.parse_args(argv)

    from eagle3_ray.config import load_config
    from eagle3_ray.extract.prepare_stage import run_prepare
    from eagle3_ray.ray_session import init_ray

    # One logical CPU beyond the pool for the read/repartition tasks: with every CPU held by engine
    # actors, Ray Data cannot schedule the reads that feed them.
    cfg = load_config(ROOT / args.config, [f"ray.num_cpus={max(args.pools) + 1}", *args.overrides])
    init_ray(cfg.ray)
    with tempfile.TemporaryDirectory(prefix="elastic-") as tmp:
        work = Path(tmp)
        prepared = run_prepare(cfg, str(write_samples(args.samples, work / "data.jsonl")), work / "prepare").prepared
        runs = [measure(cfg, Path(prepared), pool, work) for pool in args.pools]
    base = runs[0]["tokens_per_s"]
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "machine": machine(), "target": cfg.target.model, "samples": args.samples,
        "batch_tokens": cfg.extract.batch_tokens, "runs": runs, "ratio": runs[-1]["tokens_per_s"] / base,
        "note": "Shared development machine: other processes competed for the cores, so the ratio is a "
                "lower bound of what idle cores give; the test (tests/test_elastic.py) checks only that "
                "every sample is captured exactly once with 2 actors.",
    }
    write_report(result, ROOT / args.out)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
