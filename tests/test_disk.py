"""Disk exhaustion: preflight refuses what cannot fit; ENOSPC mid-write keeps completed shards valid
and the run resumable.

Two levels: the store writer with an injected full disk (no Ray, every write path), and the real
extraction on a real local Ray writing to a small tmpfs mounted for the test (root only; skipped
cleanly where mounting is not permitted).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from eagle3_ray.config import load_config
from eagle3_ray.errors import PreflightError, StoreError
from eagle3_ray.features import store as store_mod

CI_CONFIG = "configs/ci-tiny.yaml"
HIDDEN = 64


def _record(sid: str, n_tok: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "sample_id": sid,
        "input_ids": torch.randint(0, 512, (n_tok,), generator=g, dtype=torch.int32),  # [T]
        "loss_mask": torch.ones(n_tok, dtype=torch.uint8),  # [T]
        "aux_hidden": torch.randn(n_tok, 3 * HIDDEN, generator=g).to(torch.bfloat16),  # [T, 3H]
        "last_hidden": torch.randn(n_tok, HIDDEN, generator=g).to(torch.bfloat16),  # [T, H]
    }


def _meta():
    return store_mod.StoreMeta(hidden_size=HIDDEN, aux_layers=[2, 4, 5], target_fingerprint="t", model_type="llama",
                               vocab_size=512)


class FakeFullDisk:
    """Stands in for a filling disk in-process: the store opens every file through ``_open_for_write``,
    and this one raises ENOSPC once ``budget`` bytes have been written (a real full disk cannot be
    arranged without root; the tmpfs test below does it for real)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.real_open = store_mod._open_for_write

    def __call__(self, path: Path):
        f = self.real_open(path)
        fake = self

        class _File:
            def write(self, data) -> int:
                n = len(memoryview(data).cast("B"))
                if n > fake.budget:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                fake.budget -= n
                return f.write(data)

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

        return _File()


def test_writer_hitting_enospc_keeps_completed_shards_and_finishes_after_space_is_freed(tmp_path, monkeypatch):
    from eagle3_ray.features import open_store

    root = tmp_path / "store"
    writer = store_mod.FeatureStoreWriter(root, _meta(), writer_id="w", shard_max_bytes=20_000)
    shard_bytes = 40 * store_mod.bytes_per_token(HIDDEN)  # 2 records of 20 tokens per shard, roughly
    monkeypatch.setattr(store_mod, "_open_for_write", FakeFullDisk(budget=int(2.5 * shard_bytes)))
    added = []
    with pytest.raises(StoreError, match="disk full .* completed shards are kept and resume skips"):
        for i in range(20):
            added.append(f"s{i:02d}")  # the add that fails keeps its record buffered for a retry
            writer.add(_record(f"s{i:02d}", 20, i))
    store = open_store(root, verify=True)
    assert 0 < len(store) < len(added), "some shards completed before the disk filled"
    assert not [p for p in (root / "shards").iterdir() if p.name.startswith(store_mod.TMP_PREFIX)]
    assert store_mod.cleanup_orphans(root) == [], "a failed write must leave no partial file behind"

    monkeypatch.undo()  # space freed: the kept buffer is written by the next flush
    writer.close()
    store = open_store(root, verify=True)
    assert sorted(store.sample_ids) == added and not store.duplicate_ids


def test_enospc_on_the_completion_marker_removes_its_shard(tmp_path, monkeypatch):
    from eagle3_ray.features import open_store

    root = tmp_path / "store"
    writer = store_mod.FeatureStoreWriter(root, _meta(), writer_id="w", shard_max_bytes=2**40)
    writer.add(_record("a", 10, 0))
    writer.flush()
    writer.add(_record("b", 10, 1))
    real = store_mod._write_atomic

    def marker_fails(final: Path, data: bytes) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(final))

    monkeypatch.setattr(store_mod, "_write_atomic", marker_fails)
    with pytest.raises(StoreError, match="disk full"):
        writer.flush()
    assert sorted(p.name for p in (root / "shards").iterdir()) == ["w-000000.done.json", "w-000000.safetensors"]
    monkeypatch.setattr(store_mod, "_write_atomic", real)
    writer.close()
    assert open_store(root, verify=True).sample_ids == ["a", "b"]


def test_preflight_counts_only_the_remaining_tokens_and_names_the_fix(tmp_path):
    from eagle3_ray.features.preflight import check_disk, projected_bytes

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    fits = max(1, free // (4 * projected_bytes(1, HIDDEN)))
    report = check_disk(tmp_path / "new" / "store", fits, HIDDEN)
    assert report.checked_path == tmp_path and report.required_bytes <= free
    too_many = 2 * free // projected_bytes(1, HIDDEN)
    with pytest.raises(PreflightError, match="not enough disk .* Free space there, pass another --out"):
        check_disk(tmp_path / "store", too_many, HIDDEN)


# ---------------------------------------------------------------- real disk, real Ray


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs: a disk that really fills up."""
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or 'not permitted'})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def prepared(ci_tiny_prepared):
    """The session's run_prepare of ci-tiny (read only)."""
    return ci_tiny_prepared[0]


def test_extract_preflight_refuses_a_store_larger_than_the_disk(prepared, tmpfs):
    from eagle3_ray.extract.pipeline import run_extract

    # 12 samples, ~700 tokens: ~0.4 MB of H=64 features; the ballast leaves ~0.2 MB free.
    cfg = load_config(CI_CONFIG)
    (tmpfs / "ballast").write_bytes(b"\0" * 800_000)
    with pytest.raises(PreflightError, match=r"not enough disk .*GB free on"):
        run_extract(cfg, prepared, tmpfs / "features")
    assert not (tmpfs / "features" / "shards").exists() or not any((tmpfs / "features" / "shards").iterdir())


def test_extract_hitting_a_full_disk_midway_keeps_shards_valid_and_resumes(prepared, tmpfs, monkeypatch, capsys):
    """The disk passes preflight, then fills up (another writer) while shards are being written."""
    from eagle3_ray.cli import main
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store
    from eagle3_ray.features import preflight

    cfg = load_config(CI_CONFIG)
    out = tmpfs / "features"
    ballast = tmpfs / "ballast"
    real_check = preflight.check_disk

    def check_then_fill(out_dir, num_tokens, hidden_size, margin=1.1, compact="none"):
        report = real_check(out_dir, num_tokens, hidden_size, margin, compact)
        # leave room for about one shard (one a batch: ci-tiny's extract.batch_tokens=256 tokens of
        # H=64 features, ~130 KB) with its marker, the meta and the rejects
        ballast.write_bytes(b"\0" * (report.free_bytes - 160 * 1024))
        return report

    monkeypatch.setattr(preflight, "check_disk", check_then_fill)
    capsys.readouterr()
    rc = main(["extract", "-c", CI_CONFIG, "--data", str(prepared), "--out", str(out)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("eagle3-ray extract: error: disk full at "), last
    assert "Traceback" not in last and "rerun: completed shards are kept" in last
    partial = open_store(out, verify=True)  # every completed shard reads back, checksums included
    assert 0 < len(partial) < 12
    first_shards = {s.path.name: s.sha256 for s in partial.shards}

    monkeypatch.undo()
    ballast.unlink()
    summary = run_extract(cfg, prepared, out)
    assert summary.skipped_done == len(partial)
    store = open_store(out, verify=True)
    assert len(store) == 12 and not store.duplicate_ids
    assert {s.path.name: s.sha256 for s in store.shards if s.path.name in first_shards} == first_shards
    assert json.loads((out / "summary.json").read_text())["samples"] == 12
