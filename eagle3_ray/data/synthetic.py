"""Prompts the target writes itself (Magpie-style), for self-distillation.

An instruct model, given its chat template up to where a user turn's text begins (the template's
default system prompt included), writes a plausible user request. Sampled at temperature 1.0, those
requests spread over what the model was tuned on, which a fixed prompt set may not (the project's
training set is 70% GSM8K word problems). The generate stage answers them like the input's
prompts, so the drafter sees more kinds of the target's answers per training token.

A request is kept when its turn ended before ``SYNTHETIC_MAX_TOKENS`` (a turn cut at the cap is
unfinished), it has at least ``SYNTHETIC_MIN_WORDS`` words and no earlier request had the same text.
The requests are written to a file before any is answered: a resumed run reads them back and
answers the same ones (sampling need not repeat bit for bit on a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_ray.atomic import write_stream
from eagle3_ray.data.sources import Sample
from eagle3_ray.errors import ConfigError, DataError

if TYPE_CHECKING:
    from eagle3_ray.engines.base import TargetEngine

SYNTHETIC_MAX_TOKENS = 160
SYNTHETIC_TEMPERATURE = 1.0
SYNTHETIC_TOP_P = 0.98
SYNTHETIC_MIN_WORDS = 4
SYNTHETIC_ID = "synthetic:"  # ids synthetic:<actor>:<k>
MAX_CALLS_PER_BATCH = 4  # engine calls per batch of requests asked for, at most (a target that rarely ends a turn)
_MARKER = "\ue000"  # a private-use character: no chat template writes it


def synthetic_id(actor: int, k: int) -> str:
    return f"{SYNTHETIC_ID}{actor}:{k:06d}"


def user_header_ids(tokenizer: Any) -> list[int]:
    """Token ids of the chat template up to where a user turn's text begins."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ConfigError(
            "generate.synthetic_prompts needs a chat template (the target writes user turns from its header); "
            "this tokenizer has none: set generate.synthetic_prompts=0"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARKER}], tokenize=False)
    if _MARKER not in text:
        raise ConfigError("the chat template drops the user's text; set generate.synthetic_prompts=0")
    return tokenizer(text[: text.index(_MARKER)], add_special_tokens=False)["input_ids"]


def synthetic_prompts(
    engine: "TargetEngine", tokenizer: Any, count: int, path: str | Path, actor: int = 0,
    batch_size: int = 64, seed: int = 0,
) -> list[Sample]:
    """``count`` requests the target writes (fewer if it rarely ends a turn), as prompt-only samples
    with ids ``synthetic:<actor>:<k>``; read back from ``path`` if an earlier run wrote it, else
    generated and written there (atomically) first."""
    path = Path(path)
    if path.exists():
        return read_synthetic(path)
    header = user_header_ids(tokenizer)
    texts: list[str] = []
    seen: set[str] = set()
    calls = 0
    max_calls = MAX_CALLS_PER_BATCH * -(-count // batch_size)
    while len(texts) < count and calls < max_calls:
        answers = engine.generate([header] * batch_size, SYNTHETIC_MAX_TOKENS, SYNTHETIC_TEMPERATURE,
                                  SYNTHETIC_TOP_P, seed + calls)
        calls += 1
        for new in answers:
            if len(new) >= SYNTHETIC_MAX_TOKENS:  # cut at the cap: the turn never ended
                continue
            text = tokenizer.decode(new, skip_special_tokens=True).strip()
            if len(text.split()) < SYNTHETIC_MIN_WORDS or text in seen:
                continue
            seen.add(text)
            texts.append(text)
    texts = texts[:count]

    def fill(dst) -> None:
        for k, text in enumerate(texts):
            dst.write((json.dumps({"id": synthetic_id(actor, k), "prompt": text}) + "\n").encode("utf-8"))

    path.parent.mkdir(parents=True, exist_ok=True)
    write_stream(path, fill)
    return read_synthetic(path)


def read_synthetic(path: Path) -> list[Sample]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            out.append(Sample(str(r["id"]), [{"role": "user", "content": str(r["prompt"])}], f"{path.name}:{n}"))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{n} is not a synthetic prompt record ({e!r}); delete {path} to write "
                            "the prompts again") from None
    return out
