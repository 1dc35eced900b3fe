"""Training on an fp8 store: the loader carries the hidden states as stored (fp8 bits + scales) and
`row_to_batch` dequantizes after the device copy, giving bit for bit the batches of the old path
(dequantized on the loader's CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_ray.features import AUX_HIDDEN, LAST_HIDDEN, FeatureStoreWriter, StoreMeta, open_store
from eagle3_ray.features.compact import FP8_DTYPE, dequantize_fp8, dequantize_fp8_bits, quantize_fp8
from eagle3_ray.train.data import LoadPackUDF, build_train_dataset, packed_row, row_to_batch
from eagle3_ray.train.packing import Pack, collate
from test_compact_features import H, make_record, write

CPU = torch.device("cpu")
SCALES = ("aux_hidden_scale", "last_hidden_scale")
# Lengths that make split_rows(row_tokens=ROW) put several samples in a row and pad the rows.
LENGTHS = (9, 4, 12, 5, 7, 3)
ROW = 12


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a tensor (torch.equal would call -0.0 equal to 0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_batch(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


def _one(*samples) -> dict:
    """A LoadPackUDF input batch of one pack."""
    return {"key": np.array(["0:0"]), "samples": [np.asarray(samples, dtype=np.int64)]}


def _row(batch: dict) -> dict:
    return {k: v[0] for k, v in batch.items() if k != "key"}


def _host_dequant_row(store, samples) -> dict:
    """The packed row as the loader built it before this change: store[i] (bf16, dequantized on
    the CPU by features/shards.read_sample) -> collate -> bf16 as uint16."""
    packed = collate([store[int(i)] for i in samples])
    return {k: (v[0].view(torch.uint16) if v.dtype == torch.bfloat16 else v[0]).numpy() for k, v in packed.items()}


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compact_train") / "fp8"
    recs = [make_record(f"s{i}", t, seed=i) for i, t in enumerate(LENGTHS)]
    recs[1][AUX_HIDDEN][2] = 0  # an all-zero token (scale 1) and a signed zero, carried as stored
    recs[1][AUX_HIDDEN][3, 5] = -0.0
    write(root, recs, "fp8", shard_max_bytes=20 * (4 * H + 21))  # several shards
    return root


# ---------------------------------------------------------------- the device-side dequantization


def test_dequantize_fp8_bits_is_dequantize_fp8_bit_for_bit_over_any_leading_dims():
    x = make_record("a", 24, seed=3)[AUX_HIDDEN]
    x[4] = 0
    q, scale = quantize_fp8(x, 3)
    want = dequantize_fp8(q, scale, 3)  # [24, 3H] bf16
    got = dequantize_fp8_bits(q.view(torch.uint8), scale, 3)
    assert torch.equal(_bits(got), _bits(want))
    rows = dequantize_fp8_bits(q.view(torch.uint8).reshape(2, 12, 3 * H), scale.reshape(2, 12, 3), 3, torch.float32)
    assert rows.shape == (2, 12, 3 * H) and rows.dtype == torch.float32
    assert torch.equal(_bits(rows.reshape(24, 3 * H)), _bits(dequantize_fp8(q, scale, 3, torch.float32)))
    with pytest.raises(TypeError, match="uint8"):
        dequantize_fp8_bits(q, scale, 3)  # fp8 itself, not its bits


# ---------------------------------------------------------------- loader rows and row_to_batch


def test_fp8_loader_row_carries_the_store_bytes_and_half_the_hidden_bytes(fp8_store):
    store = open_store(fp8_store)
    samples = (0, 3, 1)
    row = _row(LoadPackUDF(str(fp8_store))(_one(*samples)))
    old = _host_dequant_row(store, samples)
    assert set(row) == set(old) | set(SCALES)
    n = sum(LENGTHS[i] for i in samples)
    assert row[AUX_HIDDEN].dtype == row[LAST_HIDDEN].dtype == np.uint8
    assert row[AUX_HIDDEN].shape == (n, 3 * H) and row[LAST_HIDDEN].shape == (n, H)
    assert row["aux_hidden_scale"].shape == (n, 3) and row["last_hidden_scale"].shape == (n, 1)
    assert row["aux_hidden_scale"].dtype == np.float32
    stored = [store.read(i, as_stored=True) for i in samples]
    assert stored[0][AUX_HIDDEN].dtype == FP8_DTYPE
    for k in (AUX_HIDDEN, LAST_HIDDEN, *SCALES):
        want = torch.cat([r[k] for r in stored])
        assert np.array_equal(_bits(torch.from_numpy(row[k])).numpy(), _bits(want).numpy()), k
    for k in ("input_ids", "loss_mask", "position_ids", "seq_ids"):
        assert np.array_equal(row[k], old[k]), k
    hidden = lambda r: sum(r[k].nbytes for k in (AUX_HIDDEN, LAST_HIDDEN, *SCALES) if k in r)  # noqa: E731
    assert hidden(row) == n * (4 * H + 16) and hidden(old) == n * 8 * H


@pytest.mark.parametrize("hidden_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_tokens", [None, ROW])
def test_fp8_row_to_batch_equals_the_host_dequant_path_bit_for_bit(fp8_store, row_tokens, hidden_dtype):
    store = open_store(fp8_store)
    samples = (2, 0, 5, 1, 3, 4)
    new = _row(LoadPackUDF(str(fp8_store))(_one(*samples)))
    old = _host_dequant_row(store, samples)
    before = row_to_batch(old, CPU, hidden_dtype, row_tokens)
    got = row_to_batch(new, CPU, hidden_dtype, row_tokens)
    assert_same_batch(got, before)
    if row_tokens:  # really laid out in padded rows, scales with their hidden states
        assert got[AUX_HIDDEN].shape[0] > 1 and bool((got["seq_ids"] < 0).any())


def test_fp8_rows_as_ray_data_yields_them_read_only(fp8_store):
    """Rows from the object store are read-only arrays: converted without writing into them."""
    row = _row(LoadPackUDF(str(fp8_store))(_one(4, 2)))
    for v in row.values():
        v.setflags(write=False)
    got = row_to_batch(row, CPU, torch.bfloat16, ROW)
    assert_same_batch(got, row_to_batch(_host_dequant_row(open_store(fp8_store), (4, 2)), CPU, torch.bfloat16, ROW))


def test_bf16_store_and_online_rows_keep_their_form(tmp_path):
    recs = [make_record(f"s{i}", t, seed=i) for i, t in enumerate(LENGTHS[:3])]
    write(tmp_path / "bf16", recs, "none")
    row = _row(LoadPackUDF(str(tmp_path / "bf16"))(_one(2, 0)))
    assert not set(SCALES) & set(row) and row[AUX_HIDDEN].dtype == np.uint16
    online = packed_row([recs[2], recs[0]])  # PackCaptureUDF's row of the same records
    assert set(online) == set(row)
    for r in (row, online):
        got = row_to_batch(r, CPU, torch.float32, 8)
        want = row_to_batch(_host_dequant_row(open_store(tmp_path / "bf16"), (2, 0)), CPU, torch.float32, 8)
        assert_same_batch(got, want)
        packed = row_to_batch(r, CPU, torch.bfloat16)
        assert torch.equal(_bits(packed[AUX_HIDDEN][0]), _bits(torch.cat([recs[2][AUX_HIDDEN], recs[0][AUX_HIDDEN]])))


def test_a_row_with_scales_but_bf16_hidden_states_is_refused(fp8_store):
    row = _row(LoadPackUDF(str(fp8_store))(_one(0)))
    row[AUX_HIDDEN] = row[AUX_HIDDEN].astype(np.uint16)
    with pytest.raises(TypeError, match="aux_hidden must be uint8 fp8 bits"):
        row_to_batch(row, CPU, torch.bfloat16)


# ---------------------------------------------------------------- through Ray Data and the prefetch thread


def test_fp8_packs_through_ray_data_and_prefetch_match_the_host_dequant_path(ray_local, fp8_store):
    from eagle3_ray.train.loop import pack_stream
    from eagle3_ray.train.prefetch import PackPrefetcher

    store = open_store(fp8_store)
    packs = [Pack(0, 0, (0, 1), 13), Pack(0, 1, (2, 3, 5), 20), Pack(0, 2, (4,), 7)]
    ds = build_train_dataset(packs, str(fp8_store), "abort", loaders=1)
    convert = lambda row: (row_to_batch(row, CPU, torch.float32, ROW), str(row["key"]))  # noqa: E731
    got = {}
    with PackPrefetcher(pack_stream(ds.iterator()), convert, CPU) as prefetch:
        while (item := prefetch.next()) is not None:
            key, batch, _ = item
            got[key] = batch
    assert sorted(got) == sorted(p.key for p in packs)
    for p in packs:
        assert_same_batch(got[p.key], row_to_batch(_host_dequant_row(store, p.samples), CPU, torch.float32, ROW))


# ---------------------------------------------------------------- training end to end


def copy_store(src, root: Path, compact: str) -> None:
    """Every record of ``src`` (bf16 as read) into a new store of format ``compact``, in store order
    (conftest.py's ``ci_tiny_fp8_pair``)."""
    meta = StoreMeta.from_dict({**src.meta.to_dict(), "compact": compact})
    with FeatureStoreWriter(root, meta, "w0") as w:
        for rec in src:
            w.add(rec)


def test_the_fp8_pair_holds_the_same_samples_and_dequantized_values(ci_tiny_inputs, ci_tiny_fp8_pair):
    fp8, bf16 = (open_store(d) for d in ci_tiny_fp8_pair)
    src = open_store(ci_tiny_inputs / "features")
    assert fp8.meta.compact == "fp8" and bf16.meta.compact == "none"
    assert fp8.sample_ids == bf16.sample_ids == src.sample_ids  # store order kept: the same pack plans
    for i in range(len(src)):
        a, b = fp8[i], bf16[i]
        assert list(a) == list(b) and a["sample_id"] == b["sample_id"] == src.sample_ids[i]
        for k in (AUX_HIDDEN, LAST_HIDDEN, "input_ids", "loss_mask"):
            assert torch.equal(_bits(a[k]), _bits(b[k])), (i, k)


def test_training_on_an_fp8_store_sees_the_batches_of_its_dequantized_copy(ci_tiny_inputs, ci_tiny_fp8_pair,
                                                                          trained_4_steps, tmp_path):
    """Train (two workers at ZeRO-2, with held-out evaluation) on an fp8 store as conftest.py's
    ``trained_4_steps`` trained on a bf16 store holding exactly its dequantized values: the same
    batches reach the step, so the same losses come out."""
    from eagle3_ray.config import load_config
    from eagle3_ray.train.trainer import run_training
    from test_train import CI_CONFIG, TRAIN_4

    fp8, bf16 = ci_tiny_fp8_pair
    bf16_out, _, trained_on = trained_4_steps
    assert trained_on == bf16
    run_training(load_config(CI_CONFIG, TRAIN_4), fp8, ci_tiny_inputs / "vocab_groups", tmp_path / "out-fp8")
    metrics = {name: [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
               for name, out in (("fp8", tmp_path / "out-fp8"), ("bf16", bf16_out))}
    assert [m["step"] for m in metrics["fp8"]] == [1, 2, 3, 4]
    keys = ("loss", "tau", "acc_0", "val_loss", "val_tau", "train_tokens")
    pick = lambda ms: [{k: m.get(k) for k in keys} for m in ms]  # noqa: E731
    assert pick(metrics["fp8"]) == pick(metrics["bf16"])
    assert metrics["fp8"][-1]["val_tokens"] > 0 and metrics["fp8"][-1]["val_loss"] is not None
