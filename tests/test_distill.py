"""Self-distillation with the real HF engine on a seeded random tiny Llama (SmolLM2 tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_ray.config import TargetConfig
from eagle3_ray.data.chat import render_generation_prompt
from eagle3_ray.data.distill import self_distill, written_ids
from eagle3_ray.data.sources import Sample
from eagle3_ray.engines.hf import HFEngine
from eagle3_ray.errors import DataError

MAX_NEW = 6


@pytest.fixture(scope="module")
def engine():
    eng = HFEngine(TargetConfig(model="random:builtin:tiny-llama", device="cpu", dtype="float32"))
    yield eng
    eng.close()


class RecordingEngine:
    """Passes every call to the real engine and remembers the prompts of each generate call."""

    def __init__(self, inner: HFEngine):
        self.inner = inner
        self.info = inner.info
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        self.calls.append([list(p) for p in prompts])
        return self.inner.generate(prompts, max_new_tokens, temperature, top_p, seed)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _prompts(n: int) -> list[Sample]:
    return [Sample(f"p-{i}", [_user(f"Question number {i}?")], f"t:{i}") for i in range(n)]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_mixed_samples_multi_turn_answered_turn_by_turn(engine, tmp_path):
    tok = engine.tokenizer
    complete = Sample(
        "done", [_user("Hi"), {"role": "assistant", "content": "Hello!"}], "t:1"
    )
    mt = Sample(
        "mt", [{"role": "system", "content": "Be brief."}, _user("Name a color."), _user("Another one?")], "t:2"
    )
    samples = [_prompts(2)[0], complete, mt, _prompts(2)[1]]
    rec = RecordingEngine(engine)
    seen = []
    summary = self_distill(
        rec, tok, samples, tmp_path / "out.jsonl", MAX_NEW, batch_size=8,
        progress=lambda done, total: seen.append((done, total)),
    )
    out = {r["id"]: r["conversations"] for r in _records(tmp_path / "out.jsonl")}
    assert list(out) == ["p-0", "done", "mt", "p-1"]
    assert out["done"] == complete.messages
    assert [m["role"] for m in out["mt"]] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["role"] for m in out["p-0"]] == ["user", "assistant"]
    # One call per turn index: all first turns together, then the one second turn.
    assert [len(c) for c in rec.calls] == [3, 1]
    # The second turn is asked with the target's own first answer in context.
    assert rec.calls[1][0] == render_generation_prompt(tok, out["mt"][:4])
    expected = engine.generate(rec.calls[1], MAX_NEW)[0]
    assert out["mt"][4]["content"] == tok.decode(expected, skip_special_tokens=True).strip()
    assert (summary.total, summary.skipped, summary.generated, summary.passed_through) == (4, 0, 3, 1)
    assert 0 < summary.new_tokens <= 4 * MAX_NEW
    assert seen == [(4, 4)]


def test_stopped_run_resumes_without_duplicates(engine, tmp_path):
    out_path = tmp_path / "out.jsonl"
    samples = _prompts(5)

    def stop_after_first_batch(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        self_distill(engine, engine.tokenizer, samples, out_path, MAX_NEW, batch_size=2,
                     progress=stop_after_first_batch)
    assert [r["id"] for r in _records(out_path)] == ["p-0", "p-1"]
    with open(out_path, "a", encoding="utf-8") as f:
        f.write('{"id": "p-2", "conversations": [{"role": "us')  # a crash mid-write

    seen = []
    summary = self_distill(engine, engine.tokenizer, samples, out_path, MAX_NEW, batch_size=2,
                           progress=lambda d, t: seen.append(d))
    ids = [r["id"] for r in _records(out_path)]
    assert ids == ["p-0", "p-1", "p-2", "p-3", "p-4"]
    assert (summary.skipped, summary.generated) == (2, 3)
    assert seen == [4, 5]

    before = out_path.read_bytes()
    summary = self_distill(engine, engine.tokenizer, samples, out_path, MAX_NEW, batch_size=2)
    assert (summary.skipped, summary.generated, summary.new_tokens) == (5, 0, 0)
    assert out_path.read_bytes() == before


def test_corrupt_middle_line_is_an_error_not_a_silent_skip(tmp_path):
    out_path = tmp_path / "out.jsonl"
    out_path.write_text('{"id": "a", "conversations": []}\nnot json\n{"id": "b", "conversations": []}\n')
    with pytest.raises(DataError, match=r"out.jsonl:2 is not a self-distillation record"):
        written_ids(out_path)


class ConcurrentEngine:
    """The real engine behind an interface that batches across calls as SGLang's does
    (``calls_in_flight``): calls arrive from several threads; the answers are the real engine's
    (one call at a time inside, as the HF engine needs), each call held a while so they overlap."""

    calls_in_flight = 3

    def __init__(self, inner: HFEngine):
        import threading

        self.inner, self.info = inner, inner.info
        self.lock = threading.Lock()
        self.in_flight = self.most = 0
        self.seeds: list[int] = []

    def generate(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=0):
        import time

        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.seeds.append(seed)
        time.sleep(0.05)
        with self.lock:
            answers = self.inner.generate(prompts, max_new_tokens, temperature, top_p, seed)
            self.in_flight -= 1
        return answers


def test_an_engine_that_batches_across_calls_gets_several_in_flight_with_the_same_answers(engine, tmp_path):
    """Batches answered from threads land in input order, seeded as if one after the other, and
    sampled answers equal the one-call-at-a-time run's."""
    tok = engine.tokenizer
    mt = Sample("mt", [_user("Name a color."), _user("Another one?")], "t:2")
    samples = _prompts(7) + [mt] + _prompts(12)[7:]
    one = RecordingEngine(engine)
    self_distill(one, tok, samples, tmp_path / "one.jsonl", MAX_NEW, temperature=0.9, batch_size=2, seed=5)
    many = ConcurrentEngine(engine)
    summary = self_distill(many, tok, samples, tmp_path / "many.jsonl", MAX_NEW, temperature=0.9, batch_size=2, seed=5)
    assert many.most == 3  # three batches in flight at once
    assert _records(tmp_path / "many.jsonl") == _records(tmp_path / "one.jsonl")
    # batch 4 holds the two-turn sample: two calls, so batch 5 starts two seeds later
    assert sorted(many.seeds) == list(range(5, 13))  # 7 batches, 8 calls
    assert summary.generated == 13
