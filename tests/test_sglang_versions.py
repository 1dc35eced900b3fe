"""The SGLang contract suite (tests/sglang_contract) against the real source of every supported version.

Each version lives --no-deps in its own directory, ``.deps/sglang-<version>`` (``make sglang-src``),
and its suite runs in a pytest subprocess with that directory on PYTHONPATH: two SGLang versions
cannot share one interpreter. A failing or skipping suite fails here with its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_ray.engines.sglang import TESTED_VERSIONS

REPO = Path(__file__).resolve().parents[1]
DEPS = REPO / ".deps"


@pytest.mark.parametrize("version", TESTED_VERSIONS)
def test_sglang_contract_suite(version):
    src = DEPS / f"sglang-{version}"
    if not (src / "sglang").is_dir():
        msg = f"{src} is missing: run `make sglang-src` (installs SGLang {version} --no-deps there)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "EAGLE3_SGLANG_VERSION": version}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(REPO / "tests" / "sglang_contract")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )
    out = proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""  # pytest's last line
    assert proc.returncode == 0, f"SGLang {version} contract suite failed (rc {proc.returncode}):\n{out[-12000:]}"
    assert " passed" in summary and "skipped" not in summary, f"SGLang {version}: {summary}\n{out[-4000:]}"
