"""Batch-1 decoding cost on one GPU: HF ``generate`` vs our loop on the DynamicCache vs ``StaticTarget``
(preallocated cache + CUDA graphs), and the cost of one chain / tree verify cycle with a drafter.

    python benchmarks/static_decode.py --out $OUT/static_decode.json          # SmolLM2-135M shape
    python benchmarks/static_decode.py --layers 32 --hidden 4096 ...          # another Llama shape

Random weights (speed does not depend on them); bf16; EOS off so every run makes exactly
``--new-tokens`` tokens. The drafter is random too, so its drafts are (almost) always rejected:
chain/tree figures here are the cost of a verify cycle (drafting + verify + rollback), not a
speedup; tokens/s of real drafters is in quality_smollm2.py. Every mode's output is compared with
the eager greedy output (bf16: near-ties may flip between kernels; the count is reported).
``<mode>_static`` drafts through the StaticTarget's graphed StaticProposer, ``<mode>_static_eager_draft``
through the eager Eagle3Proposer; ``ms_per_cycle_parts`` splits a cycle into draft / verify /
accept / commit (SpecStats.parts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch
from shapes import SHAPE_KEYS, add_shape_args, random_llama  # benchmarks/shapes.py


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    add_shape_args(ap)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", default=None, help="cProfile one run of this mode (e.g. chain_static) into --out.prof.txt")
    a = ap.parse_args(argv)

    import eagle3_ray.decode as spec
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    dev = torch.device(a.device)
    cfg, model = random_llama(a, dev)
    dtype = model.dtype
    aux = [2, a.layers // 2, a.layers - 3]
    dcfg = DrafterConfig.from_target(cfg, min(a.vocab, 32000), aux)
    drafter = spec.prepare_drafter(Eagle3Drafter(dcfg), model)
    prompt = torch.randint(10, a.vocab, (a.prompt_tokens,), generator=torch.Generator().manual_seed(1))
    n = a.new_tokens
    result = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
              "shape": {k: getattr(a, k) for k in SHAPE_KEYS},
              "prompt_tokens": a.prompt_tokens, "new_tokens": n, "dtype": str(dtype),
              "command": " ".join([sys.executable, *sys.argv]), "modes": {}}

    def hf():
        clock = spec.stats.Stopwatch(dev)
        out = model.generate(prompt[None].to(dev), attention_mask=torch.ones(1, a.prompt_tokens, device=dev),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                             top_p=None, top_k=None, temperature=None)
        return out[0, a.prompt_tokens:].tolist(), clock.seconds()

    parts: dict[str, dict[str, float]] = {}

    def ours(target, mode, name=None, draft_graphs=True):
        if isinstance(target, spec.StaticTarget):
            target.draft_graphs = draft_graphs
        if mode == "plain":
            toks, st = spec.target_generate(target, prompt, n, eos_token_id=[])
        else:
            params = {"chain": dict(num_steps=3), "tree": dict(topk=8, depth=6, total_tokens=48)}[mode]
            toks, st = spec.generate(target, drafter, prompt, n, mode=mode, eos_token_id=[], **params)
        if name:
            parts[name] = {k: 1000 * v / max(st.verify_steps, 1) for k, v in st.parts.items() if k != "prefill"}
        return toks, st.seconds, st.verify_steps

    t = time.perf_counter()
    try:
        static = spec.StaticTarget(model, aux, max_length=a.prompt_tokens + n + 64)
        for mode in ("plain", "chain", "tree"):
            ours(static, mode)
        result["capture_seconds"] = time.perf_counter() - t
        result["graph_widths"] = static.captured
        result["drafter_graphs"] = [str(k) for _, p in static._proposers.values() for k in p.captured]
    except Exception:  # noqa: BLE001 - report it and measure the eager static path instead
        result["capture_error"] = traceback.format_exc()
        print(result["capture_error"], flush=True)
        static = spec.StaticTarget(model, aux, max_length=a.prompt_tokens + n + 64, cuda_graphs=False)
    ref, _ = hf()
    runs = {"hf_generate": lambda: (*hf(), n)}
    for mode in ("plain", "chain", "tree"):
        runs[f"{mode}_eager"] = lambda mode=mode: ours(model, mode, f"{mode}_eager")
        runs[f"{mode}_static"] = lambda mode=mode: ours(static, mode, f"{mode}_static")
        if mode != "plain":
            runs[f"{mode}_static_eager_draft"] = lambda mode=mode: ours(static, mode, f"{mode}_static_eager_draft", False)
    for name, fn in runs.items():
        fn()  # warm-up
        times, differ, cycles = [], 0, 0
        for _ in range(a.repeats):
            toks, seconds, cycles = fn()
            times.append(seconds)
            differ += int(toks != ref)
        best = min(times)
        result["modes"][name] = {"tokens_per_s": n / best, "ms_per_forward": 1000 * best / max(cycles, 1),
                                 "target_forwards": cycles, "seconds": times, "runs_differing_from_hf": differ,
                                 "ms_per_cycle_parts": parts.get(name)}
        print(f"{name:14s} {n / best:8.1f} tok/s  {1000 * best / max(cycles, 1):7.2f} ms/cycle  differ {differ}",
              flush=True)
    if a.profile:
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        runs[a.profile]()
        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(45)
        with open(a.out + ".prof.txt", "w") as f:
            f.write(text.getvalue())
    base = result["modes"]["hf_generate"]["tokens_per_s"]
    for r in result["modes"].values():
        r["vs_hf_generate"] = r["tokens_per_s"] / base
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
