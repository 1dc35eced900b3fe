"""Disk preflight: refuse an extraction that would fill the disk midway."""

from __future__ import annotations

import gc
import shutil
import subprocess

import pytest

from eagle3_ray.errors import PreflightError
from eagle3_ray.features import bytes_per_token, check_disk, projected_bytes

H = 576  # SmolLM2-135M


def test_projected_bytes_is_tokens_times_bytes_per_token():
    assert bytes_per_token(H) == 4 * H * 2 + 4 + 1
    assert projected_bytes(1000, H) == 1000 * (8 * H + 5)
    # docs/contracts.md scale check: a 2,100-token Kimi-K2.5 sample is about 120 MB of features
    assert 115e6 < projected_bytes(2100, 7168) < 125e6


def test_small_extraction_passes_and_measures_nearest_existing_parent(tmp_path):
    out = tmp_path / "not" / "yet" / "there"
    report = check_disk(out, num_tokens=1000, hidden_size=H)
    assert report.checked_path == tmp_path and report.out_dir == out
    assert report.projected_bytes == projected_bytes(1000, H)
    assert report.required_bytes == int(report.projected_bytes * 1.1)
    assert report.free_bytes == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.05)
    assert not out.exists()  # a check only, it creates nothing


def test_too_large_extraction_is_refused_with_numbers_and_fixes(tmp_path):
    with pytest.raises(PreflightError) as e:
        check_disk(tmp_path / "store", num_tokens=10**12, hidden_size=7168)
    msg = str(e.value)
    assert "GB projected" in msg and "GB free" in msg and str(tmp_path) in msg
    assert "another --out" in msg and "data.max_samples" in msg and "Free space" in msg


@pytest.fixture
def tmpfs_2m(tmp_path):
    """A real 2 MiB filesystem with an exactly known free size, or skip where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        gc.collect()
        if subprocess.run(["umount", str(mnt)]).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_margin_decides_at_the_boundary(tmpfs_2m):
    free = shutil.disk_usage(tmpfs_2m).free
    tokens = int(free / 1.2) // bytes_per_token(H)  # projected ~ free / 1.2
    assert check_disk(tmpfs_2m / "out", tokens, H, margin=1.1).free_bytes == free
    with pytest.raises(PreflightError, match="x1.3 margin"):
        check_disk(tmpfs_2m / "out", tokens, H, margin=1.3)
