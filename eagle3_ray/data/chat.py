"""Chat-template rendering and assistant loss masks, for any template, without per-template rules.

The conversation is rendered with the tokenizer's own ``chat_template``. The character span of each
assistant turn is found by incremental rendering: the turn starts where the rendered prefix with a
generation prompt ends and stops where the rendering of the conversation up to and including that
turn ends, less trailing whitespace. So the span holds the assistant content plus the end-of-turn
token(s) the template emits right after it (``<|im_end|>``, ``<|eot_id|>``,
``<｜end▁of▁sentence｜>``) and never the role header. Spans are mapped to tokens through the fast
tokenizer's offset mapping.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from eagle3_ray.data.sources import Sample
from eagle3_ray.errors import ConfigError, SampleRejected


@dataclass
class TokenizedSample:
    sample_id: str
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 on assistant content + its end-of-turn token(s)
    source: str


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the target tokenizer has no chat_template; use an instruct/chat model or set "
            "tokenizer.chat_template (a Jinja string) before tokenizing"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:
        raise SampleRejected(f"the chat template refuses this conversation: {e}") from None


def render_generation_prompt(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` followed by the template's assistant header (for generation)."""
    text = render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(
    tokenizer: Any, sample: Sample, max_length: int, truncate: bool = False
) -> TokenizedSample:
    """Render, tokenize and mask one conversation; raises SampleRejected with the reason."""
    messages = sample.messages
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleRejected("no assistant turn; answer prompt-only samples with self-distillation first")
    text = render(tokenizer, messages)
    spans = assistant_spans(tokenizer, messages, text)
    input_ids, offsets = _tokenize_with_offsets(tokenizer, text)
    loss_mask = _mask_from_spans(offsets, spans)
    if sum(loss_mask) == 0:
        raise SampleRejected("the chat template renders no assistant tokens for this conversation")
    if len(input_ids) > max_length:
        if not truncate:
            raise SampleRejected(
                f"{len(input_ids)} tokens > data.max_length={max_length}; raise data.max_length "
                "or set data.truncate=true"
            )
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
        if sum(loss_mask) == 0:
            raise SampleRejected(
                f"no assistant tokens within the first data.max_length={max_length} tokens; "
                "raise data.max_length"
            )
    return TokenizedSample(sample.sample_id, input_ids, loss_mask, sample.source)


def assistant_spans(tokenizer: Any, messages: list[dict], text: str) -> list[tuple[int, int]]:
    """[start, end) character spans of every assistant turn (content + end-of-turn) in ``text``."""
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        turn = _turn_text(tokenizer, messages, i)
        span = _locate(text, turn, m["content"], cursor)
        if span is None:
            raise SampleRejected(
                f"cannot find assistant turn {i + 1} in the rendered conversation: the chat template "
                "renders it differently in context than on its own"
            )
        spans.append(span)
        cursor = span[1]
    return spans


def _turn_text(tokenizer: Any, messages: list[dict], i: int) -> str:
    """Assistant turn i as the template renders it when it is the last message (no header)."""
    header_end = render(tokenizer, messages[:i], add_generation_prompt=True)
    upto = render(tokenizer, messages[: i + 1])
    # A generation prompt may carry more than the header (e.g. an opened "<think>"): the turn
    # starts where the two renderings part.
    start = len(os.path.commonprefix([header_end, upto]))
    return upto[start:].rstrip()


def _locate(text: str, turn: str, content: str, cursor: int) -> tuple[int, int] | None:
    """Span of the turn in the full rendering, searching from ``cursor``.

    Templates that rewrite history (e.g. drop reasoning from earlier turns) render a turn
    differently in context; then the span from the content's first character to the end-of-turn
    text is searched instead.
    """
    at = text.find(turn, cursor)
    if at >= 0:
        return at, at + len(turn)
    core_at = turn.find(content.strip())
    if core_at > 0:
        core = turn[core_at:]
        at = text.find(core, cursor)
        if at >= 0:
            return at, at + len(core)
    return None


def _tokenize_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            "loss masks need a fast tokenizer (offset mapping); load the target tokenizer with "
            "use_fast=True or convert it to a tokenizer.json"
        )
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


def _mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for tokens overlapping an assistant span (a token straddling the header boundary counts)."""
    mask = [0] * len(offsets)
    j = 0
    for t, (s, e) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= s:
            j += 1
        if j < len(spans) and s < spans[j][1] and e > spans[j][0]:
            mask[t] = 1
    return mask
