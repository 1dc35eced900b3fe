"""Golden loss masks of agentic conversations (tools, tool calls, tool results, reasoning), per template family.

The real SmolLM2 tokenizer renders each conversation with its own template and with the real templates of
Llama-3.1-8B-Instruct, DeepSeek-V3 and Kimi-K2.5 (tests/data/templates/, each file names its source) set on a
copy of it, their special tokens added. The masked spans are what the target generates: assistant content,
its tool calls and its reasoning where the template keeps them, with the end-of-turn; never tool results,
tool definitions, user or system text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3_ray.data.chat import render, render_generation_prompt, tokenize_conversation
from eagle3_ray.data.messages import conversation
from eagle3_ray.data.sources import Sample
from test_chat_templates import _masked_runs  # noqa: E402  the same decoding of masked runs

TEMPLATES = Path(__file__).parent / "data" / "templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
RESULT_1, RESULT_2 = '{"temp_c": 18, "sky": "clear"}', '{"temp_c": 24, "sky": "haze"}'
TURNS = [  # OpenAI form, as an agent's log holds it: arguments as JSON text, call-only content null
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "reasoning_content": "I need the weather tool.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT_1},
    {"role": "assistant", "content": "Clear, 18 C.", "reasoning_content": "Read the result."},
    {"role": "user", "content": "And Rome?"},
    {"role": "assistant", "content": "", "reasoning_content": "Same tool.",
     "tool_calls": [{"id": "call_2", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": RESULT_2},
    {"role": "assistant", "content": "Hazy, 24 C.", "reasoning_content": "Warmer."},
]
NEVER_MASKED = ("Weather in Paris?", "And Rome?", "You are terse.", "temp_c", "Current weather of a city")


def _sample(turns: list[dict]) -> Sample:
    messages, tools = conversation(turns, TOOLS)
    return Sample("agent-1", messages, "test:1", tools)


def _tokenizer(smollm2_dir, template: str | None = None, special: dict | None = None):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    if special:
        tok.add_special_tokens(special)
    if template:
        tok.chat_template = (TEMPLATES / template).read_text(encoding="utf-8")
    return tok


def _check(tok, sample: Sample, expected: list[str]) -> str:
    ts = tokenize_conversation(tok, sample, max_length=4096)
    runs = _masked_runs(tok, ts.input_ids, ts.loss_mask)
    assert runs == expected
    masked = "".join(runs)
    assert not any(text in masked for text in NEVER_MASKED), masked
    text = render(tok, sample.messages, tools=sample.tools)
    assert ts.input_ids == tok(text, add_special_tokens=False)["input_ids"]
    return text


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_dir):
    return _tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def llama31(smollm2_dir):
    special = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    return _tokenizer(smollm2_dir, "llama-3.1-8b-instruct.jinja",
                      {"bos_token": "<|begin_of_text|>", "additional_special_tokens": special})


@pytest.fixture(scope="module")
def deepseek_v3(smollm2_dir):
    names = ["User", "Assistant", "end▁of▁sentence", "tool▁calls▁begin", "tool▁calls▁end",
             "tool▁call▁begin", "tool▁call▁end", "tool▁sep", "tool▁outputs▁begin", "tool▁outputs▁end",
             "tool▁output▁begin", "tool▁output▁end"]
    return _tokenizer(smollm2_dir, "deepseek-v3.jinja", {"bos_token": "<｜begin▁of▁sentence｜>",
                                                         "additional_special_tokens": [f"<｜{n}｜>" for n in names]})


@pytest.fixture(scope="module")
def kimi(smollm2_dir):
    names = ["im_user", "im_assistant", "im_system", "im_middle", "im_end", "tool_calls_section_begin",
             "tool_calls_section_end", "tool_call_begin", "tool_call_end", "tool_call_argument_begin"]
    return _tokenizer(smollm2_dir, "kimi-k2.5.jinja",
                      {"additional_special_tokens": [f"<|{n}|>" for n in names] + ["<think>", "</think>"]})


def test_smollm2_template_drops_tools_and_calls_as_its_server_does(smollm2_tok):
    """SmolLM2's template writes only each message's content: no tool list, no calls, no reasoning. A turn
    that only calls a tool is its end-of-turn alone; the tool results are context."""
    text = _check(smollm2_tok, _sample(TURNS), [
        "<|im_end|>", "Clear, 18 C.<|im_end|>", "<|im_end|>", "Hazy, 24 C.<|im_end|>",
    ])
    assert f"<|im_start|>tool\n{RESULT_1}<|im_end|>" in text and "get_weather" not in text


def test_llama31_masks_its_json_calls_never_the_ipython_results(llama31):
    text = _check(llama31, _sample(TURNS), [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
        "Clear, 18 C.<|eot_id|>",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
        "Hazy, 24 C.<|eot_id|>",
    ])
    # The tool list goes into the first user message, the results into ipython turns: both unmasked.
    assert "Given the following functions" in text and '"description": "Current weather of a city"' in text
    assert text.count("<|start_header_id|>ipython<|end_header_id|>") == 2


def test_deepseek_v3_template_renders_calls_only_for_null_content(deepseek_v3):
    """DeepSeek-V3's template writes a tool call only when the turn's content is None, and transformers
    (5.2x) drops None keys before rendering: the calls are lost, in serving too. The results and the answers
    after them are rendered: the answers masked, the results not."""
    text = _check(deepseek_v3, _sample(TURNS), [
        "<｜end▁of▁sentence｜>", "Clear, 18 C.<｜end▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>", "Hazy, 24 C.<｜end▁of▁sentence｜>",
    ])
    outputs = f"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{RESULT_1}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    assert outputs in text


def test_deepseek_v3_gets_arguments_as_text_where_it_joins_them(deepseek_v3):
    """A template that adds the arguments to a string (DeepSeek-V3's) fails on an object; the renderer
    then hands them over as JSON text."""
    messages, _ = conversation(TURNS[:3], TOOLS)
    messages[2]["content"] = "Checking."
    text = render(deepseek_v3, messages)
    assert text.endswith("<｜Assistant｜>Checking.<｜end▁of▁sentence｜>")


def test_kimi_k25_drops_reasoning_before_the_last_answer(kimi):
    """Kimi-K2.5 keeps reasoning only after the last answer without tool calls: here every turn is history,
    rendered <think></think>. What the target generates after its header's <think> is masked: </think>, the
    calls in Kimi's tool-call section (ids as given), the answers."""
    section = ("</think><|tool_calls_section_begin|><|tool_call_begin|>call_{n}<|tool_call_argument_begin|>"
               '{{"city": "{city}"}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>')
    text = _check(kimi, _sample(TURNS), [
        section.format(n=1, city="Paris"), "</think>Clear, 18 C.<|im_end|>",
        section.format(n=2, city="Rome"), "</think>Hazy, 24 C.<|im_end|>",
    ])
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"type":"function"')
    assert f"<|im_system|>tool<|im_middle|>## Return of call_1\n{RESULT_1}<|im_end|>" in text
    assert "I need the weather tool." not in text


def test_kimi_k25_keeps_the_reasoning_of_the_current_tool_loop(kimi):
    """After the last answer (Rome's question on), the template keeps the reasoning of each tool-calling
    turn: it is generated, so it is masked; the loop's earlier history still drops it."""
    text = _check(kimi, _sample(TURNS[:8]), [
        "</think><|tool_calls_section_begin|><|tool_call_begin|>call_1<|tool_call_argument_begin|>"
        '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "</think>Clear, 18 C.<|im_end|>",
        "Same tool.</think><|tool_calls_section_begin|><|tool_call_begin|>call_2<|tool_call_argument_begin|>"
        '{"city": "Rome"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
    ])
    assert text.endswith(f"## Return of call_2\n{RESULT_2}<|im_end|>")


def test_generation_prompt_after_tool_results_ends_with_the_assistant_header(kimi, llama31):
    messages, tools = conversation(TURNS[:4], TOOLS)
    ids = render_generation_prompt(kimi, messages, tools)
    assert kimi.decode(ids).endswith(f"{RESULT_1}<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    ids = render_generation_prompt(llama31, messages, tools)
    assert llama31.decode(ids).endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


def test_sharegpt_agentic_record_renders_as_its_openai_twin(llama31):
    """LLaMA-Factory's ShareGPT form (function_call / observation turns, tools as JSON text) is the same
    conversation as the OpenAI form, call ids given by position."""
    sharegpt = [
        {"from": "human", "value": "Weather in Paris?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"from": "observation", "value": RESULT_1},
        {"from": "gpt", "value": "Clear, 18 C."},
    ]
    a, tools_a = conversation(sharegpt, json.dumps(TOOLS))
    b, tools_b = conversation([{k: v for k, v in t.items() if k != "reasoning_content"} for t in TURNS[1:5]], TOOLS)
    assert tools_a == tools_b
    assert render(llama31, a, tools=tools_a) == render(llama31, b, tools=tools_b)
    assert a[1]["tool_calls"][0]["id"] == a[2]["tool_call_id"] == "functions.get_weather:0"
