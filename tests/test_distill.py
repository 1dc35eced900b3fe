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


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {}}}}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
RESULT = {"role": "tool", "content": '{"temp_c": -4}', "tool_call_id": "c1"}
ANSWER = {"role": "assistant", "content": "Minus four."}


@pytest.fixture(scope="module")
def llama31_tok(engine):
    """The engine's (SmolLM2) tokenizer with Llama-3.1's template, which writes the tools into the prompt."""
    import copy

    tok = copy.deepcopy(engine.tokenizer)
    tok.chat_template = (Path(__file__).parent / "data" / "templates" / "llama-3.1-8b-instruct.jinja").read_text()
    return tok


def test_the_target_replies_to_tool_results_and_never_writes_them(engine, llama31_tok, tmp_path):
    """A conversation that ends on tool results gets the target's reply, asked with the record's tools; the
    calls and results are copied as given; a complete agentic conversation passes through."""
    from eagle3_ray.data.sources import read_samples

    ends_on_result = Sample("open", [_user("Weather in Oslo?"), CALL, RESULT], "t:1", TOOLS)
    complete = Sample("full", [_user("Weather in Oslo?"), CALL, RESULT, ANSWER], "t:2", TOOLS)
    rec = RecordingEngine(engine)
    summary = self_distill(rec, llama31_tok, [ends_on_result, complete], tmp_path / "out.jsonl", MAX_NEW)
    out = {r["id"]: r for r in _records(tmp_path / "out.jsonl")}
    assert out["open"]["conversations"][:3] == ends_on_result.messages
    assert [m["role"] for m in out["open"]["conversations"]] == ["user", "assistant", "tool", "assistant"]
    assert out["full"]["conversations"] == complete.messages and out["full"]["tools"] == TOOLS
    assert rec.calls == [[render_generation_prompt(llama31_tok, ends_on_result.messages, TOOLS)]]
    prompt = llama31_tok.decode(rec.calls[0][0])
    assert "Weather of a city" in prompt and prompt.endswith('"{\\"temp_c\\": -4}"<|eot_id|><|start_header_id|>'
                                                              "assistant<|end_header_id|>\n\n")
    assert (summary.generated, summary.passed_through) == (1, 1)
    # The output reads back as the same agentic records.
    back = {s.sample_id: s for s in read_samples(tmp_path / "out.jsonl")}
    assert back["full"].messages == complete.messages and back["full"].tools == TOOLS


def test_regenerate_after_tools_rewrites_only_the_answers_to_results(engine, llama31_tok, tmp_path):
    sample = Sample("full", [_user("Weather in Oslo?"), CALL, RESULT, ANSWER, _user("Thanks!"),
                             {"role": "assistant", "content": "You're welcome."}], "t:2", TOOLS)
    rec = RecordingEngine(engine)
    self_distill(rec, llama31_tok, [sample], tmp_path / "out.jsonl", MAX_NEW, regenerate_after_tools=True)
    (record,) = _records(tmp_path / "out.jsonl")
    conv = record["conversations"]
    assert conv[:3] == sample.messages[:3] and conv[4:] == sample.messages[4:]
    assert conv[3]["role"] == "assistant" and conv[3] != ANSWER
    assert rec.calls == [[render_generation_prompt(llama31_tok, sample.messages[:3], TOOLS)]]


def test_reasoning_before_the_close_marker_becomes_reasoning_content(engine):
    """A target that reasons (its prompt opens <think>, or it writes one) gets its reasoning apart from its
    answer: with </think> as one special token, as plain text, and cut off before the marker."""
    import copy

    from eagle3_ray.data.distill import answer_message

    plain = engine.tokenizer
    special = copy.deepcopy(plain)
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    for tok in (plain, special):
        enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        opened = enc("<|im_start|>assistant\n<think>")
        assert answer_message(tok, opened, enc("Add them.</think>It is 4.<|im_end|>")) == {
            "role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."}
        assert answer_message(tok, enc("assistant\n"), enc("<think>\nAdd.\n</think>\n\n4")) == {
            "role": "assistant", "content": "4", "reasoning_content": "Add."}
        assert answer_message(tok, opened, enc("Still thinking")) == {
            "role": "assistant", "content": "", "reasoning_content": "Still thinking"}
        assert answer_message(tok, enc("assistant\n"), enc("Just 4.")) == {"role": "assistant", "content": "Just 4."}
