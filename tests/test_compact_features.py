"""Compact (fp8) feature format: quantization error bound, store round trip, bytes, format guards."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pydantic
import pytest
import torch
from safetensors import safe_open

from eagle3_ray.config import ExtractConfig
from eagle3_ray.errors import ConfigError, SampleRejected, StoreError
from eagle3_ray.features import (
    AUX_HIDDEN,
    INPUT_IDS,
    LAST_HIDDEN,
    LOSS_MASK,
    SAMPLE_ID,
    FeatureStoreWriter,
    StoreMeta,
    bytes_per_token,
    cleanup_orphans,
    completed_ids,
    manifest,
    open_store,
    read_meta,
)
from eagle3_ray.features.compact import FP8_DTYPE, dequantize_fp8, quantize_fp8
from eagle3_ray.train.data import LoadPackUDF, row_to_batch

H = 16
VOCAB = 512
BOUND = 2.0**-4  # e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2^-4 of the value


def meta(compact: str = "none", hidden: int = H) -> StoreMeta:
    return StoreMeta(hidden_size=hidden, aux_layers=[2, 3, 4], target_fingerprint="tiny-0", model_type="llama",
                     vocab_size=VOCAB, compact=compact)


def make_record(sample_id: str, t: int, hidden: int = H, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    # the three aux layers at very different magnitudes, like a residual stream growing with depth
    aux = torch.randn(t, 3, hidden, generator=g) * torch.tensor([0.05, 3.0, 400.0])[:, None]
    return {
        SAMPLE_ID: sample_id,
        INPUT_IDS: torch.randint(0, VOCAB, (t,), generator=g, dtype=torch.int32),
        LOSS_MASK: (torch.arange(t) >= t // 2).to(torch.uint8),
        AUX_HIDDEN: aux.reshape(t, 3 * hidden).bfloat16(),
        LAST_HIDDEN: torch.randn(t, hidden, generator=g).bfloat16(),
    }


def write(root: Path, recs: list[dict], compact: str, hidden: int = H, writer_id: str = "w0",
          shard_max_bytes: int = 2**30) -> FeatureStoreWriter:
    with FeatureStoreWriter(root, meta(compact, hidden), writer_id, shard_max_bytes=shard_max_bytes) as w:
        for r in recs:
            w.add(r)
    return w


def block_absmax(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """[T, B·W] -> [T, B·W]: each element's block absmax, broadcast back."""
    t, width = x.shape
    xb = x.float().reshape(t, blocks, width // blocks)
    return xb.abs().amax(dim=-1, keepdim=True).expand_as(xb).reshape(t, width)


def assert_within_fp8_bound(x: torch.Tensor, y: torch.Tensor, blocks: int, slack: float = 0.0) -> None:
    err = (y.float() - x.float()).abs()
    assert bool((err <= (BOUND + slack) * block_absmax(x, blocks)).all()), float((err / block_absmax(x, blocks)).max())


# ---------------------------------------------------------------- quantize / dequantize


def test_fp8_roundtrip_error_is_bounded_by_block_absmax():
    rec = make_record("a", 64, hidden=96, seed=1)
    x = rec[AUX_HIDDEN]  # [64, 288] bf16, blocks 1e3 apart in magnitude
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 3)
    y = dequantize_fp8(q, scale, 3, dtype=torch.float32)
    assert_within_fp8_bound(x, y, 3)
    # in e4m3's normal range the error is also relative to the value itself
    normal = x.float().abs() >= 2.0**-6 * scale.repeat_interleave(96, dim=1)
    err = (y - x.float()).abs()
    assert bool((err[normal] <= BOUND * x.float().abs()[normal]).all())
    # per-block scales keep the small first layer: a per-row scale would flush it to zero
    assert float(y[:, :96].abs().mean()) > 0.9 * float(x[:, :96].float().abs().mean())
    # bf16 output adds one bf16 rounding (2^-9 of the value)
    assert_within_fp8_bound(x, dequantize_fp8(q, scale, 3), 3, slack=2.0**-8)


def test_fp8_block_absmax_is_exact_and_never_overflows():
    x = torch.tensor([[1.0, -3.0, 0.5, 2.0], [7.0, 1e-3, -7.0, 5.0]]).bfloat16()  # [2, 4], 2 blocks of 2
    q, scale = quantize_fp8(x, 2)
    assert torch.isfinite(q.float()).all() and float(q.float().abs().max()) == 448.0
    torch.testing.assert_close(dequantize_fp8(q, scale, 2, torch.float32)[0, 1], torch.tensor(-3.0))


def test_fp8_zero_rows_and_blocks_roundtrip_to_zero():
    x = torch.randn(6, 3 * H).bfloat16()
    x[2] = 0  # a whole zero row
    x[4, H:2 * H] = 0  # one zero block
    q, scale = quantize_fp8(x, 3)
    assert torch.isfinite(scale).all() and bool((scale > 0).all())
    y = dequantize_fp8(q, scale, 3)
    assert torch.equal(y[2], torch.zeros(3 * H, dtype=torch.bfloat16))
    assert torch.equal(y[4, H:2 * H], torch.zeros(H, dtype=torch.bfloat16))
    assert_within_fp8_bound(x, y, 3, slack=2.0**-8)


# ---------------------------------------------------------------- the store in fp8


def test_fp8_store_reads_back_bf16_with_right_shapes_and_close_values(tmp_path):
    recs = [make_record(f"s{i}", 5 + i, seed=i) for i in range(6)]
    write(tmp_path / "st", recs, "fp8", shard_max_bytes=20 * bytes_per_token(H, "fp8"))
    store = open_store(tmp_path / "st", verify=True)
    assert store.meta.compact == "fp8" and len(store.shards) > 1
    assert [r[SAMPLE_ID] for r in store] == [r[SAMPLE_ID] for r in recs]
    for want, got in zip(recs, store):
        for name in (INPUT_IDS, LOSS_MASK):
            assert torch.equal(got[name], want[name])
        for name, blocks in ((AUX_HIDDEN, 3), (LAST_HIDDEN, 1)):
            assert got[name].dtype == torch.bfloat16 and got[name].shape == want[name].shape
            assert_within_fp8_bound(want[name], got[name], blocks, slack=2.0**-8)
            assert not torch.equal(got[name], want[name])  # it really went through fp8

    with safe_open(str(store.shards[0].path), framework="pt") as f:
        assert f.metadata()["compact"] == "fp8"
        assert f.get_slice(AUX_HIDDEN).get_dtype() == "F8_E4M3"
        assert f.get_slice("aux_hidden_scale").get_shape() == [store.shards[0].tokens, 3]
        assert f.get_slice("last_hidden_scale").get_shape() == [store.shards[0].tokens, 1]


def test_training_loader_gets_dequantized_bf16_from_an_fp8_store(tmp_path):
    """The loader carries fp8 as stored; row_to_batch dequantizes on the device (tests/test_compact_train.py)."""
    recs = [make_record(f"s{i}", 4 + i, seed=i) for i in range(3)]
    write(tmp_path / "st", recs, "fp8")
    store = open_store(tmp_path / "st")
    row = LoadPackUDF(str(tmp_path / "st"))({"key": np.array(["p0"]), "samples": [np.array([0, 2])]})
    batch = row_to_batch({k: v[0] for k, v in row.items() if k != "key"}, torch.device("cpu"), torch.bfloat16)
    assert torch.equal(batch[AUX_HIDDEN][0], torch.cat([store[0][AUX_HIDDEN], store[2][AUX_HIDDEN]]))


def test_fp8_bytes_per_token_at_most_055_of_full(tmp_path):
    hidden = 576  # SmolLM2-135M
    recs = [make_record(f"s{i}", 40 + 3 * i, hidden=hidden, seed=i) for i in range(4)]
    full = write(tmp_path / "full", recs, "none", hidden=hidden)
    fp8 = write(tmp_path / "fp8", recs, "fp8", hidden=hidden)
    assert full.tokens_written == fp8.tokens_written

    def measured(root: Path) -> float:
        return sum(p.stat().st_size for p in (root / "shards").glob("*.safetensors")) / full.tokens_written

    ratio = measured(tmp_path / "fp8") / measured(tmp_path / "full")
    assert ratio <= 0.55, ratio
    assert bytes_per_token(hidden, "fp8") == 4 * hidden + 16 + 5
    # shard files are the formula plus a header and offsets: within 1% here
    assert measured(tmp_path / "fp8") == pytest.approx(bytes_per_token(hidden, "fp8"), rel=0.01)


def test_validation_happens_before_quantizing(tmp_path):
    with FeatureStoreWriter(tmp_path / "st", meta("fp8"), "w0") as w:
        for bad in (float("nan"), float("inf")):
            rec = make_record("bad", 5)
            rec[AUX_HIDDEN][1, 3] = bad
            with pytest.raises(SampleRejected, match="non-finite"):
                w.add(rec)
        rec = make_record("wide", 5)
        rec[LAST_HIDDEN] = torch.zeros(5, H + 1, dtype=torch.bfloat16)
        with pytest.raises(SampleRejected, match="last_hidden width"):
            w.add(rec)


# ---------------------------------------------------------------- one format per store


@pytest.mark.parametrize("first,second", [("none", "fp8"), ("fp8", "none")])
def test_appending_another_format_is_refused(tmp_path, first, second):
    write(tmp_path / "st", [make_record("a", 5)], first)
    with pytest.raises(StoreError, match=rf"holds extract.compact='{first}'.*Set extract.compact={first}.*new --out"):
        FeatureStoreWriter(tmp_path / "st", meta(second), "w1")
    write(tmp_path / "st", [make_record("b", 6)], first, writer_id="w1")  # the same format still appends
    assert open_store(tmp_path / "st").sample_ids == ["a", "b"]


def test_store_without_compact_field_reads_as_none(tmp_path):
    root = tmp_path / "old"
    recs = [make_record("a", 5), make_record("b", 7, seed=1)]
    write(root, recs, "none")
    meta_path = root / "store_meta.json"
    d = json.loads(meta_path.read_text())
    del d["compact"]  # as written before the compact format existed
    meta_path.write_text(json.dumps(d))
    assert read_meta(root).compact == "none"
    store = open_store(root, verify=True)
    assert torch.equal(store[1][AUX_HIDDEN], recs[1][AUX_HIDDEN])
    write(root, [make_record("c", 4)], "none", writer_id="w1")
    with pytest.raises(StoreError, match="compact"):
        FeatureStoreWriter(root, meta("fp8"), "w2")


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="extract.compact='int4'"):
        meta("int4")
    with pytest.raises(pydantic.ValidationError):
        ExtractConfig(compact="int4")
    assert ExtractConfig().compact == "none"


def test_meta_claiming_fp8_over_bf16_shards_is_a_corrupt_shard(tmp_path):
    write(tmp_path / "st", [make_record("a", 5)], "none")
    meta_path = tmp_path / "st" / "store_meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "compact": "fp8"}))
    with pytest.raises(StoreError, match="corrupt feature shard.*compact='fp8'"):
        open_store(tmp_path / "st")


# ---------------------------------------------------------------- resume machinery on fp8 shards


def test_fp8_shards_keep_markers_sha256_resume_and_corruption_checks(tmp_path):
    root = tmp_path / "st"
    recs = [make_record(f"s{i}", 6 + i, seed=i) for i in range(5)]
    w = write(root, recs, "fp8", shard_max_bytes=15 * bytes_per_token(H, "fp8"))
    assert completed_ids(root) == {r[SAMPLE_ID] for r in recs}
    for m, shard in zip(manifest(root), w.shards_written):
        assert m["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
        assert m["bytes"] == shard.stat().st_size

    # a restarted writer continues its sequence and never replaces a completed shard
    w2 = write(root, [make_record("s5", 8, seed=5)], "fp8")
    assert w2.shards_written[0].name > w.shards_written[-1].name
    assert len(open_store(root, verify=True)) == 6

    # an unmarked fp8 shard (crash between shard and marker) is an orphan
    orphan = root / "shards" / "w9-000000.safetensors"
    orphan.write_bytes(w.shards_written[0].read_bytes())
    assert orphan in cleanup_orphans(root)

    # one flipped byte of fp8 data (same size, valid header) is caught by verify=True
    shard = w.shards_written[0]
    with safe_open(str(shard), framework="pt") as f:
        n_tok = f.get_slice(INPUT_IDS).get_shape()[0]
    data = bytearray(shard.read_bytes())
    data[-(5 * n_tok + 1)] ^= 0xFF  # last byte of last_hidden, just before input_ids and loss_mask
    shard.write_bytes(bytes(data))
    assert len(open_store(root)) == 6  # the cheap checks cannot see it
    with pytest.raises(StoreError, match="sha256"):
        open_store(root, verify=True)
    kept = open_store(root, on_corrupt="skip", verify=True)
    assert len(kept.skipped_shards) == 1
    assert len(kept) == 6 - len(manifest(root)[0]["sample_ids"])
