"""Linear warmup then cosine decay to `min_lr_ratio` x lr, as a LambdaLR factor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def warmup_steps_of(warmup_steps: int, warmup_ratio: float | None, total_steps: int) -> int:
    """The run's warmup in optimizer steps: ``warmup_ratio`` of ``total_steps`` (at least 1) when set,
    else ``warmup_steps`` (train.warmup_ratio / train.warmup_steps)."""
    if warmup_ratio is None:
        return warmup_steps
    return max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0
