"""Build `make demo`'s math workload from GSM8K (../shared/data, copied from openai/grade-school-math @ 3101c7d5).

    python benchmarks/demo_math_data.py --data ../shared/data --out eagle3_ray/resources

Writes ``demo_math_prompts.jsonl`` (220 train-split questions, ``{"id": "gsm8k-train-<line>", "prompt"}``)
and ``demo_math_eval.jsonl`` (16 test-split questions, ``{"question_id": <line>, "category": "math",
"turns": [question]}``): seeded choices among the questions of at most ``--max-words`` words (short
prompts: the demo's extraction and training time grow with every prompt token), the text unchanged, in
file order. No evaluation question is a training question. The answers are the target's own, written
next by ``eagle3-ray generate`` (``demo_math_answers.meta.json`` names that command).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def _questions(path: Path, max_words: int) -> list[tuple[int, str]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(i, r["question"].strip()) for i, r in enumerate(rows) if len(r["question"].split()) <= max_words]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=220)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--max-words", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    train = _questions(Path(a.data) / "gsm8k_train.jsonl", a.max_words)
    test = _questions(Path(a.data) / "gsm8k_test.jsonl", a.max_words)
    random.Random(a.seed).shuffle(train)
    random.Random(a.seed).shuffle(test)
    train, test = sorted(train[: a.train]), sorted(test[: a.eval])
    overlap = {q for _, q in train} & {q for _, q in test}
    if overlap:
        raise SystemExit(f"{len(overlap)} evaluation question(s) also in training: {sorted(overlap)[:3]}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "demo_math_prompts.jsonl", "w", encoding="utf-8") as f:
        for i, q in train:
            f.write(json.dumps({"id": f"gsm8k-train-{i:05d}", "prompt": q}, ensure_ascii=False) + "\n")
    with open(out / "demo_math_eval.jsonl", "w", encoding="utf-8") as f:
        for i, q in test:
            f.write(json.dumps({"question_id": i, "category": "math", "turns": [q]}, ensure_ascii=False) + "\n")
    print(json.dumps({"train": len(train), "eval": len(test), "out": str(out)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
