"""Conversations for the demo-workload experiments (record demo_workload_cpu): the target's answers from
the committed SpecForge-comparison conversations (`results/specforge_smollm2_conversations.jsonl.gz`,
SmolLM2-135M-Instruct greedy, bf16 on an H100), each answer cut to its first 128 tokens (the demo's
answer length), optionally after the demo's own 300 general-chat answers.

    python benchmarks/demo_data_mix.py --demo --general 490 --gsm8k 210 --out mix1000.jsonl   # general chat
    python benchmarks/demo_data_mix.py --gsm8k 300 --seed 1 --out gsm300.jsonl                # math only

Then `eagle3-ray run -c configs/demo-smollm2-chat.yaml --data <out> --out <dir> generate.answers=null ...`
(the record names each run's overrides).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEMO = Path(__file__).resolve().parents[1] / "eagle3_ray" / "resources" / "demo_answers.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--demo", action="store_true", help="start with the demo's 300 shipped general-chat answers")
    ap.add_argument("--general", type=int, default=0, help="non-GSM8K conversations to add")
    ap.add_argument("--gsm8k", type=int, default=0, help="GSM8K conversations to add")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from eagle3_ray.engines.targets import smollm2_dir

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()))
    with gzip.open(RESULTS / "specforge_smollm2_conversations.jsonl.gz", "rt", encoding="utf-8") as f:
        rec = [json.loads(line) for line in f]
    rng = random.Random(a.seed)
    gsm = [r for r in rec if r["id"].startswith("gsm8k")]
    other = [r for r in rec if not r["id"].startswith("gsm8k")]
    rng.shuffle(gsm)
    rng.shuffle(other)

    def cut(r: dict) -> dict:
        msgs = [m if m["role"] != "assistant" else
                {"role": "assistant", "content": tok.decode(tok.encode(m["content"], add_special_tokens=False)
                                                            [: a.answer_tokens])} for m in r["conversations"]]
        return {"id": r["id"], "conversations": msgs}

    rows = [json.loads(line) for line in DEMO.read_text(encoding="utf-8").splitlines()] if a.demo else []
    rows += [cut(r) for r in gsm[: a.gsm8k] + other[: a.general]]
    Path(a.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(json.dumps({"conversations": len(rows), "out": a.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
