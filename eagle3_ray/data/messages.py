"""Chat records -> normalised messages: roles, tool calls, tool results, reasoning, the tools list.

One reading of the OpenAI (``messages``: ``role``/``content``) and ShareGPT (``conversations``:
``from``/``value``) forms for training data (``data/sources.py``) and benchmark prompts
(``bench/prompts.py``). A normalised message is what Hugging Face chat templates take:

- ``{"role": "system" | "user", "content": str}``;
- ``{"role": "assistant", "content": str, "reasoning_content"?: str, "tool_calls"?: [{"id": str,
  "type": "function", "function": {"name": str, "arguments": dict}}]}``: ``content`` may be "" when
  the turn only calls tools, ``arguments`` is an object (OpenAI gives JSON text; templates and
  SGLang's server take the object), ``tool_calls`` only when there is one (Llama-3.1's template tests
  ``'tool_calls' in message``);
- ``{"role": "tool", "content": str, "tool_call_id": str, "name"?: str}``.

Tool calls without an id get ``functions.<name>:<k>`` (k counts the record's calls): the form
Kimi-K2 generates and its template prints; templates that ignore ids are unaffected. A tool result
without ``tool_call_id`` answers the next call still open. Reasoning in the content itself (a
``<think>`` block) stays in the content: templates that split it do so themselves.

Order: system messages anywhere; then user first; an assistant turn after each user turn (a record
without any assistant turn may hold several user turns: a prompt-only conversation); after an
assistant turn that calls tools, one result per call; after the results, more results or the
assistant's next turn. A record may end on any turn. Anything else raises ``BadRecord`` with the
turn and the fix. ``answer_script`` says which assistant turns self-distillation writes.
"""

from __future__ import annotations

import json
from typing import Any

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "function_call": "assistant",  # ShareGPT (LLaMA-Factory): the value is the call as JSON
    "tool": "tool",
    "observation": "tool",  # ShareGPT (LLaMA-Factory): a tool's result
    "function": "tool",  # OpenAI's older name of a tool result
    "ipython": "tool",  # Llama-3.1's name of a tool result
}
REASONING_FIELDS = ("reasoning_content", "reasoning")  # SGLang / vLLM name it either way


class BadRecord(Exception):
    """One record is unusable; the message says which turn and why (it becomes a reject)."""


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def conversation(turns: list, tools: Any = None, system: Any = None) -> tuple[list[dict], list[dict] | None]:
    """(normalised messages, normalised tools or None) of one record's turns; ``BadRecord`` otherwise.

    ``tools``: the record's ``tools`` (a list, or JSON text of one as LLaMA-Factory writes it);
    ``system``: a top-level ``system`` string (LLaMA-Factory), put first unless a system turn is."""
    if not turns:
        raise BadRecord("empty conversation")
    calls = _CallIds()
    messages = [_message(i, turn, calls) for i, turn in enumerate(turns, start=1)]
    check_order(messages)
    if system is not None:
        if not isinstance(system, str) or not system.strip():
            raise BadRecord(f"'system' is {system!r}; it must be a non-empty string (or left out)")
        if messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
    return messages, normalise_tools(tools)


def normalise_tools(tools: Any) -> list[dict] | None:
    """The record's tool list in OpenAI form (``{"type": "function", "function": {...}}``)."""
    if tools is None:
        return None
    if isinstance(tools, str):  # LLaMA-Factory stores the list as JSON text
        if not tools.strip():
            return None
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRecord(f"'tools' is a string but not JSON ({e.msg} at column {e.colno}); "
                            "write the list of tools as JSON") from None
    if not isinstance(tools, list):
        raise BadRecord(f"'tools' is a JSON {json_type(tools)}; it must be a list of tool definitions")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise BadRecord(f"tools[{i}] is a JSON {json_type(tool)}; a tool is an object with a function name")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRecord(f"tools[{i}] has no function name; write {{\"type\": \"function\", \"function\": "
                            "{\"name\": ..., \"parameters\": {...}}}")
        out.append({"type": "function", "function": function})
    return out or None


class _CallIds:
    """Ids of a record's tool calls: given ones kept, missing ones numbered (see the module doc)."""

    def __init__(self) -> None:
        self.count = 0

    def next(self, name: str, given: Any) -> str:
        self.count += 1
        if isinstance(given, str) and given:
            return given
        return f"functions.{name}:{self.count - 1}"


def _message(i: int, turn: Any, calls: _CallIds) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(f"turn {i} is a JSON {json_type(turn)}, expected an object")
    raw_role = turn.get("role", turn.get("from"))
    if not isinstance(raw_role, str) or raw_role.lower() not in ROLE_ALIASES:
        raise BadRecord(f"turn {i}: unknown role {raw_role!r}; expected one of {sorted(ROLE_ALIASES)}")
    role = ROLE_ALIASES[raw_role.lower()]
    content = turn.get("content", turn.get("value"))
    if raw_role.lower() == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _sharegpt_calls(i, content, calls)}
    if role == "assistant":
        return _assistant(i, turn, content, calls)
    if role == "tool":
        if not isinstance(content, str):
            raise BadRecord(f"turn {i} (tool): the result is a JSON {json_type(content)}; write it as a string "
                            "(JSON text for structured results)")
        msg = {"role": "tool", "content": content}
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                if not isinstance(turn[key], str) or not turn[key]:
                    raise BadRecord(f"turn {i} (tool): '{key}' must be a non-empty string, got {turn[key]!r}")
                msg[key] = turn[key]
        return msg
    if not isinstance(content, str) or not content.strip():
        raise BadRecord(f"turn {i} ({role}): empty content")
    return {"role": role, "content": content}


def _assistant(i: int, turn: dict, content: Any, calls: _CallIds) -> dict:
    raw_calls = turn.get("tool_calls")
    if raw_calls is None and turn.get("function_call") is not None:  # OpenAI's older single call
        raw_calls = [{"function": turn["function_call"]}]
    if raw_calls is not None and not isinstance(raw_calls, list):
        raise BadRecord(f"turn {i} (assistant): 'tool_calls' is a JSON {json_type(raw_calls)}; it must be a list")
    tool_calls = [_call(i, f"tool_calls[{k}]", c.get("function") if isinstance(c, dict) else None,
                        c.get("id") if isinstance(c, dict) else None, calls)
                  for k, c in enumerate(raw_calls or [])]
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRecord(f"turn {i} (assistant): content is a JSON {json_type(content)}, expected a string")
    if not content.strip() and not tool_calls:
        raise BadRecord(f"turn {i} (assistant): empty content")
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    reasoning = next((turn[k] for k in REASONING_FIELDS if turn.get(k) is not None), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise BadRecord(f"turn {i} (assistant): reasoning_content is a JSON {json_type(reasoning)}, "
                            "expected a string")
        if reasoning.strip():
            msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _sharegpt_calls(i: int, value: Any, calls: _CallIds) -> list[dict]:
    """A ShareGPT ``function_call`` turn: JSON text of one call ``{"name", "arguments"}`` or a list."""
    if not isinstance(value, str):
        raise BadRecord(f"turn {i} (function_call): the value is a JSON {json_type(value)}; write the call as "
                        "JSON text {\"name\": ..., \"arguments\": {...}}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise BadRecord(f"turn {i} (function_call): the value is not JSON ({e.msg} at column {e.colno}); "
                        "write {\"name\": ..., \"arguments\": {...}}") from None
    items = parsed if isinstance(parsed, list) else [parsed]
    if not items:
        raise BadRecord(f"turn {i} (function_call): an empty list of calls")
    return [_call(i, f"call {k + 1}", item, item.get("id") if isinstance(item, dict) else None, calls)
            for k, item in enumerate(items)]


def _call(i: int, what: str, function: Any, given_id: Any, calls: _CallIds) -> dict:
    where = f"turn {i} (assistant): {what}"
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise BadRecord(f"{where} has no function name; write {{\"function\": {{\"name\": ..., \"arguments\": "
                        "...}}")
    arguments = function.get("arguments", function.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise BadRecord(f"{where}: the arguments are not JSON ({e.msg} at column {e.colno}); write a JSON "
                            "object") from None
    if not isinstance(arguments, dict):
        raise BadRecord(f"{where}: the arguments are a JSON {json_type(arguments)}; they must be an object")
    name = function["name"]
    return {"id": calls.next(name, given_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def check_order(messages: list[dict]) -> None:
    """The order rules of the module doc; ``BadRecord`` naming the first turn that breaks them."""
    if all(m["role"] == "system" for m in messages):
        raise BadRecord("conversation has only a system message")
    prev: dict | None = None
    prev_at = 0
    open_calls: list[str] = []  # ids of the last assistant turn's calls still without a result
    prompt_only = not any(m["role"] == "assistant" for m in messages)  # user turns only: answered one by one
    for n, m in enumerate(messages, start=1):
        role = m["role"]
        if role == "system":
            continue
        if prev is None:
            if role != "user":
                raise BadRecord(f"wrong role order: the first turn is {role}, expected user")
        elif role == "tool":
            if prev["role"] == "assistant" and not prev.get("tool_calls"):
                raise BadRecord(f"wrong role order: turn {n} is a tool result, but turn {prev_at} (assistant) "
                                "calls no tool; give that turn its tool_calls or drop the result")
            if prev["role"] == "user":
                raise BadRecord(f"wrong role order: turn {n} (after user) is tool, expected assistant")
            _answer(open_calls, m, n)
        else:
            expected = {"user": "assistant", "assistant": "tool" if prev.get("tool_calls") else "user",
                        "tool": "assistant"}[prev["role"]]
            if open_calls:  # right after the calls, or after some of their results
                raise BadRecord(f"turn {n} ({role}) comes while the tool call {open_calls[0]!r} has no result; "
                                "give each call of an assistant turn its result (a tool turn) before the next turn")
            if role != expected and not (prompt_only and role == "user"):
                raise BadRecord(f"wrong role order: turn {n} (after {prev['role']}) is {role}, expected {expected}")
        if role == "assistant":
            open_calls = [c["id"] for c in m.get("tool_calls", [])]
        prev, prev_at = m, n
    if open_calls and prev is not None and prev["role"] == "tool":
        raise BadRecord(f"the conversation ends while the tool call {open_calls[0]!r} has no result; give each "
                        "call of an assistant turn its result (a tool turn)")


def _answer(open_calls: list[str], result: dict, n: int) -> None:
    """``result`` answers one of ``open_calls`` (its ``tool_call_id``, else the first still open)."""
    if not open_calls:
        raise BadRecord(f"turn {n} is a tool result, but every call before it has its result already")
    wanted = result.get("tool_call_id")
    if wanted is None:
        result["tool_call_id"] = open_calls.pop(0)
    elif wanted in open_calls:
        open_calls.remove(wanted)
    else:
        raise BadRecord(f"turn {n} (tool): tool_call_id {wanted!r} answers no open call (open: {open_calls}); "
                        "fix the id")


def answer_script(messages: list[dict], regenerate_after_tools: bool = False) -> list[dict | None]:
    """The conversation with ``None`` where the target writes an assistant turn (self-distillation).

    A prompt-only conversation (no assistant turn) is answered after each user turn; a conversation that
    ends on tool results gets the reply to them. ``regenerate_after_tools``: every assistant turn that
    answers tool results without calling a tool is written again. Tool calls and tool results are never
    replaced: the results belong to the calls, and only the data knows them."""
    if not any(m["role"] == "assistant" for m in messages):
        out: list[dict | None] = []
        for m in messages:
            out += [m, None] if m["role"] == "user" else [m]
        return out
    out, prev = [], None
    for m in messages:
        after_results = prev == "tool" and m["role"] == "assistant" and not m.get("tool_calls")
        out.append(None if regenerate_after_tools and after_results else m)
        prev = m["role"] if m["role"] != "system" else prev
    if prev == "tool":
        out.append(None)
    return out


def ends_on_results(messages: list[dict]) -> bool:
    """The last turn (system messages aside) is a tool result: the assistant's reply to it is missing."""
    last = next((m for m in reversed(messages) if m["role"] != "system"), None)
    return last is not None and last["role"] == "tool"
