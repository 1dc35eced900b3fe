"""Online (streamed, no disk) and hybrid training on ci-tiny with a real local Ray and DeepSpeed."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3_ray.config import load_config
from eagle3_ray.errors import ConfigError

CI_CONFIG = "configs/ci-tiny.yaml"


@pytest.fixture(scope="module")
def prepared(ci_tiny_prepared):
    """The session's run_prepare of ci-tiny (read only)."""
    return ci_tiny_prepared[0]


@pytest.fixture(scope="module")
def vocab(prepared, tmp_path_factory):
    from eagle3_ray.online import run_online_vocab

    return run_online_vocab(load_config(CI_CONFIG), prepared, tmp_path_factory.mktemp("online_vocab"))


def test_vocab_from_prepared_tokens_keeps_the_most_frequent_loss_tokens(prepared, vocab):
    from eagle3_ray.data.vocab import load_vocab_map
    from eagle3_ray.extract.prepared import read_prepared

    _, _, ids, masks = read_prepared(prepared)
    picked = np.concatenate([i[m.astype(bool)] for i, m in zip(ids, masks)])
    counts = np.bincount(picked)
    d2t, t2d, meta = load_vocab_map(vocab)
    assert len(d2t) == 256 and meta["loss_tokens"] == len(picked)
    top = np.argsort(-counts, kind="stable")[: min(256, int((counts > 0).sum()))]
    assert t2d[top].all()


def test_resource_split_refuses_a_pool_that_would_starve_training():
    from eagle3_ray.online import check_resource_split

    cfg = load_config(CI_CONFIG, ["train.mode=online", "train.num_workers=2", "extract.max_actors=3",
                                  "extract.num_gpus_per_actor=1"])
    with pytest.raises(ConfigError, match="max_actors"):
        check_resource_split(cfg, {"CPU": 16.0, "GPU": 4.0}, use_gpu=True)
    check_resource_split(cfg, {"CPU": 16.0, "GPU": 5.0}, use_gpu=True)


def test_streaming_data_config_caps_bytes_in_flight():
    from eagle3_ray.online import streaming_data_config

    cfg = load_config(CI_CONFIG, ["extract.max_bytes_in_flight=67108864"])
    opts = streaming_data_config(cfg)._resolve_execution_options("train")
    assert opts.resource_limits.object_store_memory == 64 * 2**20


def test_online_training_streams_features_without_touching_disk(prepared, vocab, tmp_path):
    from eagle3_ray.online import run_online_training
    from eagle3_ray.train.checkpoint import consumed_packs, read_train_state

    cfg = load_config(CI_CONFIG, ["train.mode=online", "train.epochs=1", "train.max_steps=2",
                                  "train.log_every=1", "extract.max_bytes_in_flight=33554432"])
    out = tmp_path / "train"
    ckpt = run_online_training(cfg, prepared, vocab, out)
    assert read_train_state(ckpt)["step"] == 2
    assert all(k.startswith("0:") for k in consumed_packs(ckpt)) and len(consumed_packs(ckpt)) == 2
    assert not list(tmp_path.glob("**/shards")) and not list(tmp_path.glob("**/*.done.json"))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2


def test_hybrid_streams_epoch_0_into_the_store_then_trains_later_epochs_from_it(prepared, vocab, tmp_path):
    import pyarrow.parquet as pq

    from eagle3_ray.features import open_store
    from eagle3_ray.online import run_online_training
    from eagle3_ray.train.checkpoint import consumed_packs, read_train_state
    from eagle3_ray.train.packing import plan

    cfg = load_config(CI_CONFIG, ["train.mode=hybrid", "train.epochs=2", "train.max_steps=null",
                                  "train.batch_tokens=1024", "train.checkpoint_every=100"])
    ckpt = run_online_training(cfg, prepared, vocab, tmp_path / "train", features=tmp_path / "features")
    table = pq.read_table(prepared / "prepared.parquet")
    store = open_store(tmp_path / "features")
    assert sorted(store.sample_ids) == sorted(table.column("sample_id").to_pylist())
    packs = plan(table.column("num_tokens").to_numpy(), cfg.train.batch_tokens, 2, cfg.train.seed)
    consumed = consumed_packs(ckpt)
    assert consumed == {p.key for p in packs}
    assert read_train_state(ckpt)["step"] == len(packs)


def test_the_pack_capture_actor_packs_what_the_engine_captures(prepared):
    """PackCaptureUDF (called in-process, as a Ray Data actor calls it) packs each pack's samples with
    the engine's own captures, bf16 bit for bit, in the packed-row layout the workers read."""
    import torch

    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.prepared import read_prepared
    from eagle3_ray.extract.udfs import PackCaptureUDF
    from eagle3_ray.features.record import uint16_to_bf16
    from eagle3_ray.features.store import StoreMeta
    from eagle3_ray.train.data import PACKED_KEYS

    cfg = load_config(CI_CONFIG)
    meta = StoreMeta.from_engine_info(describe_target(cfg.target))
    udf = PackCaptureUDF(str(prepared), cfg.target, cfg.extract.batch_tokens, meta)
    _, _, ids, masks = read_prepared(prepared)
    packs = [np.asarray([2, 0]), np.asarray([1])]
    samples = np.empty(2, dtype=object)
    samples[0], samples[1] = packs
    rows = udf({"key": np.asarray(["0:0", "0:1"]), "samples": samples})
    assert list(rows["key"]) == ["0:0", "0:1"] and set(PACKED_KEYS) <= set(rows)
    flat = np.concatenate(packs)  # one engine call, as the actor makes it
    by_sample = dict(zip(flat.tolist(), udf.engine.capture([ids[i].tolist() for i in flat])))
    for r, pack in enumerate(packs):
        caps = [by_sample[i] for i in pack.tolist()]
        want_aux = torch.cat([c.aux_hidden.to(torch.bfloat16) for c in caps])
        want_last = torch.cat([c.last_hidden.to(torch.bfloat16) for c in caps])
        assert torch.equal(uint16_to_bf16(np.ascontiguousarray(rows["aux_hidden"][r])), want_aux)
        assert torch.equal(uint16_to_bf16(np.ascontiguousarray(rows["last_hidden"][r])), want_last)
        assert np.array_equal(rows["input_ids"][r], np.concatenate([ids[i] for i in pack]))
        assert np.array_equal(rows["loss_mask"][r].astype(bool), np.concatenate([masks[i] for i in pack]).astype(bool))
        assert np.array_equal(rows["seq_ids"][r], np.repeat(np.arange(len(pack)), [len(ids[i]) for i in pack]))


def test_a_retried_hybrid_capture_call_does_not_commit_its_samples_twice(prepared, tmp_path):
    """Hybrid mode: the capture actor commits each call's samples under a writer named after its pack
    keys. Ray runs a call again when its actor died; the second attempt finds what the first committed
    and writes only the rest, so the store (read by the later epochs) holds every sample once."""
    from eagle3_ray.engines.describe import describe_target
    from eagle3_ray.extract.udfs import PackCaptureUDF
    from eagle3_ray.features.store import (
        StoreMeta,
        completed_ids,
        create_store,
        manifest,
    )

    cfg = load_config(CI_CONFIG)
    meta = StoreMeta.from_engine_info(describe_target(cfg.target))
    store = tmp_path / "store"
    create_store(store, meta)
    udf = PackCaptureUDF(str(prepared), cfg.target, cfg.extract.batch_tokens, meta, store_root=str(store))
    samples = np.empty(2, dtype=object)
    samples[0], samples[1] = np.asarray([2, 0]), np.asarray([1])
    batch = {"key": np.asarray(["0:0", "0:1"]), "samples": samples}
    first = udf(batch)
    ids = completed_ids(store)
    assert len(ids) == 3
    again = udf(batch)  # the same call, retried
    assert list(again["key"]) == list(first["key"])  # it still feeds training its packs
    assert all(np.array_equal(a, b) for a, b in zip(again["input_ids"], first["input_ids"]))
    assert completed_ids(store) == ids
    assert sum(len(m["sample_ids"]) for m in manifest(store)) == 3  # no duplicate rows in the store
