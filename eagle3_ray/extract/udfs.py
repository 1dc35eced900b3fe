"""Ray Data callable classes of the stages: tokenize (prepare), capture-and-write (offline extract),
capture into packed training rows (online/hybrid training).

Each class loads its heavy state once in ``__init__`` and transforms numpy batches in
``__call__``; the compute they call (chat templates, engines, the store) has no Ray in it.
bf16 hidden states travel through Ray Data as uint16 views (numpy/Arrow have no bfloat16).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from eagle3_ray.config import ExtractConfig, TargetConfig
from eagle3_ray.extract.startup import ActorStartup

if TYPE_CHECKING:
    from eagle3_ray.features.store import StoreMeta


class TokenizeUDF:
    """messages (and tools) -> input_ids / loss_mask with the tokenizer's own chat template, and each row's token
    and loss-token counts; a rejected row keeps its reason in ``reject`` ("" for a kept row).
    ``greedy_by`` (the target that answered the sample greedily, or "") travels on."""

    def __init__(self, tokenizer_path: str, max_length: int, truncate: bool, run: str = ""):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.max_length = max_length
        self.truncate = truncate
        self.run = run

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from eagle3_ray.data.chat import tokenize_conversation
        from eagle3_ray.data.sources import Sample
        from eagle3_ray.errors import SampleRejected

        ids, masks, n_tokens, rejects = [], [], [], []
        tools = batch["tools"] if "tools" in batch else ["null"] * len(batch["sample_id"])  # JSON, per row
        for sid, messages, source, tool_list in zip(batch["sample_id"], batch["messages"], batch["source"], tools):
            sample = Sample(sample_id=str(sid), messages=json.loads(messages), source=str(source),
                            tools=json.loads(tool_list))
            try:
                tok = tokenize_conversation(self.tokenizer, sample, self.max_length, self.truncate)
            except SampleRejected as e:
                ids.append(np.zeros(0, np.int32))
                masks.append(np.zeros(0, np.uint8))
                n_tokens.append(0)
                rejects.append(str(e))
                continue
            ids.append(np.asarray(tok.input_ids, dtype=np.int32))
            masks.append(np.asarray(tok.loss_mask, dtype=np.uint8))
            n_tokens.append(len(tok.input_ids))
            rejects.append("")
        _record_stage(self.run, "prepare", sum(1 for r in rejects if not r), sum(n_tokens),
                      sum(1 for r in rejects if r))
        # An Arrow table, so that the token columns stay list<int32> / list<uint8> (the prepared
        # parquet's types) rather than becoming Ray Data tensor columns.
        return pa.table({
            "sample_id": pa.array([str(s) for s in batch["sample_id"]], pa.string()),
            "source": pa.array([str(s) for s in batch["source"]], pa.string()),
            "greedy_by": pa.array([str(s) for s in batch.get("greedy_by", [""] * len(ids))], pa.string()),
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
            "num_tokens": pa.array(n_tokens, pa.int64()),
            "loss_tokens": pa.array([int(m.sum()) for m in masks], pa.int64()),
            "reject": pa.array(rejects, pa.string()),
        })


class CaptureUDF:
    """The engine actor: one target engine per actor, full-sequence capture of aux + last hidden."""

    def __init__(self, target: TargetConfig, batch_tokens: int, expected_hidden: int, run: str = "",
                 stage: str = "capture", audit_share: float = 0.0):
        from eagle3_ray.engines.factory import build_engine

        self.run, self.stage = run, stage
        self.engine = build_engine(target, batch_tokens=batch_tokens, audit_share=audit_share)
        if self.engine.info.hidden_size != expected_hidden:
            raise RuntimeError(
                f"engine hidden size {self.engine.info.hidden_size} != planned {expected_hidden}"
            )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from eagle3_ray.features.record import bf16_to_uint16, ragged

        t0 = time.monotonic()
        seqs = [np.asarray(a).tolist() for a in batch["input_ids"]]
        captures = self.engine.capture(seqs)
        aux = [bf16_to_uint16(c.aux_hidden.to(torch.bfloat16)) for c in captures]
        last = [bf16_to_uint16(c.last_hidden.to(torch.bfloat16)) for c in captures]
        _record_capture(self.run, self.stage, len(seqs), sum(len(q) for q in seqs), time.monotonic() - t0)
        # Every input column travels on (online mode carries its pack keys through the engine).
        return {**batch, "aux_hidden": ragged(aux), "last_hidden": ragged(last)}


class PackCaptureUDF(CaptureUDF):
    """Engine actor of online/hybrid training: rows {key, samples} in, packed micro-batch rows out.

    Loads the prepared token ids once; each call captures every sample of its packs in one engine
    call (the engine actor of `CaptureUDF`: its engine, not its numpy rows), drops samples that fail
    record validation (counted as rejects), and, in hybrid mode, commits them to the feature store
    under a writer id derived from the pack keys: a retried call (Ray retries a task whose actor died)
    finds the samples its first attempt committed (`store.writer_committed_ids`) and does not write
    them twice. Hidden states stay bf16 tensors until the packed row (the layout of train/data.py,
    bf16 as uint16) leaves the actor. The capture audit judges each call's samples (online) or each
    shard before it is committed (hybrid): a failing one stops training with ``AuditFailed``.
    """

    def __init__(self, prepared: str, target: TargetConfig, batch_tokens: int, meta: StoreMeta,
                 run: str = "", store_root: str | None = None, shard_max_bytes: int | None = None,
                 extract: ExtractConfig | None = None):
        """``store_root`` (hybrid): the feature store each call commits its samples to, in shards of
        about ``shard_max_bytes`` (``extract.shard_max_bytes``; None: one shard a call). ``extract``:
        the capture audit's settings (default: the schema's)."""
        from eagle3_ray.extract.capture_audit import CaptureAudit
        from eagle3_ray.extract.prepared import read_greedy_by, read_prepared

        extract = extract or ExtractConfig()
        super().__init__(target, batch_tokens, meta.hidden_size, run=run, stage="online",
                         audit_share=extract.audit_rows)
        self.sample_ids, _, self.ids, self.masks = read_prepared(prepared)
        self.greedy_by = read_greedy_by(prepared)
        self.meta, self.store_root, self.shard_max_bytes = meta, store_root, shard_max_bytes
        self.audit = CaptureAudit(self.engine, target, extract, meta.target_fingerprint, run, "online")

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from eagle3_ray.features.record import ragged
        from eagle3_ray.train.data import PACKED_KEYS, packed_row

        packs = [np.asarray(s, dtype=np.int64) for s in batch["samples"]]
        flat = np.concatenate(packs)  # prepared indices of every sample in this call
        captures = self._capture([self.ids[i].tolist() for i in flat])
        records = [self._record(i, c) for i, c in zip(flat, captures)]
        audits = [self.audit.sample(self.sample_ids[i], self.ids[i], self.masks[i], c, self.greedy_by[i])
                  for i, c in zip(flat, captures)]
        keep = self._validate_or_store(records, batch["key"], audits)
        rows, start = [], 0
        for pack in packs:
            kept = [records[j] for j in range(start, start + len(pack)) if keep[j]]
            start += len(pack)
            rows.append(packed_row(kept) if kept else None)
        ok = [i for i, r in enumerate(rows) if r is not None]
        return {"key": batch["key"][ok], **{k: ragged([rows[i][k] for i in ok]) for k in PACKED_KEYS}}

    def _capture(self, seqs: list[list[int]]) -> list:
        """The engine's captures of `seqs`, counted on the dashboard as `CaptureUDF` counts its own."""
        t0 = time.monotonic()
        captures = self.engine.capture(seqs)
        _record_capture(self.run, self.stage, len(seqs), sum(len(q) for q in seqs), time.monotonic() - t0)
        return captures

    def _record(self, i: int, capture) -> dict[str, Any]:
        import torch

        return {
            "sample_id": self.sample_ids[i],
            "input_ids": torch.from_numpy(self.ids[i]),  # [T] int32
            "loss_mask": torch.from_numpy(self.masks[i]),  # [T] uint8
            "aux_hidden": capture.aux_hidden.to(torch.bfloat16),  # [T, 3H]
            "last_hidden": capture.last_hidden.to(torch.bfloat16),  # [T, H]
        }

    def _validate_or_store(self, records: list[dict[str, Any]], keys: np.ndarray, audits: list) -> list[bool]:
        from eagle3_ray import metrics
        from eagle3_ray.errors import SampleRejected
        from eagle3_ray.features.record import validate_record
        from eagle3_ray.features.store import FeatureStoreWriter, writer_committed_ids

        keep = []
        if self.store_root is None:
            for rec in records:
                try:
                    validate_record(rec, self.meta.hidden_size, self.meta.vocab_size)
                    keep.append(True)
                except SampleRejected:
                    keep.append(False)
            self.audit.check(f"the online capture of packs {', '.join(str(k) for k in keys[:3])}"
                             f"{', ...' if len(keys) > 3 else ''}", [a for a, k in zip(audits, keep) if k])
        else:
            wid = "h" + hashlib.sha1("\n".join(str(k) for k in keys).encode()).hexdigest()[:16]
            committed = writer_committed_ids(self.store_root, wid)  # by an earlier attempt of this call
            with FeatureStoreWriter(self.store_root, self.meta, writer_id=wid,
                                    shard_max_bytes=self.shard_max_bytes, on_shard=self.audit.on_shard) as w:
                for rec, audit in zip(records, audits):
                    if rec["sample_id"] in committed:
                        keep.append(True)
                        continue
                    try:
                        w.add(rec, audit)
                        keep.append(True)
                    except SampleRejected as e:
                        w.reject(rec["sample_id"], "online", str(e), stage="extract")
                        keep.append(False)
            metrics.inc("bytes_written", sum(p.stat().st_size for p in w.shards_written), self.run, "store")
        metrics.inc("rejects", keep.count(False), self.run, self.stage)
        return keep


START_POLL_S = 0.05  # CaptureWriteUDF: how often a call looks for the run's start file


def _ray_placement() -> tuple[dict[str, str] | None, str]:
    """({"ip", "id"} of this process's Ray node, its actor id) in a Ray actor; (None, "") outside Ray."""
    import ray

    if not ray.is_initialized():
        return None, ""
    ctx = ray.get_runtime_context()
    return {"ip": ray.util.get_node_ip_address(), "id": ctx.get_node_id()}, ctx.get_actor_id() or ""


def _record_stage(run: str, stage: str, samples: int, tokens: int, rejects: int) -> None:
    from eagle3_ray import metrics

    metrics.inc("samples", samples, run, stage)
    metrics.inc("tokens", tokens, run, stage)
    metrics.inc("rejects", rejects, run, stage)


def _record_capture(run: str, stage: str, samples: int, tokens: int, seconds: float) -> None:
    """One engine capture call on the dashboard: its samples and tokens, and its rate."""
    from eagle3_ray import metrics

    _record_stage(run, stage, samples, tokens, 0)
    metrics.set_gauge("extract_tokens_per_s", tokens / max(seconds, 1e-9), run, stage)


def _stopped_before_start(start_file: str | None) -> bool:
    """True when the run's start file already says ``{"go": false}`` (CaptureWriteUDF)."""
    if start_file is None:
        return False
    try:
        with open(start_file, encoding="utf-8") as f:
            return not json.load(f).get("go")
    except (OSError, ValueError):  # not written yet (or mid-write: write_json is atomic, so not expected)
        return False


class CaptureWriteUDF:
    """Offline extraction: capture, validate and commit one shard per batch inside the engine actor.

    Features never cross the object store (at 8B scale a batch is ~270 MB: serialising it and
    re-reading it in a writer task cost more than the forward). A batch is one shard (whatever
    ``extract.shard_max_bytes``), named after its sample ids, so a retried call (actor died after
    committing) finds its shard and does no work twice; a call that died before committing left
    nothing. Calls may run concurrently in threads (the next forward overlaps this one's
    device-to-host copy and write). Returns a small row per sample, with the actor's start-up
    (extract/startup.py) and its capture audit sums (extract/capture_audit.py). A batch whose
    audit fails raises ``AuditFailed`` before its shard is written.
    """

    def __init__(self, target: TargetConfig, batch_tokens: int, root: str, meta: StoreMeta | None,
                 run: str = "", start_file: str | None = None, extract: ExtractConfig | None = None):
        """``meta``: the store's; None with ``start_file``: the store's metadata is read once the driver
        has written ``start_file`` (it created or checked the store meanwhile, while this engine was
        built), and nothing is captured or written before; ``{"go": false}`` there stops the call.
        ``extract``: the capture audit's settings (default: the schema's)."""
        self.startup = ActorStartup()
        self.root, self.meta, self.start_file = root, None, start_file
        self.target, self.extract, self.audit = target, extract or ExtractConfig(), None
        self._started = threading.Lock()
        self.run = run
        self.node, self.actor = _ray_placement()
        if _stopped_before_start(start_file):
            # The driver's checks failed before this actor got here: its calls only raise the
            # driver's reason (_await_start), so the target is not loaded for nothing (the driver
            # waits for those calls to end the stage).
            self.engine = None
            return
        from eagle3_ray.engines.factory import build_engine

        self.startup.imported()
        self.engine = build_engine(target, batch_tokens=batch_tokens, audit_share=self.extract.audit_rows)
        self.startup.built()
        if meta is not None:
            self._take_meta(meta)
        elif start_file is None:
            raise ValueError("CaptureWriteUDF needs the store's meta or the run's start_file")

    def _take_meta(self, meta: StoreMeta) -> None:
        from eagle3_ray.extract.capture_audit import CaptureAudit

        if self.engine.info.hidden_size != meta.hidden_size:
            raise RuntimeError(f"engine hidden size {self.engine.info.hidden_size} != planned {meta.hidden_size}")
        self.audit = CaptureAudit(self.engine, self.target, self.extract, meta.target_fingerprint, self.run)
        self.meta = meta

    def _await_start(self) -> None:
        """Block until the driver's checks are done (its start file), then take the store's metadata."""
        from eagle3_ray.errors import StoreError
        from eagle3_ray.features.store import read_meta

        with self._started:  # concurrent calls: one reads, the others find self.meta set
            if self.meta is not None:
                return
            while not os.path.exists(self.start_file):
                time.sleep(START_POLL_S)
            with open(self.start_file, encoding="utf-8") as f:
                start = json.load(f)
            if not start.get("go"):
                raise StoreError(f"the extract run was stopped before it wrote anything: {start.get('reason')}")
            self._take_meta(read_meta(self.root))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        from eagle3_ray.errors import SampleRejected
        from eagle3_ray.features.store import FeatureStoreWriter, batch_committed

        self._await_start()
        sids = [str(s) for s in batch["sample_id"]]
        ids = [np.array(a, dtype=np.int32) for a in batch["input_ids"]]  # writable: torch.from_numpy below
        wid = "b" + hashlib.sha1("\n".join(sids).encode()).hexdigest()[:16]
        lengths = np.asarray([len(a) for a in ids], dtype=np.int64)
        if batch_committed(self.root, wid):
            return self._rows(batch["sample_id"], lengths, ["skipped"] * len(sids), [""] * len(sids))
        t0 = time.monotonic()
        captures = self.engine.capture([a.tolist() for a in ids])
        _record_capture(self.run, "capture", len(ids), int(lengths.sum()), time.monotonic() - t0)
        status, reasons, audits = [], [], []
        greedy_by = batch["greedy_by"] if "greedy_by" in batch else [""] * len(sids)  # older prepared files
        with FeatureStoreWriter(self.root, self.meta, writer_id=wid, shard_max_bytes=None, node=self.node,
                                on_shard=self.audit.on_shard) as w:
            for sid, source, a, mask, cap, by in zip(sids, batch["source"], ids, batch["loss_mask"], captures,
                                                     greedy_by):
                audit = self.audit.sample(sid, a, mask, cap, str(by))
                rec = {
                    "sample_id": sid,
                    "input_ids": torch.from_numpy(a),
                    "loss_mask": torch.from_numpy(np.array(mask, dtype=np.uint8)),
                    "aux_hidden": cap.aux_hidden.to(torch.bfloat16),
                    "last_hidden": cap.last_hidden.to(torch.bfloat16),
                }
                try:
                    w.add(rec, audit)
                    status.append("ok")
                    reasons.append("")
                    audits.append(audit)
                except SampleRejected as e:
                    w.reject(sid, str(source), str(e), stage="extract")
                    status.append("rejected")
                    reasons.append(str(e))
                    audits.append(None)
        self._record_store(w, lengths, status)
        return self._rows(batch["sample_id"], lengths, status, reasons, audits)

    def _rows(self, sample_ids: np.ndarray, lengths: np.ndarray, status: list[str], reasons: list[str],
              audits: list | None = None):
        """One small row per sample: its status, the engine actor and node that handled it, the actor's
        start-up and the sample's capture audit sums."""
        from eagle3_ray.extract.capture_audit import columns

        n = len(status)
        return {"sample_id": sample_ids, "num_tokens": lengths, "status": np.asarray(status, dtype=object),
                "reason": np.asarray(reasons, dtype=object),
                "actor": np.asarray([self.actor] * n, dtype=object),
                "node": np.asarray([(self.node or {}).get("ip", "")] * n, dtype=object),
                **self.startup.columns(n), **columns(audits or [None] * n)}

    def _record_store(self, writer, lengths: np.ndarray, status: list[str]) -> None:
        from eagle3_ray import metrics

        ok = np.asarray([s == "ok" for s in status], dtype=bool)
        _record_stage(self.run, "store", int(ok.sum()), int(lengths[ok].sum()), int((~ok).sum()))
        metrics.inc("bytes_written", sum(p.stat().st_size for p in writer.shards_written), self.run, "store")
