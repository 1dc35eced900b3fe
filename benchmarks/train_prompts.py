"""Build the self-distillation prompt set of the SmolLM2 quality benchmark from ../shared/data.

    python benchmarks/train_prompts.py --data ../shared/data --out .gq/train_prompts.jsonl

Every prompt-only or chat set that is not evaluated: GSM8K train, AlpacaEval, Arena-Hard v0.1 and
v2.0, the ShareGPT-500 prompts, the OASST lottery prompts, the first user turn of the OASST-100 and
Alpaca-seed chats. The evaluation sets (MT-bench, Spec-Bench, GSM8K test, HumanEval) are held out:
any prompt whose text also occurs in one of them is dropped. With ``--two-turn F`` a fraction F of
the prompts get a second user turn, a generic follow-up (written here, not taken from any
benchmark), so the drafter also sees answers conditioned on an earlier exchange, as in MT-bench's
second turns. GSM8K train is 7,473 of the 10,542 prompts; ``--max-gsm8k N`` keeps a seeded N of them
(the rest of the set is chat of many kinds, as MT-bench is). Output: one ``{"id", "turns": [...]}`` line per prompt, shuffled (seeded).

``--eval-only-mt-bench`` appends MT-bench's 80 questions (both turns) as ``mtbench-<question_id>``, for a
run that holds them out of training whole (``train.eval_only``): the target answers them with the rest,
and every held-out evaluation of the training reports the drafter's simulated tau on those answers
(``benchmarks/device/overrides/product7.txt`` names the groups). They are never trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FOLLOW_UPS = [
    "Can you explain that in simpler terms?",
    "Summarize your answer in two sentences.",
    "Rewrite your answer as a short list of bullet points.",
    "Give me a concrete example.",
    "What are the main limitations of what you just said?",
    "Now make your answer more formal.",
    "Can you expand on the most important point?",
    "Write a short title for your answer.",
    "Explain your reasoning step by step.",
    "What would be a good follow-up question to ask about this?",
    "Rewrite your answer for a ten-year-old.",
    "Translate the first sentence of your answer into French.",
    "Are you sure? Double-check your answer.",
    "Now give the opposite point of view.",
    "Make your answer shorter.",
    "Add a brief conclusion to your answer.",
]


def _lines(path: Path):
    for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines: prompts hold U+2028
        if line.strip():
            yield json.loads(line)


def _first_user(conversations: list[dict]) -> str | None:
    return next((m["content"] for m in conversations if m.get("role") == "user"), None)


def collect(data: Path) -> list[tuple[str, str]]:
    """(id, prompt) of every training source, in a fixed order."""
    out: list[tuple[str, str]] = []
    for i, r in enumerate(_lines(data / "gsm8k_train.jsonl")):
        out.append((f"gsm8k-{i:05d}", r["question"]))
    for r in _lines(data / "alpaca_eval_prompts.jsonl"):
        out.append((f"alpacaeval-{int(r['id']):05d}", r["instruction"]))
    for name in ("arena_hard_v0.1", "arena_hard_v2.0"):
        for r in _lines(data / f"{name}.jsonl"):
            out.append((f"{name}-{r['uid']}", r["prompt"]))
    for r in _lines(data / "sharegpt500_prompts.jsonl"):
        out.append((f"sharegpt-{r['id']}", _first_user(r["conversations"])))
    for i, r in enumerate(_lines(data / "oasst_prompt_lottery_en_250.jsonl")):
        out.append((f"oasst-{i:03d}", r))
    for name in ("oasst_en100_chat", "alpaca_seed_chat"):
        for r in _lines(data / f"{name}.jsonl"):
            out.append((f"{name}-{r['id']}", _first_user(r["conversations"])))
    return [(i, p.strip()) for i, p in out if isinstance(p, str) and p.strip()]


def held_out_texts(data: Path) -> set[str]:
    texts = set()
    for r in _lines(data / "mt_bench.jsonl"):
        texts.update(t.strip() for t in r["turns"])
    for r in _lines(data / "spec_bench.jsonl"):
        texts.update(t.strip() for t in r["turns"])
    texts.update(r["question"].strip() for r in _lines(data / "gsm8k_test.jsonl"))
    texts.update(r["prompt"].strip() for r in _lines(data / "humaneval.jsonl"))
    return texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--out", required=True)
    ap.add_argument("--two-turn", type=float, default=0.3, help="fraction of prompts given a follow-up turn")
    ap.add_argument("--max-gsm8k", type=int, default=None, metavar="N",
                    help="keep at most N GSM8K train prompts (a seeded choice; default: all)")
    ap.add_argument("--eval-only-mt-bench", action="store_true",
                    help="append MT-bench's questions as mtbench-<id>, for train.eval_only (never trained on)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.max_gsm8k is not None and a.max_gsm8k < 0:
        ap.error(f"--max-gsm8k must be 0 or more, got {a.max_gsm8k}")
    data = Path(a.data)
    held = held_out_texts(data)
    rows, seen, dropped = [], set(), 0
    prompts = collect(data)
    if a.max_gsm8k is not None:
        gsm8k = [r for r in prompts if r[0].startswith("gsm8k-")]
        keep = {r[0] for r in random.Random(a.seed).sample(gsm8k, min(a.max_gsm8k, len(gsm8k)))}
        prompts = [r for r in prompts if not r[0].startswith("gsm8k-") or r[0] in keep]
    for sid, prompt in prompts:
        if prompt in held or prompt in seen:
            dropped += 1
            continue
        seen.add(prompt)
        rows.append({"id": sid, "turns": [prompt]})
    rng = random.Random(a.seed)
    rng.shuffle(rows)
    for r in rows[: int(a.two_turn * len(rows))]:
        r["turns"].append(rng.choice(FOLLOW_UPS))
    rng.shuffle(rows)
    if a.eval_only_mt_bench:
        rows += [{"id": f"mtbench-{int(r['question_id'])}", "turns": [t.strip() for t in r["turns"]]}
                 for r in _lines(data / "mt_bench.jsonl")]
    Path(a.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(json.dumps({"prompts": len(rows), "gsm8k": sum(r["id"].startswith("gsm8k-") for r in rows),
                      "two_turn": sum(len(r["turns"]) == 2 for r in rows),
                      "mt_bench_eval_only": sum(r["id"].startswith("mtbench-") for r in rows),
                      "dropped_held_out_or_duplicate": dropped, "out": a.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
