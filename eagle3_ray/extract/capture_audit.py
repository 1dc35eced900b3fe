"""The capture audit in an engine actor (docs/feature-store.md, "Capture audit").

Each capture arrives with the engine's figures of its audited rows (computed with the target's
lm_head where the states are: ``engines/hf.py``, ``engines/sglang_hooks.py``); here they become one
sum per sample, with the final-norm check of every row, and each shard's sums are judged before the
shard is committed (``FeatureStoreWriter``'s ``on_shard``): a failing shard is never written, so a
rerun after the fix redoes it. The compute is ``eagle3_ray.audit``; this is its use by the actors.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch

from eagle3_ray.audit.figures import AuditPolicy, SampleAudit, ShardAudit, audit_sample
from eagle3_ray.config import ExtractConfig, TargetConfig
from eagle3_ray.errors import AuditFailed

log = logging.getLogger(__name__)

# Per-sample columns an offline extraction batch returns to the driver (its progress line).
COLUMNS = ("rows", "nll", "entropy", "excess_sq", "greedy_rows", "agree", "norm_rows", "unnormed")


class CaptureAudit:
    """One engine actor's audit: ``sample`` for each capture, ``on_shard`` / ``check`` per shard."""

    def __init__(self, engine: Any, target: TargetConfig, extract: ExtractConfig, fingerprint: str,
                 run: str = "", stage: str = "capture"):
        """``fingerprint``: the store's ``target_fingerprint``, which the generate stage writes as
        ``greedy_by`` on this target's greedy answers."""
        self.policy, self.share = AuditPolicy.from_config(extract), extract.audit_rows
        self.fingerprint, self.run, self.stage = fingerprint, run, stage
        self.norm = _final_norm_weight(engine, target) if self.policy.max_unnormed < 1.0 else None
        check_aux_layers(engine)

    def sample(self, sample_id: str, input_ids: Any, loss_mask: Any, capture: Any, greedy_by: str) -> SampleAudit:
        if self.share > 0 and capture.audit is None:
            raise AuditFailed(
                f"the engine returned no capture audit figures for sample {sample_id!r} (extract.audit_rows="
                f"{self.share:g}): its lm_head could not be read where the states are (SGLang's log says why); set "
                "extract.audit_rows=0 to extract without the lm_head audit (the final-norm check still runs)"
            )
        return audit_sample(sample_id, torch.as_tensor(np.asarray(input_ids)), torch.as_tensor(np.asarray(loss_mask)),
                            capture.audit, bool(greedy_by) and greedy_by == self.fingerprint,
                            capture.last_hidden, capture.aux_hidden, self.norm,
                            getattr(capture, "normed", None) if self.norm is not None else None)

    def check(self, where: str, audits: Sequence[SampleAudit]) -> dict[str, Any]:
        """Judge one shard's samples (``AuditFailed`` naming ``where``); its figures, on the dashboard."""
        shard = ShardAudit(audits)
        figures = shard.to_json()
        _record(figures, self.run, self.stage)
        self.policy.check(where, shard)
        return figures

    def on_shard(self, name: str, notes: list[SampleAudit | None]) -> dict[str, Any]:
        """``FeatureStoreWriter``'s hook: the shard's marker fields, or ``AuditFailed``."""
        audits = [n for n in notes if n is not None]
        figures = self.check(f"shard {name}", audits)
        return {"audit": figures, "greedy_ids": [a.sample_id for a in audits if a.greedy]}


REFERENCE_TOKENS = 32  # the reference capture's length


def check_aux_layers(engine: Any) -> None:
    """The lm_head cannot see which layers the aux states came from: an engine that can make a
    reference capture (``aux_layer_sources``: the HF engine) captures a short sequence both ways at
    the start, and ``AuditFailed`` names the states it took when they are not ``info.aux_layers``."""
    sources = getattr(engine, "aux_layer_sources", None)
    if sources is None:
        return
    info = engine.info
    seq = torch.randint(0, info.vocab_size, (REFERENCE_TOKENS,), generator=torch.Generator().manual_seed(0))
    got = sources(seq.tolist())
    if got != list(info.aux_layers):
        raise AuditFailed(
            f"the capture's aux states are hidden_states {got} of a reference forward of {REFERENCE_TOKENS} tokens, "
            f"not target.aux_layers={list(info.aux_layers)} (HF hidden_states indices, docs/contracts.md \"Aux layer "
            "ids\"). Likely causes: the aux layer id convention (an id off by one: transformers' selective "
            "output_hidden_states, engines/hidden_states.py); a capture of another layer set. Nothing was written"
        )


def columns(audits: Sequence[SampleAudit | None]) -> dict[str, np.ndarray]:
    """The per-sample sums as ``audit_<name>`` columns of an extraction batch's result rows."""
    rows = [a or SampleAudit("") for a in audits]
    return {f"audit_{k}": np.asarray([getattr(a, k) for a in rows], dtype=np.float64) for k in COLUMNS}


def from_columns(batch: dict[str, np.ndarray], keep: np.ndarray) -> SampleAudit:
    """The sums of the rows ``keep`` of a batch ``columns`` made (zeros where a batch has none)."""
    return SampleAudit("", **{k: float(np.asarray(batch[f"audit_{k}"])[keep].sum()) if f"audit_{k}" in batch else 0
                              for k in COLUMNS})


def _final_norm_weight(engine: Any, target: TargetConfig) -> torch.Tensor:
    """The final norm's weight [H] on the CPU: the HF engine's model holds it; else (SGLang, whose
    model lives in its own processes) it is read by name from the target's files."""
    from eagle3_ray.audit.weights import final_norm, lm_head_and_norm

    model = getattr(getattr(engine, "target", None), "model", None)
    norm = final_norm(model) if isinstance(model, torch.nn.Module) else None
    if norm is not None:
        return norm.weight.detach().float().cpu()
    return lm_head_and_norm(target, with_head=False)[1].float()


def _record(figures: dict[str, Any], run: str, stage: str) -> None:
    from eagle3_ray import metrics

    for key, name in (("agreement", "capture_agreement"), ("nll", "capture_nll"),
                      ("nll_excess", "capture_nll_excess")):
        if figures.get(key) is not None:
            metrics.set_gauge(name, figures[key], run, stage)
