"""Output tokens and the accounting of one generation.

Definitions (docs/decode.md):
- a *verify step* is one target forward over the drafted tokens; the prefill forward, which
  produces the first new token, is not one;
- tau = tokens appended by verify steps / verify steps. A step appends its accepted drafts plus
  the target's own next token (the bonus, or the correction after a rejection), so tau counts the
  bonus and is >= 1; a step cut short by EOS or max_new_tokens counts what it appended;
- accept_by_position[i-1] = fraction of verify steps where the target accepted at least i drafts
  (before any EOS/length cut);
- target_forwards = verify steps + the prefill, the denominator to compare methods by;
- parts = wall seconds per part of the generation: ``prefill`` (the prompt's target forward and
  the drafter's priming), then per verify cycle ``draft`` (drafting), ``verify`` (the target
  forward), ``accept`` (the acceptance decision, cache rollback, output bookkeeping) and ``commit``
  (feeding the accepted target states to the drafter; greedy decoding on the static drafter commits
  inside the next draft's graph and has no ``commit`` part, ``spec.chain._chain_generate_ahead``).
  On CUDA each part is the device time
  between CUDA events recorded at the part boundaries, so no part adds a host sync; they sum to
  ``seconds`` up to the clock's own overhead.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass
class SpecStats:
    tau: float | None  # None when no verify step ran (the prefill token ended the generation)
    accept_by_position: list[float]  # [K], draft position 1..K
    verify_steps: int
    new_tokens: int
    seconds: float
    tokens_per_s: float
    target_forwards: int
    accept_hist: list[int]  # [K+1], verify steps that accepted exactly i drafts
    parts: dict[str, float] = field(default_factory=dict)  # seconds per part (module doc)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Tally:
    """Collects new tokens until EOS (kept) or ``max_new_tokens``, and the per-step counts."""

    def __init__(self, max_new_tokens: int, eos_ids: set[int], max_drafts: int):
        self.max_new_tokens = max_new_tokens
        self.eos_ids = eos_ids
        self.tokens: list[int] = []
        self.done = False
        self.appended: list[int] = []  # per verify step: tokens it added to the output
        self.hist = [0] * (max_drafts + 1)  # [K+1]

    def _push(self, tokens: list[int]) -> int:
        added = 0
        for token in tokens:
            if self.done:
                break
            self.tokens.append(token)
            added += 1
            self.done = token in self.eos_ids or len(self.tokens) >= self.max_new_tokens
        return added

    def first(self, token: int) -> bool:
        """Record the prefill's token; True when generation is over."""
        self._push([token])
        return self.done

    def step(self, tokens: list[int], accepted: int) -> bool:
        """Record one verify step: its accepted drafts + the target's token; True when over."""
        self.hist[accepted] += 1
        self.appended.append(self._push(tokens))
        return self.done

    def stats(self, seconds: float, parts: dict[str, float] | None = None) -> SpecStats:
        steps = len(self.appended)
        at_least = [sum(self.hist[i:]) for i in range(1, len(self.hist))]  # steps with >= i accepted
        return SpecStats(
            tau=sum(self.appended) / steps if steps else None,
            accept_by_position=[n / steps if steps else 0.0 for n in at_least],
            verify_steps=steps,
            new_tokens=len(self.tokens),
            seconds=seconds,
            tokens_per_s=len(self.tokens) / seconds if seconds > 0 else 0.0,
            target_forwards=steps + 1,
            accept_hist=list(self.hist),
            parts=dict(parts or {}),
        )


class Stopwatch:
    """Wall time of a generation; waits for the device so queued GPU work is inside the interval.

    ``mark(part)`` charges the time since the previous mark (or the start) to ``part``; on CUDA
    with CUDA events on the current stream (no host sync), elsewhere with the host clock.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._sync()
        self.start = time.perf_counter()
        self._marks: list[tuple[str, object]] = [("", self._now())]

    def _now(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, part: str) -> None:
        self._marks.append((part, self._now()))

    def parts(self) -> dict[str, float]:
        """Seconds per part over the marks so far (waits for the device on CUDA)."""
        self._sync()
        total: dict[str, float] = {}
        for (_, before), (part, after) in zip(self._marks, self._marks[1:]):
            spent = before.elapsed_time(after) / 1000 if self._cuda else after - before
            total[part] = total.get(part, 0.0) + spent
        return total

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self) -> float:
        self._sync()
        return time.perf_counter() - self.start
