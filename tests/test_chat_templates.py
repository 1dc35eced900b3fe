"""Golden loss masks: the real SmolLM2 tokenizer with its own template and with the Llama-3, Qwen,
DeepSeek-V3 and a history-rewriting (Qwen3-style) template set on a copy of it."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from eagle3_ray.data.chat import render_generation_prompt, tokenize_conversation
from eagle3_ray.data.sources import Sample
from eagle3_ray.errors import SampleRejected

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
DEEPSEEK_V3_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system_prompt='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{% endif %}{% endfor %}{{ ns.system_prompt }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
# Qwen3-style: only the final assistant turn carries an (empty) think block, so earlier turns render
# differently in context than as the last message.
THINK_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message.content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SYSTEM = {"role": "system", "content": "You answer briefly."}
TURNS = [
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven is prime."},
    {"role": "user", "content": "And an even one?"},
    {"role": "assistant", "content": "Two: it is the only even prime.\n"},
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def _with_template(smollm2_dir, template: str, special: dict) -> AutoTokenizer:
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.add_special_tokens(special)
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module")
def llama3(smollm2_dir):
    extra = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _with_template(
        smollm2_dir, LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>", "additional_special_tokens": extra}
    )


@pytest.fixture(scope="module")
def qwen(smollm2_dir):
    return _with_template(smollm2_dir, QWEN_TEMPLATE, {})


@pytest.fixture(scope="module")
def deepseek(smollm2_dir):
    return _with_template(
        smollm2_dir,
        DEEPSEEK_V3_TEMPLATE,
        {
            "bos_token": "<｜begin▁of▁sentence｜>",
            "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
        },
    )


@pytest.fixture(scope="module")
def think(smollm2_dir):
    return _with_template(smollm2_dir, THINK_TEMPLATE, {})


def _sample(messages: list[dict]) -> Sample:
    return Sample("s-1", messages, "test:1")


def _masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of masked tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


def _unmasked_text(tok, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if not m])


def test_smollm2_own_template_masks_assistant_text_and_im_end(tokenizer):
    ts = tokenize_conversation(tokenizer, _sample(TURNS), max_length=512)
    assert _masked_runs(tokenizer, ts.input_ids, ts.loss_mask) == [
        "Seven is prime.<|im_end|>",
        "Two: it is the only even prime.\n<|im_end|>",
    ]
    unmasked = _unmasked_text(tokenizer, ts.input_ids, ts.loss_mask)
    # Headers, the default system prompt and user turns stay out of the loss.
    assert unmasked.count("<|im_start|>assistant\n") == 2
    assert "You are a helpful AI assistant named SmolLM" in unmasked
    assert "Name a prime number." in unmasked and "Seven" not in unmasked
    assert len(ts.input_ids) == len(ts.loss_mask)
    assert ts.input_ids == tokenizer(tokenizer.apply_chat_template(TURNS, tokenize=False),
                                     add_special_tokens=False)["input_ids"]


def test_smollm2_with_system_prompt(tokenizer):
    ts = tokenize_conversation(tokenizer, _sample([SYSTEM, *TURNS[:2]]), max_length=512)
    assert _masked_runs(tokenizer, ts.input_ids, ts.loss_mask) == ["Seven is prime.<|im_end|>"]
    unmasked = _unmasked_text(tokenizer, ts.input_ids, ts.loss_mask)
    assert "You answer briefly." in unmasked and "SmolLM" not in unmasked


def test_llama3_masks_trimmed_content_and_eot(llama3):
    ts = tokenize_conversation(llama3, _sample([SYSTEM, *TURNS]), max_length=512)
    assert ts.input_ids[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    # The template trims content, so the trailing newline of the last answer is not rendered.
    assert _masked_runs(llama3, ts.input_ids, ts.loss_mask) == [
        "Seven is prime.<|eot_id|>",
        "Two: it is the only even prime.<|eot_id|>",
    ]
    unmasked = _unmasked_text(llama3, ts.input_ids, ts.loss_mask)
    assert unmasked.count("<|start_header_id|>assistant<|end_header_id|>\n\n") == 2


def test_qwen_default_system_and_multi_turn(qwen):
    ts = tokenize_conversation(qwen, _sample(TURNS), max_length=512)
    assert _masked_runs(qwen, ts.input_ids, ts.loss_mask) == [
        "Seven is prime.<|im_end|>",
        "Two: it is the only even prime.\n<|im_end|>",
    ]
    assert "You are Qwen" in _unmasked_text(qwen, ts.input_ids, ts.loss_mask)


def test_deepseek_v3_masks_content_and_end_of_sentence(deepseek):
    ts = tokenize_conversation(deepseek, _sample([SYSTEM, *TURNS]), max_length=512)
    assert _masked_runs(deepseek, ts.input_ids, ts.loss_mask) == [
        "Seven is prime.<｜end▁of▁sentence｜>",
        "Two: it is the only even prime.\n<｜end▁of▁sentence｜>",
    ]
    unmasked = _unmasked_text(deepseek, ts.input_ids, ts.loss_mask)
    assert unmasked.startswith("<｜begin▁of▁sentence｜>You answer briefly.<｜User｜>")
    assert unmasked.count("<｜Assistant｜>") == 2


def test_history_rewriting_template_is_located_by_content(think):
    ts = tokenize_conversation(think, _sample(TURNS), max_length=512)
    assert _masked_runs(think, ts.input_ids, ts.loss_mask) == [
        "Seven is prime.<|im_end|>",
        "<think>\n\n</think>\n\nTwo: it is the only even prime.\n<|im_end|>",
    ]


def test_template_that_raises_rejects_the_sample(smollm2_dir):
    no_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    )
    tok = _with_template(smollm2_dir, no_system, {})
    assert sum(tokenize_conversation(tok, _sample(TURNS), max_length=512).loss_mask) > 0
    with pytest.raises(SampleRejected, match="System role not supported"):
        tokenize_conversation(tok, _sample([SYSTEM, *TURNS]), max_length=512)


def test_truncation_keeps_the_first_tokens_and_their_mask(tokenizer):
    full = tokenize_conversation(tokenizer, _sample(TURNS), max_length=512)
    cut = len(full.input_ids) - 5
    with pytest.raises(SampleRejected, match="data.max_length"):
        tokenize_conversation(tokenizer, _sample(TURNS), max_length=cut)
    ts = tokenize_conversation(tokenizer, _sample(TURNS), max_length=cut, truncate=True)
    assert ts.input_ids == full.input_ids[:cut]
    assert ts.loss_mask == full.loss_mask[:cut]
    assert sum(ts.loss_mask) < sum(full.loss_mask)


def test_truncation_that_drops_every_assistant_token_is_rejected(tokenizer):
    with pytest.raises(SampleRejected, match="no assistant tokens"):
        tokenize_conversation(tokenizer, _sample(TURNS), max_length=20, truncate=True)


def test_prompt_only_sample_is_rejected(tokenizer):
    with pytest.raises(SampleRejected, match="no assistant turn"):
        tokenize_conversation(tokenizer, _sample(TURNS[:1]), max_length=512)


def test_generation_prompt_ends_with_the_assistant_header(tokenizer, llama3):
    ids = render_generation_prompt(tokenizer, TURNS[:1])
    assert tokenizer.decode(ids).endswith("Name a prime number.<|im_end|>\n<|im_start|>assistant\n")
    ids = render_generation_prompt(llama3, TURNS[:1])
    assert llama3.decode(ids).endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids.count(llama3.convert_tokens_to_ids("<|begin_of_text|>")) == 1
