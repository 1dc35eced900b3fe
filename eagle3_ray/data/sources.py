"""Conversation readers: JSONL / JSON-array files in the common chat and prompt forms.

Every record becomes a ``Sample`` (normalised messages, and the record's tools) or a ``Reject``
(file:line and a precise reason); reading goes on past bad records. A chat record's turns (tool
calls, tool results and reasoning included) are read by ``data/messages.py``. A stage may read
several files in order (``data.path`` as a list), with ids unique over all of them. Only a file
that cannot be read at all raises ``DataError``. Reference answers in prompt-only forms (``output``, ``answer``, ``reference``) are
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

from eagle3_ray.data.messages import BadRecord, answer_script, conversation, json_type
from eagle3_ray.errors import DataError

if TYPE_CHECKING:
    from eagle3_ray.config import DataConfig

BUILTIN_PREFIX = "builtin:"
DEFAULT_DATA = BUILTIN_PREFIX + "demo_prompts"  # a stage's input when neither --data nor data.path names one
Format = Literal["auto", "sharegpt", "openai", "prompts"]
DataPath = str | Path | list[str] | tuple[str, ...]  # one file (or builtin:<name>) or several, read in order

ID_FIELDS = ("id", "question_id", "task_id", "uid")
PROMPT_FIELDS = ("prompt", "instruction", "question", "turns")


@dataclass
class Sample:
    sample_id: str
    messages: list[dict]  # normalised messages (data/messages.py): system, user, assistant, tool
    source: str  # "file:line" (JSONL) or "file:item" (1-based, JSON array)
    tools: list[dict] | None = None  # the record's tool definitions, given to the chat template
    # The fingerprint of the target that wrote every assistant turn greedily (the generate stage's
    # ``greedy_by`` field), "" otherwise: the capture audit's agreement is judged on these samples.
    greedy_by: str = ""

    @property
    def needs_generation(self) -> bool:
        """An answer is missing: a prompt-only sample (no assistant turn: several user turns are answered
        turn by turn), or a conversation that ends on tool results (the reply to them)."""
        return None in answer_script(self.messages)


@dataclass
class Reject:
    sample_id: str
    source: str
    reason: str


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


def inputs_fingerprint(paths: list[Path]) -> dict[str, Any]:
    """``file_fingerprint`` of a stage's input files: that of the one file when there is one (the record
    runs over one file have always written); for several, their paths, total size and a sha256 over
    their hashes in order."""
    if len(paths) == 1:
        return file_fingerprint(paths[0])
    parts = [file_fingerprint(p) for p in paths]
    joined = hashlib.sha256("\n".join(p["sha256"] for p in parts).encode()).hexdigest()
    return {"data": [p["data"] for p in parts], "bytes": sum(p["bytes"] for p in parts), "sha256": joined}


def path_list(path: DataPath) -> list[str]:
    """``data.path`` (or --data) as a list: one entry, or the several it names."""
    entries = list(path) if isinstance(path, (list, tuple)) else [path]
    return [str(p) for p in entries]


def input_paths(data: DataPath | None, cfg: DataConfig) -> list[Path]:
    """The files a stage reads, in order: ``data`` (its --data), else ``data.path``, else ``DEFAULT_DATA``."""
    return [resolve_data_path(p) for p in path_list(data or cfg.path or DEFAULT_DATA)]


def read_input(data: DataPath | None, cfg: DataConfig) -> tuple[list[Path], list[Sample], list[Reject]]:
    """A stage's input (``input_paths``) read whole with the data section's settings: (the files, their
    samples, their rejected records)."""
    sources = input_paths(data, cfg)
    samples, rejects = [], []
    for item in read_samples(sources, cfg.format, cfg.max_samples, cfg.system_prompt):
        (rejects if isinstance(item, Reject) else samples).append(item)
    return sources, samples, rejects


def read_samples(
    path: DataPath,
    format: Format = "auto",
    max_samples: int | None = None,
    system_prompt: str | None = None,
) -> Iterator[Sample | Reject]:
    """Yield one Sample or Reject per record, file after file in file order; stop after ``max_samples``
    Samples. Ids are unique over all the files."""
    seen: dict[str, str] = {}  # sample_id -> source of its first occurrence
    n_samples = 0
    for name in path_list(path):
        file = resolve_data_path(name)
        for pos, raw in _records(file):
            source = f"{file}:{pos}"
            fallback_id = f"{file.stem}-{pos}"
            if isinstance(raw, BadRecord):
                yield Reject(fallback_id, source, str(raw))
                continue
            sample_id = _record_id(raw) or fallback_id
            if sample_id in seen:
                yield Reject(sample_id, source, f"duplicate id {sample_id!r} (first at {seen[sample_id]})")
                continue
            seen[sample_id] = source
            try:
                messages, tools = _to_messages(raw, format)
            except BadRecord as e:
                yield Reject(sample_id, source, str(e))
                continue
            if system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            greedy_by = raw.get("greedy_by") if isinstance(raw, dict) else None
            yield Sample(sample_id, messages, source, tools, greedy_by if isinstance(greedy_by, str) else "")
            n_samples += 1
            if max_samples is not None and n_samples >= max_samples:
                return


def _records(file: Path) -> Iterator[tuple[int, Any]]:
    """(line or item number, parsed record | BadRecord) pairs; DataError if the file is unusable."""
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
            yield lineno, BadRecord(
                f"line is not valid UTF-8: byte 0x{line[e.start]:02x} at column {e.start + 1}"
            )
            continue
        try:
            yield lineno, json.loads(text)
        except json.JSONDecodeError as e:
            yield lineno, BadRecord(f"malformed JSON: {e.msg} at column {e.colno}")


def _record_id(raw: Any) -> str | None:
    if not isinstance(raw, dict):
        return None
    for key in ID_FIELDS:
        value = raw.get(key)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return str(value)
    return None


def _to_messages(raw: Any, format: Format) -> tuple[list[dict], list[dict] | None]:
    """Normalised, validated (messages, tools) of one record (raises BadRecord with the reason)."""
    if isinstance(raw, dict) and isinstance(raw.get("conversations", raw.get("messages")), list):
        turns = raw.get("conversations", raw.get("messages"))
        form = _conversation_form(turns)
        if format not in ("auto", form):
            raise BadRecord(f"record is in {form} form but data.format={format!r}")
        return conversation(turns, raw.get("tools"), raw.get("system"))
    if format in ("sharegpt", "openai"):
        raise BadRecord(f"data.format={format!r} needs a 'conversations' or 'messages' list")
    return _prompt_messages(raw), None


def _conversation_form(turns: list) -> str:
    first = next((t for t in turns if isinstance(t, dict)), {})
    return "sharegpt" if "from" in first or "value" in first else "openai"


def _prompt_messages(raw: Any) -> list[dict]:
    """Prompt-only forms -> one or more user messages (MT-bench turns stay separate)."""
    if isinstance(raw, str):
        return [_user(raw, "the record")]
    if not isinstance(raw, dict):
        raise BadRecord(f"record is a JSON {json_type(raw)}; expected an object or a string")
    if "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns:
            raise BadRecord("'turns' must be a non-empty list of strings")
        return [_user(t, f"turns[{i}]") for i, t in enumerate(turns)]
    if "instruction" in raw:
        extra = raw.get("input") or ""
        if not isinstance(extra, str):
            raise BadRecord("'input' must be a string")
        msg = _user(raw["instruction"], "'instruction'")
        if extra.strip():
            msg["content"] = f"{msg['content']}\n\n{extra}"
        return [msg]
    for key in ("prompt", "question"):
        if key in raw:
            return [_user(raw[key], f"'{key}'")]
    raise BadRecord(
        f"unrecognised record with keys {sorted(raw)}; expected 'conversations'/'messages', "
        f"one of {list(PROMPT_FIELDS)}, or a bare JSON string"
    )


def _user(text: Any, what: str) -> dict:
    if not isinstance(text, str):
        raise BadRecord(f"{what} is a JSON {json_type(text)}, expected a string")
    if not text.strip():
        raise BadRecord(f"empty content: {what} is blank")
    return {"role": "user", "content": text}
