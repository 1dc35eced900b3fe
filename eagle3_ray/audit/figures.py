"""The audit's figures per sample and per shard, and the judgement that stops a bad capture.

A sample's figures are sums over its audited rows (``rows.py``), so a shard's are exact sums of its
samples'. Three figures are judged, each over one kind of row:

- ``unnormed``: the share of rows (all rows of a sample) whose ``last_hidden`` is not the output of
  the final RMSNorm (``normed_rms`` off 1 by more than ``NORM_TOLERANCE``);
- ``agreement``: on rows predicting a token of an answer the target wrote greedily (the generate
  stage's greedy answers, ``greedy_by`` = this target's fingerprint), the share where the argmax is
  that token;
- ``nll_excess``: on rows predicting an assistant token, the mean next-token NLL less the target's
  own entropy there. A healthy capture of a calibrated target scores near 0 on any text; a target
  with random weights too (uniform: NLL = entropy = log V), where the NLL alone would be log V.

The thresholds come from the config (``extract.audit_*``) and were set from measured healthy and
faulty captures (docs/feature-store.md, "Capture audit"). A shard fails only when its figure is past
the threshold with ``SIGMAS`` standard errors to spare (a row's NLL excess varies by ~2.5 nats), so a
small shard of a healthy capture does not fail by chance while a gross fault fails on a few rows.
No Ray in here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from eagle3_ray.audit.rows import NORM_TOLERANCE, RowFigures, normed_rms
from eagle3_ray.errors import AuditFailed

MIN_ROWS = 32  # a shard's figure is judged over at least this many rows (fewer: reported, not judged)
SIGMAS = 3.0  # a figure fails when it is past its threshold by this many standard errors
# aux_rms (reported, not judged) reads at most this many of a sample's audited rows, spread evenly: the
# host gathers them from the [T, 3H] bf16 capture, which at the Llama-3.1-8B shape and share 0.1 was
# 200 rows x 12,288 values a 2K-token sample: likely most of the audit's 6.8% measured there
# (record capture_audit_h100; not profiled on that machine)
AUX_RMS_ROWS = 16

CAUSES = {
    "unnormed": "last_hidden is not the final norm's output (an aux layer's or the pre-norm state: the aux/last "
                "layer mapping); rows never written (a skipped prefix: radix cache, chunked prefill)",
    "agreement": "the capture is off by one position; last_hidden from another layer (the aux/last layer "
                 "mapping); an unreduced tensor-parallel sum; a skipped prefix (radix cache, chunked prefill)",
    "nll_excess": "the capture is off by one position; last_hidden from another layer (the aux/last layer "
                  "mapping); an unreduced tensor-parallel sum; a skipped prefix (radix cache, chunked prefill); "
                  "text this target cannot predict (answers another model wrote)",
}
KEYS = {"unnormed": "extract.audit_max_unnormed", "agreement": "extract.audit_min_agreement",
        "nll_excess": "extract.audit_max_nll_excess"}


@dataclass
class SampleAudit:
    """One sample's audit sums."""

    sample_id: str
    greedy: bool = False  # its answers are this target's greedy ones
    rows: int = 0  # audited rows that predict an assistant token
    nll: float = 0.0  # summed over those rows
    entropy: float = 0.0  # summed over those rows
    excess_sq: float = 0.0  # (nll - entropy) ** 2 summed over those rows
    greedy_rows: int = 0  # of them, rows in an answer this target wrote greedily
    agree: int = 0  # of those, rows whose argmax is the next token
    norm_rows: int = 0  # rows whose last_hidden was checked against the final norm (every row)
    unnormed: int = 0  # of them, rows that are not the norm's output
    aux_rows: int = 0  # audited rows (at most AUX_RMS_ROWS a sample) whose aux states' RMS is summed in aux_rms
    aux_rms: list[float] = field(default_factory=list)  # per aux layer, summed RMS over aux_rows

    def value(self, figure: str) -> float | None:
        if figure == "unnormed":
            return self.unnormed / self.norm_rows if self.norm_rows else None
        if figure == "agreement":
            return self.agree / self.greedy_rows if self.greedy_rows else None
        return (self.nll - self.entropy) / self.rows if self.rows else None

    def count(self, figure: str) -> int:
        return {"unnormed": self.norm_rows, "agreement": self.greedy_rows}.get(figure, self.rows)

    def bound(self, figure: str) -> float | None:
        """The figure moved ``SIGMAS`` standard errors toward healthy: the agreement's upper bound,
        the NLL excess's lower bound (the unnormed share as it is: a healthy capture has none)."""
        value, n = self.value(figure), self.count(figure)
        if value is None or figure == "unnormed":
            return value
        if figure == "agreement":
            return value + SIGMAS * math.sqrt(max(value * (1.0 - value), 1.0 / n) / n)
        var = max(self.excess_sq / n - value * value, 0.0)
        return value - SIGMAS * math.sqrt(var / n)


def audit_sample(sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor, figures: RowFigures | None,
                 greedy: bool, last_hidden: torch.Tensor | None = None, aux_hidden: torch.Tensor | None = None,
                 norm_weight: torch.Tensor | None = None, normed: torch.Tensor | None = None) -> SampleAudit:
    """The audit sums of one sample: ``input_ids`` / ``loss_mask`` [T]; ``figures`` the row figures
    the engine computed (None: none); ``greedy``: its answers are this target's greedy ones;
    ``last_hidden`` [T, H] and ``norm_weight`` [H] for the norm check of every row, or ``normed`` [T]
    its ``normed_rms`` computed by the engine already; ``aux_hidden`` [T, 3H] for the aux layers' RMS
    at the audited rows."""
    out = SampleAudit(sample_id, greedy=greedy)
    if figures is not None and figures.positions.numel():
        ids = input_ids.to(torch.int64).cpu()
        mask = loss_mask.cpu()
        fig = figures.to("cpu")
        nxt = fig.positions + 1
        answer = mask[nxt] == 1  # rows predicting an assistant token
        out.rows = int(answer.sum())
        out.nll = float(fig.nll[answer].double().sum())
        out.entropy = float(fig.entropy[answer].double().sum())
        out.excess_sq = float((fig.nll[answer].double() - fig.entropy[answer].double()).pow(2).sum())
        if greedy:
            out.greedy_rows = out.rows
            out.agree = int((fig.argmax[answer] == ids[nxt][answer]).sum())
        if aux_hidden is not None:
            pos = fig.positions
            if pos.numel() > AUX_RMS_ROWS:
                pos = pos[torch.linspace(0, pos.numel() - 1, AUX_RMS_ROWS).round().long()]
            aux = aux_hidden[pos.to(aux_hidden.device)].float()  # [n, 3H], n <= AUX_RMS_ROWS
            layers = aux.view(aux.shape[0], 3, -1)
            out.aux_rows = aux.shape[0]
            out.aux_rms = [float(v) for v in layers.pow(2).mean(-1).sqrt().double().sum(0)]
    if normed is None and last_hidden is not None and norm_weight is not None:
        normed = normed_rms(last_hidden, norm_weight)
    if normed is not None:
        out.norm_rows = int(normed.numel())
        out.unnormed = int(((normed - 1.0).abs() > NORM_TOLERANCE).sum())
    return out


@dataclass
class ShardAudit:
    """The audit of one shard (or one online batch): its samples' sums."""

    samples: Sequence[SampleAudit]

    def total(self, name: str) -> float:
        return sum(getattr(s, name) for s in self.samples)

    def value(self, figure: str) -> float | None:
        return self.merged().value(figure)

    def bound(self, figure: str) -> float | None:
        return self.merged().bound(figure)

    def merged(self) -> SampleAudit:
        """The shard's sums as one SampleAudit (without aux_rms)."""
        return SampleAudit("", **{k: self.total(k) for k in SUMS})

    def count(self, figure: str) -> int:
        return int(self.total({"unnormed": "norm_rows", "agreement": "greedy_rows"}.get(figure, "rows")))

    def aux_rms(self) -> list[float] | None:
        rows = self.total("aux_rows")
        sums = [s.aux_rms for s in self.samples if s.aux_rms]
        return [round(sum(v) / rows, 5) for v in zip(*sums)] if rows and sums else None

    def to_json(self) -> dict[str, Any]:
        """The shard's figures as its completion marker records them (docs/feature-store.md)."""
        rows = self.count("nll_excess")
        out: dict[str, Any] = {
            "rows": rows,
            "nll": _r(self.total("nll") / rows) if rows else None,
            "entropy": _r(self.total("entropy") / rows) if rows else None,
            "nll_excess": _r(self.value("nll_excess")),
            "nll_excess_std": _r(math.sqrt(max(self.total("excess_sq") / rows - self.value("nll_excess") ** 2, 0.0)))
            if rows else None,
            "greedy_rows": self.count("agreement"),
            "agreement": _r(self.value("agreement")),
            "norm_rows": self.count("unnormed"),
            "unnormed": _r(self.value("unnormed")),
        }
        if (aux := self.aux_rms()) is not None:
            out["aux_rms"] = aux
        return out


def _r(v: float | None) -> float | None:
    return None if v is None else round(float(v), 5)


@dataclass(frozen=True)
class AuditPolicy:
    """The thresholds a shard must meet (``extract.audit_*``)."""

    min_agreement: float
    max_nll_excess: float
    max_unnormed: float

    @classmethod
    def from_config(cls, extract: Any) -> AuditPolicy:
        return cls(extract.audit_min_agreement, extract.audit_max_nll_excess, extract.audit_max_unnormed)

    def threshold(self, figure: str) -> float:
        return {"unnormed": self.max_unnormed, "agreement": self.min_agreement,
                "nll_excess": self.max_nll_excess}[figure]

    def failing(self, shard: ShardAudit) -> str | None:
        """The first figure of ``shard`` that breaks its threshold (norm, agreement, NLL), or None."""
        for figure in ("unnormed", "agreement", "nll_excess"):
            value = shard.bound(figure)
            if value is None or shard.count(figure) < MIN_ROWS:
                continue
            bad = value < self.min_agreement if figure == "agreement" else value > self.threshold(figure)
            if bad:
                return figure
        return None

    def check(self, where: str, shard: ShardAudit) -> None:
        """``AuditFailed`` with one line naming ``where`` (the shard), the figure, the worst sample and
        the likely causes, when a figure of ``shard`` breaks its threshold."""
        figure = self.failing(shard)
        if figure is not None:
            raise AuditFailed(failure_line(where, figure, shard, self.threshold(figure)))


def worst_sample(shard: ShardAudit, figure: str) -> SampleAudit | None:
    scored = [s for s in shard.samples if s.value(figure) is not None]
    if not scored:
        return None
    sign = 1.0 if figure == "agreement" else -1.0
    return min(scored, key=lambda s: (sign * s.value(figure), -s.count(figure)))


def failure_line(where: str, figure: str, shard: ShardAudit, threshold: float) -> str:
    value, bound, rows = shard.value(figure), shard.bound(figure), shard.count(figure)
    op = "<" if figure == "agreement" else ">"
    margin = "" if figure == "unnormed" else f" ({'at most' if figure == 'agreement' else 'at least'} {bound:.3f} " \
        f"at {SIGMAS:g} sigma)"
    worst = worst_sample(shard, figure)
    sample = f"; worst sample {worst.sample_id!r}: {worst.value(figure):.3f} over {worst.count(figure)} rows" \
        if worst is not None else ""
    return (f"{where} fails the capture audit: {figure} {value:.3f}{margin} {op} {KEYS[figure]}={threshold:g} over "
            f"{rows} rows{sample}. Likely causes, most likely first: {CAUSES[figure]}. Shards committed before it are "
            f"valid and kept: fix the cause and rerun the same command to resume (docs/feature-store.md, "
            f"\"Capture audit\")")


SUMS = ("rows", "nll", "entropy", "excess_sq", "greedy_rows", "agree", "norm_rows", "unnormed")


def sums_from_json(fig: dict[str, Any]) -> SampleAudit:
    """A shard's sums back from its ``to_json`` figures (means times rows), to merge shards."""
    rows, greedy = int(fig.get("rows") or 0), int(fig.get("greedy_rows") or 0)
    norm_rows = int(fig.get("norm_rows") or 0)
    excess, std = fig.get("nll_excess") or 0.0, fig.get("nll_excess_std") or 0.0
    return SampleAudit("", rows=rows, nll=(fig.get("nll") or 0.0) * rows, entropy=(fig.get("entropy") or 0.0) * rows,
                       excess_sq=(std * std + excess * excess) * rows,
                       greedy_rows=greedy, agree=round((fig.get("agreement") or 0.0) * greedy),
                       norm_rows=norm_rows, unnormed=round((fig.get("unnormed") or 0.0) * norm_rows))


def merged_json(figures: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The figures of several shards (their markers' ``audit``) as one: a store's, for summary.json."""
    return ShardAudit([sums_from_json(f) for f in figures]).to_json()


def progress_text(s: SampleAudit) -> str:
    """The audit's part of a progress line ("" before any audited row)."""
    parts = []
    if s.greedy_rows:
        parts.append(f"agreement {s.agree / s.greedy_rows:.3f} ({s.greedy_rows} rows)")
    if s.rows:
        parts.append(f"NLL {s.nll / s.rows:.2f} nats, excess {(s.nll - s.entropy) / s.rows:+.2f} ({s.rows} rows)")
    if s.norm_rows:
        parts.append(f"unnormed {s.unnormed / s.norm_rows:.4f}")
    return "audit " + ", ".join(parts) if parts else ""
