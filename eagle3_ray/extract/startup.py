"""The extract stage's timeline: where the time to its first shard goes.

Only timing lives here; the stage does the same work without it. It gives the timing fields of the
stage's summary.json and its last printed line (docs/pipeline.md, "extract"): the driver's planning
(``plan_s``, ``checks_s``), each engine actor's start-up, measured in the actor and sent back as
columns of its rows (``ActorStartup``), the first committed shard reaching the driver and the steady
rate after it (``Timeline``). The driver's planning steps go to one log line, "extract planning:
<step> <s>, ..." (``PlanningSteps``), which benchmarks/device/extract_e2e.py reads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class PlanningSteps:
    """Seconds per named step of the driver's planning, for one log line (where start-up time goes)."""

    def __init__(self) -> None:
        self.t = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.steps.append((name, now - self.t))
        self.t = now

    def line(self) -> str:
        return ", ".join(f"{name} {s:.2f}s" for name, s in self.steps)


# An engine actor's start-up on the wall clock (time.time()): its process started, its constructor
# entered (the process had imported Ray Data and the stage's modules), the engine's modules (torch) imported.
ACTOR_STARTS = ("process_at", "init_at", "imported_at")


def _process_start() -> float:
    """When this process started (time.time() clock); nan where psutil (a Ray dependency) is absent."""
    try:
        import psutil
    except ImportError:
        return float("nan")
    return psutil.Process().create_time()


class ActorStartup:
    """An engine actor's start-up, taken in its constructor and sent with every row it returns
    (``columns``): the ``ACTOR_STARTS`` times, the engine build's seconds (``engine_s``) and when the
    engine was ready (``engine_ready_at``, wall clock: the driver compares it with its own start,
    on the same node or an NTP'd one)."""

    def __init__(self) -> None:
        """Called first thing in the actor's constructor."""
        self.at = {"process_at": _process_start(), "init_at": time.time(), "imported_at": math.nan}
        self.engine_s = self.ready_at = math.nan
        self._build_t0 = 0.0

    def imported(self) -> None:
        """The engine's modules are imported; its build starts."""
        self.at["imported_at"] = time.time()
        self._build_t0 = time.monotonic()

    def built(self) -> None:
        """The engine is built and ready to capture."""
        self.engine_s, self.ready_at = time.monotonic() - self._build_t0, time.time()

    def columns(self, n: int) -> dict[str, np.ndarray]:
        """The start-up columns of ``n`` rows."""
        return {"engine_s": np.full(n, self.engine_s, dtype=np.float64),
                "engine_ready_at": np.full(n, self.ready_at, dtype=np.float64),
                **{k: np.full(n, v, dtype=np.float64) for k, v in self.at.items()}}


def _first(batch: dict[str, np.ndarray], key: str, reduce) -> float | None:
    values = batch.get(key)
    return float(reduce(values)) if values is not None and len(values) else None


@dataclass
class Timeline:
    """When this run's planning ended and its committed batches reached the driver (monotonic seconds)."""

    t0: float
    t0_wall: float = 0.0  # time.time() at t0: engine actors report when they were ready on that clock
    plan: float | None = None
    checks: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0  # every committed token of this run
    later_tokens: int = 0  # those after the first report
    engine_s: float | None = None
    ready_at: float | None = None
    actor_at: dict[str, float] = field(default_factory=dict)  # the earliest actor's ACTOR_STARTS

    def batch(self, rows: dict[str, np.ndarray], tokens: int) -> None:
        """A batch of the engine actors' rows reached the driver, ``tokens`` of them committed."""
        now = time.monotonic()
        engine_s, ready_at = _first(rows, "engine_s", np.max), _first(rows, "engine_ready_at", np.min)
        if engine_s is not None:
            self.engine_s = max(self.engine_s or 0.0, engine_s)
        if ready_at is not None:
            self.ready_at = min(self.ready_at or ready_at, ready_at)
        for k in ACTOR_STARTS:
            v = _first(rows, k, np.min)
            if v is not None and not math.isnan(v):
                self.actor_at[k] = min(self.actor_at.get(k, v), v)
        if tokens <= 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.later_tokens += tokens
        self.last, self.tokens = now, self.tokens + tokens

    def fields(self) -> dict[str, Any]:
        """The summary's timing fields, in seconds from the stage's start."""
        since = (lambda t: None if t is None else round(t - self.t0, 2))
        span = (self.last - self.first) if self.first is not None else 0.0
        at = {f"actor_{k[:-3]}_s": round(self.actor_at[k] - self.t0_wall, 2) if k in self.actor_at else None
              for k in ACTOR_STARTS}
        return {"run_tokens": self.tokens, "plan_s": since(self.plan), "checks_s": since(self.checks), **at,
                "engine_s": None if self.engine_s is None else round(self.engine_s, 2),
                "engine_ready_s": None if self.ready_at is None else round(self.ready_at - self.t0_wall, 2),
                "first_shard_s": since(self.first),
                "steady_tokens_per_s": round(self.later_tokens / span, 1) if span > 0 else None}


def timeline_line(summary, seconds: float) -> str | None:
    """The stage's last printed line: this run's timeline (an ``ExtractSummary``); None when the run
    committed nothing."""
    s = summary
    if s.first_shard_s is None:
        return None
    steady = f"{s.steady_tokens_per_s:,.0f}" if s.steady_tokens_per_s else "?"
    engine = (f", an engine actor ready after {s.engine_ready_s}s, its build {s.engine_s}s"
              if s.engine_s is not None else "")
    if s.actor_init_s is not None:
        engine += (f" (its process started at {s.actor_process_s}s, its constructor at "
                   f"{s.actor_init_s}s, the engine's modules imported at {s.actor_imported_s}s)")
    return (f"[extract] this run: {s.run_tokens:,} tokens; first shard after {s.first_shard_s}s "
            f"(planning {s.plan_s}s, the driver's checks done at {s.checks_s}s{engine}); "
            f"{s.run_tokens / seconds:,.0f} tokens/s end to end, {steady} tokens/s after the first shard")
