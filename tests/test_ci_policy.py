"""The suite's own rule: under CI=true a skip fails unless its reason is on conftest's allow-list."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

CASES = '''
import pytest

def test_dependency_missing():
    pytest.importorskip("eagle3_ray_no_such_package")

@pytest.mark.skipif(True, reason="needs CUDA: a GPU-only path")
def test_cuda_only():
    pass

def test_runs():
    pass
'''


def _pytest(tmp_path: Path, ci: str) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {**os.environ, "CI": ci}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_under_ci_fails_unless_allowed(tmp_path):
    proc = _pytest(tmp_path, "true")
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 1 passed, 1 skipped" in proc.stdout
    assert "FAILED" in proc.stdout and "eagle3_ray_no_such_package" in proc.stdout


def test_outside_ci_a_skip_stays_a_skip(tmp_path):
    proc = _pytest(tmp_path, "")
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 2 skipped" in proc.stdout
