"""Where did MT-bench tau go? The product's BenchActor over a returned drafter, chain(3) only, on the
first MT-bench questions, in variants that differ in one thing each (one process, one H200):

  graphs       the bench as it runs: the drafter's prompt commit in 256-wide chunks through its graph
  graphs-nocudnn the same, the chunk graphs captured again without cuDNN attention (the eager kernels)
  chunks-eager the same chunks run eagerly (their graphs withheld)
  one-pass     the prompt commit as one eager pass (prompt_width 0: before d050ef2)
  eager-draft  the eager Eagle3Proposer (bench.draft_graphs=false): the reference drafter path

    python3 benchmarks/device/spec_prompt_check.py --drafter /tmp/bench-drafter/drafter --out $OUT/check.json
    (--paths graphs --exact-reductions: the bench's path with cuBLAS reducing bf16 GEMMs in fp32)
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
    ap.add_argument("--target", default="/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=".gq/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--paths", default="graphs,graphs-nocudnn,chunks-eager,one-pass,eager-draft",
                    help="which of the paths to measure, in this order")
    ap.add_argument("--exact-reductions", action="store_true",
                    help="cuBLAS reductions of bf16/fp16 GEMMs in fp32 (torch's allow_*_reduced_precision_reduction off)")
    args = ap.parse_args()
    paths = args.paths.split(",")
    if args.exact_reductions:  # before anything is built: the graphs capture the GEMMs chosen under it
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    cfg = load_config("configs/smollm2-h200.yaml", [f"target.model={args.target}", "bench.modes=[chain]",
                                                     f"bench.max_new_tokens={args.max_new_tokens}", "bench.untrained=false"])
    sets = load_prompt_sets(args.prompts, args.num_prompts)
    prompts = [p for ps in sets.values() for p in ps]
    actor = BenchActor(cfg.target, args.drafter)
    actor.static_off_cuda = True  # the StaticTarget on CPU too (eager there): how this script is tried off the GPU
    bench = cfg.bench
    actor.warmup(prompts[0], bench)
    static = actor._static
    proposer = static.proposer(actor.drafter)
    results = {}

    def measure(name, b):
        if name not in paths:
            return
        t0 = time.perf_counter()
        recs = actor.run_category(prompts, b)["chain"]
        new = sum(r["stats"]["new_tokens"] for r in recs)
        steps = sum(r["stats"]["verify_steps"] for r in recs)
        results[name] = {"tau": (new - len(recs)) / steps if steps else None, "turns": len(recs),
                         "identical": sum(r["identical"] for r in recs), "seconds": time.perf_counter() - t0,
                         "tau_mean_of_turns": sum(r["stats"]["tau"] or 0 for r in recs) / len(recs)}
        print(name, results[name], flush=True)

    measure("graphs", bench)
    width = proposer.prompt_width
    import eagle3_ray.spec.static_draft as static_draft

    own = static_draft.capture_graph

    def without_cudnn(fn, buf, device):
        with static_draft.sdpa_for_growing_keys(device):
            return own(fn, buf, device)

    static_draft.capture_graph = without_cudnn
    for span in proposer.spans:
        proposer._graphs.pop(("extend", width, span), None)
    measure("graphs-nocudnn", bench)
    static_draft.capture_graph = own
    for span in proposer.spans:
        proposer._graphs[("extend", width, span)] = None  # withheld: _graph returns None, the step runs eagerly
    measure("chunks-eager", bench)
    proposer.prompt_width = 0
    measure("one-pass", bench)
    proposer.prompt_width = width
    measure("eager-draft", bench.model_copy(update={"draft_graphs": False}))
    with open(args.out, "w") as f:
        json.dump({"drafter": args.drafter, "prompts": args.prompts, "num_prompts": len(prompts),
                   "exact_reductions": args.exact_reductions, **results}, f, indent=1)


if __name__ == "__main__":
    main()
