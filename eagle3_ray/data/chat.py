"""Chat-template rendering and assistant loss masks, for any template, without per-template rules.

The conversation is rendered with the tokenizer's own ``chat_template``, the record's tools passed as
``tools=``. The character span of each assistant turn is found by incremental rendering: the turn
starts where the rendered prefix with a generation prompt ends and stops where the rendering of the
conversation up to and including that turn ends, less trailing whitespace. So the span holds what the
target generates in that turn, as its template writes it: the content, its tool calls, its reasoning
where the template keeps it, and the end-of-turn token(s) (``<|im_end|>``, ``<|eot_id|>``,
``<｜end▁of▁sentence｜>``); never the role header, user or system text, tool results or tool
definitions. Spans are mapped to tokens through the fast tokenizer's offset mapping.

Tool calls are handed to the template in Hugging Face's conventions first: arguments as an object,
the content of a turn that only calls tools as None. A template that fails on those because it joins
them as text (DeepSeek-V3's arguments, SmolLM2's content) gets the arguments as JSON text, then ""
content, then both: the first ``Style`` that renders the whole conversation is used for every render
of that conversation. A template that ignores tools and tool calls (SmolLM2's) drops them here as it
does when the target is served.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from jinja2.exceptions import TemplateError

from eagle3_ray.data.sources import Sample
from eagle3_ray.errors import ConfigError, SampleRejected


@dataclass
class TokenizedSample:
    sample_id: str
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 on assistant content + its end-of-turn token(s)
    source: str


class Style(NamedTuple):
    """How tool calls are handed to a template (see the module doc)."""

    arguments_as_text: bool  # JSON text instead of an object
    call_only_content: str | None  # the content of a turn that only calls tools


STYLES = (Style(False, None), Style(True, None), Style(False, ""), Style(True, ""))


def render(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = False,
           tools: list[dict] | None = None, style: Style | None = None) -> str:
    """The conversation as the template writes it; ``style``: the one to use (else the first that renders)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "the target tokenizer has no chat_template; use an instruct/chat model or set "
            "tokenizer.chat_template (a Jinja string) before tokenizing"
        )
    styles = [style] if style is not None else STYLES if _calls_tools(messages) else STYLES[:1]
    error: Exception | None = None
    for s in styles:
        try:
            return tokenizer.apply_chat_template(
                _styled(messages, s), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, TypeError) as e:  # TypeError: the template joined an object or None as text
            error = e
    raise SampleRejected(f"the chat template refuses this conversation: {error}") from None


def template_style(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> Style:
    """The first style in which the template renders the whole conversation (SampleRejected if none)."""
    for s in STYLES if _calls_tools(messages) else STYLES[:1]:
        try:
            render(tokenizer, messages, tools=tools, style=s)
            return s
        except SampleRejected:
            continue
    render(tokenizer, messages, tools=tools)  # raises with the template's own error
    raise AssertionError("unreachable: render() raised")


def _calls_tools(messages: list[dict]) -> bool:
    return any(m.get("tool_calls") for m in messages)


def _styled(messages: list[dict], style: Style) -> list[dict]:
    if not _calls_tools(messages):
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = dict(m)
            if not m["content"]:
                m["content"] = style.call_only_content
            if style.arguments_as_text:
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(
                    c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]
        out.append(m)
    return out


def render_generation_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` followed by the template's assistant header (for generation)."""
    text = render(tokenizer, messages, add_generation_prompt=True, tools=tools)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_conversation(
    tokenizer: Any, sample: Sample, max_length: int, truncate: bool = False
) -> TokenizedSample:
    """Render, tokenize and mask one conversation; raises SampleRejected with the reason."""
    messages = sample.messages
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleRejected("no assistant turn; answer prompt-only samples with self-distillation first")
    style = template_style(tokenizer, messages, sample.tools)
    text = render(tokenizer, messages, tools=sample.tools, style=style)
    spans = assistant_spans(tokenizer, messages, text, sample.tools, style)
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


def assistant_spans(tokenizer: Any, messages: list[dict], text: str, tools: list[dict] | None = None,
                    style: Style | None = None) -> list[tuple[int, int]]:
    """[start, end) character spans of every assistant turn (what it generates + end-of-turn) in ``text``."""
    style = style or template_style(tokenizer, messages, tools)
    spans = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        turn = _turn_text(tokenizer, messages, i, tools, style)
        span = _locate(text, turn, m, cursor)
        if span is None:
            raise SampleRejected(
                f"cannot find assistant turn {i + 1} in the rendered conversation: the chat template "
                "renders it differently in context than on its own"
            )
        spans.append(span)
        cursor = span[1]
    return spans


def _turn_text(tokenizer: Any, messages: list[dict], i: int, tools: list[dict] | None, style: Style) -> str:
    """Assistant turn i as the template renders it when it is the last message (no header)."""
    header_end = render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools, style=style)
    upto = render(tokenizer, messages[: i + 1], tools=tools, style=style)
    # A generation prompt may carry more than the header (e.g. an opened "<think>"): the turn
    # starts where the two renderings part.
    start = len(os.path.commonprefix([header_end, upto]))
    if start < len(header_end):
        plain = render(tokenizer, messages[:i], tools=tools, style=style)
        header_at = len(os.path.commonprefix([header_end, plain]))
        if start < header_at:
            # They part before the header: the template rewrote earlier turns once this one came (Kimi's
            # drops the reasoning of every turn before the last answer). The turn starts after its header.
            header = header_end[header_at:]
            at = upto.rfind(header) if header else -1
            if at >= 0:
                start = at + len(header)
    return upto[start:].rstrip()


def _locate(text: str, turn: str, message: dict, cursor: int) -> tuple[int, int] | None:
    """Span of the turn in the full rendering, searching from ``cursor``.

    Templates that rewrite history (drop the reasoning of earlier turns: Qwen3's, Kimi's) render a
    turn differently in context; then the turn is searched from the end of its reasoning, then from
    its content's first character, to its end.
    """
    if not turn:
        return cursor, cursor
    candidates = [turn]
    reasoning = message.get("reasoning_content", "").strip()
    if reasoning and reasoning in turn:
        candidates.append(turn[turn.index(reasoning) + len(reasoning):])
    content = message["content"].strip()
    core_at = turn.find(content) if content else -1
    if core_at > 0:
        candidates.append(turn[core_at:])
    for candidate in candidates:
        at = text.find(candidate, cursor)
        if at >= 0:
            return at, at + len(candidate)
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
