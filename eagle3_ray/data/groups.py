"""Named groups of samples by id (train.val_groups): held-out metrics per group, and the eval-only
groups that training and the vocab map leave out."""

from __future__ import annotations

import re
from typing import Sequence


def sample_groups(sample_ids: Sequence[str], patterns: dict[str, str]) -> list[str | None]:
    """Each sample's group: the first name of ``patterns`` ({name: regex}, in order) whose regex
    matches the whole id, or None (train.val_groups)."""
    compiled = [(name, re.compile(p)) for name, p in patterns.items()]
    return [next((name for name, r in compiled if r.fullmatch(str(i))), None) for i in sample_ids]
