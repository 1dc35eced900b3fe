"""Samples grouped by id: a prompt's answers (``generate.samples_per_prompt``: ``<id>``, ``<id>#s1``,
...), which training holds out together, and the named groups of ``train.val_groups`` (held-out
metrics per group, and the eval-only groups that training and the vocab map leave out)."""

from __future__ import annotations

import re
from typing import Sequence

COPY_TAG = "#s"  # <id>#s<copy>: the sampled copies 1..n-1 of a prompt (generate.samples_per_prompt)
_COPY_SUFFIX = re.compile(re.escape(COPY_TAG) + r"[0-9]+\Z")


def copy_id(sample_id: str, copy: int) -> str:
    """Id of answer ``copy`` of a prompt: its own id for copy 0, ``<id>#s<copy>`` for the sampled ones."""
    return sample_id if copy == 0 else f"{sample_id}{COPY_TAG}{copy}"


def base_id(sample_id: str) -> str:
    """The prompt an answer belongs to: ``sample_id`` without a trailing ``#s<digits>``."""
    return _COPY_SUFFIX.sub("", sample_id)


def sample_groups(sample_ids: Sequence[str], patterns: dict[str, str]) -> list[str | None]:
    """Each sample's group: the first name of ``patterns`` ({name: regex}, in order) whose regex
    matches the whole id, or None (train.val_groups)."""
    compiled = [(name, re.compile(p)) for name, p in patterns.items()]
    return [next((name for name, r in compiled if r.fullmatch(str(i))), None) for i in sample_ids]
