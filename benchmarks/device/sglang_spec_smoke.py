"""Does SGLang's EAGLE-3 engine answer at all, and how fast? The product's bench mode (``run_mode``)
in this process, no Ray: a few MT-bench first turns, few tokens, each mode's engine with CUDA graphs
unless ``--no-graphs``, SGLang's log at ``info`` (its decode batches and accept length).

    python3 benchmarks/device/sglang_spec_smoke.py --target /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --drafter <export> --modes chain tree --out $OUT/smoke          # GPU, ~1-2 min a mode

A hang is diagnosed, not waited out: every Python process started from here (SGLang's scheduler and
detokenizer included) dumps all its threads' stacks to stderr ``--dump-after`` seconds after it
started, and again every ``--dump-after`` seconds (``faulthandler`` through a ``sitecustomize`` put
first on PYTHONPATH). Writes ``<out>/smoke.json`` after each mode.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SITECUSTOMIZE = """import faulthandler, os, sys
_s = float(os.environ.get("E3_DUMP_AFTER_S", "0") or 0)
if _s > 0:
    faulthandler.dump_traceback_later(_s, repeat=True, file=sys.stderr)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--modes", nargs="+", default=["chain"], choices=["plain", "chain", "tree"])
    p.add_argument("--prompts", default=".gq/mt_bench.jsonl")
    p.add_argument("--max-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--dump-after", type=float, default=150.0, help="seconds; 0: no stack dumps")
    p.add_argument("--extra", default="", help="JSON object merged into target.sglang.extra_engine_kwargs")
    a = p.parse_args()

    if a.dump_after > 0:  # this process, and (through sitecustomize) every Python process it starts
        site = Path(tempfile.mkdtemp(prefix="e3dump-"))
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = f"{site}:{os.environ.get('PYTHONPATH', '')}"
        os.environ["E3_DUMP_AFTER_S"] = str(a.dump_after)
        faulthandler.dump_traceback_later(a.dump_after, repeat=True, file=sys.stderr)

    from eagle3_ray.bench import sglang_bench as sb
    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.config import BenchConfig, PipelineConfig, TargetConfig
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.engines.describe import load_tokenizer

    extra = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none",
             "log_level": "info", **(json.loads(a.extra) if a.extra else {})}
    target = TargetConfig(model=a.target, backend="sglang", device="cuda", dtype="bfloat16",
                          sglang={"extra_engine_kwargs": extra})
    bench = BenchConfig(engine="sglang", modes=[m for m in a.modes if m != "plain"] or ["chain"],
                        max_new_tokens=a.max_new_tokens, concurrency=a.concurrency, cuda_graphs=not a.no_graphs)
    cfg = PipelineConfig(target=target, bench=bench)
    tok = load_tokenizer(cfg.target)
    sets = load_prompt_sets({"path": a.prompts, "max_prompts": a.max_prompts})
    turns = [sb.TurnPrompt(cat, pr.id, 0, render_generation_prompt(tok, [{"role": "user", "content": pr.turns[0]}]))
             for cat, prompts in sets.items() for pr in prompts]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"target": a.target, "drafter": a.drafter, "graphs": not a.no_graphs, "turns": len(turns),
                     "max_new_tokens": a.max_new_tokens, "modes": {}}
    for mode in a.modes:
        t = time.perf_counter()
        print(f"[smoke] {mode}: starting", flush=True)
        try:
            if mode == "plain":  # plans its own (identical) turns from the first user turns
                convs = {cat: [(pr.id, [pr.turns[0]]) for pr in prompts] for cat, prompts in sets.items()}
                part = sb.run_mode(cfg, mode, a.drafter, conversations=convs)
            else:
                part = sb.run_mode(cfg, mode, a.drafter, turns=turns)
            row = {c: {k: r[k] for k in ("tau", "accept_length", "tokens_per_s", "completion_tokens", "accept_histogram")}
                   for c, r in part["by_concurrency"].items()}
            results["modes"][mode] = {"by_concurrency": row, "start_seconds": part["start_seconds"],
                                      "seconds": time.perf_counter() - t, "device": part["device"]}
        except Exception as e:  # recorded; the next mode still runs
            results["modes"][mode] = {"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t}
        print(f"[smoke] {mode}: {json.dumps(results['modes'][mode])}", flush=True)
        (out / "smoke.json").write_text(json.dumps(results, indent=1))
    return 0 if all("error" not in m for m in results["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
