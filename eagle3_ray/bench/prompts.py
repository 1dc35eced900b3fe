"""Benchmark prompt sets: MT-bench / Spec-Bench JSONL and single-turn prompt files, by category.

Forms (one JSON object per line, or a JSON array of them):
- MT-bench / Spec-Bench: ``{"question_id", "category", "turns": [str, ...]}``;
- single turn: ``{"prompt"}``, ``{"question"}`` or ``{"instruction"(, "input")}``;
- a chat record, as training data takes it: OpenAI ``{"messages": [...]}`` or ShareGPT
  ``{"conversations": [...]}`` (read by ``data/messages.py``: system messages, tool calls, tool results
  and a ``tools`` list included). Each user turn is a bench turn, and so is the reply to the tool results
  a record ends on; the record's own replies between two user turns (its assistant turns, tool calls
  and tool results) are the history, and where it gives none the baseline's answer is.
Every form takes an optional ``"category"`` (default: the file's stem) and id field (default:
``<stem>-<line>``).

``bench.prompts`` is one entry or a list of them; an entry is a path (or ``builtin:<name>``) or a
mapping ``{path, max_prompts, name}`` and each entry is one *set* (named by ``name``, else the file's
stem). One set keeps its categories as they are in the file; with several, categories are
namespaced ``<set>/<category>`` so that two sets' "writing" stay apart.

Unlike training data, where bad records are quarantined and reading goes on, a benchmark file must
be clean: a changed prompt set changes the numbers, so any bad record raises ``DataError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

from eagle3_ray.config import PROMPT_ENTRY_FORM, PromptSetEntry
from eagle3_ray.data.messages import BadRecord, conversation, ends_on_results, json_type
from eagle3_ray.data.sources import BUILTIN_PREFIX, builtin_names, resolve_data_path
from eagle3_ray.errors import DataError

ID_FIELDS = ("question_id", "id", "task_id", "uid")
SINGLE_TURN_FIELDS = ("prompt", "question", "instruction")
ENTRY_KEYS = tuple(PromptSetEntry.model_fields)  # a mapping entry of bench.prompts
ENTRY_FORM = PROMPT_ENTRY_FORM


@dataclass
class Prompt:
    id: str
    category: str
    # user turns, answered one after the other (a chat record that ends on tool results: then its last result,
    # the turn being the reply to the results)
    turns: list[str] = field(default_factory=list)
    set_name: str = ""  # the prompt set (bench.prompts entry) it comes from
    # Fixed replies that become the history (a record's "answers"): reply i follows turn i instead of the
    # baseline's own answer, so that benches of different drafters decode exactly the same turns.
    answers: list[str] | None = None
    # A chat record's normalised messages (data/messages.py) and tools; None for the other forms.
    messages: list[dict] | None = None
    tools: list[dict] | None = None

    def conversation(self, turn: int, replies: list[str]) -> list[dict]:
        """The messages decoded at user turn ``turn``: the earlier turns, each followed by the record's own
        replies where it has them (``answers``; a chat record's assistant turns, tool calls and results),
        else by the baseline's ``replies[j]``, then the user turn itself."""
        if self.messages is None:
            out: list[dict] = []
            for j, text in enumerate(self.turns[:turn]):
                given = self.answers is not None and j < len(self.answers)
                out += [{"role": "user", "content": text},
                        {"role": "assistant", "content": self.answers[j] if given else replies[j]}]
            return out + [{"role": "user", "content": self.turns[turn]}]
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        ends = users[1:] + [len(self.messages)]
        out = [dict(m) for m in self.messages[: users[0]]]  # the system messages before the first turn
        for j in range(turn):
            between = self.messages[users[j] + 1: ends[j]]
            out.append(dict(self.messages[users[j]]))
            if not any(m["role"] == "assistant" for m in between):
                out.append({"role": "assistant", "content": replies[j]})
            out += [dict(m) for m in between]
        # turn == len(users): the reply to the tool results the record ends on, after all of it
        return out + [dict(self.messages[users[turn]])] if turn < len(users) else out


@dataclass(frozen=True)
class PromptSetSpec:
    """One entry of ``bench.prompts``, resolved: its name, file and own cap (None: the global one)."""

    name: str
    file: Path
    max_prompts: int | None = None


def load_prompt_sets(source: Any, max_prompts: int | None = None) -> dict[str, list[Prompt]]:
    """Prompts by category, in file order, sets in the order given.

    ``source``: one entry of ``bench.prompts`` or a list of them (``prompt_set_specs``). Each set is
    capped at its entry's ``max_prompts``, else at ``max_prompts``, taken round-robin over that set's
    categories, so that a small cap still covers every category (8 of MT-bench's 80 = one per
    category). With several sets the categories (and ``Prompt.category``) are ``<set>/<category>``;
    prompt ids are unique within a set.
    """
    specs = prompt_set_specs(source)
    loaded = [(spec, _load_set(spec, max_prompts if spec.max_prompts is None else spec.max_prompts))
              for spec in specs]
    if len(loaded) == 1:
        return loaded[0][1]
    out: dict[str, list[Prompt]] = {}
    for spec, sets in loaded:
        for cat, prompts in sets.items():
            key = f"{spec.name}/{cat}"
            out[key] = [replace(p, category=key) for p in prompts]
    return out


def categories_by_set(sets: dict[str, list[Prompt]]) -> dict[str, str]:
    """``{category: set name}`` of loaded prompt sets (the key of ``results.json``'s ``per_set``)."""
    return {cat: prompts[0].set_name for cat, prompts in sets.items() if prompts}


def prompt_set_specs(source: Any) -> list[PromptSetSpec]:
    """The sets ``source`` names: a path / ``builtin:<name>`` / mapping entry, or a list of them.

    ``DataError`` (saying what to change) on an entry of another form, an unknown key, a missing
    file, or two sets of the same name."""
    listed = isinstance(source, (list, tuple))
    entries = list(source) if listed else [source]
    if not entries:
        raise DataError(f"bench.prompts is an empty list; give at least one entry: {ENTRY_FORM}")
    specs: list[PromptSetSpec] = []
    first: dict[str, str] = {}
    for i, entry in enumerate(entries):
        where = f"bench.prompts[{i}]" if listed else "bench.prompts"
        spec = _spec(entry, where)
        if spec.name in first:
            raise DataError(
                f"{where}: a second prompt set named {spec.name!r} (first: {first[spec.name]}); set names must "
                f"be unique: give one of them another name, e.g. {{path: {spec.file.name}, name: "
                f"{spec.name}_2}}, or drop the repeated entry"
            )
        first[spec.name] = where
        specs.append(spec)
    return specs


def _spec(entry: Any, where: str) -> PromptSetSpec:
    if hasattr(entry, "model_dump"):  # a validated config entry (config.PromptSetEntry)
        entry = entry.model_dump()
    if isinstance(entry, (str, Path)):
        entry = {"path": str(entry)}
    if not isinstance(entry, dict):
        raise DataError(f"{where}: {entry!r} is not a prompt set; an entry is {ENTRY_FORM}")
    unknown = sorted(str(k) for k in entry if k not in ENTRY_KEYS)
    if unknown:
        raise DataError(f"{where}: unknown key(s) {unknown} in {entry!r}; an entry takes only {list(ENTRY_KEYS)}")
    path, cap, name = entry.get("path"), entry.get("max_prompts"), entry.get("name")
    if not isinstance(path, str) or not path.strip():
        raise DataError(f"{where}: 'path' must be a prompt file or builtin:<name>, got {path!r}")
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise DataError(f"{where}: 'max_prompts' must be an integer >= 1 (or left out), got {cap!r}")
    file = _prompt_file(path, where)
    name = file.stem if name is None else name
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise DataError(f"{where}: 'name' must be a non-empty string without '/', got {name!r}")
    return PromptSetSpec(name, file, cap)


def _prompt_file(path: str, where: str) -> Path:
    if not path.startswith(BUILTIN_PREFIX):
        p = Path(path).expanduser()
        if not p.exists() or p.is_dir():
            what = "does not exist" if not p.exists() else "is a directory"
            raise DataError(
                f"{where}: prompt file {p} {what}; pass a JSONL/JSON file of prompts or builtin:<name> "
                f"(one of {[BUILTIN_PREFIX + n for n in builtin_names()]})"
            )
    return resolve_data_path(path)  # an unknown builtin name raises here


def _load_set(spec: PromptSetSpec, max_prompts: int | None) -> dict[str, list[Prompt]]:
    """One file's prompts by category (categories as in the file), capped round-robin."""
    file = spec.file
    sets: dict[str, list[Prompt]] = {}
    seen: dict[str, str] = {}
    for pos, raw in _records(file):
        where = f"{file}:{pos}"
        prompt = _to_prompt(raw, file.stem, pos, where)
        prompt.set_name = spec.name
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
        raise DataError(f"{where}: record is not a JSON object; write {{\"turns\": [...]}}, {{\"prompt\": ...}} "
                        "or {\"messages\": [...]}")
    category = raw.get("category", stem)
    if not isinstance(category, str) or not category.strip():
        raise DataError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    pid = next((raw[k] for k in ID_FIELDS if k in raw), f"{stem}-{pos}")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise DataError(f"{where}: the id must be a string or an integer, got {pid!r}")
    chat = raw.get("messages", raw.get("conversations"))
    if chat is not None:
        return _chat_prompt(raw, chat, str(pid), category, where)
    turns = _turns(raw, where)
    return Prompt(str(pid), category, turns, answers=_answers(raw, len(turns), where))


def _chat_prompt(raw: dict, chat: Any, pid: str, category: str, where: str) -> Prompt:
    """A chat record (OpenAI ``messages`` / ShareGPT ``conversations``) as a prompt of its user turns."""
    key = "messages" if "messages" in raw else "conversations"
    if not isinstance(chat, list):
        raise DataError(f"{where}: '{key}' is a JSON {json_type(chat)}; it must be a list of turns")
    if "answers" in raw:
        raise DataError(f"{where}: 'answers' belongs to the 'turns' form; a chat record gives its replies as its "
                        "assistant turns: drop 'answers'")
    try:
        messages, tools = conversation(chat, raw.get("tools"), raw.get("system"))
    except BadRecord as e:
        raise DataError(f"{where}: {e}") from None
    turns = [m["content"] for m in messages if m["role"] == "user"]
    if ends_on_results(messages):  # one more turn: the reply to those results (its entry: the last result)
        turns.append(messages[-1]["content"])
    return Prompt(pid, category, turns, messages=messages, tools=tools)


def _answers(raw: dict, turns: int, where: str) -> list[str] | None:
    """A record's fixed history: ``"answers"``, one reply per turn but the last (which may be given too)."""
    if "answers" not in raw:
        return None
    answers = raw["answers"]
    if not isinstance(answers, list) or not turns - 1 <= len(answers) <= turns:
        raise DataError(f"{where}: 'answers' must be a list of the replies that follow each turn: {turns - 1} or "
                        f"{turns} strings for its {turns} turns, got {answers!r:.80}; fix it or drop the field (the "
                        "bench's baseline then answers)")
    return [_text(a, f"answers[{i}]", where) for i, a in enumerate(answers)]


def _turns(raw: dict, where: str) -> list[str]:
    if "turns" in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings")
        return [_text(t, f"turns[{i}]", where) for i, t in enumerate(turns)]
    key = next((k for k in SINGLE_TURN_FIELDS if k in raw), None)
    if key is None:
        raise DataError(
            f"{where}: record with keys {sorted(raw)} has no prompt; expected 'turns' (MT-bench), 'messages' / "
            f"'conversations' (chat) or one of {list(SINGLE_TURN_FIELDS)}"
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
