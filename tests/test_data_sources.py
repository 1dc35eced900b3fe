"""Conversation readers: every accepted form, per-sample quarantine of bad records, builtin sets."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3_ray.data.sources import Reject, Sample, read_samples, resolve_data_path
from eagle3_ray.errors import DataError

DATA = Path(__file__).parent / "data"
BAD = DATA / "bad"
SHARED = Path("/work/shared/data")


def _read(path, **kw) -> list[Sample | Reject]:
    return list(read_samples(str(path), **kw))


def _rejects(items) -> list[Reject]:
    return [r for r in items if isinstance(r, Reject)]


def _samples(items) -> list[Sample]:
    return [s for s in items if isinstance(s, Sample)]


def test_every_accepted_form_is_normalised():
    items = _read(DATA / "all_forms.jsonl")
    assert _rejects(items) == []
    by_id = {s.sample_id: s for s in items}
    assert list(by_id) == [
        "sg-1", "oa-1", "oa-2", "all_forms-4", "7", "all_forms-6", "all_forms-7", "81",
        "HumanEval/0", "abc123", "all_forms-11",
    ]
    assert by_id["sg-1"].messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert [m["role"] for m in by_id["oa-1"].messages] == ["user", "assistant"] * 2
    assert by_id["oa-2"].messages[0]["role"] == "user"
    # Reference answers are ignored: the target answers prompts itself (self-distillation).
    assert by_id["7"].messages == [{"role": "user", "content": "Summarize the text.\n\nCats sleep a lot."}]
    assert by_id["all_forms-6"].messages == [{"role": "user", "content": "List two colors."}]
    assert by_id["all_forms-7"].messages[0]["content"].startswith("Tom has 3 apples")
    assert by_id["81"].messages == [
        {"role": "user", "content": "Write a limerick."},
        {"role": "user", "content": "Now make it about a cat."},
    ]
    assert by_id["all_forms-11"].messages == [{"role": "user", "content": "What is the tallest mountain?"}]
    assert [s.needs_generation for s in items] == [False, False, False] + [True] * 8
    assert by_id["abc123"].source == f"{DATA / 'all_forms.jsonl'}:10"


def test_json_array_file_uses_item_numbers():
    items = _read(DATA / "sharegpt_array.json")
    assert [type(i).__name__ for i in items] == ["Sample", "Sample", "Reject"]
    assert items[1].sample_id == "sharegpt_array-2" and items[1].needs_generation
    assert items[2].source.endswith("sharegpt_array.json:3")
    assert "first turn is assistant" in items[2].reason


@pytest.mark.parametrize(
    "name, bad_id, line, reason",
    [
        ("malformed_json.jsonl", "malformed_json-2", 2, "malformed JSON"),
        ("non_utf8.jsonl", "non_utf8-2", 2, "not valid UTF-8: byte 0xe9"),
        ("empty_conversation.jsonl", "empty", 2, "empty conversation"),
        ("unknown_role.jsonl", "narrator", 2, "turn 2: unknown role 'narrator'"),
        ("empty_content.jsonl", "blank", 2, "turn 2 (assistant): empty content"),
        ("duplicate_id.jsonl", "ok-1", 3, "duplicate id 'ok-1' (first at"),
        ("unrecognised_shape.jsonl", "odd", 2, "unrecognised record with keys ['id', 'text']"),
    ],
)
def test_bad_record_is_quarantined_and_reading_goes_on(name, bad_id, line, reason):
    items = _read(BAD / name)
    rejects = _rejects(items)
    assert rejects[0].sample_id == bad_id
    assert rejects[0].source == f"{BAD / name}:{line}"
    assert reason in rejects[0].reason
    # Good records before and after the bad one are still read.
    assert all(s.sample_id.startswith("ok-") for s in _samples(items))
    assert len(_samples(items)) >= 1


def test_wrong_role_order_names_the_turn():
    rejects = _rejects(_read(BAD / "wrong_role_order.jsonl"))
    assert [(r.sample_id, r.reason) for r in rejects] == [
        ("two-users", "wrong role order: turn 2 (after user) is user, expected assistant"),
        ("assistant-first", "wrong role order: the first turn is assistant, expected user"),
    ]


def test_a_bare_number_record_is_rejected_with_its_type():
    rejects = _rejects(_read(BAD / "unrecognised_shape.jsonl"))
    assert rejects[1].source.endswith(":3") and "record is a JSON number" in rejects[1].reason


@pytest.mark.parametrize(
    "path, message",
    [
        (BAD / "truncated_array.json", "not valid JSON"),
        (BAD / "empty_file.jsonl", "is empty"),
        (BAD, "is a directory"),
        (BAD / "missing.jsonl", "does not exist"),
    ],
)
def test_unreadable_file_raises_data_error(path, message):
    with pytest.raises(DataError, match=message):
        _read(path)


def test_max_samples_counts_samples_not_rejects():
    items = _read(BAD / "duplicate_id.jsonl", max_samples=2)
    assert [s.sample_id for s in items] == ["ok-1", "ok-2"]
    items = _read(BAD / "malformed_json.jsonl", max_samples=2)
    assert [type(i).__name__ for i in items] == ["Sample", "Reject", "Sample"]


def test_system_prompt_is_added_only_where_missing():
    items = {s.sample_id: s for s in _read(DATA / "all_forms.jsonl", system_prompt="Be brief.")}
    assert items["sg-1"].messages[0] == {"role": "system", "content": "Be kind."}
    assert items["oa-1"].messages[0] == {"role": "system", "content": "Be brief."}
    assert items["81"].messages[0]["role"] == "system" and items["81"].needs_generation


def test_explicit_format_rejects_other_forms():
    items = _read(DATA / "all_forms.jsonl", format="sharegpt")
    assert [s.sample_id for s in _samples(items)] == ["sg-1"]
    assert "openai form but data.format='sharegpt'" in _rejects(items)[0].reason
    items = _read(DATA / "all_forms.jsonl", format="prompts")
    assert len(_samples(items)) == 8 and all(s.needs_generation for s in _samples(items))


def test_builtin_names_resolve_inside_the_package():
    for name in ("demo_prompts", "demo_eval", "ci_tiny"):
        path = resolve_data_path(f"builtin:{name}")
        assert path.is_file() and path.parent.name == "resources" and path.parent.parent.name == "eagle3_ray"
    with pytest.raises(DataError, match="builtin:ci_tiny"):
        resolve_data_path("builtin:nope")


def test_demo_prompts_are_300_unique_single_turn_prompts():
    items = _read("builtin:demo_prompts")
    assert _rejects(items) == []
    assert len(items) == 300
    assert [s.sample_id for s in items] == [f"demo-{i:04d}" for i in range(1, 301)]
    assert all(s.needs_generation and len(s.messages) == 1 for s in items)
    assert len({s.messages[0]["content"] for s in items}) == 300


def test_demo_math_sets_are_gsm8k_questions_split_apart():
    """`make demo`'s workload: 220 GSM8K train questions to answer, 16 GSM8K test questions to bench,
    none in both (benchmarks/demo_math_data.py wrote them; GSM8K_LICENSE.md beside them)."""
    items = _read("builtin:demo_math_prompts")
    assert _rejects(items) == [] and len(items) == 220
    assert all(s.needs_generation and len(s.messages) == 1 and s.sample_id.startswith("gsm8k-train-") for s in items)
    train = {s.messages[0]["content"] for s in items}
    assert len(train) == 220
    evals = _read("builtin:demo_math_eval")
    assert _rejects(evals) == [] and len(evals) == 16 and all(len(s.messages) == 1 for s in evals)
    assert not train & {s.messages[0]["content"] for s in evals}
    assert (resolve_data_path("builtin:demo_math_prompts").parent / "GSM8K_LICENSE.md").is_file()


def test_demo_eval_is_mt_bench_shaped():
    lines = resolve_data_path("builtin:demo_eval").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    assert Counter(r["category"] for r in records) == {
        c: 3 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
    }
    assert all(len(r["turns"]) == 2 for r in records)
    items = _read("builtin:demo_eval")
    assert _rejects(items) == [] and len(items) == 24
    assert all(s.needs_generation and len(s.messages) == 2 for s in items)


def test_ci_tiny_is_complete_conversations():
    items = _read("builtin:ci_tiny")
    assert _rejects(items) == [] and len(items) == 12
    assert not any(s.needs_generation for s in items)
    assert any(s.messages[0]["role"] == "system" for s in items)
    assert any(sum(m["role"] == "assistant" for m in s.messages) > 1 for s in items)
    assert all(s.messages[-1]["role"] == "assistant" for s in items)


@pytest.mark.skipif(not SHARED.is_dir(), reason="the shared public data sets are not on this machine")
@pytest.mark.parametrize(
    "name, count",
    [
        ("mt_bench.jsonl", 80),
        ("humaneval.jsonl", 164),
        ("arena_hard_v0.1.jsonl", 500),
        ("alpaca_eval_prompts.jsonl", 805),
        ("oasst_prompt_lottery_en_250.jsonl", 250),
        ("oasst_en100_chat.jsonl", 100),
        ("raw/fastchat_dummy_conversation.json", 500),
    ],
)
def test_public_data_sets_read_without_rejects(name, count):
    items = _read(SHARED / name)
    assert _rejects(items) == [] and len(items) == count
