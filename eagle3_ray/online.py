"""Online and hybrid training: captured hidden states stream from the engine actors into Ray Train.

    prepared.parquet -> pack plan (driver; the same `plan` as offline, over the prepared lengths)
      -> one row per pack {key, samples} -> map_batches(PackCaptureUDF (extract/udfs.py), engine actor pool):
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

import time
from pathlib import Path

import numpy as np
import ray
import ray.train
from ray.data import ExecutionOptions, ExecutionResources

from eagle3_ray.atomic import write_json
from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.data.vocab import (
    VOCAB_FILE, build_vocab_map, count_tokens, data_fingerprint, save_vocab_map, vocab_fingerprint,
)
from eagle3_ray.engines.describe import describe, describe_target
from eagle3_ray.errors import ConfigError
from eagle3_ray.extract.prepared import read_prepared
from eagle3_ray.extract.stage import SUMMARY_FILE, engine_pool
from eagle3_ray.extract.udfs import PackCaptureUDF
from eagle3_ray.features import open_store
from eagle3_ray.features.store import StoreMeta, create_store
from eagle3_ray.progress import say
from eagle3_ray.train.data import build_train_dataset, pack_rows
from eagle3_ray.train.packing import Pack
from eagle3_ray.train.trainer import fit, plan_run, trains_on_gpu


def run_online_vocab(cfg: PipelineConfig, prepared: str | Path, out: str | Path) -> Path:
    """The vocab map from the prepared data's loss-masked tokens: no hidden states needed, so it is
    ready before the first capture. Same counts, same map as `run_vocab` over a complete store."""
    out = Path(out)
    save_resolved(cfg, out)
    sample_ids, lengths, ids, masks = read_prepared(prepared)
    info = describe_target(cfg.target)
    counts = count_tokens(np.concatenate(ids), np.concatenate(masks), info.vocab_size)  # int64 [vocab]
    d2t, t2d = build_vocab_map(counts, cfg.vocab.draft_vocab_size)
    total = int(counts.sum())
    meta = {
        "fingerprint": vocab_fingerprint(data_fingerprint(sample_ids, lengths), info.fingerprint,
                                         cfg.vocab.draft_vocab_size),
        "target_fingerprint": info.fingerprint,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "distinct_tokens": int((counts > 0).sum()),
        "loss_tokens": total,
        "coverage": int(counts[t2d.astype(bool)].sum()) / max(total, 1),
    }
    path = save_vocab_map(out / VOCAB_FILE, d2t, t2d, meta)
    write_json(out / SUMMARY_FILE, meta, newline=False)
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


def streaming_dataset(cfg: PipelineConfig, prepared: Path, packs, meta: StoreMeta, store_root: str | None):
    """Ray Data pipeline: pack rows -> engine actor pool -> packed micro-batch rows (hybrid: also
    committed to the store at ``store_root``, in shards of ``extract.shard_max_bytes``)."""
    rows = pack_rows(packs)
    packs_per_call = max(1, cfg.extract.batch_tokens // cfg.train.batch_tokens)
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows) // packs_per_call, 1000)))
    return ds.map_batches(
        PackCaptureUDF,
        fn_constructor_kwargs=dict(prepared=str(prepared), target=cfg.target,
                                   batch_tokens=cfg.extract.batch_tokens, meta=meta, run=cfg.name,
                                   store_root=store_root, shard_max_bytes=cfg.extract.shard_max_bytes,
                                   extract=cfg.extract),
        **engine_pool(cfg.extract),
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
    if cfg.train.val_groups or cfg.train.eval_only:
        raise ConfigError(f"train.val_groups / train.eval_only group the held-out samples of an offline feature "
                          f"store; train.mode={cfg.train.mode} streams every prepared sample and evaluates none: "
                          "drop them (or train offline)")
    if hybrid and features is None:
        raise ConfigError("train.mode=hybrid writes the feature store during epoch 0: pass its directory")
    t0 = time.monotonic()
    out = Path(out).resolve()
    save_resolved(cfg, out)
    use_gpu = trains_on_gpu(cfg)
    check_resource_split(cfg, ray.cluster_resources(), use_gpu)
    prepared = Path(prepared).resolve()
    sample_ids, lengths, _, _ = read_prepared(prepared)
    target = describe(cfg.target)
    train_plan = plan_run(cfg, lengths, data_fingerprint(sample_ids, lengths), vocab, out, target)
    packs = train_plan.packs
    meta = StoreMeta.from_engine_info(target.info, compact=cfg.extract.compact)
    data_config = streaming_data_config(cfg)
    if not hybrid:
        return fit(cfg, train_plan, streaming_dataset(cfg, prepared, packs, meta, None), out, t0, use_gpu,
                   data_config)
    store_root = str(Path(features).resolve())
    create_store(store_root, meta)
    first = [p for p in packs if p.epoch == 0]
    say(f"[train] hybrid: epoch 0 streams {len(first)} packs and writes {store_root}")
    ckpt = fit(cfg, train_plan, streaming_dataset(cfg, prepared, first, meta, store_root), out, t0, use_gpu,
               data_config)
    later = _store_packs([p for p in packs if p.epoch > 0], sample_ids, open_store(store_root))
    if not later:
        return ckpt
    say(f"[train] hybrid: epochs 1..{cfg.train.epochs - 1} read {len(later)} packs from {store_root}")
    dataset = build_train_dataset(later, store_root, cfg.extract.on_corrupt_shard)
    return fit(cfg, train_plan, dataset, out, t0, use_gpu)

