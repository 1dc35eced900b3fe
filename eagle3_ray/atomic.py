"""Atomic file and directory publication: every file the package writes goes through here.

A file is written to a private temp file in its final directory, flushed and fsynced, renamed over
its final name, and the directory is fsynced; readers therefore see the old file, or the complete
new one, never a partial write. On an error the temp file is removed and the error re-raised.
Temp names start with ``TMP_PREFIX`` so that listings (and ``features.store.cleanup_orphans``)
can tell them apart.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, TypeVar

TMP_PREFIX = ".tmp-"

T = TypeVar("T")
Opener = Callable[[Path], BinaryIO]


def open_exclusive(path: Path) -> BinaryIO:
    """The default opener: a new file, never an existing one."""
    return open(path, "xb")


def tmp_path(final: Path) -> Path:
    """A temp name next to ``final``, unique per process and call."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def remove_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_tmp(final: Path, fill: Callable[[BinaryIO], T], opener: Opener) -> tuple[Path, T]:
    tmp = tmp_path(final)
    try:
        with opener(tmp) as f:
            result = fill(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        remove_quietly(tmp)
        raise
    return tmp, result


def write_stream(final: str | Path, fill: Callable[[BinaryIO], T], opener: Opener = open_exclusive) -> T:
    """Publish the bytes ``fill(f)`` writes to a binary file object as ``final``; returns what
    ``fill`` returns. ``opener`` opens the temp file (tests pass one that fails like a full disk)."""
    final = Path(final)
    tmp, result = _write_tmp(final, fill, opener)
    try:
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(final.parent)
    return result


def write_bytes(final: str | Path, data: bytes, opener: Opener = open_exclusive) -> None:
    write_stream(final, lambda f: f.write(data), opener)


def write_text(final: str | Path, text: str) -> None:
    write_bytes(final, text.encode("utf-8"))


def write_json(final: str | Path, obj: Any, *, indent: int | None = 2, sort_keys: bool = False,
               newline: bool = True) -> None:
    """``json.dumps(obj, indent=indent, sort_keys=sort_keys)``, plus a final newline if ``newline``."""
    write_text(final, json.dumps(obj, indent=indent, sort_keys=sort_keys) + ("\n" if newline else ""))


def write_file(final: str | Path, build: Callable[[Path], None]) -> None:
    """Publish a file that a library writes by name (safetensors, parquet): ``build(tmp)`` writes
    ``tmp``, which is then fsynced and renamed to ``final``."""
    final = Path(final)
    tmp = tmp_path(final)
    try:
        build(tmp)
        _fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(final.parent)


def publish_if_absent(final: str | Path, data: bytes, opener: Opener = open_exclusive) -> bool:
    """Atomically create ``final`` unless it exists; False when another process won."""
    final = Path(final)
    tmp, _ = _write_tmp(final, lambda f: f.write(data), opener)
    try:
        os.link(tmp, final)  # unlike rename, link never replaces an existing file
    except FileExistsError:
        return False
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        if final.exists():  # filesystem without hard links: best-effort check-then-rename
            return False
        os.replace(tmp, final)
    finally:
        remove_quietly(tmp)
    fsync_dir(final.parent)
    return True


def publish_dir(dest: Path, build: Callable[[Path], None]) -> Path:
    """Build a directory in a private temp dir, then rename it into place.

    The rename is atomic, so readers see either nothing or a complete directory. When two processes
    race, the loser's rename fails because ``dest`` exists; it drops its copy and uses the winner's.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        build(tmp)
        os.rename(tmp, dest)
    except OSError:
        if not dest.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
