"""Divergence audit: where a greedy speculative output first differs from plain greedy decoding, and
whether rounding of the logits can explain it.

At temperature 0 speculative decoding emits the target's argmax at every position, so a turn can
differ from plain decoding only where the target's own logits differ between the two ways of
computing them (a one-token decode forward vs a (K+1)- or tree-wide verify forward, different
kernels, different reduction orders). That can flip the argmax only where the top two logits are
within the rounding error of the target dtype. The audit takes, at the first differing position,
the top-2 gap of the *baseline's* logits (``spec.target_top2``: the same decode forwards, replayed
untimed and teacher-forced on the baseline's answer, so the gap is that of the baseline's own
context even if a free replay would decode otherwise; ``replay_identical`` says whether the
replay's argmax reproduced the baseline) and calls the divergence explained when

    gap <= TIE_ULPS * ulp(max |logit| of that row)

with ``ulp(x)`` the spacing of the target dtype's numbers at |x| (bf16: 2^(floor(log2|x|) - 7)).
The scale is the row's, not the top two's: two forwards differ by the rounding of the activations
that every logit is computed from, so the difference is of the same size for every entry of a row,
small logits included. Measured on the H200 (SmolLM2-135M, bf16, at ee8d170 with
``benchmarks/device/divergence_probe.py``, since removed; ``benchmarks/results/divergence_probe_h200_w{4,49}.json``): over the 127 positions of one turn, the largest
|verify - decode| difference of a row had median 0.31 and maximum 0.91, in rows whose largest
|logit| was about 40 (4 ulps = 1.0). At the position that turn diverged, the top two logits were
1.9 and 1.8: 4 ulps of those is 0.03, a third of the smallest such difference seen, so a bound taken
at the top two's own magnitude (this audit's first rule) called a rounding tie a bug.
TIE_ULPS = 4 allows each of the two logits to be off by 2 ulps of the row's scale. A divergence over
the bound is a bug to look for, not rounding. In fp32 the bound is 2^16 times tighter than in bf16,
so an fp32 divergence is practically always unexplained (as it should be).
"""

from __future__ import annotations

import math
from typing import Any

import torch

TIE_ULPS = 4


def ulp(value: float, dtype: torch.dtype) -> float:
    """Spacing of ``dtype``'s numbers at |value| (the smallest normal's spacing at 0)."""
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)
    _, exponent = math.frexp(magnitude)  # magnitude = m * 2^exponent, 0.5 <= m < 1
    return info.eps * 2.0 ** (exponent - 1)


def first_difference(reference: list[int], other: list[int]) -> int | None:
    """First position where the two token lists differ (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def audit_turn(
    reference: list[int], other: list[int], top2: list[tuple[float, float]], dtype: torch.dtype
) -> dict[str, Any] | None:
    """The audit record of one turn (None when ``other`` equals ``reference``).

    ``top2[i]``: the baseline's two largest logits at new token i, and the largest |logit| of that
    row (without it, the larger of the two stands in). ``explained`` is None when the position has
    no baseline logits (``other`` runs past the reference's end).
    """
    pos = first_difference(reference, other)
    if pos is None:
        return None
    record: dict[str, Any] = {
        "position": pos,
        "baseline_token": reference[pos] if pos < len(reference) else None,
        "token": other[pos] if pos < len(other) else None,
        "top1": None, "top2": None, "scale": None, "gap": None, "ulp": None, "gap_ulps": None, "explained": None,
    }
    if pos < len(top2):
        top1, second, *rest = top2[pos]
        scale = rest[0] if rest else max(abs(top1), abs(second))
        step = ulp(scale, dtype)
        gap = top1 - second
        record.update(top1=top1, top2=second, scale=scale, gap=gap, ulp=step, gap_ulps=gap / step,
                      explained=gap <= TIE_ULPS * step)
    return record


def bound_text(dtype: torch.dtype) -> str:
    return f"top-2 gap <= {TIE_ULPS} ulp of the row's max |logit| in {str(dtype).removeprefix('torch.')}"
