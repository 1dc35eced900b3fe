"""Feature record contract, atomic shards, manifest, resume, rejects, corruption handling, reader."""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_ray.errors import SampleRejected, StoreError
from eagle3_ray.features import (
    AUX_HIDDEN,
    INPUT_IDS,
    LAST_HIDDEN,
    LOSS_MASK,
    SAMPLE_ID,
    TENSOR_FIELDS,
    FeatureStoreWriter,
    StoreMeta,
    bf16_to_uint16,
    bytes_per_token,
    check_compatible,
    cleanup_orphans,
    completed_ids,
    manifest,
    open_store,
    read_rejects,
    rejected_ids,
    to_torch_record,
    uint16_to_bf16,
    validate_record,
)
from eagle3_ray.features import store as store_mod

H = 16
VOCAB = 512
META = StoreMeta(hidden_size=H, aux_layers=[2, 3, 4], target_fingerprint="tiny-0", model_type="llama", vocab_size=VOCAB)


def make_record(sample_id: str, t: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(t, dtype=torch.uint8)
    mask[t // 2:] = 1
    return {
        SAMPLE_ID: sample_id,
        INPUT_IDS: torch.randint(0, VOCAB, (t,), generator=g, dtype=torch.int32),
        LOSS_MASK: mask,
        AUX_HIDDEN: torch.randn(t, 3 * H, generator=g).bfloat16(),
        LAST_HIDDEN: torch.randn(t, H, generator=g).bfloat16(),
    }


def records(n: int, prefix: str = "s", base_len: int = 5) -> list[dict]:
    return [make_record(f"{prefix}{i}", base_len + i % 7, seed=hash((prefix, i)) % 2**31) for i in range(n)]


def assert_same_record(a: dict, b: dict) -> None:
    assert a[SAMPLE_ID] == b[SAMPLE_ID]
    for k in TENSOR_FIELDS:
        assert b[k].dtype == a[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def write_store(root: Path, recs: list[dict], writer_id: str = "w0", shard_tokens: int = 30) -> FeatureStoreWriter:
    with FeatureStoreWriter(root, META, writer_id, shard_max_bytes=shard_tokens * bytes_per_token(H)) as w:
        for r in recs:
            w.add(r)
    return w


# ---------------------------------------------------------------- record contract


def test_bf16_uint16_round_trip_is_bit_exact_and_zero_copy():
    t = torch.tensor([[1.0, -2.5, float("inf"), float("-inf")], [float("nan"), 0.0, -0.0, 3e38]]).bfloat16()
    a = bf16_to_uint16(t)
    assert a.dtype == np.uint16 and a.shape == (2, 4)
    assert np.shares_memory(a, t.view(torch.uint16).numpy())
    back = uint16_to_bf16(a)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.view(torch.uint16), t.view(torch.uint16))  # bit-exact, nan included
    assert back.data_ptr() == t.data_ptr()


def test_uint16_to_bf16_copies_read_only_arrays():
    a = bf16_to_uint16(torch.randn(3, 5).bfloat16()).copy()
    a.flags.writeable = False
    t = uint16_to_bf16(a)
    t.zero_()  # must not touch the read-only source
    assert a.any()


def test_numpy_record_with_uint16_hidden_states_validates():
    rec = make_record("np", 9)
    as_np = {SAMPLE_ID: "np", INPUT_IDS: rec[INPUT_IDS].numpy(), LOSS_MASK: rec[LOSS_MASK].numpy(),
             AUX_HIDDEN: bf16_to_uint16(rec[AUX_HIDDEN]), LAST_HIDDEN: bf16_to_uint16(rec[LAST_HIDDEN])}
    back = to_torch_record(as_np)
    validate_record(back, H, VOCAB)
    assert_same_record(rec, back)


def _broken(field: str, value) -> dict:
    rec = make_record("bad", 8)
    rec[field] = value
    return rec


def _nan_aux() -> torch.Tensor:
    aux = torch.randn(8, 3 * H).bfloat16()
    aux[3, 5] = float("nan")
    return aux


@pytest.mark.parametrize(
    "rec, reason",
    [
        (_broken(AUX_HIDDEN, torch.randn(7, 3 * H).bfloat16()), "token count mismatch"),
        (_broken(LOSS_MASK, torch.ones(9, dtype=torch.uint8)), "token count mismatch"),
        (_broken(AUX_HIDDEN, torch.randn(8, 2 * H).bfloat16()), "aux_hidden width"),
        (_broken(LAST_HIDDEN, torch.randn(8, H + 1).bfloat16()), "last_hidden width"),
        (_broken(AUX_HIDDEN, torch.randn(8, 3 * H)), "dtype torch.float32"),
        (_broken(INPUT_IDS, torch.arange(8)), "input_ids has dtype torch.int64"),
        (_broken(AUX_HIDDEN, _nan_aux()), "non-finite"),
        (_broken(LAST_HIDDEN, torch.full((8, H), float("inf")).bfloat16()), "non-finite"),
        (_broken(LOSS_MASK, torch.zeros(8, dtype=torch.uint8)), "no 1s"),
        (_broken(LOSS_MASK, torch.full((8,), 2, dtype=torch.uint8)), "only 0 and 1"),
        (_broken(INPUT_IDS, torch.full((8,), VOCAB, dtype=torch.int32)), "outside [0, 512)"),
        (_broken(SAMPLE_ID, ""), "sample_id"),
        (make_record("empty", 0), "empty sample"),
    ],
)
def test_validate_record_rejects_with_precise_reason(rec, reason):
    with pytest.raises(SampleRejected, match=reason.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        validate_record(rec, H, VOCAB)


def test_bytes_per_token():
    assert bytes_per_token(7168) == 4 * 7168 * 2 + 5


# ---------------------------------------------------------------- writer + reader


def test_round_trip_over_many_shards(tmp_path):
    recs = records(20)
    w = write_store(tmp_path, recs)
    assert len(w.shards_written) > 3
    store = open_store(tmp_path, verify=True)
    assert len(store) == 20 and store.sample_ids == [r[SAMPLE_ID] for r in recs]
    assert store.lengths.tolist() == [r[INPUT_IDS].shape[0] for r in recs]
    assert store.num_tokens == sum(store.lengths)
    assert [Path(s.path) for s in store.shards] == w.shards_written
    assert sum(s.tokens for s in store.shards) == store.num_tokens
    assert all(s.bytes == Path(s.path).stat().st_size for s in store.shards)
    for a, b in zip(recs, store):
        assert_same_record(a, b)
    assert_same_record(recs[-1], store[-1])
    assert_same_record(recs[7], store[7])
    with pytest.raises(IndexError):
        store[20]
    assert store.meta == META


def test_shards_are_plain_safetensors_readable_without_the_package(tmp_path):
    recs = records(6)
    w = write_store(tmp_path, recs, shard_tokens=10**6)
    (shard,) = w.shards_written
    tensors = load_file(str(shard))  # the reference safetensors loader, nothing of ours
    with safe_open(str(shard), framework="pt") as f:
        md = f.metadata()
    ids = json.loads(md["sample_ids"])
    assert ids == [r[SAMPLE_ID] for r in recs] and json.loads(md["aux_layers"]) == META.aux_layers
    off = tensors["offsets"]
    assert off.dtype == torch.int64 and off.shape == (len(recs) + 1,)
    for i, r in enumerate(recs):
        rows = slice(int(off[i]), int(off[i + 1]))
        for k in TENSOR_FIELDS:
            assert torch.equal(tensors[k][rows], r[k]), k
    marker = json.loads(shard.with_name(shard.name.replace(".safetensors", ".done.json")).read_text())
    assert marker["sha256"] == hashlib.sha256(shard.read_bytes()).hexdigest()
    assert marker["bytes"] == shard.stat().st_size and marker["sample_ids"] == ids
    assert marker["producer"] == f"{socket.gethostname()}:{os.getpid()}"  # which process wrote it
    assert json.loads((tmp_path / "store_meta.json").read_text())["dtype"] == "bfloat16"


def test_records_from_a_real_target_round_trip(tmp_path, tiny_llama_config):
    """Features captured from a seeded random Llama the way the HF engine does (hidden_states
    indices, post-norm last state) survive the store bit for bit."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config).eval()
    h = tiny_llama_config.hidden_size
    meta = StoreMeta(hidden_size=h, aux_layers=[2, 3, 4], target_fingerprint="rand-0",
                     model_type="llama", vocab_size=tiny_llama_config.vocab_size)
    recs = []
    with torch.no_grad():
        for i, t in enumerate([11, 17, 5]):
            ids = torch.randint(3, tiny_llama_config.vocab_size, (1, t))
            hs = model(ids, output_hidden_states=True).hidden_states
            recs.append({SAMPLE_ID: f"real{i}", INPUT_IDS: ids[0].int(), LOSS_MASK: torch.ones(t, dtype=torch.uint8),
                         AUX_HIDDEN: torch.cat([hs[k][0] for k in meta.aux_layers], -1).bfloat16(),
                         LAST_HIDDEN: hs[-1][0].bfloat16()})
    with FeatureStoreWriter(tmp_path, meta, "hf0") as w:
        for r in recs:
            w.add(r)
    store = open_store(tmp_path, verify=True)
    for a, b in zip(recs, store):
        assert_same_record(a, b)
    assert torch.equal(store[1][AUX_HIDDEN][:, h:2 * h], recs[1][AUX_HIDDEN][:, h:2 * h])


def test_store_pickles_without_open_handles(tmp_path):
    recs = records(5)
    write_store(tmp_path, recs)
    store = open_store(tmp_path)
    store[0]
    clone = pickle.loads(pickle.dumps(store))
    assert_same_record(recs[4], clone[4])


def test_open_store_on_missing_dir_says_what_to_do(tmp_path):
    with pytest.raises(StoreError, match="no feature store .* run extraction with --out"):
        open_store(tmp_path / "nowhere")


# ---------------------------------------------------------------- meta compatibility


def test_writer_on_existing_store_with_other_target_names_every_mismatch(tmp_path):
    write_store(tmp_path, records(2))
    other = StoreMeta(hidden_size=32, aux_layers=[2, 5, 9], target_fingerprint="other", model_type="llama",
                      vocab_size=VOCAB)
    with pytest.raises(StoreError) as e:
        FeatureStoreWriter(tmp_path, other, "w1")
    msg = str(e.value)
    for name in ("hidden_size", "aux_layers", "target_fingerprint"):
        assert name in msg
    assert "vocab_size" not in msg and "new --out" in msg
    FeatureStoreWriter(tmp_path, META, "w1").close()  # the same target is welcome


def test_check_compatible_names_mismatches(tmp_path):
    write_store(tmp_path, records(2))
    store = open_store(tmp_path)
    check_compatible(store.meta, {"hidden_size": H, "aux_layers": (2, 3, 4), "vocab_size": VOCAB})
    with pytest.raises(StoreError, match=r"vocab_size: store has 512, expected 1000") as e:
        check_compatible(store.meta, {"hidden_size": H, "vocab_size": 1000})
    assert "hidden_size" not in str(e.value)


# ---------------------------------------------------------------- concurrency


def _writer_proc(root: str, writer_id: str, start: int, n: int) -> None:
    with FeatureStoreWriter(root, META, writer_id, shard_max_bytes=25 * bytes_per_token(H)) as w:
        for i in range(start, start + n):
            w.add(make_record(f"c{i}", 4 + i % 5, seed=i))
            w.reject(f"r{i}", f"{writer_id}.jsonl", "reason " + "x" * 300, "extract")


def test_concurrent_writers_in_one_directory(tmp_path):
    ctx = mp.get_context("spawn")  # fork after torch initialised its thread pool can hang
    procs = [ctx.Process(target=_writer_proc, args=(str(tmp_path), f"w{k}", 12 * k, 12)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    store = open_store(tmp_path, verify=True)
    assert sorted(store.sample_ids) == sorted(f"c{i}" for i in range(36))
    assert completed_ids(tmp_path) == set(store.sample_ids)
    for rec in store:
        i = int(rec[SAMPLE_ID][1:])
        assert_same_record(make_record(f"c{i}", 4 + i % 5, seed=i), rec)
    rejects = read_rejects(tmp_path)  # every line whole: no interleaving between processes
    assert len(rejects) == 36 and rejected_ids(tmp_path) == {f"r{i}" for i in range(36)}
    assert {r["stage"] for r in rejects} == {"extract"} and all(len(r["reason"]) == 307 for r in rejects)
    assert len(manifest(tmp_path)) == len(store.shards)


# ---------------------------------------------------------------- crash, resume, disk full


def test_resume_ignores_orphans_and_never_overwrites(tmp_path):
    recs = records(10)
    first = write_store(tmp_path, recs[:6])
    shards = tmp_path / "shards"
    # what a crash leaves: a renamed shard whose marker was never written, and a temp file
    (shards / "w0-000099.safetensors").write_bytes(first.shards_written[0].read_bytes())
    (shards / ".tmp-w0-000100.safetensors.123.abcd").write_bytes(b"partial")
    assert completed_ids(tmp_path) == {r[SAMPLE_ID] for r in recs[:6]}
    assert len(open_store(tmp_path)) == 6  # the orphan is not served
    store_mod.append_reject(tmp_path, "s7", "data.jsonl:8", "too long", stage="extract")
    # what a resumed extraction skips: committed (not orphaned) or rejected
    done = store_mod.finished(tmp_path, [r[SAMPLE_ID] for r in recs])
    assert done.tolist() == [True] * 6 + [False, True, False, False]

    removed = cleanup_orphans(tmp_path)
    assert sorted(p.name for p in removed) == [".tmp-w0-000100.safetensors.123.abcd", "w0-000099.safetensors"]
    before = {p.name: p.read_bytes() for p in shards.iterdir()}
    todo = [r for r in recs if r[SAMPLE_ID] not in completed_ids(tmp_path)]
    again = write_store(tmp_path, todo)  # same writer id, restarted
    assert not set(p.name for p in again.shards_written) & set(before)
    assert all((shards / n).read_bytes() == b for n, b in before.items())
    store = open_store(tmp_path, verify=True)
    assert store.sample_ids == [r[SAMPLE_ID] for r in recs]


def test_cleanup_removes_markers_of_missing_or_truncated_shards(tmp_path):
    w = write_store(tmp_path, records(12))
    a, b = w.shards_written[:2]
    a.unlink()
    b.write_bytes(b.read_bytes()[:-10])
    markers = [p.with_name(p.name.replace(".safetensors", ".done.json")) for p in (a, b)]
    lost = {sid for m in markers for sid in json.loads(m.read_text())["sample_ids"]}
    assert completed_ids(tmp_path) == {f"s{i}" for i in range(12)} - lost  # so resume redoes them
    gone = {p.name for p in cleanup_orphans(tmp_path)}
    assert gone == {a.name.replace(".safetensors", ".done.json"), b.name, b.name.replace(".safetensors", ".done.json")}
    store = open_store(tmp_path)
    assert store.skipped_shards == [] and len(store.shards) == len(w.shards_written) - 2


class FakeFullDiskFile:
    """Stands in for a file on a full disk (ENOSPC after ``capacity`` bytes), for machines where
    a small tmpfs cannot be mounted."""

    def __init__(self, path: Path, capacity: int):
        self._f = open(path, "xb")
        self._left = capacity

    def write(self, buf) -> int:
        n = memoryview(buf).nbytes
        if n > self._left:
            self._f.write(memoryview(buf).cast("B")[: self._left])
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._left -= n
        return self._f.write(buf)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def test_disk_full_mid_shard_keeps_earlier_shards(tmp_path, monkeypatch):
    recs = records(12)
    w = FeatureStoreWriter(tmp_path, META, "w0", shard_max_bytes=30 * bytes_per_token(H))
    for r in recs[:4]:
        w.add(r)
    kept = w.flush()
    monkeypatch.setattr(store_mod, "_open_for_write", lambda p: FakeFullDiskFile(p, 2000))
    added = 4
    with pytest.raises(StoreError, match="disk full at .*free space on that disk and rerun: completed shards are kept"):
        for r in recs[4:]:
            added += 1
            w.add(r)
    assert [p.name for p in (tmp_path / "shards").iterdir() if p.name.startswith(".tmp-")] == []
    assert completed_ids(tmp_path) == {r[SAMPLE_ID] for r in recs[:4]}
    assert [Path(s.path) for s in open_store(tmp_path, verify=True).shards] == [kept]
    monkeypatch.undo()  # space freed: the buffer kept by the failed flush is written on retry
    w.close()
    store = open_store(tmp_path, verify=True)
    assert store.sample_ids == [r[SAMPLE_ID] for r in recs[:added]]
    for a, b in zip(recs, store):
        assert_same_record(a, b)


def test_disk_full_on_marker_removes_the_unmarked_shard(tmp_path, monkeypatch):
    w = FeatureStoreWriter(tmp_path, META, "w0")
    w.add(make_record("a", 6))
    real = store_mod._write_atomic

    def full(final, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(store_mod, "_write_atomic", full)
    with pytest.raises(StoreError, match="disk full"):
        w.flush()
    assert list((tmp_path / "shards").iterdir()) == []
    monkeypatch.setattr(store_mod, "_write_atomic", real)
    w.close()
    assert open_store(tmp_path).sample_ids == ["a"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 1 MiB filesystem, or skip where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        gc.collect()  # drop any mmap of a shard still held by a dead reader
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_real_enospc_on_a_tiny_tmpfs(tiny_tmpfs):
    root = tiny_tmpfs / "store"
    w = FeatureStoreWriter(root, META, "w0", shard_max_bytes=40 * bytes_per_token(H))
    added = []
    with pytest.raises(StoreError, match="disk full") as e:
        for i in range(10**4):
            rec = make_record(f"s{i}", 20, seed=i)
            w.add(rec)
            added.append(rec)
    assert "completed shards are kept" in str(e.value)
    assert not any(p.name.startswith(".tmp-") for p in (root / "shards").iterdir())
    store = open_store(root, verify=True)
    assert len(store.shards) == len(w.shards_written) > 0
    for a, b in zip(added, store):
        assert_same_record(a, b)
    store.close()


# ---------------------------------------------------------------- corruption


def _shard_and_marker(w: FeatureStoreWriter, k: int) -> tuple[Path, Path]:
    shard = w.shards_written[k]
    return shard, shard.with_name(shard.name.replace(".safetensors", ".done.json"))


def _rewrite_offsets(shard: Path, marker: Path) -> None:
    """Valid safetensors, correct marker, but offsets that do not add up to the token count."""
    tensors = load_file(str(shard))
    with safe_open(str(shard), framework="pt") as f:
        md = f.metadata()
    tensors["offsets"] = tensors["offsets"].clone()
    tensors["offsets"][1] = tensors["offsets"][2] + 1
    save_file(tensors, str(shard), metadata=md)
    m = json.loads(marker.read_text())
    m["bytes"], m["sha256"] = shard.stat().st_size, hashlib.sha256(shard.read_bytes()).hexdigest()
    marker.write_text(json.dumps(m))


def _truncate(shard: Path, marker: Path) -> None:
    shard.write_bytes(shard.read_bytes()[:-100])


def _bad_header(shard: Path, marker: Path) -> None:
    raw = bytearray(shard.read_bytes())
    raw[8:12] = b"\xff\xfe\x00!"
    shard.write_bytes(raw)


def _drop_shard(shard: Path, marker: Path) -> None:
    shard.unlink()


@pytest.mark.parametrize(
    "damage, reason",
    [(_truncate, "truncated"), (_bad_header, "bad safetensors header"), (_rewrite_offsets, "offsets inconsistent"),
     (_drop_shard, "shard file missing")],
)
def test_corrupt_shard_aborts_or_is_skipped(tmp_path, damage, reason):
    w = write_store(tmp_path, records(12))
    shard, marker = _shard_and_marker(w, 1)
    lost = json.loads(marker.read_text())["sample_ids"]
    damage(shard, marker)
    with pytest.raises(StoreError, match=f"corrupt feature shard .*{shard.name}: .*{reason}.*Delete {shard.name}"):
        open_store(tmp_path)
    store = open_store(tmp_path, on_corrupt="skip")
    assert [s["path"] for s in store.skipped_shards] == [str(shard)] and reason in store.skipped_shards[0]["reason"]
    assert set(store.sample_ids) == {f"s{i}" for i in range(12)} - set(lost)
    assert len(list(store)) == len(store)


def test_flipped_byte_is_caught_only_with_verify(tmp_path):
    w = write_store(tmp_path, records(12))
    shard, _ = _shard_and_marker(w, 0)
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0x01  # a loss_mask byte: the layout stays valid
    shard.write_bytes(raw)
    assert len(open_store(tmp_path)) == 12  # header/size checks cannot see it
    with pytest.raises(StoreError, match="sha256 differs"):
        open_store(tmp_path, verify=True)
    assert open_store(tmp_path, on_corrupt="skip", verify=True).skipped_shards[0]["path"] == str(shard)


def test_duplicate_sample_ids_are_served_once_first_wins(tmp_path):
    first = make_record("dup", 6, seed=1)
    second = make_record("dup", 9, seed=2)
    write_store(tmp_path, [make_record("a", 5), first], writer_id="a")
    write_store(tmp_path, [second, make_record("b", 5)], writer_id="b")
    store = open_store(tmp_path)
    assert store.sample_ids == ["a", "dup", "b"] and store.duplicate_ids == ["dup"]
    assert_same_record(first, store[1])
    assert store.num_tokens == 5 + 6 + 5


def test_rejects_file_survives_a_torn_last_line(tmp_path):
    w = FeatureStoreWriter(tmp_path, META, "w0")
    bad = make_record("bad", 6)
    bad[LOSS_MASK] = torch.zeros(6, dtype=torch.uint8)
    with pytest.raises(SampleRejected) as e:
        w.add(bad)
    w.reject("bad", "data.jsonl:7", str(e.value), "extract")
    with open(tmp_path / "rejects.jsonl", "a") as f:
        f.write('{"sample_id": "torn", "sou')
    assert read_rejects(tmp_path) == [
        {"sample_id": "bad", "source": "data.jsonl:7", "reason": str(e.value), "stage": "extract"}]
    w.close()
    assert open_store(tmp_path).sample_ids == []


def test_store_and_vocab_modules_do_not_import_ray():
    code = ("import sys, eagle3_ray.features, eagle3_ray.data.vocab; "
            "sys.exit(1 if any(m == 'ray' or m.startswith('ray.') for m in sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent).returncode == 0
