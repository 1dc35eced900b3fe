"""Where SGLang's EAGLE-3 decode cycle goes, through the product's own SGLang bench (GPU).

Runs ``eagle3_ray.bench.runner.run_bench`` with ``bench.engine=sglang`` and the cycle probe
(``sglang_cycle_probe``) loaded into the engines' scheduler processes, then prints per mode the
milliseconds of a verify cycle's parts (draft, verify, draft-extend) next to plain decoding's
milliseconds per token, all at concurrency 1:

    # SmolLM2 with a trained drafter
    python benchmarks/device/sglang_cycle.py --target <SmolLM2 dir or GGUF> --drafter <export> --out $OUT/cycle_smollm2
    # the Llama-3.1-8B shape with dummy weights and a seeded random drafter of its shape (tau ~1)
    python benchmarks/device/sglang_cycle.py --target random:eagle3_ray/resources/llama3.1-8b-shape.json --out $OUT/cycle_8b

Writes ``<out>/cycle.json`` (the bench's results plus ``cycle``) and the bench's report beside it; cut off
(SIGINT, as ``timeout -s INT`` sends), ``<out>/cycle_partial.json``: the probe's parts of the modes that decoded.
With a random drafter nothing is accepted, so the 8B figures are the cycle's cost, not its payoff:
``projected_speedup`` = tau x plain ms per token / ms per cycle for a given tau (``--tau``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.device.sglang_cycle_probe import read_cycles  # noqa: E402
from eagle3_ray.config import PipelineConfig  # noqa: E402

TRITON = {"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}


def random_drafter(target: str, out: Path, draft_vocab: int) -> str:
    """An exported drafter of the target's shape with seeded random weights (SGLang layout)."""
    from eagle3_ray.config import TargetConfig
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.engines.base import default_aux_layers
    from eagle3_ray.engines.describe import target_hf_config

    hf = target_hf_config(TargetConfig(model=target))
    cfg = DrafterConfig.from_target(hf, draft_vocab_size=draft_vocab, aux_layers=default_aux_layers(hf.num_hidden_layers))
    torch.manual_seed(0)
    save_drafter_weights(Eagle3Drafter(cfg), out / "ckpt")
    return str(export_drafter(out / "ckpt", out / "drafter", engine="sglang"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", help="exported drafter (default: a seeded random one of the target's shape)")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default=".gq/mt_bench.jsonl")
    p.add_argument("--max-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--modes", nargs="+", default=["chain", "tree"], choices=["chain", "tree"],
                   help="EAGLE-3 modes beside plain decoding (each its own engine start: about a minute at 8B)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--total-tokens", type=int, default=48)
    p.add_argument("--tau", type=float, nargs="*", default=[2.5, 3.0, 4.0, 5.0],
                   help="tau values to project the speedup for")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    drafter = a.drafter or random_drafter(a.target, Path("/tmp") / f"cycle-drafter-{out.name}", a.draft_vocab)
    probe = Path("/tmp") / f"cycle-probe-{out.name}"
    shutil.rmtree(probe, ignore_errors=True)  # a rerun's totals must not add an earlier run's
    hooks = [{"name": "e3r_cycle", "target_modules": ["lm_head"],
              "hook_factory": "benchmarks.device.sglang_cycle_probe:factory", "config": {"out": str(probe)}}]
    cfg = PipelineConfig.model_validate({
        "target": {"model": a.target, "backend": "sglang",
                   "sglang": {"extra_engine_kwargs": {**TRITON, "forward_hooks": hooks}}},
        "bench": {"engine": "sglang", "concurrency": [1], "modes": a.modes, "max_new_tokens": a.max_new_tokens,
                  "num_steps": 3, "topk": a.topk, "depth": a.depth, "total_tokens": a.total_tokens,
                  "prompts": {"path": a.prompts, "max_prompts": a.max_prompts}, "num_gpus": 1},
    })
    from eagle3_ray.bench.runner import run_bench

    try:
        results = run_bench(cfg, drafter, out=out / "bench")
    except KeyboardInterrupt:  # cut off (timeout -s INT): keep the probe's parts of the modes that decoded
        modes = {m: read_cycles(probe, topk=k) for m, k in (("chain", 1), ("tree", a.topk)) if m in a.modes}
        (out / "cycle_partial.json").write_text(json.dumps({
            "target": a.target, "drafter": drafter, "interrupted": True, "probe": modes,
            "note": "the bench did not finish: its per-mode speeds are in its log; the probe's totals are written "
                    "every 50 cycles, so the last few cycles of a mode may be missing"}, indent=1))
        for m, parts in modes.items():
            print(f"[cycle] {m} (interrupted): probe " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                              parts["ms_per_call"].items()), flush=True)
        return 130
    s = results["sglang"]
    plain_ms = 1000 / s["modes"]["plain"]["1"]["tokens_per_s"]
    cycles = {}
    for mode, topk in (("chain", 1), ("tree", a.topk)):
        if mode not in a.modes:
            continue
        parts = read_cycles(probe, topk=topk)
        row = s["modes"][mode]["1"]
        cycle_ms = row["ms_per_cycle"]
        cycles[mode] = {
            "probe_ms": parts["ms_per_call"], "probe_calls": parts["calls"],
            "ms_per_cycle": cycle_ms, "plain_ms_per_token": plain_ms, "tau": row["tau"],
            "cycle_over_plain_step": cycle_ms / plain_ms if cycle_ms else None,
            "projected_speedup": {str(t): t * plain_ms / cycle_ms for t in a.tau} if cycle_ms else None,
        }
        print(f"[cycle] {mode}: {cycle_ms:.2f} ms per cycle ({cycle_ms / plain_ms:.2f} plain steps), probe "
              + ", ".join(f"{k} {v:.2f} ms" for k, v in parts["ms_per_call"].items()), flush=True)
    print(f"[cycle] plain: {plain_ms:.2f} ms per token", flush=True)
    (out / "cycle.json").write_text(json.dumps({"target": a.target, "drafter": drafter, "cycle": cycles,
                                                "device": torch.cuda.get_device_name(0), "sglang": s}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
