"""bench.prompts in the chat forms training data takes: OpenAI ``messages`` and ShareGPT ``conversations``
records, agentic ones included. Each user turn is a bench turn, and so is the reply to the tool results a
record ends on; the record's own replies (assistant turns, tool calls, tool results) are the history, else
the baseline's answer is. The actor runs on the real tiny
target with an exported drafter (tests/test_bench.py's)."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.bench.prompts import Prompt, load_prompt_sets
from eagle3_ray.bench.runner import BenchActor
from eagle3_ray.config import BenchConfig
from eagle3_ray.errors import DataError
from test_bench import TINY_BENCH, TINY_TARGET, drafter_dir  # noqa: F401  (a module fixture)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
AGENT = {"id": "a1", "category": "agent", "tools": TOOLS, "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": -4}'},
    {"role": "assistant", "content": "Minus four."},
    {"role": "system", "content": "Celsius only."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Colder."},
]}
OPEN = {"id": "a2", "category": "agent", "tools": TOOLS, "messages": AGENT["messages"][:4]}  # ends on a result
SHAREGPT = {"id": "s1", "conversations": [{"from": "human", "value": "Name a color."},
                                          {"from": "human", "value": "Another one?"}]}


def _file(tmp_path, records, name="chat.jsonl"):
    f = tmp_path / name
    f.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return f


def test_chat_records_become_prompts_of_their_user_turns(tmp_path):
    sets = load_prompt_sets(_file(tmp_path, [AGENT, SHAREGPT]))
    agent, colors = sets["agent"][0], sets["chat"][0]
    assert agent.turns == ["Weather in Oslo?", "And tomorrow?"] and agent.tools == TOOLS
    assert agent.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert colors.id == "s1" and colors.turns == ["Name a color.", "Another one?"] and colors.tools is None


def test_a_record_that_ends_on_tool_results_has_one_more_turn_the_reply_to_them(tmp_path):
    (prompt,) = load_prompt_sets(_file(tmp_path, [OPEN]))["agent"]
    assert prompt.turns == ["Weather in Oslo?", '{"temp_c": -4}']
    assert prompt.conversation(1, ["the baseline's reply to the user turn"]) == prompt.messages


def test_the_history_is_the_records_own_replies_else_the_baselines(tmp_path):
    sets = load_prompt_sets(_file(tmp_path, [AGENT, SHAREGPT]))
    agent, colors = sets["agent"][0], sets["chat"][0]
    messages = agent.messages
    assert agent.conversation(0, []) == messages[:2]
    # turn 2 after the given call, result, answer and the system message between the turns
    assert agent.conversation(1, ["the baseline said this"]) == messages[:7]
    assert colors.conversation(1, ["Red."]) == [{"role": "user", "content": "Name a color."},
                                                {"role": "assistant", "content": "Red."},
                                                {"role": "user", "content": "Another one?"}]
    mt = Prompt("m", "writing", ["a", "b", "c"], answers=["given"])
    assert [m["content"] for m in mt.conversation(2, ["x", "y"])] == ["a", "given", "b", "y", "c"]


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "1"}]},
     r"chat\.jsonl:1: wrong role order: turn 2 \(after user\) is tool, expected assistant"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "answers": ["x"]},
     r"chat\.jsonl:1: 'answers' belongs to the 'turns' form.*drop 'answers'"),
    ({"conversations": {"from": "human"}}, r"chat\.jsonl:1: 'conversations' is a JSON object; it must be a list"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"function": {}}]},
     r"chat\.jsonl:1: tools\[0\] has no function name"),
])
def test_a_bad_chat_record_fails_the_prompt_set_naming_file_line_and_fix(tmp_path, record, message):
    with pytest.raises(DataError, match=message):
        load_prompt_sets(_file(tmp_path, [record]))


def test_the_actor_decodes_each_user_turn_after_the_records_history(drafter_dir, tmp_path):  # noqa: F811
    """Turn 2 of the agentic record is decoded after its own call, result and answer, rendered with its
    tools; the ShareGPT record without replies is decoded after the baseline's; the record that ends on a
    tool result is decoded after it."""
    sets = load_prompt_sets(_file(tmp_path, [AGENT, {**SHAREGPT, "category": "agent"}, OPEN]))
    actor = BenchActor(TINY_TARGET, drafter_dir)
    bench = BenchConfig(**{**TINY_BENCH, "modes": ["chain"], "prompt_lookup": False})
    records = actor.run_category(sets["agent"], bench)
    tokens = {(r["prompt_id"], r["turn"]): r["prompt_tokens"] for r in records["chain"]}
    agent = sets["agent"][0]
    assert tokens[("a1", 1)] == len(actor._render(agent.messages[:7], TOOLS))
    base = actor.target.tokenizer.decode(actor._runners(bench)["baseline"](actor._render(
        [{"role": "user", "content": "Name a color."}]), bench.max_new_tokens)[0], skip_special_tokens=True)
    assert tokens[("s1", 1)] == len(actor._render(sets["agent"][1].conversation(1, [base])))
    assert tokens[("a2", 1)] == len(actor._render(sets["agent"][2].messages, TOOLS))  # the reply to the result
    assert all(r["identical"] for r in records["chain"])


def test_demo_agentic_eval_is_held_out_agent_turns():
    """The shipped agentic bench set: 12 conversations apart from the training set builtin:demo_agentic
    (no shared question), 25 turns of which 11 are replies to tool results."""
    from eagle3_ray.data.sources import read_samples

    (prompts,) = load_prompt_sets("builtin:demo_agentic_eval").values()
    assert len(prompts) == 12 and sum(len(p.turns) for p in prompts) == 25
    assert sum(p.messages[-1]["role"] == "tool" for p in prompts) == 11
    train = {m["content"] for s in read_samples("builtin:demo_agentic") for m in s.messages if m["role"] == "user"}
    assert not train & {t for p in prompts for t in p.turns}
