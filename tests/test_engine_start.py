"""A failure that will repeat fails fast (issue 47): an engine whose construction fails ends the stage
within seconds, with exit status 2 and one line naming the cause, and is built once, not retried.

The engine is the real HF engine on a target whose load fails deterministically: a seeded random
tiny Llama whose config asks for a negative MLP width, which torch refuses when the model is built
(a RuntimeError, not one of the errors the target loader words for the user). The driver reads only
the config, so the failure happens where an engine is built, in a Ray actor: generate's
DistillActor, extract's engine actor (Ray Data), the benchmark's BenchActor. Each stage's actor class
is a subclass that counts its constructions in a file and is otherwise the stage's own. Ray's own
side: a task that raises runs once (``fail_fast_remote``), one whose process dies runs again.
SGLang's start failures (a scheduler that fails, SGLang's SIGQUIT) are covered by
tests/sglang_contract/test_start_failure.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from eagle3_ray.engines.sglang_process import logged_failure
from eagle3_ray.errors import EngineStartError, engine_start, exception_line

CI_CONFIG = "configs/ci-tiny.yaml"
TINY = Path(__file__).resolve().parents[1] / "eagle3_ray" / "resources" / "tiny-llama.json"
CAUSE = "RuntimeError: Trying to create tensor with negative dimension -1: [-1, 64]"
BOUND_S = 120  # seconds; a stage that retried its engine, or hung, would take far longer on this machine


@pytest.fixture()
def broken_target(tmp_path) -> str:
    """``random:<config>``: ci-tiny's target with intermediate_size=-1 (SmolLM2's tokenizer, as ci-tiny)."""
    config = json.loads(TINY.read_text())
    config["intermediate_size"] = -1
    path = tmp_path / "broken-llama" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    return f"random:{path}"


def counted(cls, attempts: Path):
    """``cls`` with each construction counted in ``attempts`` (one line each, from whichever process)."""

    class Counted(cls):
        def __init__(self, *args, **kwargs):
            with open(attempts, "a", encoding="utf-8") as f:
                f.write(f"{os.getpid()}\n")
            super().__init__(*args, **kwargs)

    Counted.__name__ = cls.__name__  # (its qualname stays local: cloudpickle sends the class itself)
    return Counted


def run_cli(argv: list[str], capsys) -> tuple[int, str, float]:
    from eagle3_ray.cli import main

    capsys.readouterr()
    t = time.monotonic()
    rc = main(argv)
    seconds = time.monotonic() - t
    return rc, capsys.readouterr().err, seconds


def check_failed_fast(cmd: str, rc: int, err: str, seconds: float, attempts: Path, target: str) -> None:
    last = err.strip().splitlines()[-1]
    assert rc == 2, err[-3000:]
    assert last.startswith(f"eagle3-ray {cmd}: error: ") and last.endswith(f"could not be built: {CAUSE}"), last
    assert f"target.model={target!r}" in last and "Traceback" not in last
    assert len(attempts.read_text().splitlines()) == 1, "the engine was built more than once"
    assert seconds < BOUND_S, seconds


@pytest.mark.ray
def test_generate_with_an_engine_that_cannot_be_built_fails_fast(ray_local, broken_target, tmp_path, monkeypatch,
                                                                 capsys):
    from eagle3_ray.extract import generate_stage

    attempts = tmp_path / "attempts"
    monkeypatch.setattr(generate_stage, "DistillActor", counted(generate_stage.DistillActor, attempts))
    rc, err, seconds = run_cli(["generate", "-c", CI_CONFIG, "--out", str(tmp_path / "gen"),
                                f"target.model={broken_target}"], capsys)
    check_failed_fast("generate", rc, err, seconds, attempts, broken_target)
    assert not (tmp_path / "gen" / "conversations.jsonl").exists()


@pytest.mark.ray
def test_extract_with_an_engine_that_cannot_be_built_fails_fast(ci_tiny_prepared, broken_target, tmp_path,
                                                                monkeypatch, capsys):
    from eagle3_ray.extract import udfs

    attempts = tmp_path / "attempts"
    monkeypatch.setattr(udfs, "CaptureWriteUDF", counted(udfs.CaptureWriteUDF, attempts))
    rc, err, seconds = run_cli(["extract", "-c", CI_CONFIG, "--data", str(ci_tiny_prepared[0]),
                                "--out", str(tmp_path / "features"), f"target.model={broken_target}"], capsys)
    check_failed_fast("extract", rc, err, seconds, attempts, broken_target)
    assert not list((tmp_path / "features").glob("shards/*"))


@pytest.mark.ray
def test_bench_with_a_target_that_cannot_be_built_fails_fast(ray_local, broken_target, tmp_path, monkeypatch,
                                                             capsys):
    import torch
    from transformers import AutoConfig

    from eagle3_ray.bench import runner
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    # An exported drafter that fits the target's shapes (the preflight checks them), made from the config.
    hf = AutoConfig.for_model(**json.loads(TINY.read_text()))
    torch.manual_seed(0)
    draft = DrafterConfig.from_target(hf, draft_vocab_size=256, aux_layers=[2, 4, 5])
    save_drafter_weights(Eagle3Drafter(draft), tmp_path / "ckpt")
    drafter = export_drafter(tmp_path / "ckpt", tmp_path / "drafter", engine="sglang")

    attempts = tmp_path / "attempts"
    monkeypatch.setattr(runner, "BenchActor", counted(runner.BenchActor, attempts))
    rc, err, seconds = run_cli(["bench", "-c", CI_CONFIG, "--drafter", str(drafter), "--out", str(tmp_path / "bench"),
                                f"target.model={broken_target}"], capsys)
    check_failed_fast("bench", rc, err, seconds, attempts, broken_target)
    assert not (tmp_path / "bench" / runner.RESULTS_NAME).exists()


@pytest.mark.ray
def test_fail_fast_remote_runs_a_raising_task_once_and_a_killed_one_again(ray_local, tmp_path):
    """What a retry can fix is retried (the worker process died), what it cannot is not (it raised)."""
    from eagle3_ray.ray_session import fail_fast_remote

    raised, killed = tmp_path / "raised", tmp_path / "killed"

    def cannot_start(path: str) -> None:
        with open(path, "a", encoding="utf-8") as f:
            f.write("x\n")
        raise EngineStartError("the SGLang engine could not start: Scheduler failed with ModuleNotFoundError: "
                               "No module named 'deep_gemm'")

    def killed_once(path: str) -> int:
        with open(path, "a", encoding="utf-8") as f:
            f.write("x\n")
        runs = len(Path(path).read_text().splitlines())
        if runs == 1:
            os._exit(1)  # the process dies, as when a node is lost or the process is killed
        return runs

    with pytest.raises(EngineStartError, match="deep_gemm"):
        ray_local.get(fail_fast_remote(cannot_start, num_cpus=0).remote(str(raised)), timeout=BOUND_S)
    assert len(raised.read_text().splitlines()) == 1
    assert ray_local.get(fail_fast_remote(killed_once, num_cpus=0).remote(str(killed)), timeout=BOUND_S) == 2
    with pytest.raises(ValueError, match="retry_exceptions"):
        fail_fast_remote(cannot_start, retry_exceptions=True)


# --- no Ray -----------------------------------------------------------------------------------------


def test_engine_start_names_the_cause_on_one_line_and_lets_user_errors_pass():
    from eagle3_ray.errors import TargetLoadError

    with pytest.raises(EngineStartError) as err:
        with engine_start("the HF engine of target.model='x'"):
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
    assert str(err.value) == ("the HF engine of target.model='x' could not be built: RuntimeError: CUDA error: out "
                              "of memory; CUDA kernel errors might be asynchronously reported")
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(TargetLoadError, match="^no config"):  # worded for the user already: as it is
        with engine_start("the HF engine"):
            raise TargetLoadError("no config")
    assert exception_line(KeyError("k")) == "KeyError: 'k'" and exception_line(ValueError()) == "ValueError"
    assert len(exception_line(ValueError("x" * 2000), limit=100)) == 100


SCHEDULER_LOG = """\
[2026-12-06 10:00:00 TP0] Init torch distributed begin.
[2026-12-06 10:00:09 TP1] Scheduler hit an exception: Traceback (most recent call last):
  File "/sglang/srt/managers/scheduler.py", line 4930, in run_scheduler_process
    scheduler = Scheduler(
                ^^^^^^^^^^
  File "/sglang/srt/model_executor/cuda_graph_runner.py", line 51, in <module>
    import deep_gemm
ImportError: cannot import name 'x' from 'y'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/sglang/srt/layers/deep_gemm_wrapper/entrypoint.py", line 20, in <module>
    raise ModuleNotFoundError("No module named 'deep_gemm'")
ModuleNotFoundError: No module named 'deep_gemm'
and a second line of its message

[2026-12-06 10:00:09 TP0] Scheduler hit an exception: Traceback (most recent call last):
  File "x.py", line 1, in f
RuntimeError: NCCL error (the other rank's failure)
"""


def test_the_failed_process_and_its_exception_are_read_from_sglangs_log():
    assert logged_failure(SCHEDULER_LOG) == "Scheduler failed with ModuleNotFoundError: No module named 'deep_gemm'"
    detok = "[t] DetokenizerManager hit an exception: Traceback (most recent call last):\n  File \"d.py\"\nOSError: x\n"
    assert logged_failure(detok) == "DetokenizerManager failed with OSError: x"
    assert logged_failure("[t] Init torch distributed begin.\n") is None
    assert logged_failure("[t] Scheduler hit an exception: Traceback (most recent call last):\n") is None  # cut off
