"""Per-turn chain(3) verify steps of one MT-bench category through the product's BenchActor, off the
GPU or on it: the yardstick for a drafter's tau measured elsewhere (a GPU bench, a product run).

    PYTHONPATH=. python3 benchmarks/tau_category.py --drafter <exported drafter> --category coding \
        --dtype float32 --out benchmarks/results/cpu_tau_mtbench_coding_fp32.json

The target is the embedded SmolLM2-135M-Instruct (the same GGUF as the H200 runs) unless --target
says otherwise; the chat template, prompts and settings are those of configs/smollm2-h200.yaml's bench
(128 new tokens, greedy).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3_ray.bench.prompts import load_prompt_sets
from eagle3_ray.bench.runner import BenchActor
from eagle3_ray.config import load_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--category", default="coding")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompts", default=".gq/mt_bench.jsonl")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="further config overrides, e.g. bench.cuda_graphs=false (repeatable)")
    ap.add_argument("--max-prompts", type=int, default=None, help="the category's first N prompts only")
    ap.add_argument("--static", action="store_true",
                    help="off CUDA too through the StaticTarget/StaticProposer code path (eager there)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/smollm2-h200.yaml", [
        f"target.model={args.target}", "bench.modes=[chain]", "bench.max_new_tokens=128", "bench.untrained=false",
        f"target.dtype={args.dtype}", *args.set])
    prompts = load_prompt_sets(args.prompts, 80)[args.category][: args.max_prompts]
    actor = BenchActor(cfg.target, args.drafter)
    actor.static_off_cuda = args.static
    t0 = time.time()
    recs = actor.run_category(prompts, cfg.bench)
    chain = [{"prompt_id": r["prompt_id"], "turn": r["turn"], "prompt_tokens": r["prompt_tokens"],
              "new": r["stats"]["new_tokens"], "steps": r["stats"]["verify_steps"], "tau": r["stats"]["tau"]}
             for r in recs["chain"]]
    new, steps = sum(r["new"] for r in chain), sum(r["steps"] for r in chain)
    result = {"category": args.category, "dtype": args.dtype, "device": str(actor.target.device),
              "overrides": args.set, "decoding": actor.describe(), "torch": torch.__version__,
              "tau": (new - len(chain)) / steps, "new_tokens": new, "verify_steps": steps,
              "seconds": time.time() - t0, "chain": chain,
              "baseline_new": [r["stats"]["new_tokens"] for r in recs["baseline"]]}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(args.category, args.dtype, *args.set, "tau", round(result["tau"], 3), "verify steps", steps, flush=True)


if __name__ == "__main__":
    main()
