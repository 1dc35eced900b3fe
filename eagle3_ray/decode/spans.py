"""Attention spans of a preallocated KV storage: a masked sdpa reads every key slot it is given, so a
forward attends only over the first ``span`` slots, the smallest span holding the committed and new
tokens (``StaticTarget`` and ``StaticProposer``; one CUDA graph per (step, span))."""

from __future__ import annotations

MIN_SPAN = 256  # the shortest attention span; the next ones double up to max_length


def attention_spans(max_length: int, min_span: int = MIN_SPAN) -> list[int]:
    """``min_span``, doubling, below ``max_length``, then ``max_length``: the spans a forward attends over."""
    spans = []
    span = min_span
    while span < max_length:
        spans.append(span)
        span *= 2
    return spans + [max_length]


def span_for(spans: list[int], n: int) -> int:
    """The smallest of ``spans`` holding ``n`` slots (the caller checked ``n`` fits the storage)."""
    return next(s for s in spans if s >= n)
