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

from eagle3_ray.engines.sglang_args import TESTED_VERSIONS

REPO = Path(__file__).resolve().parents[1]
DEPS = REPO / ".deps"


def _missing(version: str) -> str | None:
    src = DEPS / f"sglang-{version}"
    return None if (src / "sglang").is_dir() else \
        f"{src} is missing: run `make sglang-src` (installs SGLang {version} --no-deps there)"


@pytest.fixture(scope="module")
def suites(tmp_path_factory):
    """Every installed version's suite, started at once: each is one single-threaded process, mostly
    imports, so on a 2-core machine the two run side by side in about the time of one. Yields
    version -> (process, output file)."""
    logs = tmp_path_factory.mktemp("sglang_suites")
    started = {}
    for version in TESTED_VERSIONS:
        if _missing(version):
            continue
        src = DEPS / f"sglang-{version}"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO)]), "EAGLE3_SGLANG_VERSION": version}
        log = logs / f"{version}.log"
        with open(log, "w") as f:  # a file, not a pipe: a suite left unread cannot block on a full pipe
            proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                 f"--basetemp={logs / version}", str(REPO / "tests" / "sglang_contract")],
                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
        started[version] = (proc, log)
    yield started
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("version", TESTED_VERSIONS)
def test_sglang_contract_suite(version, suites):
    msg = _missing(version)
    if msg:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    proc, log = suites[version]
    rc = proc.wait(timeout=900)
    out = log.read_text(errors="replace")
    lines = out.strip().splitlines()
    summary = lines[-1] if lines else ""  # pytest's last line
    assert rc == 0, f"SGLang {version} contract suite failed (rc {rc}):\n{out[-12000:]}"
    assert " passed" in summary and "skipped" not in summary, f"SGLang {version}: {summary}\n{out[-4000:]}"
