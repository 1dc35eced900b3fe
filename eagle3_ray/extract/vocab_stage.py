"""`eagle3-ray vocab`: loss-masked token counts over the feature store (a Ray Data aggregation),
then the d2t/t2d map of docs/contracts.md ("Vocab map"), cached by data + target fingerprint.
Samples of the train.eval_only groups (never trained on) are not counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_ray.atomic import write_json
from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.data.vocab import VOCAB_FILE
from eagle3_ray.extract.stage import SUMMARY_FILE
from eagle3_ray.progress import say


class ShardTokenCounter:
    """Ray Data UDF: one row per shard (path, the positions of its samples not to count) -> one row
    with the shard's loss-masked token counts."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from eagle3_ray.data.vocab import count_tokens
        from eagle3_ray.features.shards import read_token_columns

        counts = np.zeros(self.vocab_size, dtype=np.int64)
        for path, skip in zip(batch["path"], batch["skip"]):
            offsets, ids, mask = read_token_columns(path, with_offsets=True)
            if len(skip):
                mask = mask.copy()
                for j in np.asarray(skip, dtype=np.int64):
                    mask[offsets[j]:offsets[j + 1]] = 0
            counts += count_tokens(ids, mask, self.vocab_size)
        return {"counts": counts[None, :]}


def run_vocab(cfg: PipelineConfig, features: str | Path, out: str | Path) -> Path:
    import ray

    from eagle3_ray.data.vocab import (
        build_vocab_map,
        data_fingerprint,
        load_vocab_map,
        save_vocab_map,
        vocab_fingerprint,
    )
    from eagle3_ray.features import open_store
    from eagle3_ray.data.groups import sample_groups

    out = Path(out)
    save_resolved(cfg, out)
    store = open_store(features, on_corrupt=cfg.extract.on_corrupt_shard)
    vocab_size = int(store.meta.vocab_size)
    # train.eval_only samples are evaluation data: their tokens stay out of the draft vocab's choice
    groups = sample_groups(store.sample_ids, {g: cfg.train.val_groups[g] for g in cfg.train.eval_only})
    counted = [i for i, g in enumerate(groups) if g is None]
    fp = vocab_fingerprint(data_fingerprint([store.sample_ids[i] for i in counted], np.asarray(store.lengths)[counted]),
                           store.meta.target_fingerprint, cfg.vocab.draft_vocab_size)
    path = out / VOCAB_FILE
    if path.is_file():
        _, _, meta = load_vocab_map(path)
        if meta.get("fingerprint") == fp:
            say(f"[vocab] reusing cached map {path} (fingerprint {fp})")
            return path

    excluded = {store.sample_ids[i] for i, g in enumerate(groups) if g is not None}
    rows = [{"path": str(s.path), "skip": [j for j, sid in enumerate(s.sample_ids) if sid in excluded]}
            for s in store.shards]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 64)))
    partial = ds.map_batches(
        ShardTokenCounter, fn_constructor_kwargs=dict(vocab_size=vocab_size),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=4), batch_size=4,
    )
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in partial.iter_batches(batch_format="numpy", batch_size=None):
        counts += np.asarray(batch["counts"]).sum(axis=0)
    d2t, t2d = build_vocab_map(counts, cfg.vocab.draft_vocab_size)
    covered = int(counts[t2d.astype(bool)].sum())
    total = int(counts.sum())
    meta = {
        "fingerprint": fp,
        "target_fingerprint": store.meta.target_fingerprint,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "distinct_tokens": int((counts > 0).sum()),
        "loss_tokens": total,
        "coverage": covered / max(total, 1),
    }
    if excluded:
        meta["eval_only_samples"] = len(excluded)
    save_vocab_map(path, d2t, t2d, meta)
    write_json(out / SUMMARY_FILE, meta, newline=False)
    say(
        (f"[vocab] {len(excluded)} samples of train.eval_only {cfg.train.eval_only} not counted; " if excluded
         else "[vocab] ") + f"{meta['distinct_tokens']} distinct loss tokens; draft vocab {cfg.vocab.draft_vocab_size} "
        f"covers {meta['coverage']:.2%} of {total:,} loss tokens -> {path}"
    )
    return path
