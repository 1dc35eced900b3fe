"""What the user sees: progress lines (``[stage] ...``), rate/ETA meters for long stages, and the
logging setup of the CLI and the jobs.

Progress is output, not diagnostics: ``say`` writes it whatever the log level, so every command
shows the same lines however it is run (CLI, job, a test calling the stage). Diagnostics go through
``logging.getLogger(__name__)`` in each module; ``configure_logging`` decides what of them is shown.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Callable, TextIO

logger = logging.getLogger(__name__)


def say(line: str, stream: TextIO | None = None) -> None:
    """One progress line for the user, on stdout unless ``stream`` is given. Written, not
    ``print``ed: Ray Train V2 patches ``print`` on its workers to log the line *and* echo it to a
    redirected stdout, so a printed line reached the driver twice."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()


def configure_logging(level: int = logging.INFO) -> None:
    """Show the package's diagnostics at ``level`` and above, and every library's warnings, as plain
    lines on stderr. Called by the CLI (and so by every job). Leaves a process whose logging is
    already set up (a handler on the root logger) as it is."""
    logging.basicConfig(format="%(message)s")
    logging.getLogger("eagle3_ray").setLevel(level)


def fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class RateMeter:
    """Tracks done/total of samples and tokens; `line()` renders the summary line."""

    def __init__(self, stage: str, total_samples: int, total_tokens: int = 0):
        self.stage = stage
        self.total_samples = total_samples
        self.total_tokens = total_tokens
        self.samples = 0
        self.tokens = 0
        self.bytes = 0
        self.rejected = 0
        self.t0 = time.monotonic()

    def update(self, samples: int = 0, tokens: int = 0, nbytes: int = 0, rejected: int = 0) -> None:
        self.samples += samples
        self.tokens += tokens
        self.bytes += nbytes
        self.rejected += rejected

    def set(self, samples: int, tokens: int, nbytes: int, rejected: int = 0) -> None:
        self.samples, self.tokens, self.bytes, self.rejected = samples, tokens, nbytes, rejected

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.t0, 1e-9)

    def line(self) -> str:
        sps = self.samples / self.elapsed
        tps = self.tokens / self.elapsed
        left = max(self.total_samples - self.samples - self.rejected, 0)
        eta = left / sps if sps > 0 else float("nan")
        parts = [
            f"[{self.stage}] {self.samples}/{self.total_samples} samples",
            f"{sps:.2f} samples/s",
            f"{tps:,.0f} tokens/s",
        ]
        if self.bytes:
            parts.append(f"{self.bytes / 1e9:.3f} GB written")
        if self.rejected:
            parts.append(f"{self.rejected} rejected")
        parts.append(f"ETA {fmt_eta(eta)}")
        return ", ".join(parts)


class Poller:
    """Calls `poll()` every `interval` seconds in a daemon thread and prints what it returns."""

    def __init__(self, poll: Callable[[], str], interval: float = 5.0, stream=None):
        self._poll = poll
        self._interval = interval
        self._stream = stream or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                say(self._poll(), self._stream)
            except Exception as e:  # progress must never kill the stage it reports on
                logger.warning("progress unavailable: %s", e)

    def __enter__(self) -> "Poller":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
