"""Conversation readers: JSONL / JSON-array files in the common chat and prompt forms.

Every record becomes a ``Sample`` (normalised messages) or a ``Reject`` (file:line and a precise
reason); reading goes on past bad records. Only a file that cannot be read at all raises
``DataError``. Reference answers in prompt-only forms (``output``, ``answer``, ``reference``) are
ignored on purpose: a drafter must learn the target's own distribution, so prompts are answered by
self-distillation (``eagle3_ray.data.distill``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Literal

from eagle3_ray.errors import DataError

if TYPE_CHECKING:
    from eagle3_ray.config import DataConfig

BUILTIN_PREFIX = "builtin:"
DEFAULT_DATA = BUILTIN_PREFIX + "demo_prompts"  # a stage's input when neither --data nor data.path names one
Format = Literal["auto", "sharegpt", "openai", "prompts"]

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
}
ID_FIELDS = ("id", "question_id", "task_id", "uid")
PROMPT_FIELDS = ("prompt", "instruction", "question", "turns")


@dataclass
class Sample:
    sample_id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}]
    source: str  # "file:line" (JSONL) or "file:item" (1-based, JSON array)
    # The fingerprint of the target that wrote every assistant turn greedily (the generate stage's
    # ``greedy_by`` field), "" otherwise: the capture audit's agreement is judged on these samples.
    greedy_by: str = ""

    @property
    def needs_generation(self) -> bool:
        """Prompt-only: no assistant turn yet (several user turns are answered turn by turn)."""
        return not any(m["role"] == "assistant" for m in self.messages)


@dataclass
class Reject:
    sample_id: str
    source: str
    reason: str


class _BadRecord(Exception):
    """Internal: one record is unusable; becomes a Reject with this message."""


def builtin_names() -> list[str]:
    res = resources.files("eagle3_ray").joinpath("resources")
    return sorted(p.name[: -len(".jsonl")] for p in res.iterdir() if p.name.endswith(".jsonl"))


def resolve_data_path(path: str) -> Path:
    """``builtin:<name>`` -> the shipped ``eagle3_ray/resources/<name>.jsonl``; else an existing path."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        res = resources.files("eagle3_ray").joinpath("resources", f"{name}.jsonl")
        if not res.is_file():
            raise DataError(
                f"unknown builtin data set {path!r}; use one of "
                f"{[BUILTIN_PREFIX + n for n in builtin_names()]} or a path to a JSONL/JSON file"
            )
        return Path(str(res))
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(
            f"data file {p} does not exist; pass data.path=<JSONL/JSON file> or builtin:<name> "
            f"(one of {builtin_names()})"
        )
    return p


def file_fingerprint(path: str | Path) -> dict[str, Any]:
    """An input data file's path, size and sha256 (read in 16 MiB chunks): what a resumed stage
    compares to know that it is answering or extracting the same records."""
    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return {"data": str(path), "bytes": path.stat().st_size, "sha256": h.hexdigest()}


def input_path(data: str | None, cfg: DataConfig) -> Path:
    """The file a stage reads: ``data`` (its --data), else ``data.path``, else ``DEFAULT_DATA``."""
    return resolve_data_path(data or cfg.path or DEFAULT_DATA)


def read_input(data: str | None, cfg: DataConfig) -> tuple[Path, list[Sample], list[Reject]]:
    """A stage's input (``input_path``) read whole with the data section's settings: (the file, its
    samples, its rejected records)."""
    source = input_path(data, cfg)
    samples, rejects = [], []
    for item in read_samples(source, cfg.format, cfg.max_samples, cfg.system_prompt):
        (rejects if isinstance(item, Reject) else samples).append(item)
    return source, samples, rejects


def read_samples(
    path: str | Path,
    format: Format = "auto",
    max_samples: int | None = None,
    system_prompt: str | None = None,
) -> Iterator[Sample | Reject]:
    """Yield one Sample or Reject per record, in file order; stop after ``max_samples`` Samples."""
    file = resolve_data_path(str(path))
    seen: dict[str, str] = {}  # sample_id -> source of its first occurrence
    n_samples = 0
    for pos, raw in _records(file):
        source = f"{file}:{pos}"
        fallback_id = f"{file.stem}-{pos}"
        if isinstance(raw, _BadRecord):
            yield Reject(fallback_id, source, str(raw))
            continue
        sample_id = _record_id(raw) or fallback_id
        if sample_id in seen:
            yield Reject(sample_id, source, f"duplicate id {sample_id!r} (first at {seen[sample_id]})")
            continue
        seen[sample_id] = source
        try:
            messages = _to_messages(raw, format)
        except _BadRecord as e:
            yield Reject(sample_id, source, str(e))
            continue
        if system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        greedy_by = raw.get("greedy_by") if isinstance(raw, dict) else None
        yield Sample(sample_id, messages, source, greedy_by if isinstance(greedy_by, str) else "")
        n_samples += 1
        if max_samples is not None and n_samples >= max_samples:
            return


def _records(file: Path) -> Iterator[tuple[int, Any]]:
    """(line or item number, parsed record | _BadRecord) pairs; DataError if the file is unusable."""
    if file.is_dir():
        raise DataError(f"data path {file} is a directory; pass one JSONL or JSON file")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {file}: {e}") from e
    data = data.removeprefix(b"\xef\xbb\xbf")
    if not data.strip():
        raise DataError(f"data file {file} is empty; it needs one record per line or a JSON array")
    if data.lstrip()[:1] == b"[":
        yield from enumerate(_json_array(file, data), start=1)
    else:
        yield from _jsonl_lines(data)


def _json_array(file: Path, data: bytes) -> list[Any]:
    try:
        items = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"JSON array file {file} is not UTF-8 ({e}); re-encode it as UTF-8") from e
    except json.JSONDecodeError as e:
        raise DataError(
            f"JSON array file {file} is not valid JSON ({e}); it may be truncated. "
            "Fix the file or convert it to JSONL (one record per line) so bad records can be skipped"
        ) from e
    if not isinstance(items, list):
        raise DataError(f"{file} starts with '[' but is not a JSON array")
    return items


def _jsonl_lines(data: bytes) -> Iterator[tuple[int, Any]]:
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield lineno, _BadRecord(
                f"line is not valid UTF-8: byte 0x{line[e.start]:02x} at column {e.start + 1}"
            )
            continue
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as e:
            yield lineno, _BadRecord(f"malformed JSON: {e.msg} at column {e.colno}")


def _record_id(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return None
    for key in ID_FIELDS:
        value = raw.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return str(value)
    return None


def _to_messages(raw: Any, format: Format) -> list[dict]:
    """Normalised, validated messages of one record (raises _BadRecord with the reason)."""
    if isinstance(raw, dict) and isinstance(raw.get("conversations", raw.get("messages")), list):
        turns = raw.get("conversations", raw.get("messages"))
        form = _conversation_form(turns)
        if format not in ("auto", form):
            raise _BadRecord(f"record is in {form} form but data.format={format!r}")
        return _check_order(_conversation(turns))
    if format in ("sharegpt", "openai"):
        raise _BadRecord(f"data.format={format!r} needs a 'conversations' or 'messages' list")
    return _prompt_messages(raw)


def _conversation_form(turns: list) -> str:
    first = next((t for t in turns if isinstance(t, dict)), {})
    return "sharegpt" if "from" in first or "value" in first else "openai"


def _conversation(turns: list) -> list[dict]:
    if not turns:
        raise _BadRecord("empty conversation")
    messages = []
    for i, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise _BadRecord(f"turn {i} is a JSON {_json_type(turn)}, expected an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
            raise _BadRecord(
                f"turn {i}: unknown role {role!r}; expected one of {sorted(ROLE_ALIASES)}"
            )
        role = ROLE_ALIASES[role.lower()]
        if not isinstance(content, str) or not content.strip():
            raise _BadRecord(f"turn {i} ({role}): empty content")
        messages.append({"role": role, "content": content})
    return messages


def _check_order(messages: list[dict]) -> list[dict]:
    """Optional system first, then user/assistant alternating, starting with user."""
    body = messages[1:] if messages[0]["role"] == "system" else messages
    offset = len(messages) - len(body)
    if not body:
        raise _BadRecord("conversation has only a system message")
    for i, m in enumerate(body):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            where = "the first turn" if i == 0 else f"turn {i + offset + 1} (after {body[i - 1]['role']})"
            raise _BadRecord(f"wrong role order: {where} is {m['role']}, expected {expected}")
    return messages


def _prompt_messages(raw: Any) -> list[dict]:
    """Prompt-only forms -> one or more user messages (MT-bench turns stay separate)."""
    if isinstance(raw, str):
        return [_user(raw, "the record")]
    if not isinstance(raw, dict):
        raise _BadRecord(f"record is a JSON {_json_type(raw)}; expected an object or a string")
    if "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns:
            raise _BadRecord("'turns' must be a non-empty list of strings")
        return [_user(t, f"turns[{i}]") for i, t in enumerate(turns)]
    if "instruction" in raw:
        extra = raw.get("input") or ""
        if not isinstance(extra, str):
            raise _BadRecord("'input' must be a string")
        msg = _user(raw["instruction"], "'instruction'")
        if extra.strip():
            msg["content"] = f"{msg['content']}\n\n{extra}"
        return [msg]
    for key in ("prompt", "question"):
        if key in raw:
            return [_user(raw[key], f"'{key}'")]
    raise _BadRecord(
        f"unrecognised record with keys {sorted(raw)}; expected 'conversations'/'messages', "
        f"one of {list(PROMPT_FIELDS)}, or a bare JSON string"
    )


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _user(text: Any, what: str) -> dict:
    if not isinstance(text, str):
        raise _BadRecord(f"{what} is a JSON {_json_type(text)}, expected a string")
    if not text.strip():
        raise _BadRecord(f"empty content: {what} is blank")
    return {"role": "user", "content": text}
