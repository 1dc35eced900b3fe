"""``rejects.jsonl``: the samples a stage quarantined, one JSON object a line.

The prepare and generate stages write one into their --out, the feature store one at its root
(``{"sample_id", "source", "reason", "stage"}``; docs/feature-store.md). Each line is appended with
one ``write()`` on an ``O_APPEND`` descriptor, so that lines from concurrent processes (the engine
actors of one store) never interleave. No torch, no Ray: a stage's driver imports this alone.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

logger = logging.getLogger(__name__)

REJECTS_FILE = "rejects.jsonl"


def append_rejects(root: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append ``rows`` to ``root``'s rejects file (created with ``root`` if need be), one write a line.
    A short write (the disk filled up) raises ``OSError`` ENOSPC."""
    path = Path(root) / REJECTS_FILE
    lines = [(json.dumps(dict(r), ensure_ascii=False) + "\n").encode("utf-8") for r in rows]
    if not lines:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        for data in lines:
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, f"short write to {path}", str(path))
    finally:
        os.close(fd)


def read_rejects(root: str | Path) -> list[dict[str, Any]]:
    """All reject lines; a torn last line from a crash is skipped with a warning."""
    path = Path(root) / REJECTS_FILE
    if not path.is_file():
        return []
    out = []
    # split at "\n" only: str.splitlines() would also split inside a record at U+2028 and the like
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n"), 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            logger.warning("skipping unreadable line %d of %s", n, path)
    return out


def rejected_ids(root: str | Path) -> set[str]:
    return {r["sample_id"] for r in read_rejects(root) if "sample_id" in r}
