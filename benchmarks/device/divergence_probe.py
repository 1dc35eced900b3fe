"""One audited divergence, measured: the baseline's logits (one-token decode) against those of a
verify-width forward over the same context, at every position of the turn.

The bench's audit flagged one tree turn (spec_bench/qa prompt 321, turn 0, position 38) whose
top-2 gap on the baseline, 0.10 at logits of 1.875, is 13 bf16 ulps of those logits. Here each
position i of the baseline's answer is predicted twice on the StaticTarget the bench uses: by the
decode (one token after the context) and by row 0 of a forward of ``--width`` tokens (the tree's
verify width: the root then the answer's next tokens, causal) after the context minus its last
token. Printed: per-row max |verify - decode| over the vocabulary, the change of the audited pair's
gap, and the positions whose argmax the wider forward changes.

    python3 benchmarks/device/divergence_probe.py --drafter <exported drafter> --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from eagle3_ray import spec
from eagle3_ray.bench.prompts import load_prompt_sets
from eagle3_ray.bench.runner import BenchActor
from eagle3_ray.config import load_config


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--target", default="/tmp/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompts", default=".gq/spec_bench.jsonl")
    ap.add_argument("--max-prompts", type=int, default=20)
    ap.add_argument("--prompt-id", default="321")
    ap.add_argument("--turn", type=int, default=0)
    ap.add_argument("--position", type=int, default=38)
    ap.add_argument("--tokens", default="14937,28954", help="the audited pair: baseline token, spec token")
    ap.add_argument("--width", type=int, default=49)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    cfg = load_config("configs/smollm2-h200.yaml", [f"target.model={args.target}"])
    prompts = [p for ps in load_prompt_sets(args.prompts, args.max_prompts).values() for p in ps]
    prompt = next(p for p in prompts if p.id == args.prompt_id)
    actor = BenchActor(cfg.target, args.drafter)
    actor.static_off_cuda = True  # CPU tries of this script
    static = actor._decoding_target(cfg.bench)
    messages = [{"role": "user", "content": t} for t in prompt.turns[: args.turn + 1]]
    if args.turn:
        raise SystemExit("turn 0 only: later turns need the baseline's earlier replies")
    ids = torch.tensor(actor._render(messages), device=actor.target.device)
    answer, _ = spec.target_generate(static, ids, args.max_new_tokens)
    dev = actor.target.device
    runner = static.runner()
    logits = runner.forward(ids).logits[-1]
    decode = [logits]
    for t in answer[:-1]:
        decode.append(runner.forward(torch.tensor([t], device=dev)).logits[-1])
    a, b = (int(x) for x in args.tokens.split(","))
    full = torch.cat([ids, torch.tensor(answer, device=dev)])
    rows = []
    for i in range(1, len(answer)):
        runner = static.runner()
        runner.forward(full[: ids.shape[0] + i - 1])  # the context but its last token (the root)
        window = full[ids.shape[0] + i - 1: ids.shape[0] + i - 1 + args.width]
        if window.shape[0] < args.width:  # pad past the answer's end: causality hides it from row 0
            window = torch.cat([window, window[-1:].expand(args.width - window.shape[0])])
        ver = runner.forward(window).logits[0]
        dec = decode[i]
        rows.append({
            "position": i,
            "max_abs_diff": float((ver - dec).abs().max()),
            "row_max_abs_logit": float(dec.abs().max()),
            "top1": float(dec.max()),
            "argmax_changed": int(ver.argmax()) != int(dec.argmax()),
            "pair_gap_decode": float(dec[a] - dec[b]),
            "pair_gap_verify": float(ver[a] - ver[b]),
        })
    at = next((r for r in rows if r["position"] == args.position), None)
    diffs = sorted(r["max_abs_diff"] for r in rows)
    summary = {
        "prompt": f"{args.prompts} id {args.prompt_id} turn {args.turn}", "width": args.width,
        "answer_tokens": len(answer), "answer_at_position": answer[args.position] if args.position < len(answer) else None,
        "at_position": at,
        "max_abs_diff_median": diffs[len(diffs) // 2], "max_abs_diff_max": diffs[-1],
        "argmax_changed_positions": [r["position"] for r in rows if r["argmax_changed"]],
        "rows": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
