"""The drafter's inputs on the GPU path against an fp32 yardstick: the aux hidden states a
StaticTarget hands the drafter (chunked graphed prefill, and a verify-width forward) against a plain
fp32 forward of the same tokens, per aux layer, plus the versions that ran. The next check after the
2026-12-03 midday session found the same drafter at MT-bench chain tau 1.86 on the H200 where CPU fp32 and
bf16 give 2.07 and its own product run gave 2.03, with every drafter path agreeing (the cause is upstream
of the drafter or in the environment).

    python3 benchmarks/device/aux_compare.py --drafter /tmp/bench-drafter/drafter --out $OUT/aux.json
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
import transformers

from eagle3_ray.bench.prompts import load_prompt_sets
from eagle3_ray.bench.runner import BenchActor
from eagle3_ray.config import load_config


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=".gq/mt_bench.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--width", type=int, default=4, help="verify width of the second check")
    ap.add_argument("--dtype", default="auto", help="target.dtype (auto: bf16 on the GPU)")
    args = ap.parse_args()
    cfg = load_config("configs/smollm2-h200.yaml", [f"target.model={args.target}", f"target.dtype={args.dtype}"])
    actor = BenchActor(cfg.target, args.drafter)
    actor.static_off_cuda = True  # CPU tries of this script
    static = actor._decoding_target(cfg.bench)
    layers = list(actor.drafter.config.aux_layers)
    model = actor.target.model
    fp32 = copy.deepcopy(model).float()
    dev = actor.target.device
    prompts = [p for ps in load_prompt_sets(args.prompts, args.num_prompts).values() for p in ps]
    rows = []
    for p in prompts:
        ids = torch.tensor(actor._render([{"role": "user", "content": p.turns[0]}]), device=dev)
        ref = fp32(input_ids=ids[None], output_hidden_states=True).hidden_states
        eager = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        runner = static.runner(layers)
        n = ids.shape[0]
        pre = runner.forward(ids[: n - args.width]).aux  # the chunked prefill
        ver = runner.forward(ids[n - args.width:]).aux  # a verify-width forward of the rest
        width = ref[0].shape[-1]
        row = {"prompt_id": p.id, "tokens": n}
        for j, k in enumerate(layers):
            r = ref[k][0]
            row[f"layer{k}_eager_bf16"] = rel(eager[k][0], r)
            row[f"layer{k}_static_prefill"] = rel(pre[:, j * width:(j + 1) * width], r[: n - args.width])
            row[f"layer{k}_static_verify"] = rel(ver[:, j * width:(j + 1) * width], r[n - args.width:])
        rows.append(row)
        print(row, flush=True)
    worst = {key: max(r[key] for r in rows) for key in rows[0] if key.startswith("layer")}
    summary = {"torch": torch.__version__, "transformers": transformers.__version__,
               "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
               "device": str(dev), "dtype": str(actor.target.dtype), "aux_layers": layers, "worst": worst, "rows": rows}
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
