"""Check that SGLang capture delivers the same hidden states as the HF backend, on a real GPU node.

Needs CUDA and SGLang's kernel package (not in CI). The same comparison ran on the lent H200 with
SGLang 0.5.17 through ``benchmarks/device/sglang_engine.py capture`` (figures in
benchmarks/results/README.md). Run it on a node with ``pip install 'eagle3-ray[sglang]'`` and a
target that fits both engines:

    python benchmarks/sglang_capture_check.py -c configs/llama3.1-8b.yaml --samples 8

It tokenizes a few shipped demo prompts, captures them with ``SGLangEngine`` (TP = target.tp_size)
and then with ``HFEngine`` (one GPU), and prints per sample the token counts and the max abs
difference of aux [T, 3H] and last [T, H]. bf16 kernels differ between the engines, so expect
differences of the order of bf16 rounding of the activations, not zero; a wrong aux-layer
translation shows up as differences of the order of the activations themselves.
"""

from __future__ import annotations

import argparse
import json

import torch

from eagle3_ray.config import load_config
from eagle3_ray.engines.base import Capture
from eagle3_ray.engines.describe import load_tokenizer


def demo_token_ids(cfg, samples: int) -> list[list[int]]:
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.data.sources import resolve_data_path

    tok = load_tokenizer(cfg.target)
    lines = resolve_data_path("builtin:demo_prompts").read_text(encoding="utf-8").splitlines()[:samples]
    prompts = [json.loads(line) for line in lines if line.strip()]
    return [render_generation_prompt(tok, [{"role": "user", "content": p["prompt"]}]) for p in prompts]


def compare(a: Capture, b: Capture) -> dict[str, object]:
    return {
        "tokens": (a.aux_hidden.shape[0], b.aux_hidden.shape[0]),
        "aux_max_abs": (a.aux_hidden.float() - b.aux_hidden.float()).abs().max().item(),
        "last_max_abs": (a.last_hidden.float() - b.last_hidden.float()).abs().max().item(),
        "aux_scale": b.aux_hidden.float().abs().max().item(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--samples", type=int, default=8)
    args = p.parse_args()
    cfg = load_config(args.config)
    seqs = demo_token_ids(cfg, args.samples)

    from eagle3_ray.engines.sglang import SGLangEngine

    sgl = SGLangEngine(cfg.target, mode="capture")
    try:
        got = sgl.capture(seqs)
    finally:
        sgl.close()

    from eagle3_ray.engines.hf import HFEngine

    hf_target = cfg.target.model_copy(update={"backend": "hf", "device": "cuda", "dtype": "bfloat16"})
    hf = HFEngine(hf_target, batch_tokens=cfg.extract.batch_tokens)
    try:
        want = hf.capture(seqs)
    finally:
        hf.close()

    for i, (a, b) in enumerate(zip(got, want)):
        print(f"sample {i}: " + json.dumps(compare(a, b)))
    assert all(a.aux_hidden.shape == b.aux_hidden.shape for a, b in zip(got, want)), "token counts differ"
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
