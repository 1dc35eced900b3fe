"""One writer per output directory: an advisory lock that dies with its process.

Two runs writing one ``--out`` at once would interleave shards, checkpoints and part files that each
run alone keeps consistent (resume, atomic commits). ``out_lock`` takes an exclusive ``flock`` on
``<out>/.eagle3-ray.lock`` for the duration of a command and refuses a second holder with the
first's pid, host, command and start time. The kernel drops the lock when the holding process
exits, however it exits (a SIGKILLed run leaves no stale lock), so rerunning after a crash just
works. Local directories only: ``flock`` is not shared between hosts on every network filesystem.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3_ray.errors import OutputInUse

LOCK_FILE = ".eagle3-ray.lock"


@contextmanager
def out_lock(out: str | Path, command: str) -> Iterator[None]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    f = open(out / LOCK_FILE, "a+", encoding="utf-8")  # not inherited by child processes (PEP 446)
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "holder unknown"
            raise OutputInUse(
                f"{out} is being written by another eagle3-ray process ({holder}); wait for it to finish, "
                "stop it, or pass another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, `{command}`, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        yield
    finally:
        f.close()  # releases the lock
