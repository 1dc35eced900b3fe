"""Online and hybrid training: captured hidden states stream from the engine actors into Ray Train.

    prepared.parquet -> pack plan (driver; the same `plan` as offline, over the prepared lengths)
      -> one row per pack {key, samples} -> map_batches(PackCaptureUDF, engine actor pool):
         capture the pack's samples, validate, collate into one packed micro-batch row
      -> TorchTrainer(datasets={"train": ...}) -> the unchanged worker loop (train/loop.py)

online:  no feature touches the disk. The object-store bytes in flight between the engine actors and
         the training workers are capped by `extract.max_bytes_in_flight` (Ray Data back-pressure:
         the actors stop taking packs while the trainer has that much unconsumed). Every epoch runs
         the target again.
hybrid:  epoch 0 streams as above and the engine actors also commit each batch to the feature store;
         the later epochs read the store (train/data.py), resuming from epoch 0's final checkpoint.

Resource split: Ray Train reserves `train.num_workers` x (GPU, `train.cpus_per_worker` CPUs) first;
the engine pool (up to `extract.max_actors` x `extract.num_gpus_per_actor`) runs in what is left.
`check_resource_split` refuses a config where both cannot hold their resources at once, since
either side waiting for the other would stall the stream.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import ray
import ray.train
import torch
from ray.data import ExecutionOptions, ExecutionResources

from eagle3_ray import metrics
from eagle3_ray.atomic import write_json
from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.data.vocab import build_vocab_map, count_tokens, save_vocab_map, vocab_fingerprint
from eagle3_ray.engines.describe import describe_target
from eagle3_ray.errors import ConfigError, DataError, SampleRejected
from eagle3_ray.extract.pipeline import prepared_path
from eagle3_ray.extract.udfs import CaptureUDF
from eagle3_ray.extract.vocab_stage import VOCAB_FILE, data_fingerprint
from eagle3_ray.features import open_store
from eagle3_ray.features.record import bf16_to_uint16, validate_record
from eagle3_ray.features.store import FeatureStoreWriter, StoreMeta, create_store
from eagle3_ray.progress import say
from eagle3_ray.train.data import build_train_dataset, pack_rows
from eagle3_ray.train.packing import Pack, collate
from eagle3_ray.train.trainer import _use_gpu, build_job, fit

PACKED_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "position_ids", "seq_ids")


def _ragged(arrays: list[np.ndarray]) -> np.ndarray:
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def read_prepared(prepared: str | Path):
    """(sample_ids [N], lengths int64 [N], input_ids [N] int32 arrays, loss_mask [N] uint8 arrays)."""
    src = prepared_path(prepared)
    if src is None:
        raise DataError(f"{prepared} is not a prepared dataset; run `eagle3-ray prepare` first")
    table = pq.read_table(src, columns=["sample_id", "input_ids", "loss_mask", "num_tokens"])
    ids = [np.asarray(a, dtype=np.int32) for a in table.column("input_ids").to_numpy(zero_copy_only=False)]
    masks = [np.asarray(a, dtype=np.uint8) for a in table.column("loss_mask").to_numpy(zero_copy_only=False)]
    return table.column("sample_id").to_pylist(), table.column("num_tokens").to_numpy(), ids, masks


def _data_fingerprint(sample_ids: list[str], lengths: np.ndarray) -> str:
    """The offline store's fingerprint of the same samples (vocab cache key and run identity)."""
    return data_fingerprint(SimpleNamespace(sample_ids=sample_ids, lengths=lengths))


def run_online_vocab(cfg: PipelineConfig, prepared: str | Path, out: str | Path) -> Path:
    """The vocab map from the prepared data's loss-masked tokens: no hidden states needed, so it is
    ready before the first capture. Same counts, same map as `run_vocab` over a complete store."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out)
    sample_ids, lengths, ids, masks = read_prepared(prepared)
    info = describe_target(cfg.target)
    counts = count_tokens(np.concatenate(ids), np.concatenate(masks), info.vocab_size)  # int64 [vocab]
    d2t, t2d = build_vocab_map(counts, cfg.vocab.draft_vocab_size)
    total = int(counts.sum())
    meta = {
        "fingerprint": vocab_fingerprint(_data_fingerprint(sample_ids, lengths), info.fingerprint,
                                         cfg.vocab.draft_vocab_size),
        "target_fingerprint": info.fingerprint,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "distinct_tokens": int((counts > 0).sum()),
        "loss_tokens": total,
        "coverage": int(counts[t2d.astype(bool)].sum()) / max(total, 1),
    }
    path = save_vocab_map(out / VOCAB_FILE, d2t, t2d, meta)
    write_json(out / "summary.json", meta, newline=False)
    say(f"[vocab] from prepared data: {meta['distinct_tokens']} distinct loss tokens, coverage "
        f"{meta['coverage']:.2%} -> {path}")
    return path


def check_resource_split(cfg: PipelineConfig, cluster: dict[str, float], use_gpu: bool) -> None:
    """Refuse a split where training workers and the engine pool cannot all run at once."""
    actors = cfg.extract.max_actors or cfg.extract.num_actors
    t, e = cfg.train, cfg.extract
    need_gpu = (t.num_workers if use_gpu else 0) + actors * e.num_gpus_per_actor
    need_cpu = t.num_workers * t.cpus_per_worker + actors * e.num_cpus_per_actor
    have_gpu, have_cpu = cluster.get("GPU", 0.0), cluster.get("CPU", 0.0)
    if need_gpu > have_gpu or need_cpu > have_cpu:
        raise ConfigError(
            f"train.mode={t.mode} runs training and extraction at once: {t.num_workers} training worker(s) "
            f"+ {actors} engine actor(s) need {need_gpu:g} GPU / {need_cpu:g} CPU, the cluster has "
            f"{have_gpu:g} GPU / {have_cpu:g} CPU; lower extract.max_actors or train.num_workers, "
            "or use train.mode=offline"
        )


def streaming_data_config(cfg: PipelineConfig):
    """Ray Train ingest options that cap the object-store bytes of streamed features."""
    limits = ExecutionResources(object_store_memory=cfg.extract.max_bytes_in_flight)
    return ray.train.DataConfig(execution_options=ExecutionOptions(resource_limits=limits))


class PackCaptureUDF(CaptureUDF):
    """Engine actor of online/hybrid mode: rows {key, samples} in, packed micro-batch rows out.

    Loads the prepared token ids once; each call captures every sample of its packs in one engine
    call (the engine actor of `CaptureUDF`: its engine, not its numpy rows), drops samples that fail
    record validation (counted as rejects), and, in hybrid mode, commits them to the feature store
    under a writer id derived from the pack keys (a retried call finds its shard and does not write
    it twice). Hidden states stay bf16 tensors until the packed row leaves the actor.
    """

    def __init__(self, prepared: str, target_cfg: dict[str, Any], batch_tokens: int, meta: StoreMeta,
                 run: str = "", store_root: str | None = None):
        super().__init__(target_cfg, batch_tokens, meta.hidden_size, run=run, stage="online")
        self.sample_ids, _, self.ids, self.masks = read_prepared(prepared)
        self.meta, self.store_root = meta, store_root

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        packs = [np.asarray(s, dtype=np.int64) for s in batch["samples"]]
        flat = np.concatenate(packs)  # prepared indices of every sample in this call
        records = [self._record(i, c) for i, c in zip(flat, self._capture([self.ids[i].tolist() for i in flat]))]
        keep = self._validate_or_store(records, batch["key"])
        rows, start = [], 0
        for pack in packs:
            kept = [records[j] for j in range(start, start + len(pack)) if keep[j]]
            start += len(pack)
            rows.append(_packed_row(kept) if kept else None)
        ok = [i for i, r in enumerate(rows) if r is not None]
        return {"key": batch["key"][ok], **{k: _ragged([rows[i][k] for i in ok]) for k in PACKED_KEYS}}

    def _capture(self, seqs: list[list[int]]) -> list:
        """The engine's captures of `seqs`, counted on the dashboard as `CaptureUDF` counts its own."""
        t0 = time.monotonic()
        captures = self.engine.capture(seqs)
        tokens = sum(len(q) for q in seqs)
        metrics.inc("samples", len(seqs), self.run, self.stage)
        metrics.inc("tokens", tokens, self.run, self.stage)
        metrics.set_gauge("extract_tokens_per_s", tokens / max(time.monotonic() - t0, 1e-9), self.run, self.stage)
        return captures

    def _record(self, i: int, capture) -> dict[str, Any]:
        return {
            "sample_id": self.sample_ids[i],
            "input_ids": torch.from_numpy(self.ids[i]),  # [T] int32
            "loss_mask": torch.from_numpy(self.masks[i]),  # [T] uint8
            "aux_hidden": capture.aux_hidden.to(torch.bfloat16),  # [T, 3H]
            "last_hidden": capture.last_hidden.to(torch.bfloat16),  # [T, H]
        }

    def _validate_or_store(self, records: list[dict[str, Any]], keys: np.ndarray) -> list[bool]:
        keep = []
        if self.store_root is None:
            for rec in records:
                try:
                    validate_record(rec, self.meta.hidden_size, self.meta.vocab_size)
                    keep.append(True)
                except SampleRejected:
                    keep.append(False)
        else:
            wid = "h" + hashlib.sha1("\n".join(str(k) for k in keys).encode()).hexdigest()[:16]
            with FeatureStoreWriter(self.store_root, self.meta, writer_id=wid,
                                    shard_max_bytes=2**62) as w:
                for rec in records:
                    try:
                        w.add(rec)
                        keep.append(True)
                    except SampleRejected as e:
                        w.reject(rec["sample_id"], "online", str(e), stage="extract")
                        keep.append(False)
            metrics.inc("bytes_written", sum(p.stat().st_size for p in w.shards_written), self.run, "store")
        metrics.inc("rejects", keep.count(False), self.run, self.stage)
        return keep


def _packed_row(records: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Records -> one packed row in the layout of train/data.py (bf16 as uint16)."""
    packed = collate(records)
    return {k: bf16_to_uint16(t[0]) if t.dtype == torch.bfloat16 else t[0].numpy() for k, t in packed.items()}


def streaming_dataset(cfg: PipelineConfig, prepared: Path, packs, meta: StoreMeta, store_root: str | None):
    """Ray Data pipeline: pack rows -> engine actor pool -> packed micro-batch rows."""
    rows = pack_rows(packs)
    packs_per_call = max(1, cfg.extract.batch_tokens // cfg.train.batch_tokens)
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows) // packs_per_call, 1000)))
    return ds.map_batches(
        PackCaptureUDF,
        fn_constructor_kwargs=dict(prepared=str(prepared), target_cfg=cfg.target.model_dump(),
                                   batch_tokens=cfg.extract.batch_tokens, meta=meta, run=cfg.name,
                                   store_root=store_root),
        compute=ray.data.ActorPoolStrategy(min_size=cfg.extract.num_actors,
                                           max_size=cfg.extract.max_actors or cfg.extract.num_actors),
        num_gpus=cfg.extract.num_gpus_per_actor or None,
        num_cpus=cfg.extract.num_cpus_per_actor,
        batch_size=packs_per_call,
        batch_format="numpy",
    )


def _store_packs(packs, sample_ids: list[str], store) -> list:
    """Prepared-index packs -> store-index packs (samples the store rejected are left out)."""
    where = {sid: k for k, sid in enumerate(store.sample_ids)}
    out = []
    for p in packs:
        idx = tuple(where[sample_ids[i]] for i in p.samples if sample_ids[i] in where)
        if idx:
            out.append(Pack(p.epoch, p.index, idx, int(sum(int(store.lengths[k]) for k in idx))))
    return out


def run_online_training(cfg: PipelineConfig, prepared: str | Path, vocab: str | Path, out: str | Path,
                        features: str | Path | None = None) -> Path:
    """Train with features streamed from the engine actors (online), or streamed for epoch 0 and
    written to `features` for the later epochs (hybrid); returns the final checkpoint directory."""
    hybrid = cfg.train.mode == "hybrid"
    if cfg.train.val_share:
        raise ConfigError(f"train.val_share={cfg.train.val_share} holds samples out of an offline feature store; "
                          f"train.mode={cfg.train.mode} streams every prepared sample: set train.val_share=0")
    if hybrid and features is None:
        raise ConfigError("train.mode=hybrid writes the feature store during epoch 0: pass its directory")
    t0 = time.monotonic()
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out)
    check_resource_split(cfg, ray.cluster_resources(), _use_gpu(cfg))
    prepared = Path(prepared).resolve()
    sample_ids, lengths, _, _ = read_prepared(prepared)
    info = describe_target(cfg.target)
    job, packs = build_job(cfg, lengths, _data_fingerprint(sample_ids, lengths), vocab, out, info)
    meta = StoreMeta.from_engine_info(info, compact=cfg.extract.compact)
    data_config = streaming_data_config(cfg)
    if not hybrid:
        return fit(cfg, job, streaming_dataset(cfg, prepared, packs, meta, None), out, t0, data_config)
    store_root = str(Path(features).resolve())
    create_store(store_root, meta)
    first = [p for p in packs if p.epoch == 0]
    say(f"[train] hybrid: epoch 0 streams {len(first)} packs and writes {store_root}")
    ckpt = fit(cfg, job, streaming_dataset(cfg, prepared, first, meta, store_root), out, t0, data_config)
    later = _store_packs([p for p in packs if p.epoch > 0], sample_ids, open_store(store_root))
    if not later:
        return ckpt
    say(f"[train] hybrid: epochs 1..{cfg.train.epochs - 1} read {len(later)} packs from {store_root}")
    dataset = build_train_dataset(later, store_root, cfg.extract.on_corrupt_shard)
    return fit(cfg, job, dataset, out, t0)

