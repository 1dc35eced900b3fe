"""Agentic records in the readers: tool calls, tool results, reasoning, several system messages, a tools list,
in the OpenAI and ShareGPT forms; which turns self-distillation writes; several input files in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_ray.config import DataConfig
from eagle3_ray.data.messages import BadRecord, answer_script, conversation
from eagle3_ray.data.sources import Reject, Sample, inputs_fingerprint, read_input, read_samples

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _write(tmp_path: Path, records: list, name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_openai_agentic_record_is_normalised(tmp_path):
    record = {"id": "a1", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 18}'},
        {"role": "system", "content": "Answer in one line."},
        {"role": "assistant", "content": "18 C.", "reasoning": "Read it."},
    ]}
    (sample,) = read_samples(_write(tmp_path, [record]))
    assert isinstance(sample, Sample) and sample.tools == [WEATHER]
    assert sample.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "c1"},
        {"role": "system", "content": "Answer in one line."},
        {"role": "assistant", "content": "18 C.", "reasoning_content": "Read it."},
    ]
    assert not sample.needs_generation


def test_sharegpt_function_call_and_observation_turns(tmp_path):
    """LLaMA-Factory's ShareGPT: function_call / observation turns, tools as JSON text, a top-level system;
    parallel calls as a list; the ``tool`` role as an observation too. Missing ids are numbered."""
    record = {"id": "s1", "system": "Be brief.", "tools": json.dumps([{"name": "get_weather", "parameters": {}}]),
              "conversations": [
                  {"from": "human", "value": "Paris and Rome?"},
                  {"from": "function_call", "value": json.dumps([
                      {"name": "get_weather", "arguments": {"city": "Paris"}},
                      {"name": "get_weather", "arguments": {"city": "Rome"}}])},
                  {"from": "observation", "value": "18"},
                  {"from": "tool", "value": "24"},
                  {"from": "gpt", "value": "18 and 24."},
              ]}
    (sample,) = read_samples(_write(tmp_path, [record]))
    assert sample.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert [m["role"] for m in sample.messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    calls = sample.messages[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["functions.get_weather:0", "functions.get_weather:1"]
    assert [m.get("tool_call_id") for m in sample.messages[3:5]] == [c["id"] for c in calls]
    assert calls[1]["function"]["arguments"] == {"city": "Rome"}


def test_results_may_come_in_any_order_by_their_ids():
    messages, _ = conversation([
        {"role": "user", "content": "both"},
        {"role": "assistant", "tool_calls": [{"id": "x", "function": {"name": "f", "arguments": "{}"}},
                                             {"id": "y", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "y", "content": "2"},
        {"role": "tool", "content": "1"},
    ])
    assert [m["tool_call_id"] for m in messages[2:]] == ["y", "x"]


@pytest.mark.parametrize("turns, reason", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "1"}],
     "turn 3 is a tool result, but turn 2 (assistant) calls no tool"),
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}],
     "wrong role order: turn 2 (after user) is tool, expected assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
      {"role": "user", "content": "and?"}],
     "turn 3 (user) comes while the tool call 'functions.f:0' has no result; give each call"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}, {"function": {"name": "g"}}]},
      {"role": "tool", "content": "1"}, {"role": "assistant", "content": "done"}],
     "turn 4 (assistant) comes while the tool call 'functions.g:1' has no result"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f"}}]},
      {"role": "tool", "tool_call_id": "b", "content": "1"}],
     "tool_call_id 'b' answers no open call (open: ['a'])"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
      {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}],
     "turn 4 is a tool result, but every call before it has its result already"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     "tool_calls[0]: the arguments are not JSON"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "tool_calls[0] has no function name"),
    ([{"role": "user", "content": "hi"},
      {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     "the arguments are a JSON array; they must be an object"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "reasoning_content": "hmm"}],
     "turn 2 (assistant): empty content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": {"name": "f"}}],
     "'tool_calls' is a JSON object; it must be a list"),
    ([{"from": "human", "value": "hi"}, {"from": "function_call", "value": "get_weather(Paris)"}],
     "turn 2 (function_call): the value is not JSON"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
      {"role": "tool", "content": {"temp": 1}}],
     "turn 3 (tool): the result is a JSON object; write it as a string"),
])
def test_bad_agentic_turns_are_rejected_with_the_turn_and_the_fix(turns, reason):
    with pytest.raises(BadRecord) as e:
        conversation(turns)
    assert reason in str(e.value)


@pytest.mark.parametrize("tools, reason", [
    ({"name": "f"}, "'tools' is a JSON object; it must be a list of tool definitions"),
    ("[{", "'tools' is a string but not JSON"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0] has no function name"),
    (["f"], "tools[0] is a JSON string"),
])
def test_bad_tool_lists_are_rejected(tools, reason):
    with pytest.raises(BadRecord, match=reason.replace("[", r"\[").replace("{", r"\{")):
        conversation([{"role": "user", "content": "hi"}], tools)


def test_answer_script_marks_the_turns_the_target_writes():
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                  "function": {"name": "f", "arguments": {}}}]}
    result = {"role": "tool", "content": "1", "tool_call_id": "c"}
    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    assert answer_script([user, user]) == [user, None, user, None]
    assert answer_script([user, answer]) == [user, answer]
    assert answer_script([user, call, result]) == [user, call, result, None]
    assert answer_script([user, call, result, answer]) == [user, call, result, answer]
    assert answer_script([user, call, result, answer], regenerate_after_tools=True) == [user, call, result, None]
    # A turn that calls again after results is kept: the next result belongs to it.
    assert answer_script([user, call, result, call, result], regenerate_after_tools=True) == \
        [user, call, result, call, result, None]
    assert answer_script([user, answer, user, answer], regenerate_after_tools=True) == [user, answer, user, answer]


def test_several_files_are_read_in_order_with_ids_unique_over_all(tmp_path):
    a = _write(tmp_path, [{"id": "x", "prompt": "one"}, {"id": "y", "prompt": "two"}], "a.jsonl")
    b = _write(tmp_path, [{"id": "y", "prompt": "again"}, {"id": "z", "prompt": "three"}], "b.jsonl")
    sources, samples, rejects = read_input(None, DataConfig(path=[str(a), str(b)]))
    assert sources == [a, b] and [s.sample_id for s in samples] == ["x", "y", "z"]
    assert [(r.source, r.reason) for r in rejects] == [(f"{b}:1", f"duplicate id 'y' (first at {a}:2)")]
    both = inputs_fingerprint([a, b])
    assert both["data"] == [str(a), str(b)] and both["sha256"] != inputs_fingerprint([a])["sha256"]
    assert inputs_fingerprint([b, a])["sha256"] != both["sha256"]  # the order is part of the input
    (_, samples, _) = read_input(None, DataConfig(path=[str(a), "builtin:demo_agentic"], max_samples=3))
    assert [s.sample_id for s in samples] == ["x", "y", "agent-001"]


def test_data_path_list_is_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="at least one file"):
        DataConfig(path=[])


def test_demo_agentic_is_three_dozen_agent_conversations():
    items = list(read_samples("builtin:demo_agentic"))
    assert not [i for i in items if isinstance(i, Reject)] and len(items) == 36
    calls = [m for s in items for m in s.messages if m.get("tool_calls")]
    assert len(calls) >= 40 and sum(len(m["tool_calls"]) > 1 for m in calls) >= 4  # parallel calls too
    assert sum(s.needs_generation for s in items) == 7  # ending on tool results: the target replies
    assert sum(any("reasoning_content" in m for m in s.messages) for s in items) >= 10
    assert sum(sum(m["role"] == "system" for m in s.messages) > 1 for s in items) >= 2
    assert all(s.tools for s in items)
    numbered = [s for s in items
                if any(c["id"].startswith("functions.") for m in s.messages for c in m.get("tool_calls", []))]
    assert len(numbered) == 5  # the ShareGPT records: their calls have no ids


def test_a_chat_record_without_answers_is_prompt_only(tmp_path):
    """Several user turns in a row are a prompt-only conversation, answered turn by turn as MT-bench's turns
    are; with an assistant turn anywhere they are a wrong order."""
    record = {"id": "p", "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a color."},
                                      {"role": "user", "content": "Another one?"}]}
    (sample,) = read_samples(_write(tmp_path, [record]))
    assert isinstance(sample, Sample) and sample.needs_generation
    assert answer_script(sample.messages).count(None) == 2
