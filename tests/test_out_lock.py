"""One writer per output directory: a second run on the same --out is refused at once with the
holder's pid and command, and a SIGKILLed holder leaves no stale lock (the rerun-after-crash path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_ray.cli import main
from eagle3_ray.config import load_config
from eagle3_ray.errors import OutputInUse
from eagle3_ray.out_lock import out_lock
from eagle3_ray.pipeline import run_pipeline

ROOT = Path(__file__).resolve().parent.parent


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path, capsys):
    with out_lock(tmp_path, "run"):
        with pytest.raises(OutputInUse, match=rf"pid {os.getpid()} .*`run`.*pass another --out"):
            with out_lock(tmp_path, "extract"):
                pass
        with pytest.raises(OutputInUse):  # the whole pipeline, before any stage (no Ray needed)
            run_pipeline(load_config(str(ROOT / "configs/ci-tiny.yaml")), None, tmp_path)
        assert not (tmp_path / "config.resolved.yaml").exists()
        rc = main(["prepare", "-c", str(ROOT / "configs/ci-tiny.yaml"), "--out", str(tmp_path)])
        assert rc == 2 and "being written by another eagle3-ray process" in capsys.readouterr().err
    with out_lock(tmp_path, "run"):  # released on exit
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    code = ("import sys, time; from eagle3_ray.out_lock import out_lock\n"
            "with out_lock(sys.argv[1], 'run'):\n    print('held', flush=True); time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputInUse, match=f"pid {holder.pid} "):
            with out_lock(tmp_path, "run"):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    with out_lock(tmp_path, "run"):  # the rerun after the crash
        pass
