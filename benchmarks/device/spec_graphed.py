"""Speculative decoding against the project's CUDA-graphed plain decoding, drafter eager vs graphed,
with the divergence audit: the product's BenchActor (eagle3_ray.bench.runner), in-process.

    python3 benchmarks/device/spec_graphed.py --target /tmp/smollm2 --drafter runs/x/drafter \\
        --mtbench .gq/mt_bench.jsonl --out $OUT            # on the GPU (bf16, CUDA graphs)
    python3 benchmarks/device/spec_graphed.py --tiny --out /tmp/o   # CPU smoke run of every code path

Per MT-bench category (``--max-prompts`` prompts round-robin over categories, both turns), on one
BenchActor: the drafter-graphed run (``bench.draft_graphs=true``: baseline, chain(K), tree, the
untrained chain, audit) then the drafter-eager run (``false``: baseline, chain, tree), each with
its own same-run baseline. Results go to ``<out>/spec_h200.json`` after every category (a run
killed at its limit keeps what it measured) and the graphed run's report to ``<out>/report/``.
Without ``--drafter`` a seeded random drafter is exported on the fly (tau ~ 1: it measures the
launch overhead of drafting, not a speedup). ``--tiny``: random tiny Llama on the CPU in fp32,
the StaticTarget/StaticProposer path forced on (it runs eagerly there), a 2-prompt file.

``--verify-sweep`` (no drafter, no prompts; ~30 s on the H200) times only the target's verify
forward (the StaticTarget graph replay + host sync, as a cycle's ``verify`` part) after a
``--sweep-context``-token context, per width (1, num_steps + 1, total_tokens + 1), for storage
capacities ``--max-length`` and the bench's default ``bench.max_length``, each attending over the
whole storage (``length_spans=False``, the old behaviour) and over the span holding the context:

    python3 benchmarks/device/spec_graphed.py --verify-sweep --target /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def bench_actor(target_cfg, drafter: str, static_off_cuda: bool = False, **kwargs):
    """The product's BenchActor; ``static_off_cuda``: its StaticTarget / StaticProposer path on the CPU
    too (run eagerly there), how a CPU run of this script exercises the graphed path's code."""
    from eagle3_ray.bench.runner import BenchActor

    class StaticOffCuda(BenchActor):
        def uses_static_target(self, b) -> bool:
            return b.cuda_graphs

    return (StaticOffCuda if static_off_cuda else BenchActor)(target_cfg, drafter, **kwargs)


def random_drafter_dir(target_cfg, work: Path) -> str:
    """A seeded random drafter for the target, saved and exported as the product does."""
    import torch

    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.engines.base import default_aux_layers
    from eagle3_ray.engines.targets import load_target

    model = load_target(target_cfg).model
    text = model.config.get_text_config()
    cfg = DrafterConfig.from_target(model.config, min(text.vocab_size, 32000), default_aux_layers(text.num_hidden_layers))
    torch.manual_seed(0)
    save_drafter_weights(Eagle3Drafter(cfg), work / "ckpt")
    return str(export_drafter(work / "ckpt", work / "export", engine="sglang"))


def tiny_prompts(work: Path) -> Path:
    f = work / "tiny_mt_bench.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a haiku.", "Now a shorter one."]},
            {"question_id": 2, "category": "math", "turns": ["What is 12 * 7?", "And 13 * 7?"]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def parts_table(results: dict) -> dict:
    """{kind: ms per cycle by part} of one run."""
    kinds = {"baseline": results.get("baseline"), **(results.get("modes") or {}), "untrained": results.get("untrained")}
    return {k: v.get("ms_per_cycle") for k, v in kinds.items() if v}


def verify_sweep(a, target_cfg, out: Path) -> int:
    """Verify ms per forward by capacity and attention span (module doc); writes verify_sweep.json."""
    import torch

    from eagle3_ray.config import BenchConfig
    from eagle3_ray.engines.base import default_aux_layers
    from eagle3_ray.engines.targets import load_target
    from eagle3_ray.decode import StaticTarget

    target = load_target(target_cfg)
    model, dev = target.model, target.device
    aux = default_aux_layers(model.config.get_text_config().num_hidden_layers)
    widths = sorted({1, a.num_steps + 1, a.total_tokens + 1})
    capacities = sorted({a.max_length, BenchConfig().max_length})
    reps = a.sweep_reps if dev.type == "cuda" else min(a.sweep_reps, 3)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.get_text_config().vocab_size, (a.sweep_context,), generator=g).to(dev)
    rows = []
    for capacity in capacities:
        for spans in (False, True):
            static = StaticTarget(model, aux, max_length=capacity, draft_graphs=False, length_spans=spans)
            runner = static.runner(aux)
            runner.forward(prompt)  # the prefill: the context the verifies attend to
            row = {"max_length": capacity, "length_spans": spans, "span": static.span(a.sweep_context + max(widths)),
                   "cuda_graphs": static.cuda_graphs, "ms": {}}
            for w in widths:
                ids = prompt[:w].clone()
                depth = torch.arange(w, device=dev)
                tree = torch.ones(w, w, dtype=torch.bool, device=dev).tril()
                static.forward(ids, a.sweep_context, depth, tree)  # capture + first replay, untimed
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    out_ = static.forward(ids, a.sweep_context, depth, tree)
                    out_.logits.argmax(-1).tolist()  # the host sync a verify ends with
                    times.append(time.perf_counter() - t)
                times.sort()
                row["ms"][str(w)] = 1000 * times[len(times) // 2]  # median
            rows.append(row)
            log(f"max_length {capacity:5d} spans {str(spans):5s} (span {row['span']:5d}): verify ms by width " +
                "  ".join(f"{w}: {ms:.2f}" for w, ms in row["ms"].items()))
            del static, runner
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
              "target": a.target, "dtype": str(target.dtype), "context": a.sweep_context, "reps": reps,
              "widths": widths, "rows": rows}
    write_json(out / "verify_sweep.json", result)
    print("verify ms per forward (median), context", a.sweep_context)
    print(f"{'max_length':>10} {'spans':>6} {'span':>6} " + " ".join(f"{'w=' + str(w):>8}" for w in widths))
    for r in rows:
        print(f"{r['max_length']:>10} {str(r['length_spans']):>6} {r['span']:>6} " +
              " ".join(f"{r['ms'][str(w)]:8.2f}" for w in widths))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="HF model dir (or any target.model spec); --tiny: a random tiny Llama")
    ap.add_argument("--drafter", help="exported drafter dir; omitted = a seeded random drafter built here")
    ap.add_argument("--mtbench", help="MT-bench JSONL (question_id, category, turns)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-prompts", type=int, default=8, help="round-robin over categories; 8 = one per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--total-tokens", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=2048, help="StaticTarget slots: longest prompt + new tokens")
    ap.add_argument("--deadline", type=float, default=200.0, help="seconds after start: no category starts later")
    ap.add_argument("--sglang-plain-tps", type=float, default=None, help="SGLang plain tokens/s on these turns")
    ap.add_argument("--no-untrained", action="store_true", help="skip the untrained-drafter chain")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: random tiny target, fp32, 2 prompts")
    ap.add_argument("--verify-sweep", action="store_true", help="only time verify by capacity and span (module doc)")
    ap.add_argument("--sweep-context", type=int, default=400, help="--verify-sweep: committed tokens before a verify")
    ap.add_argument("--sweep-reps", type=int, default=200, help="--verify-sweep: timed forwards per width")
    a = ap.parse_args(argv)

    import torch

    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.bench.report import write_report
    from eagle3_ray.bench.runner import results_body
    from eagle3_ray.config import BenchConfig, TargetConfig

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="spec_h200_"))
    if a.tiny:
        a.target, a.device, a.dtype = a.target or "random:builtin:tiny-llama", "cpu", "float32"
        a.mtbench = a.mtbench or str(tiny_prompts(work))
        a.max_new_tokens, a.topk, a.depth, a.total_tokens = min(a.max_new_tokens, 12), 2, 3, 6
        a.max_length = min(a.max_length, 256)
        a.sweep_context = min(a.sweep_context, 100)
    if a.verify_sweep:
        if not a.target:
            ap.error("--verify-sweep needs --target (or --tiny)")
        return verify_sweep(a, TargetConfig(model=a.target, device=a.device, dtype=a.dtype), out)
    if not a.target or not a.mtbench:
        ap.error("--target and --mtbench are required (or --tiny)")
    target_cfg = TargetConfig(model=a.target, device=a.device, dtype=a.dtype)
    result: dict = {"command": " ".join([sys.executable, *sys.argv]), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
                    "settings": {k: v for k, v in vars(a).items()}, "categories_done": [], "errors": []}
    import transformers

    result["transformers"] = transformers.__version__
    path = out / "spec_h200.json"
    drafter = a.drafter
    if not drafter:
        drafter = random_drafter_dir(target_cfg, work)
        log(f"random untrained drafter exported to {drafter}")
    result["drafter"] = a.drafter or "random (untrained, seeded)"
    sets = load_prompt_sets(a.mtbench, a.max_prompts)
    log(f"{sum(len(p) for p in sets.values())} prompts, {sum(len(p.turns) for ps in sets.values() for p in ps)} turns, "
        f"categories {list(sets)}")
    actor = bench_actor(target_cfg, drafter, static_off_cuda=a.tiny, compare_untrained=not a.no_untrained)
    untrained = actor.untrained
    common = dict(max_new_tokens=a.max_new_tokens, num_steps=a.num_steps, topk=a.topk, depth=a.depth,
                  total_tokens=a.total_tokens, max_length=a.max_length, prompt_lookup=False, temperature=0.0)
    runs = {"graphed": BenchConfig(**common, draft_graphs=True), "eager": BenchConfig(**common, draft_graphs=False)}
    records: dict[str, dict] = {name: {} for name in runs}
    first = next(p for ps in sets.values() for p in ps)
    for name, bench in runs.items():  # warm-up: graph captures, kernels, allocator, outside the timings
        actor.untrained = untrained if name == "graphed" else None
        t = time.perf_counter()
        try:
            actor.warmup(first, bench)
        except Exception:  # noqa: BLE001 - the other run may still measure; say what failed
            result["errors"].append({"category": "warm-up", "run": name, "traceback": traceback.format_exc()})
            log(f"warm-up {name} FAILED:\n{result['errors'][-1]['traceback']}")
        result[f"warmup_seconds_{name}"] = time.perf_counter() - t
        log(f"warm-up {name}: {result[f'warmup_seconds_{name}']:.1f}s")
        write_json(path, result)
    if actor._static is not None:
        result["target_graph_widths"] = actor._static.captured
        result["target_graph_spans"] = actor._static.graph_keys  # (width, attention span)
        proposers = [p for _, p in actor._static._proposers.values()]
        result["drafter_graphs"] = [[str(key) for key in p.captured] for p in proposers]
        result["drafter_capture_errors"] = [p.capture_errors for p in proposers]
        log(f"graphs: target widths {result['target_graph_widths']}, drafters {result['drafter_graphs']}, "
            f"capture errors {result['drafter_capture_errors']}")

    def publish() -> None:
        result["categories_done"] = {name: list(records[name]) for name in runs}
        for name, bench in runs.items():
            if records[name]:
                actor.untrained = untrained if name == "graphed" else None
                info = {**actor.describe(), "draft_graphs": bench.draft_graphs and actor.info["graphed_baseline"]}
                body = results_body(dict(records[name]), bench, info, a.sglang_plain_tps)
                result[name] = body
                result[f"ms_per_cycle_{name}"] = parts_table(body)
        g, e = result.get("graphed"), result.get("eager")
        if g:
            result["summary"] = {**g["summary"], "tau": g["tau"],
                                 "tokens_per_s": {**g["tokens_per_s"], "baseline": g["baseline"]["tokens_per_s"]},
                                 "turns": g["num_turns"]}
        if e:
            result.setdefault("summary", {}).update({
                "eager_draft_spec_vs_graphed_chain": e["summary"]["spec_vs_graphed_chain"],
                "eager_draft_spec_vs_graphed_tree": e["summary"]["spec_vs_graphed_tree"],
                "eager_draft_bf16_divergent_turns": e["summary"]["bf16_divergent_turns"],
                "eager_draft_bf16_unexplained_divergences": e["summary"]["bf16_unexplained_divergences"],
                "eager_draft_turns": e["num_turns"],
            })
        result["elapsed_seconds"] = time.perf_counter() - T0
        write_json(path, result)

    for cat, prompts in sets.items():
        if time.perf_counter() - T0 > a.deadline:
            log(f"deadline {a.deadline:.0f}s reached: {cat} and later categories not measured")
            break
        for name, bench in runs.items():
            actor.untrained = untrained if name == "graphed" else None
            t = time.perf_counter()
            try:
                records[name][cat] = actor.run_category(prompts, bench)
            except Exception:  # noqa: BLE001 - keep what the other runs measure, say what failed
                result["errors"].append({"category": cat, "run": name, "traceback": traceback.format_exc()})
                log(f"{cat} {name} FAILED:\n{result['errors'][-1]['traceback']}")
                continue
            recs = records[name][cat]
            tps = {k: sum(r["stats"]["new_tokens"] for r in v) / max(sum(r["stats"]["seconds"] for r in v), 1e-9)
                   for k, v in recs.items()}
            differ = {k: sum(not r["identical"] for r in v) for k, v in recs.items() if k != "baseline"}
            log(f"{cat} {name} ({time.perf_counter() - t:.1f}s): tok/s " +
                " ".join(f"{k} {v:.1f}" for k, v in tps.items()) + f"; turns differing {differ}")
        publish()
    publish()
    if "graphed" in result:
        write_report({**result["graphed"], "config": {"bench": runs["graphed"].model_dump(), "prompts": a.mtbench}},
                     out / "report")
        log(f"summary: {json.dumps(result['summary'], default=str)}")
    log(f"wrote {path}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
