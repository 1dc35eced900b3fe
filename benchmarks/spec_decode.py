"""Speculative decoding on an HF target: tau and tokens/s of target-only, prompt lookup, chain and
tree decoding, and their speedups over target-only, all measured in one run on the same prompts.

    # the embedded SmolLM2 with a trained drafter, on a GPU
    python benchmarks/spec_decode.py --target smollm2 --drafter out/export --device cuda --dtype bfloat16
    # quick CPU smoke run: random tiny target, untrained random drafter (tau ~ 1, speedup < 1)
    python benchmarks/spec_decode.py --target random:builtin:tiny-llama --num-prompts 2 --max-new-tokens 32

Prompts are the first turn of each record of an MT-bench-style JSONL (``turns``), rendered with the
tokenizer's chat template when it has one. Batch size 1, greedy unless --temperature > 0. At
temperature 0 the chain and tree outputs are checked token for token against target-only.
Aggregate tau = tokens from verify steps / verify steps over all prompts (docs/decode.md).
``--static`` decodes target-only, chain and tree through one StaticTarget (CUDA graphs on CUDA),
drafting through its graphed StaticProposer unless ``--eager-draft``; ``ms_per_cycle`` splits a
verify cycle into its parts (SpecStats.parts).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from eagle3_ray.config import TargetConfig
from eagle3_ray.drafter.export import load_drafter
from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_ray.engines.base import default_aux_layers
from eagle3_ray.engines.targets import load_target
from eagle3_ray.errors import DataError
from eagle3_ray.decode import SpecStats, StaticTarget, generate, prompt_lookup_generate, target_generate

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "eagle3_ray" / "resources" / "demo_eval.jsonl"


def read_prompts(path: Path, limit: int) -> list[str]:
    """First turn of the first ``limit`` records of an MT-bench-style JSONL."""
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            turns = json.loads(line).get("turns")
            if not turns:
                raise DataError(f"{path}:{line_no} has no 'turns'; give MT-bench-style records")
            prompts.append(turns[0])
            if len(prompts) == limit:
                break
    return prompts


def encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return tokenizer(text)["input_ids"]


def random_drafter(model, seed: int) -> Eagle3Drafter:
    """An untrained drafter sized for ``model`` (measures overhead; its drafts are almost never accepted)."""
    text = model.config.get_text_config()
    cfg = DrafterConfig.from_target(
        model.config, min(text.vocab_size, 32000), default_aux_layers(text.num_hidden_layers)
    )
    torch.manual_seed(seed)
    return Eagle3Drafter(cfg)


def aggregate(runs: list[SpecStats]) -> dict[str, float | None]:
    steps = sum(r.verify_steps for r in runs)
    tokens = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    verified = sum(r.tau * r.verify_steps for r in runs if r.tau is not None)
    parts = {p: sum(r.parts.get(p, 0.0) for r in runs) for p in ("draft", "verify", "accept", "commit")}
    return {
        "ms_per_cycle": {p: 1000 * v / steps for p, v in parts.items() if v} if steps else {},
        "tau": verified / steps if steps else None,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "new_tokens": tokens,
        "seconds": seconds,
        "target_forwards": sum(r.target_forwards for r in runs),
    }


def run_method(fn, prompts: list[list[int]]) -> tuple[list[list[int]], list[SpecStats]]:
    outputs, runs = [], []
    for ids in prompts:
        out, stats = fn(ids)
        outputs.append(out)
        runs.append(stats)
    return outputs, runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2", help="target.model spec (smollm2, HF dir, .gguf, random:...)")
    ap.add_argument("--drafter", help="drafter checkpoint/export dir; omitted = an untrained random drafter")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="MT-bench-style JSONL with 'turns'")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ap.add_argument("--num-steps", type=int, default=3, help="chain: drafts per verify (K)")
    ap.add_argument("--topk", type=int, default=4, help="tree: children per expanded node")
    ap.add_argument("--depth", type=int, default=5, help="tree: maximum draft depth")
    ap.add_argument("--total-tokens", type=int, default=16, help="tree: draft tokens verified per step")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="prompt lookup: candidate tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then outputs are cross-checked)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--static", action="store_true", help="decode through a StaticTarget (CUDA graphs on CUDA)")
    ap.add_argument("--eager-draft", action="store_true", help="with --static: the eager drafter, not the graphed one")
    ap.add_argument("--max-length", type=int, default=4096, help="with --static: KV slots")
    a = ap.parse_args(argv)

    target = load_target(TargetConfig(model=a.target, device=a.device, dtype=a.dtype, seed=a.seed))
    model, tok = target.model, target.tokenizer
    drafter = load_drafter(a.drafter) if a.drafter else random_drafter(model, a.seed)
    prompts = [encode(tok, t) for t in read_prompts(a.prompts, a.num_prompts)]
    sampling = {"temperature": a.temperature, "seed": a.seed}
    chain = {"num_steps": a.num_steps, **sampling}
    tree = {"topk": a.topk, "depth": a.depth, "total_tokens": a.total_tokens, **sampling}
    decoding = model
    if a.static:
        decoding = StaticTarget(model, drafter.config.aux_layers, max_length=a.max_length,
                                draft_graphs=not a.eager_draft)
    methods = {
        "target": lambda ids: target_generate(decoding, ids, a.max_new_tokens, **sampling),
        "chain": lambda ids: generate(decoding, drafter, ids, a.max_new_tokens, mode="chain", **chain),
        "tree": lambda ids: generate(decoding, drafter, ids, a.max_new_tokens, mode="tree", **tree),
    }
    if a.temperature == 0:
        methods["prompt_lookup"] = lambda ids: prompt_lookup_generate(model, ids, a.max_new_tokens, a.lookup_tokens)

    for fn in methods.values():  # warm-up: allocator, kernels, the drafter's move to the target device
        fn(prompts[0][:16])
    results, outputs = {}, {}
    for name, fn in methods.items():
        outputs[name], runs = run_method(fn, prompts)
        results[name] = aggregate(runs)
    base = results["target"]["tokens_per_s"]
    for r in results.values():
        r["speedup"] = r["tokens_per_s"] / base if base else None
    if a.temperature == 0:
        for name in ("chain", "tree"):
            results[name]["matches_target"] = outputs[name] == outputs["target"]

    print(f"target={a.target} device={target.device} dtype={target.dtype} prompts={len(prompts)} "
          f"max_new_tokens={a.max_new_tokens} drafter={a.drafter or 'random (untrained)'}")
    print(f"{'method':<14}{'tau':>7}{'tok/s':>10}{'speedup':>9}{'forwards':>10}  lossless")
    for name, r in results.items():
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "-"
        same = {True: "yes", False: "NO", None: ""}[r.get("matches_target")]
        parts = " ".join(f"{p} {v:.2f}" for p, v in r["ms_per_cycle"].items())
        print(f"{name:<14}{tau:>7}{r['tokens_per_s']:>10.1f}{r['speedup']:>8.2f}x{r['target_forwards']:>10}  {same:<4} "
              f"ms/cycle: {parts}")
    if a.json:
        meta = {"args": {k: str(v) for k, v in vars(a).items()}, "host": platform.node(), "torch": torch.__version__}
        Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n", encoding="utf-8")
    mismatch = [n for n, r in results.items() if r.get("matches_target") is False]
    if mismatch and target.dtype != torch.float32:
        print(f"{mismatch} differ from target-only: in {target.dtype} exact logit ties can flip a greedy token "
              "(docs/decode.md); rerun with --dtype float32 to check losslessness")
        return 0
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
