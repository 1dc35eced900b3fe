"""Batched generation speed on one GPU (self-distillation's workload): transformers ``generate``
vs ``StaticBatchGenerator`` (preallocated KV cache, the decode step as a CUDA graph).

    python benchmarks/batch_generate.py --out $OUT/batch_generate.json          # SmolLM2-135M shape

Random weights (speed does not depend on them), bf16, prompts of random lengths, EOS off so every
row makes exactly ``--new-tokens`` tokens; both paths get the same left-padded batches. Greedy
outputs are compared row by row (bf16: kernels that differ may flip near-ties; the share of
identical rows and of identical first 32 tokens is reported).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from shapes import SHAPE_KEYS, add_shape_args, random_llama  # benchmarks/shapes.py


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    add_shape_args(ap)
    ap.add_argument("--batches", default="64,256,512", help="batch sizes to measure")
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-max-batch", type=int, default=512, help="skip HF generate above this batch")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)

    from transformers import GenerationConfig

    from eagle3_ray.engines.static_generate import StaticBatchGenerator

    dev = torch.device(a.device)
    cfg, model = random_llama(a, dev)
    dtype = model.dtype
    no_eos = a.vocab + 7  # an id the model never produces: every row runs to --new-tokens
    gen = StaticBatchGenerator(model, [no_eos], pad_id=0)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    result = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
              "shape": {k: getattr(a, k) for k in SHAPE_KEYS},
              "dtype": str(dtype), "new_tokens": a.new_tokens, "prompt_tokens": [a.min_prompt, a.max_prompt],
              "command": " ".join([sys.executable, *sys.argv]), "runs": []}

    def hf(prompts):
        width = max(map(len, prompts))
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        cfg_ = GenerationConfig(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0, repetition_penalty=1.0)
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), generation_config=cfg_)
        return out[:, width:].tolist()

    def timed(fn, *args):
        sync()
        t = time.perf_counter()
        out = fn(*args)
        sync()
        return out, time.perf_counter() - t

    g = torch.Generator().manual_seed(1)
    for b in (int(x) for x in a.batches.split(",")):
        lens = torch.randint(a.min_prompt, a.max_prompt + 1, (b,), generator=g).tolist()
        prompts = [torch.randint(10, a.vocab, (n,), generator=g).tolist() for n in lens]
        run = {"batch": b, "padded_prompt_tokens": b * max(lens), "prompt_tokens": sum(lens)}
        with torch.inference_mode():
            timed(gen.generate, prompts[:2], 4)  # nothing measured: allocator / kernels warm
            _, run["static_first_call_s"] = timed(gen.generate, prompts, a.new_tokens)  # includes the capture
            ours, run["static_s"] = timed(gen.generate, prompts, a.new_tokens)
            _, run["static_sampled_s"] = timed(gen.generate, prompts, a.new_tokens, 0.7, 0.95)
        run["static_tokens_per_s"] = b * a.new_tokens / run["static_s"]
        run["static_sampled_tokens_per_s"] = b * a.new_tokens / run["static_sampled_s"]
        if b <= a.hf_max_batch:
            with torch.inference_mode():
                ref, run["hf_s"] = timed(hf, prompts)
            run["hf_tokens_per_s"] = b * a.new_tokens / run["hf_s"]
            run["speedup"] = run["static_tokens_per_s"] / run["hf_tokens_per_s"]
            run["rows_identical"] = sum(x == y for x, y in zip(ours, ref)) / b
            run["rows_identical_first_32"] = sum(x[:32] == y[:32] for x, y in zip(ours, ref)) / b
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
