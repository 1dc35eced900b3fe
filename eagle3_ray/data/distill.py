"""Self-distillation: the target writes the assistant turns the data lacks, so the drafter learns its own outputs.

Which turns: every answer of a prompt-only sample, the reply to tool results that end a conversation,
and with ``regenerate_after_tools`` every turn that answers tool results without calling a tool
(``data.messages.answer_script``). Tool calls and tool results stay as the data gives them: the target
never invents a tool's result. Each turn is generated from the conversation so far, rendered with the
record's tools, the target's earlier answers included; the samples of a batch are generated together,
one ``engine.generate`` call per answer index.

An answer is stored as its decoded text (special tokens skipped, stripped). A target that reasons first
(its template opens ``<think>``, or it writes one) gets what it wrote before ``</think>`` as
``reasoning_content``, the rest as content: the template then keeps or drops the reasoning as it does
for served traffic (``data/chat.py``).

Resumable by construction: records are appended batch by batch (flush + fsync) as
``{"id", "conversations": [messages], "tools"?, "greedy_by"?}`` lines, read back as OpenAI-form
records; a rerun skips every id already in the output and drops a trailing partial line left by a
crash. ``greedy_by`` (the target's fingerprint) marks a sample whose every assistant turn the target
wrote here at temperature 0: the capture audit checks that the captured states predict those answers
(docs/feature-store.md, "Capture audit").
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
from eagle3_ray.data.messages import answer_script
from eagle3_ray.data.sources import Sample
from eagle3_ray.engines.base import TargetEngine
from eagle3_ray.errors import ConfigError, DataError, EngineError
from eagle3_ray.progress import say

Progress = Callable[[int, int], None]  # (samples done, samples total)


@dataclass
class DistillSummary:
    total: int  # samples given
    skipped: int  # already in the output (earlier run) or repeated ids
    generated: int  # samples with turns written by the target in this run
    passed_through: int  # samples with nothing to write, written unchanged
    empty_answers: int  # answers that decoded to empty text; readers reject those samples later
    new_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    regenerate_after_tools: bool = False


def needs_answers(sample: Sample, regenerate_after_tools: bool = False) -> bool:
    """The target writes at least one of ``sample``'s assistant turns (see the module doc)."""
    return None in answer_script(sample.messages, regenerate_after_tools)


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
    regenerate_after_tools: bool = False,
    answered_by: str = "",
) -> DistillSummary:
    """Write the turns each sample lacks (see the module doc) and append all samples to ``out_path`` (JSONL).
    ``answered_by``: the target's fingerprint (the feature store's ``target_fingerprint``), written as
    ``greedy_by`` on the samples whose every assistant turn is written here at temperature 0."""
    if batch_size < 1:
        raise ConfigError(f"generate.batch_size={batch_size}: must be >= 1")
    t0 = time.monotonic()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    samples = list(samples)
    todo = _pending(samples, written_ids(out))
    sampling = _Sampling(max_new_tokens, temperature, top_p, regenerate_after_tools)
    summary = DistillSummary(len(samples), len(samples) - len(todo), 0, 0, 0, 0, 0.0)
    report = progress or _LinePrinter(start=summary.skipped)
    batches = [todo[start : start + batch_size] for start in range(0, len(todo), batch_size)]
    seeds, calls = [], 0
    for batch in batches:  # each batch's first seed, as if answered one after the other
        seeds.append(seed + calls)
        calls += _calls_needed(batch, regenerate_after_tools)
    greedy_by = answered_by if temperature == 0 else ""
    with open(out, "a", encoding="utf-8") as f, _Answering(engine, tokenizer, sampling) as answering:
        done = 0
        for batch, (convs, stats) in zip(batches, answering.in_order(batches, seeds)):
            start, done = done, done + len(batch)
            _append(f, [_record(s, c, _greedy_mark(s, greedy_by, regenerate_after_tools))
                        for s, c in zip(batch, convs)])
            answered = sum(needs_answers(s, regenerate_after_tools) for s in batch)
            summary.generated += answered
            summary.passed_through += len(batch) - answered
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


def _calls_needed(batch: list[Sample], regenerate_after_tools: bool = False) -> int:
    """The engine calls ``_answer_batch`` makes for ``batch``: one per answer of its sample with the most."""
    return max((answer_script(s.messages, regenerate_after_tools).count(None) for s in batch), default=0)


def _answer_batch(
    engine: TargetEngine, tokenizer: Any, batch: list[Sample], sampling: _Sampling, seed: int
) -> tuple[list[list[dict]], dict[str, int]]:
    """Conversations of the batch with every turn of their ``answer_script`` written by the target."""
    scripts = [answer_script(s.messages, sampling.regenerate_after_tools) for s in batch]
    convs: list[list[dict]] = [[] for _ in batch]
    at = [0] * len(batch)  # next script entry of each sample

    def advance(i: int) -> None:  # copy the given messages up to the next answer to write (or the end)
        while at[i] < len(scripts[i]) and scripts[i][at[i]] is not None:
            convs[i].append(dict(scripts[i][at[i]]))
            at[i] += 1

    stats = {"calls": 0, "empty": 0, "tokens": 0}
    for answer in range(_calls_needed(batch, sampling.regenerate_after_tools)):
        rows = [i for i, script in enumerate(scripts) if script.count(None) > answer]
        for i in rows:
            advance(i)
        prompts = [render_generation_prompt(tokenizer, convs[i], batch[i].tools) for i in rows]
        answers = engine.generate(
            prompts, sampling.max_new_tokens, sampling.temperature, sampling.top_p, seed + stats["calls"]
        )
        if len(answers) != len(prompts):
            raise EngineError(f"engine.generate returned {len(answers)} answers for {len(prompts)} prompts")
        stats["calls"] += 1
        for i, prompt, new_ids in zip(rows, prompts, answers):
            message = answer_message(tokenizer, prompt, list(new_ids))
            convs[i].append(message)
            at[i] += 1
            stats["empty"] += not message["content"]
            stats["tokens"] += len(new_ids)
    for i in range(len(batch)):
        advance(i)
    return convs, stats


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def answer_message(tokenizer: Any, prompt: list[int], new_ids: list[int]) -> dict:
    """The assistant message of generated ``new_ids``: the text before ``</think>`` is its reasoning when
    the target reasons (the prompt ends with ``<think>`` or the answer opens one), the rest its content."""
    close = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    if isinstance(close, int) and close != tokenizer.unk_token_id and close in new_ids:  # </think> is one token
        cut = new_ids.index(close)
        reasoning = tokenizer.decode(new_ids[:cut], skip_special_tokens=True)
        content = tokenizer.decode(new_ids[cut + 1:], skip_special_tokens=True)
    else:
        text = tokenizer.decode(new_ids, skip_special_tokens=True)
        reasoning, sep, content = text.partition(THINK_CLOSE)
        if not sep:
            opened = tokenizer.decode(prompt[-4:]).rstrip().endswith(THINK_OPEN)
            reasoning, content = (text, "") if opened else ("", text)
    reasoning = reasoning.strip().removeprefix(THINK_OPEN).strip()
    message = {"role": "assistant", "content": content.strip()}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message


def _greedy_mark(sample: Sample, greedy_by: str, regenerate_after_tools: bool) -> str:
    """``greedy_by`` when the target writes every assistant turn of ``sample`` here, the mark the sample
    came with when it writes none, else "" (a conversation mixing given and written turns)."""
    script = answer_script(sample.messages, regenerate_after_tools)
    if None not in script:
        return sample.greedy_by
    given = any(m is not None and m["role"] == "assistant" for m in script)
    return "" if given else greedy_by


def _record(sample: Sample, conv: list[dict], greedy_by: str = "") -> dict:
    record: dict[str, Any] = {"id": sample.sample_id, "conversations": conv}
    if sample.tools:
        record["tools"] = sample.tools
    if greedy_by:
        record["greedy_by"] = greedy_by
    return record


def append_records(path: Path, lines: list[str]) -> None:
    """Appends records already in JSON (one line each) to the output ``path``, forced to disk as a
    batch of answers is (answers written earlier, taken by the generate stage: ``generate.answers``)."""
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(line.rstrip("\n") + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())


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
