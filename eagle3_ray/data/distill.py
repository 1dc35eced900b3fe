"""Self-distillation: the target answers prompt-only samples, so the drafter learns its own outputs.

Resumable by construction: records are appended batch by batch (flush + fsync) as
``{"id", "conversations": [{"role", "content"}]}`` lines (plus ``"greedy_by"``: the target's
fingerprint, on answers written at temperature 0); a rerun skips every id already in the
output and drops a trailing partial line left by a crash. Multi-turn prompt-only samples (MT-bench
``turns``) are answered turn by turn, each turn seeing the target's earlier answers; the samples
of a batch are generated together, one ``engine.generate`` call per turn index.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from eagle3_ray.data.chat import render_generation_prompt
from eagle3_ray.data.sources import Sample
from eagle3_ray.engines.base import TargetEngine
from eagle3_ray.errors import ConfigError, DataError, EngineError
from eagle3_ray.progress import say

Progress = Callable[[int, int], None]  # (samples done, samples total)


@dataclass
class DistillSummary:
    total: int  # samples given
    skipped: int  # already in the output (earlier run) or repeated ids
    generated: int  # prompt-only samples answered in this run
    passed_through: int  # samples that already had assistant turns, written unchanged
    empty_answers: int  # answers that decoded to empty text; readers reject those samples later
    new_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float


def self_distill(
    engine: TargetEngine,
    tokenizer: Any,
    samples: Iterable[Sample],
    out_path: str | Path,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    seed: int = 0,
    progress: Progress | None = None,
    answered_by: str = "",
) -> DistillSummary:
    """Answer every sample that needs generation and append all samples to ``out_path`` (JSONL).
    ``answered_by``: the target's fingerprint (the feature store's ``target_fingerprint``), written as
    ``greedy_by`` on the answers written here at temperature 0."""
    if batch_size < 1:
        raise ConfigError(f"generate.batch_size={batch_size}: must be >= 1")
    t0 = time.monotonic()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = list(samples)
    todo = _pending(samples, written_ids(out))
    sampling = _Sampling(max_new_tokens, temperature, top_p)
    summary = DistillSummary(len(samples), len(samples) - len(todo), 0, 0, 0, 0, 0.0)
    report = progress or _LinePrinter(start=summary.skipped)
    batches = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
    seeds, calls = [], 0
    for batch in batches:  # each batch's first seed, as if answered one after the other
        seeds.append(seed + calls)
        calls += _calls_needed(batch)
    # Greedy answers carry the target's fingerprint: the capture audit checks that the captured states
    # predict them (docs/feature-store.md, "Capture audit").
    greedy_by = answered_by if temperature == 0 else ""
    with open(out, "a", encoding="utf-8") as f, _Answering(engine, tokenizer, sampling) as answering:
        done = 0
        for batch, (convs, stats) in zip(batches, answering.in_order(batches, seeds)):
            start, done = done, done + len(batch)
            _append(f, [_record(s, c, greedy_by) for s, c in zip(batch, convs)])
            summary.generated += sum(s.needs_generation for s in batch)
            summary.passed_through += sum(not s.needs_generation for s in batch)
            summary.empty_answers += stats["empty"]
            summary.new_tokens += stats["tokens"]
            report(summary.skipped + start + len(batch), summary.total)
    summary.seconds = round(time.monotonic() - t0, 3)
    return summary


def written_ids(out: Path) -> set[str]:
    """Ids already in ``out``; a trailing partial line (crash mid-write) is cut off the file."""
    if not out.exists():
        return set()
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(out, "r+b") as f:
            f.truncate(end)
    ids = set()
    for lineno, line in enumerate(data[:end].split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            ids.add(str(json.loads(line)["id"]))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{out}:{lineno} is not a self-distillation record ({e!r}); fix or delete that line, "
                "or write to a new output file"
            ) from None
    return ids


def _pending(samples: list[Sample], done: set[str]) -> list[Sample]:
    todo, seen = [], set(done)
    for s in samples:
        if s.sample_id not in seen:
            seen.add(s.sample_id)
            todo.append(s)
    return todo


class _Answering:
    """Answers batches in order. An engine that batches across calls (``engine.calls_in_flight`` > 1:
    SGLang's scheduler fills each forward from every request it holds) gets that many batches at
    once, from threads, so that it always holds the next batch's requests: one call at a time left
    it decoding only a batch's longest answers at the end of each call. Others, one at a time."""

    def __init__(self, engine: TargetEngine, tokenizer: Any, sampling: _Sampling):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.width = max(1, int(getattr(engine, "calls_in_flight", 1) or 1))
        self.pool = None
        if self.width > 1:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(self.width, thread_name_prefix="eagle3-ray-distill")

    def __enter__(self) -> "_Answering":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if self.pool is not None:  # on an error or an interrupt, the calls in flight are not waited for
            self.pool.shutdown(wait=exc_type is None, cancel_futures=True)

    def in_order(self, batches: list[list[Sample]], seeds: list[int]):
        answer = lambda b, s: _answer_batch(self.engine, self.tokenizer, b, self.sampling, s)  # noqa: E731
        if self.pool is None:
            for batch, first_seed in zip(batches, seeds):
                yield answer(batch, first_seed)
            return
        from collections import deque

        pending: deque = deque()
        jobs = iter(zip(batches, seeds))
        for batch, first_seed in jobs:
            pending.append(self.pool.submit(answer, batch, first_seed))
            if len(pending) >= self.width:
                break
        while pending:
            result = pending.popleft().result()
            nxt = next(jobs, None)
            if nxt is not None:
                pending.append(self.pool.submit(answer, *nxt))
            yield result


def _calls_needed(batch: list[Sample]) -> int:
    """The engine calls ``_answer_batch`` makes for ``batch``: one per user turn of its longest question."""
    longest = 0
    for s in batch:
        if s.needs_generation:
            q = list(s.messages)
            while q and q[0]["role"] != "user":
                q.pop(0)
            longest = max(longest, len(q))
    return longest


def _answer_batch(
    engine: TargetEngine, tokenizer: Any, batch: list[Sample], sampling: _Sampling, seed: int
) -> tuple[list[list[dict]], dict[str, int]]:
    """Conversations of the batch with every user turn of prompt-only samples answered."""
    convs = [[dict(m) for m in s.messages] if not s.needs_generation else [] for s in batch]
    questions = [[dict(m) for m in s.messages] if s.needs_generation else [] for s in batch]
    for i, q in enumerate(questions):
        # The system message (if any) leads; each user turn is answered before the next is asked.
        while q and q[0]["role"] != "user":
            convs[i].append(q.pop(0))
    stats = {"calls": 0, "empty": 0, "tokens": 0}
    for turn in range(max((len(q) for q in questions), default=0)):
        rows = [i for i, q in enumerate(questions) if turn < len(q)]
        for i in rows:
            convs[i].append(questions[i][turn])
        prompts = [render_generation_prompt(tokenizer, convs[i]) for i in rows]
        answers = engine.generate(
            prompts, sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed + stats["calls"]
        )
        if len(answers) != len(prompts):
            raise EngineError(f"engine.generate returned {len(answers)} answers for {len(prompts)} prompts")
        stats["calls"] += 1
        for i, new_ids in zip(rows, answers):
            text = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
            convs[i].append({"role": "assistant", "content": text})
            stats["empty"] += not text
            stats["tokens"] += len(new_ids)
    return convs, stats


def _record(sample: Sample, conversation: list[dict], greedy_by: str) -> dict[str, Any]:
    """The output line of ``sample``: its answered conversation, and ``greedy_by`` (the fingerprint of
    the target that answered it greedily) for a sample answered here, or the one it came with."""
    rec: dict[str, Any] = {"id": sample.sample_id, "conversations": conversation}
    mark = greedy_by if sample.needs_generation else sample.greedy_by
    if mark:
        rec["greedy_by"] = mark
    return rec


def _append(f, records: list[dict]) -> None:
    """One write per batch, forced to disk, so a stopped run loses at most the batch in flight."""
    f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    f.flush()
    os.fsync(f.fileno())


class _LinePrinter:
    """Default progress: one line per batch with samples/s and ETA."""

    def __init__(self, start: int) -> None:
        self.t0 = time.monotonic()
        self.start = start  # samples/s counts this run only, not the skipped ones

    def __call__(self, done: int, total: int) -> None:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        rate = (done - self.start) / elapsed
        eta = (total - done) / rate if rate > 0 else float("nan")
        say(f"[self-distill] {done}/{total} samples, {rate:.2f} samples/s, ETA {eta:.0f}s", sys.stderr)
