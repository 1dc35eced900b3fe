"""Ctrl-C during training reaches the driver at once (real Ray Train on the session's Ray).

Called on the main thread, ``TorchTrainer.fit()`` installs Ray Train's own SIGINT handler, which
waits for the controller to abort the run: 23 s and 70 s in two `eagle3-ray run`s of ci-tiny on
2 cores, silent, exit status 1. ``fit_off_main_thread`` keeps the main thread free, so the
KeyboardInterrupt reaches the CLI, which says how to resume and exits 130 (cli.py).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest

WAIT_S = 120


def test_ctrl_c_during_a_ray_train_fit_interrupts_the_main_thread_at_once(ray_local, tmp_path):
    import ray.train
    from ray.train.torch import TorchTrainer

    from eagle3_ray.train.trainer import fit_off_main_thread

    def train_func(config):  # nested: pickled by value, as the workers cannot import this test module
        Path(config["started"]).touch()  # the worker group is up: the fit is under way
        deadline = time.monotonic() + config["hold_s"]
        while time.monotonic() < deadline and not Path(config["release"]).exists():
            time.sleep(0.05)

    started, release = tmp_path / "started", tmp_path / "release"
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"started": str(started), "release": str(release), "hold_s": WAIT_S},
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="interrupt", storage_path=str(tmp_path / "storage")),
    )
    # A fresh `eagle3-ray` started from a terminal has Python's default handler. A process started in the
    # background by a shell without job control inherits SIGINT ignored (SIG_IGN), and Python keeps it:
    # a suite launched that way failed here with DID NOT RAISE. The test sets the default for its
    # duration and names what it found.
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        warnings.warn(f"the SIGINT handler at the start of this test was {previous!r}; set to Python's default")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sent: dict[str, float] = {}

    def ctrl_c_once_started() -> None:
        deadline = time.monotonic() + WAIT_S
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_once_started, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            fit_off_main_thread(trainer)
        waited = time.monotonic() - sent["at"]
        assert started.exists(), "the interrupt must land while the fit runs"
        # Ray Train's handler (fit on the main thread) would have waited for the controller's abort
        # and the worker, held here for WAIT_S, without raising: the main thread saw it at once.
        assert waited < WAIT_S / 4, waited
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ray Train installed none
    finally:
        release.touch()  # let the worker end; the fit's thread finishes by itself
        signal.signal(signal.SIGINT, previous)



def test_an_error_raised_while_a_ctrl_c_is_handled_is_reported_as_the_interrupt(monkeypatch, capsys):
    """A Ctrl-C inside ``threading.Condition.wait`` (a queue's ``get``) can surface as ``RuntimeError:
    release unlocked lock``, raised while its KeyboardInterrupt is handled (seen on the H200 during
    extraction): the CLI says "interrupted" and exits 130, as for the interrupt itself. An error of
    its own still propagates."""
    from eagle3_ray import cli

    def interrupted(args):
        try:
            raise KeyboardInterrupt  # stands for the signal landing inside the wait
        except KeyboardInterrupt:
            threading.Lock().release()  # RuntimeError: release unlocked lock, its __context__ the interrupt

    monkeypatch.setattr(cli, "_dispatch", interrupted)
    assert cli.main(["run", "-c", "configs/ci-tiny.yaml"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (and while stopping: RuntimeError: release unlocked lock)" in err and "Traceback" not in err

    def failing(args):
        raise RuntimeError("an error of its own")

    monkeypatch.setattr(cli, "_dispatch", failing)
    with pytest.raises(RuntimeError, match="an error of its own"):
        cli.main(["run", "-c", "configs/ci-tiny.yaml"])
