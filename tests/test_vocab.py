"""Vocab map core: token counts, d2t/t2d construction, padding, ties, coverage, save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle3_ray.data.vocab import (
    build_vocab_map,
    count_tokens,
    data_fingerprint,
    draft_to_target_ids,
    load_vocab_map,
    save_vocab_map,
    vocab_coverage,
    vocab_fingerprint,
)
from eagle3_ray.errors import ConfigError, DataError, StoreError


def test_count_tokens_counts_only_loss_masked_tokens_and_adds_up():
    ids = np.array([5, 5, 7, 9, 5, 1], dtype=np.int32)
    mask = np.array([0, 1, 1, 1, 1, 0], dtype=np.uint8)
    c = count_tokens(ids, mask, vocab_size=10)
    assert c.dtype == np.int64 and c.shape == (10,)
    assert c.tolist() == [0, 0, 0, 0, 0, 2, 0, 1, 0, 1]
    # per-block counts sum to the whole-data count (what a distributed aggregation relies on)
    tail = count_tokens(torch.from_numpy(ids[3:]), torch.from_numpy(mask[3:]), 10)  # torch input too
    halves = count_tokens(ids[:3], mask[:3], 10) + tail
    assert np.array_equal(halves, c)


def test_count_tokens_rejects_foreign_token_ids_and_shape_mismatch():
    with pytest.raises(DataError, match="outside the target vocab"):
        count_tokens(np.array([3, 12]), np.array([1, 1]), vocab_size=10)
    assert count_tokens(np.array([3, 12]), np.array([1, 0]), vocab_size=10)[3] == 1  # unmasked ids are not counted
    with pytest.raises(DataError, match="same shape"):
        count_tokens(np.array([1, 2, 3]), np.array([1, 1]), vocab_size=10)


def test_map_round_trips_target_equals_draft_plus_offset():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, size=300)
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=64)
    assert d2t.dtype == np.int64 and d2t.shape == (64,) and t2d.dtype == np.bool_ and t2d.shape == (300,)
    chosen = np.argsort(-counts, kind="stable")[:64]  # stable: ties keep the lower id first
    target = np.arange(64) + d2t  # target_id = draft_id + d2t[draft_id]
    assert np.array_equal(target, np.sort(chosen))
    assert np.all(np.diff(target) > 0)  # draft ids follow target-id order
    assert t2d.sum() == 64 and np.array_equal(np.flatnonzero(t2d), target)
    assert np.array_equal(draft_to_target_ids(d2t), target)


def test_fewer_distinct_tokens_pad_with_lowest_unused_ids():
    counts = np.zeros(20, dtype=np.int64)
    counts[[4, 11, 17]] = [3, 9, 1]
    d2t, t2d = build_vocab_map(counts, draft_vocab_size=6)
    # the three seen tokens, then the lowest unseen ids 0, 1, 2 fill the draft vocab
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 4, 11, 17]
    assert t2d.sum() == 6


def test_ties_break_by_lower_id_deterministically():
    counts = np.array([1, 5, 3, 5, 5, 3, 0, 5])
    d2t, _ = build_vocab_map(counts, draft_vocab_size=3)
    assert draft_to_target_ids(d2t).tolist() == [1, 3, 4]  # four ids have 5; the three lowest win
    assert all(np.array_equal(build_vocab_map(counts, 3)[0], d2t) for _ in range(3))
    d2t5, _ = build_vocab_map(counts, draft_vocab_size=5)
    assert draft_to_target_ids(d2t5).tolist() == [1, 2, 3, 4, 7]


def test_draft_vocab_larger_than_target_vocab_is_a_config_error():
    with pytest.raises(ConfigError, match="vocab.draft_vocab_size=11"):
        build_vocab_map(np.ones(10, dtype=np.int64), draft_vocab_size=11)
    d2t, t2d = build_vocab_map(np.ones(10, dtype=np.int64), draft_vocab_size=10)  # full vocab is fine
    assert t2d.all() and (d2t == 0).all()


def test_coverage_is_fraction_of_masked_tokens_in_draft_vocab():
    counts = np.array([10, 0, 30, 5, 55])
    _, t2d = build_vocab_map(counts, draft_vocab_size=2)
    assert vocab_coverage(counts, t2d) == pytest.approx((55 + 30) / 100)
    assert vocab_coverage(np.zeros(5, dtype=np.int64), t2d) == 0.0


def test_save_load_round_trip_with_metadata(tmp_path):
    counts = np.random.default_rng(1).integers(0, 50, size=128)
    d2t, t2d = build_vocab_map(counts, 32)
    meta = {"data_fingerprint": "data-1", "target_fingerprint": "tgt-1", "draft_vocab_size": 32,
            "coverage": vocab_coverage(counts, t2d), "num_tokens": int(counts.sum())}
    path = save_vocab_map(tmp_path / "vocab" / "map.safetensors", d2t, t2d, meta)
    d2t2, t2d2, meta2 = load_vocab_map(path)
    assert np.array_equal(d2t2, d2t) and np.array_equal(t2d2, t2d) and meta2 == meta
    assert [p.name for p in path.parent.iterdir()] == ["map.safetensors"]  # no temp file left


def test_load_refuses_missing_and_inconsistent_maps(tmp_path):
    with pytest.raises(StoreError, match="run `eagle3-ray vocab`"):
        load_vocab_map(tmp_path / "none.safetensors")
    from safetensors.numpy import save_file

    d2t, t2d = build_vocab_map(np.arange(16), 4)
    t2d = t2d.copy()
    t2d[0] = True  # now 5 ids marked for a 4-token draft vocab
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(StoreError, match="inconsistent"):
        load_vocab_map(tmp_path / "bad.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(StoreError, match="unreadable"):
        load_vocab_map(tmp_path / "junk.safetensors")


def test_fingerprint_is_stable_and_sensitive_to_each_input():
    fp = vocab_fingerprint("d", "t", 32000)
    assert fp == vocab_fingerprint("d", "t", 32000)
    assert len({fp, vocab_fingerprint("d2", "t", 32000), vocab_fingerprint("d", "t2", 32000),
                vocab_fingerprint("d", "t", 16000)}) == 4


def test_data_fingerprint_is_the_samples_ids_and_lengths_in_any_order():
    import hashlib

    fp = data_fingerprint(["b", "a"], np.asarray([7, 3], dtype=np.int64))  # a store's columns
    # the key of cached vocab maps and checkpoint identities: its format must not drift
    assert fp == hashlib.sha256(b"a:3;b:7;").hexdigest()[:16]
    assert fp == data_fingerprint(["a", "b"], [3, 7])  # prepared data, other order
    assert len({fp, data_fingerprint(["a", "b"], [3, 8]), data_fingerprint(["a", "c"], [3, 7])}) == 3


def test_eval_only_samples_stay_out_of_the_vocab_counts(ci_tiny_inputs, tmp_path):
    """train.eval_only groups are evaluation data: `eagle3-ray vocab` counts every other sample's
    loss tokens, exactly, and the map's fingerprint differs from the one over all samples."""
    from eagle3_ray.config import load_config
    from eagle3_ray.extract.vocab_stage import run_vocab
    from eagle3_ray.features import open_store

    cfg = load_config("configs/ci-tiny.yaml", ['train.val_groups={late: "ci-1[0-2]"}', "train.eval_only=[late]"])
    features = ci_tiny_inputs / "features"
    path = run_vocab(cfg, features, tmp_path / "vocab")
    _, _, meta = load_vocab_map(path)
    _, _, full = load_vocab_map(ci_tiny_inputs / "vocab" / "vocab_map.safetensors")
    store = open_store(features)
    kept = [i for i, sid in enumerate(store.sample_ids) if sid not in ("ci-10", "ci-11", "ci-12")]
    assert len(kept) == len(store) - 3 and meta["eval_only_samples"] == 3
    assert meta["loss_tokens"] == sum(int(torch.as_tensor(store[i]["loss_mask"]).sum()) for i in kept)
    assert meta["loss_tokens"] < full["loss_tokens"] and meta["fingerprint"] != full["fingerprint"]
