"""Fault injection on a real local Ray: processes are SIGKILLed mid-run and the work still completes.

1. An extraction engine actor (Ray Data ``MapWorker(MapBatches(CaptureWriteUDF))``) is killed once the
   first shard is committed: the run finishes with every sample exactly once in the store.
2. A Ray Train worker (``RayTrainWorker``) of a whole ``eagle3-ray run`` is killed after the first
   checkpoint: training restarts from that checkpoint by itself, with its step counter, LR schedule
   and data position.
3. That run is then killed whole mid-training and rerun: finished stages are skipped, training
   resumes at its step, and the benchmark measures only the categories it lacks.
(2 and 3 are one run, conftest.py's ``ci_tiny_run``: a CLI run costs a Ray start and every stage's
actors, so the faults share it.)

Victims are found among this test's own descendant processes by their Ray process title, so a
concurrent Ray of someone else is never touched.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from eagle3_ray.config import load_config

CI_CONFIG = "configs/ci-tiny.yaml"
ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300
ENGINE_ACTOR = "ray::MapWorker(MapBatches(Capture"  # the extraction engine actor's process title  # generous: the machine is shared; a hang still fails the test


def _descendants(title: str, root: psutil.Process | None = None) -> list[psutil.Process]:
    """Live descendants of ``root`` (default: this process) whose command line contains ``title``."""
    found = []
    for p in (root or psutil.Process()).children(recursive=True):
        try:
            if title in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.NoSuchProcess:
            continue
    return found


def _wait_for(what: str, cond, alive=lambda: True, deadline_s: float = WAIT_S, poll_s: float = 0.05):
    """Poll ``cond`` until truthy; fail if the run under test ends first (the fault came too late)."""
    t_end = time.monotonic() + deadline_s
    while time.monotonic() < t_end:
        value = cond()
        if value:
            return value
        if not alive():
            raise AssertionError(f"the run ended before {what}: the fault must land mid-run")
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


class Background:
    """Runs ``fn`` in a thread (the test process stays the Ray driver) and keeps its result or error."""

    def __init__(self, fn):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # re-raised in the test thread by join()
            self.error = e

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self):
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the run did not finish after the fault"
        if self.error is not None:
            raise self.error
        return self.result


def _kill(procs: list[psutil.Process]) -> list[int]:
    pids = []
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
            pids.append(p.pid)
        except ProcessLookupError:
            continue
    return pids


# ---------------------------------------------------------------- 1. extraction actor death


@pytest.fixture(scope="module")
def many_samples(ray_local, tmp_path_factory):
    """ci_tiny's conversations 10x over (unique ids), prepared: enough batches for a mid-run."""
    from eagle3_ray.data.sources import resolve_data_path
    from eagle3_ray.extract.prepare_stage import run_prepare

    root = tmp_path_factory.mktemp("many")
    lines = resolve_data_path("builtin:ci_tiny").read_text(encoding="utf-8").splitlines()
    with open(root / "data.jsonl", "w", encoding="utf-8") as f:
        for copy in range(10):
            for n, line in enumerate(lines):
                rec = json.loads(line)
                rec["id"] = f"c{copy}-{n}"
                f.write(json.dumps(rec) + "\n")
    summary = run_prepare(load_config(CI_CONFIG), str(root / "data.jsonl"), root / "prepare")
    assert summary.samples == 120
    return root / "prepare"


def test_killing_an_extraction_actor_mid_run_loses_and_duplicates_nothing(many_samples, tmp_path):
    import pyarrow.parquet as pq

    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import completed_ids, manifest

    # ~2 samples per engine call (one shard each): many batches and commits for the fault to fall between.
    cfg = load_config(CI_CONFIG, ["extract.batch_tokens=128"])
    out = tmp_path / "features"
    run = Background(lambda: run_extract(cfg, many_samples, out))
    _wait_for("the first committed shard", lambda: completed_ids(out) if (out / "shards").is_dir() else None,
              run.alive)
    actors = _wait_for("the engine actor", lambda: _descendants(ENGINE_ACTOR), run.alive)
    done_at_kill = len(completed_ids(out))
    killed = _kill(actors)
    assert killed and run.alive() and done_at_kill < 120, "the fault must land mid-run"

    summary = run.join()
    expected = sorted(pq.read_table(many_samples / "prepared.parquet", columns=["sample_id"]).column(0).to_pylist())
    from_markers = [sid for m in manifest(out) for sid in m["sample_ids"]]
    store = open_store(out, verify=True)
    assert sorted(from_markers) == expected, "manifest: every sample exactly once"
    assert sorted(store.sample_ids) == expected and not store.duplicate_ids, "shards agree with the manifest"
    assert summary.samples == 120
    FAULTS["extraction actor SIGKILL"] = {"killed_pids": killed, "samples_done_at_kill": done_at_kill,
                                          "samples_lost": 0, "samples_duplicated": len(store.duplicate_ids)}


# ---------------------------------------------------------------- 2. training worker death


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _first_resumed_row(rows: list[dict]) -> int | None:
    """Index of the first row logged by a restarted attempt (its ``resumed_from``, the checkpoint step
    it started from, is not 0); None if none. A restart from the last step logged repeats no step, so
    the step numbers alone cannot show it."""
    return next((i for i, m in enumerate(rows) if m["resumed_from"] != 0), None)


def test_killing_a_train_worker_resumes_from_the_last_checkpoint(ci_tiny_run):
    from eagle3_ray.train.checkpoint import consumed_packs, latest_checkpoint, read_train_state

    r = ci_tiny_run
    steps, every = 12, r["checkpoint_every"]
    assert len(r["worker_killed"]) == 1 and r["logged_at_worker_kill"] < steps, "the fault must land mid-training"
    logged = _metrics(r["out"] / "train")
    first = logged[:r["lines_at_stop"]]  # the first run's steps: the worker kill and the restart
    seq = [m["step"] for m in first]
    i = _first_resumed_row(first)
    starts = [m["resumed_from"] for m in first]
    assert i is not None and set(starts[i:]) == {starts[i]}, f"exactly one restart expected: {list(zip(seq, starts))}"
    resumed_from = starts[i]
    assert resumed_from >= every and resumed_from % every == 0, f"resumed at step {resumed_from}, not a checkpoint"
    assert resumed_from <= seq[i - 1]  # a checkpoint of the attempt that was killed
    assert seq[:i] == list(range(1, seq[i - 1] + 1)) and seq[i:] == list(range(resumed_from + 1, seq[-1] + 1))
    assert f"[train] resumed at step {resumed_from}" in r["first_log"]
    # The LR schedule (DeepSpeed scheduler state) continues exactly where the checkpoint left it.
    before = {m["step"]: m for m in first[:i]}
    after = {m["step"]: m for m in logged[i:]}
    for s in set(before) & set(after):
        assert after[s]["lr"] == pytest.approx(before[s]["lr"], rel=1e-6)
    # Data position: one pack per step over the whole run, none consumed twice across the restarts.
    final = latest_checkpoint(r["out"] / "train")
    assert read_train_state(final)["step"] == steps and len(consumed_packs(final)) == steps
    assert all(m["loss"] == m["loss"] for m in logged)
    FAULTS["train worker SIGKILL"] = {"killed_pids": r["worker_killed"],
                                      "step_logged_at_kill": r["logged_at_worker_kill"],
                                      "resumed_from_step": resumed_from, "final_step": steps,
                                      "loss_step1": logged[0]["loss"], "loss_after_resume": first[i]["loss"],
                                      "packs_consumed": len(consumed_packs(final))}


# ---------------------------------------------------------------- 3. stop and rerun the whole job


def _start_run(out: Path, log: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "eagle3_ray.cli", "run", "-c", CI_CONFIG, "--out", str(out), *overrides]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, as a user's run
    env["PYTHONUNBUFFERED"] = "1"
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def _stop_hard(proc: subprocess.Popen) -> None:
    """SIGKILL the run and every process it started (its Ray head included), as a crashed node would."""
    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:  # it ended by itself; the assertions after the stop say what that means
        tree = []
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(tree, timeout=30)
    proc.wait(30)


def _finish(proc: subprocess.Popen, log: Path) -> str:
    rc = proc.wait(WAIT_S * 2)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    return text


def stopped_and_rerun(tmp_path_factory) -> dict:
    """ci-tiny's whole ``eagle3-ray run`` (a CLI process with its own local Ray, as a user's run) with
    two faults, then rerun to the end:

    1. once a step past the first training checkpoint is logged, its Ray Train worker is SIGKILLed:
       Ray Train restarts the worker group from that checkpoint by itself (train.max_failures);
    2. once the restarted group has logged a step, the whole run is SIGKILLed with its Ray.

    Run once per session (conftest.py's ``ci_tiny_run``): the fault tests above and below check the
    restart and the resume, test_run_pipeline.py the finished run's outputs."""
    from eagle3_ray.train.checkpoint import latest_checkpoint, read_train_state

    tmp = tmp_path_factory.mktemp("whole_run")
    out = tmp / "run"
    every = 4
    # lr 1e-2: within 12 steps the drafter learns enough of the random target to be accepted more often
    # than the untrained one (test_run_pipeline.py compares them)
    overrides = ("train.max_steps=12", f"train.checkpoint_every={every}", "train.log_every=1", "train.lr=0.01")
    first = _start_run(out, tmp / "first.log", *overrides)
    alive = lambda: first.poll() is None  # noqa: E731
    try:
        # A step logged after the first checkpoint: its report returned, so Ray Train finished copying
        # it to storage and registered it. (Stopping as soon as train_state.json shows up could land
        # mid-copy and leave a newest checkpoint with truncated DeepSpeed files.)
        _wait_for("a step past the first training checkpoint",
                  lambda: any(m["step"] > every for m in _metrics(out / "train")), alive, poll_s=0.1)
        run_tree = psutil.Process(first.pid)
        workers = _wait_for("the Ray Train worker", lambda: _descendants("ray::RayTrainWorker", run_tree), alive)
        logged = _metrics(out / "train")
        worker_killed = _kill(workers)
        assert alive(), "the fault must land mid-run"
        # The restarted worker group logs a step (its rows name the checkpoint it resumed from).
        _wait_for("a step of the restarted workers",
                  lambda: _first_resumed_row(_metrics(out / "train")) is not None, alive, poll_s=0.1)
        shards_before = sorted(p.name for p in (out / "features" / "shards").iterdir())
    finally:
        _stop_hard(first)
    done_before_rerun = (out / "train" / "_DONE.json").exists()
    stopped_at = read_train_state(latest_checkpoint(out / "train" / "ray_train"))["step"]
    lines_at_stop = len(_metrics(out / "train"))
    log = _finish(_start_run(out, tmp / "second.log", *overrides), tmp / "second.log")
    return {"out": out, "overrides": overrides, "log": log, "shards_before": shards_before,
            "stopped_at": stopped_at, "train_done_before_rerun": done_before_rerun, "checkpoint_every": every,
            "worker_killed": worker_killed, "logged_at_worker_kill": max(m["step"] for m in logged),
            "lines_at_stop": lines_at_stop, "first_log": (tmp / "first.log").read_text(errors="replace")}


def test_stopping_and_rerunning_the_whole_run_redoes_only_missing_work(ci_tiny_run, ray_local, capsys):
    from eagle3_ray.bench.runner import PARTIAL_DIR, run_bench
    from eagle3_ray.train.checkpoint import latest_checkpoint, read_train_state

    out, log, overrides, stopped_at = (ci_tiny_run[k] for k in ("out", "log", "overrides", "stopped_at"))
    assert not ci_tiny_run["train_done_before_rerun"], "the stop must land mid-training"
    for stage in ("prepare", "extract", "vocab"):
        assert f"[run] {stage}: done earlier, skipping" in log
    assert sorted(p.name for p in (out / "features" / "shards").iterdir()) == ci_tiny_run["shards_before"]
    assert read_train_state(latest_checkpoint(out / "train"))["step"] == 12
    steps = [m["step"] for m in _metrics(out / "train")]
    # The rerun's steps follow the first run's (which had a worker restart of its own, checked
    # above); steps logged after the checkpoint and before the stop are logged again by the rerun.
    rerun = steps[ci_tiny_run["lines_at_stop"]:]
    assert rerun and rerun == list(range(rerun[0], 13)), steps
    resumed_from = rerun[0] - 1
    assert {m["resumed_from"] for m in _metrics(out / "train")[ci_tiny_run["lines_at_stop"]:]} == {resumed_from}
    assert 4 <= resumed_from <= stopped_at and f"[train] resumed at step {resumed_from}" in log
    assert log.count("[train] resumed at step") == 1  # once: worker lines are not echoed twice
    assert steps[-1] == 12 and sorted(set(steps)) == list(range(1, 13))

    # A stop during the benchmark leaves some categories measured: the rerun measures only the rest.
    # (Rerun in-process on this test's Ray: a third CLI run would only add another Ray start.)
    partials = sorted((out / "bench" / PARTIAL_DIR).glob("*.json"))
    kept, lost = partials[:-1], partials[-1]
    kept_stamp = {p.name: p.stat().st_mtime_ns for p in kept}
    lost.unlink()
    cfg = load_config(CI_CONFIG, list(overrides))
    capsys.readouterr()
    results = run_bench(cfg, drafter=str(out / "drafter"), out=out / "bench", compare_untrained=True)
    assert f"[bench] {len(kept)} categories already measured, 1 to run" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in kept} == kept_stamp and lost.is_file()
    assert results["num_prompts"] == len(partials)
    FAULTS["whole run SIGKILL + rerun"] = {"resumed_at_train_step": resumed_from, "bench_categories_kept": len(kept),
                                           "bench_categories_rerun": 1, "shards_redone": 0}


FAULTS: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def report_figures():
    """Print the figures docs/reliability.md records (run with -s to see them)."""
    yield
    if FAULTS:
        print("\n[reliability] " + json.dumps(FAULTS, indent=2))
