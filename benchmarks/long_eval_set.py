"""Long multi-turn conversations from the public sets in ../shared/data, for the long-sample work
(docs/data.md, "Long samples"), and the two tools that go with them.

  build  Conversations of user turns, concatenated from the sets (each shuffled, seeded, then taken in
         turn, so that a conversation mixes them) until the rendered conversation (SmolLM2's chat
         template; each earlier turn answered by a placeholder of --answer-tokens tokens, the last turn's
         answer reserved too) reaches a length bucket: with --buckets 2048,4096,6144,8192 a conversation
         of bucket 4096 ends between 2,048 and 4,096 - --margin tokens. --sources eval takes the held-out sets (MT-bench, Spec-Bench without its MT-bench
         copy, GSM8K test, HumanEval); --sources train the sets benchmarks/train_prompts.py trains on
         (GSM8K train, AlpacaEval, Arena-Hard, ShareGPT-500, OASST; minus any text of the held-out sets).
         A source record's turns stay together and in order (MT-bench's second turn refers to its first).
  split  The 2K baseline's data: answered conversations (the generate stage's conversations.jsonl) cut at
         turn boundaries into conversations of at most --max-tokens rendered tokens, each answer kept whole
         in one piece (an exchange longer than that alone is one piece, which prepare then truncates or
         rejects): the same answers, trained with at most --max-tokens of context. Ids <id>@p<k> (a copy's
         #s<n> suffix stays last, so its prompt's answers are still held out together).
  tau    tau by context length: a bench stage's per-turn records (<bench out>/partial/*.json) pooled by
         each turn's prompt tokens into the --buckets ranges, per decoding mode; several bench dirs side by
         side, two compared turn by turn (benchmarks/long_tau.py).

Why user turns only, in MT-bench's form ({"question_id", "category", "turns"}): it is the one form both
the bench (`bench.prompts`) and the training data path (the generate stage answers it turn by turn) read.
The bench answers each turn with the target's greedy answer as the next turn's context, and records every
turn's context length (`prompt_tokens`) beside its acceptance: so tau is measured by real speculative
decoding, on the target's own continuations, bucketed by the context each turn actually had. ../shared/data
has no long conversations with real assistant turns (OASST-100's threads are 2 to 4 short turns), and
a held-out evaluation in training sees only samples within that run's data.max_length, so a drafter
trained at 2K could not be evaluated on 8K there. The category is the bucket ("2k", "4k", ...), so the
bench resumes bucket by bucket.

Every record names its parts (`provenance`: set, id, turns) and its estimate (`estimated_tokens`: the last
turn's rendered prompt with placeholder answers, plus --answer-tokens). The bench's answers end at EOS or
bench.max_new_tokens, so a turn's real context is at most the estimate when --answer-tokens is
bench.max_new_tokens. Deterministic: the same --data, --seed and options give the same file.

    python benchmarks/long_eval_set.py build --data ../shared/data --out long_eval.jsonl --per-bucket 12 --answer-tokens 128
    python benchmarks/long_eval_set.py build --data ../shared/data --sources train --out long_train.jsonl \
        --per-bucket 0 --answer-tokens 256          # 0: until the sets are used up, round-robin over buckets
    python benchmarks/long_eval_set.py split --conversations runs/long/generate/conversations.jsonl --max-tokens 2048 \
        --out split_2k.jsonl
    python benchmarks/long_eval_set.py tau --bench runs/long/bench runs/short/bench --labels long,2k --out tau.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from long_tau import bucket_label, tau_report  # noqa: E402  (this directory's tau by context length)

DEFAULT_BUCKETS = "2048,4096,6144,8192"
_COPY = re.compile(r"^(.*?)(#s\d+)?$", re.S)


def _lines(path: Path):
    for line in path.read_text(encoding="utf-8").split("\n"):  # not splitlines: prompts hold U+2028
        if line.strip():
            yield json.loads(line)


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    if spec == "smollm2":
        from eagle3_ray.engines.targets import smollm2_dir

        spec = str(smollm2_dir())
    return AutoTokenizer.from_pretrained(spec)


# --- sources ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One source record: its user turns, kept together and in order."""

    uid: str
    set: str
    turns: tuple[str, ...]


def eval_units(data: Path) -> list[Unit]:
    """The held-out sets of benchmarks/train_prompts.py, each text once (Spec-Bench's MT-bench copy out)."""
    units: list[Unit] = []
    for r in _lines(data / "mt_bench.jsonl"):
        units.append(Unit(f"mt_bench:{r['question_id']}", "mt_bench", tuple(t.strip() for t in r["turns"])))
    for r in _lines(data / "spec_bench.jsonl"):
        units.append(Unit(f"spec_bench:{r['question_id']}", f"spec_bench/{r.get('category', '')}",
                          tuple(t.strip() for t in r["turns"])))
    for i, r in enumerate(_lines(data / "gsm8k_test.jsonl")):
        units.append(Unit(f"gsm8k_test:{i}", "gsm8k_test", (r["question"].strip(),)))
    for r in _lines(data / "humaneval.jsonl"):
        units.append(Unit(f"humaneval:{r['task_id']}", "humaneval", (r["prompt"].strip(),)))
    return _unique(units)


def train_units(data: Path) -> list[Unit]:
    """The prompts benchmarks/train_prompts.py trains on, without any text of the held-out sets."""
    import train_prompts

    held = train_prompts.held_out_texts(data)
    units = [Unit(f"train:{sid}", sid.split("-", 1)[0], (prompt,)) for sid, prompt in train_prompts.collect(data)
             if prompt not in held]
    return _unique(units)


def _unique(units: list[Unit]) -> list[Unit]:
    seen: set[str] = set()
    out = []
    for u in units:
        if u.turns and all(u.turns) and u.turns[0] not in seen:
            seen.add(u.turns[0])
            out.append(u)
    return out


def interleaved(units: list[Unit], rng: random.Random) -> list[Unit]:
    """Each set shuffled, then one unit of each set in turn (sets in first-seen order), so that every
    conversation mixes the sets instead of being mostly the largest (GSM8K: 1,319 of 1,883 eval units)."""
    groups: dict[str, list[Unit]] = {}
    for u in units:
        groups.setdefault(u.set.split("/")[0], []).append(u)
    for g in groups.values():
        rng.shuffle(g)
    longest = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(longest) for g in groups.values() if i < len(g)]


# --- lengths --------------------------------------------------------------------------------------


class Lengths:
    """Rendered token counts of a conversation of user turns, each earlier turn answered by a placeholder
    of ``answer_tokens`` tokens, with the generation prompt of the last turn; grown turn by turn, only the
    new text tokenized (the template renders history unchanged; else the whole text is)."""

    def __init__(self, tok, answer_tokens: int):
        from eagle3_ray.data.chat import render

        self.tok, self.render, self.answer_tokens = tok, render, answer_tokens
        self.placeholder = "a" + " a" * (answer_tokens - 1)  # answer_tokens tokens in SmolLM2's tokenizer

    def ntok(self, text: str) -> int:
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def messages(self, turns: list[str]) -> list[dict]:
        msgs: list[dict] = []
        for i, t in enumerate(turns):
            if i:
                msgs.append({"role": "assistant", "content": self.placeholder})
            msgs.append({"role": "user", "content": t})
        return msgs

    def text(self, turns: list[str]) -> str:
        return self.render(self.tok, self.messages(turns), add_generation_prompt=True)

    def grow(self, state: tuple[str, int] | None, turns: list[str]) -> tuple[str, int]:
        """(text, tokens) of ``turns``' last prompt, from ``state`` of a prefix of them."""
        text = self.text(turns)
        if state is not None and text.startswith(state[0]):
            return text, state[1] + self.ntok(text[len(state[0]):])
        return text, self.ntok(text)


def build(units: list[Unit], tok, buckets: list[int], per_bucket: int, answer_tokens: int, seed: int,
          margin: int, prefix: str, max_skips: int = 24) -> tuple[list[dict], dict]:
    """Conversations per bucket, round-robin over the buckets, from a seeded shuffle of ``units``."""
    lengths = Lengths(tok, answer_tokens)
    uppers = {b: b - margin for b in buckets}
    lowers = dict(zip(buckets, [buckets[0] // 2, *buckets[:-1]]))
    deck = interleaved(units, random.Random(seed))
    too_long = [u for u in deck if lengths.grow(None, list(u.turns))[1] + answer_tokens > uppers[buckets[-1]]]
    skip_ids = {u.uid for u in too_long}
    deck = [u for u in deck if u.uid not in skip_ids]
    made = {b: 0 for b in buckets}
    records: list[dict] = []
    open_buckets = list(buckets)
    while open_buckets and deck:
        for b in list(open_buckets):
            conv = _one(deck, lengths, lowers[b], uppers[b], max_skips)
            if conv is None:  # the deck cannot fill this bucket any more
                open_buckets.remove(b)
                continue
            made[b] += 1
            turns, parts, n = conv
            records.append({
                "question_id": f"{prefix}-{bucket_label(b)}-{made[b] - 1:04d}", "category": bucket_label(b),
                "turns": turns,
                "bucket_tokens": b, "estimated_tokens": n, "answer_tokens": answer_tokens, "num_turns": len(turns),
                "provenance": [{"set": u.set, "id": u.uid, "turns": len(u.turns)} for u in parts], "seed": seed,
            })
            if per_bucket and made[b] >= per_bucket:
                open_buckets.remove(b)
    stats = {"conversations": {bucket_label(b): made[b] for b in buckets}, "units_left": len(deck),
             "units_too_long": len(too_long)}
    return records, stats


def _one(deck: list[Unit], lengths: Lengths, lower: int, upper: int, max_skips: int):
    """Take units off the front of ``deck`` while the conversation fits ``upper``; units that would not
    fit go back to the front for the next conversation. (turns, units, estimated tokens) or None."""
    turns: list[str] = []
    parts: list[Unit] = []
    state = None
    skipped: list[Unit] = []
    i = 0
    while i < len(deck) and len(skipped) < max_skips:
        unit = deck[i]
        cand = lengths.grow(state, turns + list(unit.turns))
        if cand[1] + lengths.answer_tokens > upper:
            skipped.append(unit)
            i += 1
            continue
        turns, state = turns + list(unit.turns), cand
        parts.append(unit)
        i += 1
    if not parts or state[1] + lengths.answer_tokens <= lower:
        return None  # what is left cannot reach this bucket: leave the deck as it was
    taken = {u.uid for u in parts}
    deck[:] = [u for u in deck if u.uid not in taken]
    exact = lengths.ntok(lengths.text(turns)) + lengths.answer_tokens  # the growth above, checked whole
    return turns, parts, exact


# --- split ----------------------------------------------------------------------------------------


def split_conversation(tok, rec: dict, max_tokens: int) -> list[dict]:
    """One answered conversation -> pieces of whole exchanges (user turn(s) + answer), each at most
    ``max_tokens`` rendered tokens where one exchange allows it; a trailing unanswered turn is dropped."""
    from eagle3_ray.data.chat import render

    msgs = rec.get("conversations") or rec.get("messages") or []
    system = [m for m in msgs[:1] if m.get("role") == "system"]
    exchanges, cur = [], []
    for m in msgs[len(system):]:
        cur.append(m)
        if m.get("role") == "assistant":
            exchanges.append(cur)
            cur = []

    def ntok(ex: list[list[dict]]) -> int:
        text = render(tok, system + [m for e in ex for m in e])
        return len(tok(text, add_special_tokens=False)["input_ids"])

    pieces: list[tuple[int, int]] = []  # [first, last] exchange indices
    start = 0
    while start < len(exchanges):
        end = start + 1
        while end < len(exchanges) and ntok(exchanges[start:end + 1]) <= max_tokens:
            end += 1
        pieces.append((start, end))
        start = end
    base, copy = _COPY.match(str(rec["id"])).groups()
    return [{"id": f"{base}@p{k}{copy or ''}", "conversations": system + [m for e in exchanges[a:b] for m in e],
             "split_from": rec["id"], "exchanges": [a, b], "tokens": ntok(exchanges[a:b])}
            for k, (a, b) in enumerate(pieces)]


# --- a fixed history ------------------------------------------------------------------------------


def with_answers(records: list[dict], conversations: list[dict]) -> tuple[list[dict], int]:
    """The evaluation set's records with ``"answers"``, the assistant replies of a generate stage's
    answered conversations (matched by id: the record's question_id, a copy's ``#s<k>`` suffix ignored,
    the first copy kept), so that every bench decodes the same turns after the same history. Returns the
    records and how many got their answers; a record without its conversation, or with fewer replies than
    it needs, is left without (the bench's baseline answers it)."""
    answered: dict[str, list[str]] = {}
    for c in conversations:
        base = str(c.get("id", "")).split("#", 1)[0]
        msgs = c.get("conversations") or c.get("messages") or []
        answered.setdefault(base, [m["content"] for m in msgs if m.get("role") == "assistant"])
    out, n = [], 0
    for r in records:
        replies = answered.get(str(r.get("question_id")))
        turns = r["turns"]
        if replies is not None and len(replies) >= len(turns) - 1 and all(a.strip() for a in replies[: len(turns)]):
            r = {**r, "answers": replies[: len(turns)]}
            n += 1
        out.append(r)
    return out, n


# --- tau by context length ------------------------------------------------------------------------


# --- main -----------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="long multi-turn conversations (MT-bench form) from ../shared/data")
    b.add_argument("--data", default="../shared/data")
    b.add_argument("--out", required=True)
    b.add_argument("--sources", choices=["eval", "train"], default="eval")
    b.add_argument("--buckets", default=DEFAULT_BUCKETS, help="upper bounds in tokens, ascending")
    b.add_argument("--per-bucket", type=int, default=12, help="conversations per bucket (0: until the sets run out)")
    b.add_argument("--answer-tokens", type=int, default=128,
                   help="tokens reserved per answer (bench.max_new_tokens, or generate.max_new_tokens for training)")
    b.add_argument("--margin", type=int, default=64, help="tokens left free under each bucket (verify width)")
    b.add_argument("--tokenizer", default="smollm2", help="'smollm2' (the embedded one) or a tokenizer directory")
    b.add_argument("--prefix", default=None, help="id prefix (default: long for eval, longtrain for train)")
    b.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("split", help="answered conversations -> pieces of at most --max-tokens")
    s.add_argument("--conversations", required=True, help="JSONL of {id, conversations} (generate's output)")
    s.add_argument("--out", required=True)
    s.add_argument("--max-tokens", type=int, default=2048)
    s.add_argument("--tokenizer", default="smollm2")
    h = sub.add_parser("thin", help="every --every-th conversation of each bucket (a smaller set of the same spread)")
    h.add_argument("--input", required=True, help="a build's JSONL")
    h.add_argument("--out", required=True)
    h.add_argument("--every", type=int, default=2)
    h.add_argument("--categories", default=None, help="comma-separated buckets to keep (default: all), e.g. 8k")
    y = sub.add_parser("history", help="the evaluation set with fixed answers (a generate stage's replies)")
    y.add_argument("--input", required=True, help="the evaluation set (a build's JSONL)")
    y.add_argument("--conversations", required=True, help="generate's conversations.jsonl over that set")
    y.add_argument("--out", required=True)
    t = sub.add_parser("tau", help="tau by context length from bench stages' per-turn records")
    t.add_argument("--bench", nargs="+", required=True, help="bench stage --out dirs (with partial/)")
    t.add_argument("--labels", default=None, help="comma-separated names of the bench dirs")
    t.add_argument("--buckets", default=DEFAULT_BUCKETS, help="bucket edges in prompt tokens")
    t.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args(argv)

    if a.cmd == "build":
        buckets = sorted(int(x) for x in a.buckets.split(","))
        if a.answer_tokens < 1 or a.margin < 0 or buckets[0] <= a.margin + a.answer_tokens:
            ap.error("--answer-tokens >= 1, --margin >= 0 and the smallest bucket above both")
        data = Path(a.data)
        units = eval_units(data) if a.sources == "eval" else train_units(data)
        tok = load_tokenizer(a.tokenizer)
        prefix = a.prefix or ("long" if a.sources == "eval" else "longtrain")
        records, stats = build(units, tok, buckets, a.per_bucket, a.answer_tokens, a.seed, a.margin, prefix)
        Path(a.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        print(json.dumps({"out": a.out, "sources": a.sources, "units": len(units), **stats,
                          "turns": sum(r["num_turns"] for r in records),
                          "estimated_tokens": sum(r["estimated_tokens"] for r in records)}))
    elif a.cmd == "split":
        tok = load_tokenizer(a.tokenizer)
        pieces, n_in, over = [], 0, 0
        for rec in _lines(Path(a.conversations)):
            n_in += 1
            for p in split_conversation(tok, rec, a.max_tokens):
                over += p["tokens"] > a.max_tokens
                pieces.append(p)
        Path(a.out).write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pieces), encoding="utf-8")
        print(json.dumps({"out": a.out, "conversations": n_in, "pieces": len(pieces), "over_max_tokens": over,
                          "max_tokens": a.max_tokens, "tokens": sum(p["tokens"] for p in pieces)}))
    elif a.cmd == "history":
        records, n = with_answers(list(_lines(Path(a.input))), list(_lines(Path(a.conversations))))
        Path(a.out).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
        print(json.dumps({"out": a.out, "records": len(records), "with_answers": n}))
    elif a.cmd == "thin":
        if a.every < 1:
            ap.error("--every >= 1")
        seen: dict[str, int] = {}
        kept = []
        for line in Path(a.input).read_text(encoding="utf-8").split("\n"):  # not splitlines: U+2028 in a turn
            if not line.strip():
                continue
            r = json.loads(line)
            at = seen[r["category"]] = seen.get(r["category"], -1) + 1
            if at % a.every == 0 and (a.categories is None or r["category"] in a.categories.split(",")):
                kept.append(line + "\n")
        Path(a.out).write_text("".join(kept), encoding="utf-8")
        print(json.dumps({"out": a.out, "conversations": len(kept), "of": sum(c + 1 for c in seen.values()),
                          "turns": sum(json.loads(k)["num_turns"] for k in kept)}))
    else:
        labels = a.labels.split(",") if a.labels else [str(d) for d in a.bench]
        if len(labels) != len(a.bench):
            ap.error("--labels names each --bench dir")
        tau_report([Path(d) for d in a.bench], labels, sorted(int(x) for x in a.buckets.split(",")), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
