"""The CUDA-graphed speculative decoding paths on the GPU, before a long run relies on them: a random
SmolLM2-135M-shaped target and a random drafter (no files), StaticTarget with CUDA graphs.

    python3 benchmarks/device/spec_graph_check.py --out $OUT       # H200: ~1 minute
    python3 benchmarks/device/spec_graph_check.py --device cpu --layers 2 --out /tmp/sgc   # CPU smoke run

a) fp32: chain(3) and tree (8, 6, 48) through the graphs give exactly the target's greedy tokens
   (the reference: ``target_generate`` on the model, DynamicCache), across attention spans (a prompt
   near the first span's end), and no graph capture failed (``capture_errors`` of target and drafter);
b) bf16: ms per cycle by part (draft / verify / accept / commit) of chain and tree with the random
   drafter (tau ~1), and ms per token of graphed plain decoding, after a warm-up and capture_spans.
Writes <out>/spec_graph_check.json; exits 1 when (a) fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/shapes.py
from shapes import random_llama  # noqa: E402

from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter  # noqa: E402
from eagle3_ray.decode import StaticTarget, generate, prepare_drafter, target_generate  # noqa: E402

MODES = [("chain", {"num_steps": 3}), ("tree", {"topk": 8, "depth": 6, "total_tokens": 48})]


def build(a, dtype):
    shape = argparse.Namespace(layers=a.layers, hidden=576, heads=9, kv_heads=3, intermediate=1536, vocab=49152)
    dev = torch.device(a.device)
    _, model = random_llama(shape, dev)
    model = model.to(dtype)
    layers = shape.layers
    cfg = DrafterConfig.from_target(model.config, 16384, [min(2, layers), layers // 2, max(layers - 3, 1)])
    torch.manual_seed(1)
    drafter = prepare_drafter(Eagle3Drafter(cfg), model)
    return model, drafter


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--new-tokens", type=int, default=96)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "layers": a.layers}
    ok = True
    # (a) exactness in fp32, across the first span's end
    model, drafter = build(a, torch.float32)
    static = StaticTarget(model, drafter.config.aux_layers, max_length=2048)
    g = torch.Generator().manual_seed(3)
    for n in (40, 230):
        prompt = torch.randint(3, 49152, (n,), generator=g).tolist()
        ref, _ = target_generate(model, prompt, a.new_tokens, eos_token_id=[])
        for mode, params in MODES:
            got, stats = generate(static, drafter, prompt, a.new_tokens, mode=mode, eos_token_id=[], **params)
            same = got == ref
            ok &= same
            result[f"fp32_{mode}_prompt{n}_identical"] = same
            print(f"fp32 {mode} prompt {n}: identical {same}, tau {stats.tau}", flush=True)
    proposer = static.proposer(drafter)
    result["fp32_capture_errors"] = dict(proposer.capture_errors)
    result["fp32_draft_graphs"] = [list(k) for k in proposer.graph_keys]
    result["fp32_target_graphs"] = [list(k) for k in static.graph_keys]
    ok &= not proposer.capture_errors
    print("drafter capture errors:", proposer.capture_errors or "none", flush=True)
    del model, drafter, static, proposer
    # (b) bf16 cycle parts
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model, drafter = build(a, dtype)
    static = StaticTarget(model, drafter.config.aux_layers, max_length=8192)
    prompt = torch.randint(3, 49152, (300,), generator=g).tolist()
    for mode, params in MODES:  # warm-up: graphs of every width met, then every span
        generate(static, drafter, prompt, 16, mode=mode, eos_token_id=[], **params)
    target_generate(static, prompt, 16, eos_token_id=[])
    static.capture_spans()
    t0 = time.perf_counter()
    _, plain = target_generate(static, prompt, a.new_tokens, eos_token_id=[])
    result["bf16_plain_ms_per_token"] = 1000 * plain.seconds / a.new_tokens
    result["bf16_plain_parts_ms"] = {k: 1000 * v / max(plain.target_forwards, 1) for k, v in (plain.parts or {}).items()}
    for mode, params in MODES:
        _, st = generate(static, drafter, prompt, a.new_tokens, mode=mode, eos_token_id=[], **params)
        cycles = max(st.verify_steps, 1)
        result[f"bf16_{mode}_tau"] = st.tau
        result[f"bf16_{mode}_ms_per_cycle"] = {k: round(1000 * v / cycles, 3) for k, v in (st.parts or {}).items()
                                               if k != "prefill"}
        print(f"bf16 {mode}: tau {st.tau}, ms/cycle {result[f'bf16_{mode}_ms_per_cycle']}", flush=True)
    print(f"bf16 plain: {result['bf16_plain_ms_per_token']:.3f} ms/token ({time.perf_counter() - t0:.1f} s)")
    result["bf16_drafter_capture_errors"] = dict(static.proposer(drafter).capture_errors)
    result["ok"] = bool(ok)
    (out / "spec_graph_check.json").write_text(json.dumps(result, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
