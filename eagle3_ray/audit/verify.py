"""Audit an existing feature store the way extraction audits it live (``eagle3-ray verify``).

Loads only the target's lm_head and final norm (``weights.py``), reads each shard's samples, computes
the figures of ``audit_positions(T, share)`` per sample on the chosen device, sums them per shard and
judges every shard with the ``extract.audit_*`` thresholds. Which samples are greedy answers of the
target comes from each shard's marker (``greedy_ids``). No Ray in here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3_ray.audit.figures import AuditPolicy, SampleAudit, ShardAudit, audit_sample, failure_line
from eagle3_ray.audit.rows import audit_positions, row_figures
from eagle3_ray.config import PipelineConfig
from eagle3_ray.errors import StoreError

PROGRESS_EVERY_S = 10.0


@dataclass
class ShardVerdict:
    name: str  # the shard's file name
    samples: int
    figures: dict  # ShardAudit.to_json()
    failing: str | None  # the figure that breaks its threshold, or None
    line: str | None  # the failure's one line


@dataclass
class VerifyReport:
    store: str
    share: float
    device: str
    shards: list[ShardVerdict]
    seconds: float

    @property
    def failed(self) -> list[ShardVerdict]:
        return [s for s in self.shards if s.failing is not None]


def check_target(cfg: PipelineConfig, store_fingerprint: str, root: Path) -> None:
    """``StoreError`` when ``cfg.target`` is not the target the store was extracted from."""
    from eagle3_ray.engines.describe import describe_target

    got = describe_target(cfg.target).fingerprint
    if got != store_fingerprint:
        raise StoreError(
            f"the feature store {root} was extracted from another target (fingerprint {store_fingerprint}) than "
            f"target.model={cfg.target.model!r} (fingerprint {got}); pass -c with the config it was extracted "
            "with, or target.model=... of that target"
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StoreError(f"--device {device}: CUDA is not available here; pass --device cpu")
    return torch.device(device)


def verify_store(root: str | Path, cfg: PipelineConfig, share: float | None = None, device: str = "auto",
                 progress: Callable[[str], None] | None = None) -> VerifyReport:
    """Audit every completed shard of the store at ``root`` with ``cfg.target``'s lm_head and final
    norm and ``cfg.extract``'s thresholds; ``share``: of each sample's rows (default
    ``extract.audit_rows``); ``progress``: called with a progress line now and then."""
    from eagle3_ray.audit.weights import lm_head_and_norm
    from eagle3_ray.features import open_store
    from eagle3_ray.features.shards import open_shard, read_sample
    from eagle3_ray.features.store import manifest

    t0 = time.monotonic()
    root = Path(root)
    store = open_store(root, on_corrupt="abort")
    check_target(cfg, store.meta.target_fingerprint, root)
    share = cfg.extract.audit_rows if share is None else share
    dev = resolve_device(device)
    head, norm = lm_head_and_norm(cfg.target)
    # As stored on a GPU (bf16, as SGLang computes its logits); fp32 on a CPU, where bf16 matmuls are slow.
    head = head.to(dev, torch.float32 if dev.type == "cpu" else head.dtype)
    norm = norm.float()
    policy = AuditPolicy.from_config(cfg.extract)
    greedy = {m["shard"]: set(m.get("greedy_ids") or ()) for m in manifest(root)}
    total = sum(len(s.sample_ids) for s in store.shards)
    verdicts, done, rows, last = [], 0, 0, time.monotonic()
    started = last  # the rate counts from here, the weights loaded
    for info in store.shards:
        handle = open_shard(info.path)
        audits: list[SampleAudit] = []
        for j, sid in enumerate(info.sample_ids):
            rec = read_sample(handle, sid, int(info.offsets[j]), int(info.offsets[j + 1]), store.meta.compact)
            audits.append(_sample(rec, head, norm, share, sid in greedy.get(info.path.name, ())))
            done += 1
            rows += audits[-1].rows
            if progress is not None and time.monotonic() - last > PROGRESS_EVERY_S:
                progress(_line(len(verdicts), len(store.shards), done, total, rows, started))
                last = time.monotonic()
        shard = ShardAudit(audits)
        figure = policy.failing(shard)
        line = failure_line(f"shard {info.path.name}", figure, shard, policy.threshold(figure)) if figure else None
        verdicts.append(ShardVerdict(info.path.name, len(audits), shard.to_json(), figure, line))
    if progress is not None:
        progress(_line(len(verdicts), len(store.shards), done, total, rows, started))
    return VerifyReport(str(root), share, str(dev), verdicts, round(time.monotonic() - t0, 2))


def _sample(rec: dict, head: torch.Tensor, norm: torch.Tensor, share: float, greedy: bool) -> SampleAudit:
    ids, last = rec["input_ids"].long(), rec["last_hidden"]  # [T], [T, H] bf16
    positions = audit_positions(len(ids), share)
    figures = None
    if positions.numel():
        hidden = last[positions].to(head.device)
        figures = row_figures(hidden, head, ids[positions + 1], positions)
    return audit_sample(rec["sample_id"], ids, rec["loss_mask"], figures, greedy, last, rec["aux_hidden"], norm)


def _line(shards_done: int, shards: int, done: int, total: int, rows: int, t0: float) -> str:
    elapsed = max(time.monotonic() - t0, 1e-9)
    left = (total - done) / (done / elapsed) if done else float("nan")
    eta = f"{left:.0f}s" if left == left else "?"
    return (f"[verify] {shards_done}/{shards} shards, {done}/{total} samples, {rows / elapsed:,.0f} audited rows/s, "
            f"ETA {eta}")
