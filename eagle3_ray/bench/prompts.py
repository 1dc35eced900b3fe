"""Benchmark prompt sets: MT-bench / Spec-Bench JSONL and single-turn prompt files, by category.

Forms (one JSON object per line, or a JSON array of them):
- MT-bench / Spec-Bench: ``{"question_id", "category", "turns": [str, ...]}``;
- single turn: ``{"prompt"}``, ``{"question"}`` or ``{"instruction"(, "input")}``, with an optional
  ``"category"`` (default: the file's stem) and id field (default: ``<stem>-<line>``).

Unlike training data, where bad records are quarantined and reading goes on, a benchmark file must
be clean: a changed prompt set changes the numbers, so any bad record raises ``DataError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

from eagle3_ray.data.sources import resolve_data_path
from eagle3_ray.errors import DataError

ID_FIELDS = ("question_id", "id", "task_id", "uid")
SINGLE_TURN_FIELDS = ("prompt", "question", "instruction")


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str] = field(default_factory=list)  # user turns, answered one after the other


def load_prompt_sets(path: str | Path, max_prompts: int | None = None) -> dict[str, list[Prompt]]:
    """Prompts by category, in file order; ``path`` may be ``builtin:<name>``.

    ``max_prompts`` caps the total, taken round-robin over categories, so that a small cap still
    covers every category (8 of MT-bench's 80 = one per category).
    """
    file = resolve_data_path(str(path))
    sets: dict[str, list[Prompt]] = {}
    seen: dict[str, str] = {}
    for pos, raw in _records(file):
        where = f"{file}:{pos}"
        prompt = _to_prompt(raw, file.stem, pos, where)
        if prompt.id in seen:
            raise DataError(
                f"{where}: duplicate prompt id {prompt.id!r} (first at {seen[prompt.id]}); ids must be unique"
            )
        seen[prompt.id] = where
        sets.setdefault(prompt.category, []).append(prompt)
    if not sets:
        raise DataError(f"prompt file {file} holds no prompts; it needs one record per line")
    return sets if max_prompts is None else _round_robin(sets, max_prompts)


def _round_robin(sets: dict[str, list[Prompt]], limit: int) -> dict[str, list[Prompt]]:
    kept: dict[str, list[Prompt]] = {}
    order = [p for row in zip_longest(*sets.values()) for p in row if p is not None]
    for p in order[:limit]:
        kept.setdefault(p.category, []).append(p)
    return {c: kept[c] for c in sets if c in kept}


def _records(file: Path) -> list[tuple[int, Any]]:
    """(line or item number, parsed record); ``DataError`` naming file:line on malformed JSON."""
    try:
        text = file.read_text(encoding="utf-8").removeprefix("\ufeff")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read prompt file {file} as UTF-8 text: {e}") from e
    if text.lstrip().startswith("["):
        try:
            return list(enumerate(json.loads(text), start=1))
        except json.JSONDecodeError as e:
            raise DataError(f"{file}: not a valid JSON array ({e}); fix it or write one record per line") from e
    records = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except json.JSONDecodeError as e:
            raise DataError(f"{file}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); fix the line") from e
    return records


def _to_prompt(raw: Any, stem: str, pos: int, where: str) -> Prompt:
    if not isinstance(raw, dict):
        raise DataError(f"{where}: record is not a JSON object; write {{\"turns\": [...]}} or {{\"prompt\": ...}}")
    category = raw.get("category", stem)
    if not isinstance(category, str) or not category.strip():
        raise DataError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    pid = next((raw[k] for k in ID_FIELDS if k in raw), f"{stem}-{pos}")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise DataError(f"{where}: the id must be a string or an integer, got {pid!r}")
    return Prompt(str(pid), category, _turns(raw, where))


def _turns(raw: dict, where: str) -> list[str]:
    if "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings")
        return [_text(t, f"turns[{i}]", where) for i, t in enumerate(turns)]
    key = next((k for k in SINGLE_TURN_FIELDS if k in raw), None)
    if key is None:
        raise DataError(
            f"{where}: record with keys {sorted(raw)} has no prompt; expected 'turns' (MT-bench) or one of "
            f"{list(SINGLE_TURN_FIELDS)}"
        )
    text = _text(raw[key], f"'{key}'", where)
    extra = raw.get("input") if key == "instruction" else None
    if extra:
        text = f"{text}\n\n{_text(extra, repr('input'), where)}"
    return [text]


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: {what} must be a non-empty string, got {value!r}")
    return value
