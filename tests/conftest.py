"""Shared fixtures: one local Ray per test session, the real SmolLM2 (converted once), tiny targets."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

# The `ray` CLI, cluster/local-head.sh and the subprocess runs use the interpreter running the tests,
# activated virtual environment or not.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray Train's controller polls its workers every 2 s by default, and a worker's ray.train.report()
# blocks until that poll takes the previous report (a queue of one): with a report per logged step,
# tiny test runs spent ~2 s per step and ~2 s more noticing the end. Set before any Ray starts, so
# the session's Ray, the test heads and the CLI subprocesses all inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
# The suite is CPU-bound on 2 cores: no idle workers started ahead of need (each imports Ray, ~1 s
# of CPU, and most are never used by these small runs), no Ray Data progress bars redrawn.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("RAY_enable_worker_prestart", "0")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
# One torch (OpenMP) thread per process: the test process, its subprocesses (CLI runs, spawned ranks,
# the SGLang contract suites) and Ray's workers (Ray keeps an OMP_NUM_THREADS it finds; Ray Train
# workers still set train.cpus_per_worker threads). On 2 cores shared with Ray's processes, two
# threads per process wait on each other: test_hf_engine.py took 19-30 s with two, 18-20 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No Ray API call starts a Ray of its own (Ray reads this when it is imported): a thread that
# outlives its test (a stage's dataset iteration still waiting for its actors when the test's
# cluster is shut down) once called Ray after test_multinode.py's teardown, started a local Ray
# with a dashboard, raced the teardown's ray.shutdown, and 60 s later Ray's core worker ended the
# whole pytest process ("Failed to connect to GCS within 60 seconds"), exit 1 and no summary, twice
# under load. Such a call now raises in that thread. Every test starts or joins Ray explicitly.
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")


# ---------------------------------------------------------------- no silent skips

# Under CI (CI=true) a skipped test is a failure unless its reason is on this list: paths that only
# exist on a CUDA machine. A missing dependency must never turn into a skip; name it and fail.
SKIP_ALLOWED = (re.compile(r"^needs CUDA\b"),)
CUDA_ONLY = "needs CUDA"  # prefix for skip reasons of CUDA-only tests: f"{CUDA_ONLY}: what it runs"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _fail_disallowed_skip(report) -> None:
    if not (_in_ci() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    if any(p.search(reason) for p in SKIP_ALLOWED):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true, and its reason is not on the allow-list "
                       f"(tests/conftest.py SKIP_ALLOWED): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_disallowed_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_disallowed_skip(outcome.get_result())


# ---------------------------------------------------------------- make test-fast: no Ray

# Tests that use these fixtures start Ray; they are marked `ray` here. A test that starts Ray any
# other way (a CLI run, `ray start`) carries `pytest.mark.ray` itself. Under EAGLE3_TEST_FAST=1
# (make test-fast) every Ray started by a test lands in a temp dir of its own, checked per test,
# so an unmarked test that starts Ray fails instead of slowing the inner loop down.
RAY_FIXTURES = {"ray_local", "local_head", "submitted_pipeline_job", "ci_tiny_prepared", "ci_tiny_inputs",
                "ci_tiny_run", "ci_tiny_fp8_pair", "trained_4_steps", "trained_4_then_6"}
_FAST = os.environ.get("EAGLE3_TEST_FAST") == "1"
if _FAST:
    import tempfile

    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="e3fast")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(autouse=True)
def _no_ray_in_fast_mode(request):
    if not _FAST:
        yield
        return
    def sessions() -> set[str]:  # Ray writes <RAY_TMPDIR>/ray/session_<time>_<pid> per start
        return {str(p) for p in Path(os.environ["RAY_TMPDIR"]).glob("*/session_*")}

    before = sessions()
    yield
    started = sessions() - before
    assert not started, (f"{request.node.nodeid} started Ray ({sorted(started)} under RAY_TMPDIR): "
                         "mark it `pytest.mark.ray` so that `make test-fast` leaves it out")


def init_local_ray():
    """ray.init of the session's local Ray (also used by test_multinode.py to restore it)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return ray


@pytest.fixture(scope="session")
def start_local_ray():
    """``init_local_ray`` for a module that shuts the shared Ray down and must bring it back
    (test_multinode.py): a fixture, since ``from conftest import`` finds whichever conftest module
    was imported first (tests/sglang_contract has its own)."""
    return init_local_ray


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray instance shared by every test that needs one (a start costs tens of seconds)."""
    ray = init_local_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ci_tiny_prepared(ray_local, tmp_path_factory):
    """(directory, PrepareSummary) of ci-tiny's builtin data through the real prepare stage, built once
    (read only: a test that changes a stage's output works on a copy)."""
    from eagle3_ray.config import load_config
    from eagle3_ray.extract.prepare_stage import run_prepare

    out = tmp_path_factory.mktemp("train_inputs") / "prepare"
    return out, run_prepare(load_config("configs/ci-tiny.yaml"), None, out)


@pytest.fixture(scope="session")
def ci_tiny_inputs(ci_tiny_prepared):
    """ci-tiny prepared data, features and vocab maps, built once through the real stages (read only)."""
    from eagle3_ray.config import load_config
    from eagle3_ray.extract.pipeline import run_extract
    from eagle3_ray.extract.vocab_stage import run_vocab

    cfg = load_config("configs/ci-tiny.yaml")
    root = ci_tiny_prepared[0].parent
    # Two engine actors from the start (the elastic pool's upper bound in use): test_elastic.py checks
    # that they shared the work with no sample twice. The store is the same as one actor's.
    two = load_config("configs/ci-tiny.yaml", ["extract.num_actors=2", "extract.max_actors=2"])
    run_extract(two, root / "prepare", root / "features")
    run_vocab(cfg, root / "features", root / "vocab")
    # test_train.py's groups, one of them evaluation-only: that map leaves those samples out, as
    # training with them requires (the map above counts every sample)
    from test_train import GROUPS

    run_vocab(load_config("configs/ci-tiny.yaml", GROUPS), root / "features", root / "vocab_groups")
    return root


@pytest.fixture(scope="session")
def ci_tiny_fp8_pair(ci_tiny_inputs, tmp_path_factory):
    """(fp8 store, bf16 store): the session's ci-tiny features copied into an fp8 store, and that fp8
    store copied back into a bf16 store (exactly its dequantized values). Read only."""
    from eagle3_ray.features import open_store
    from test_compact_train import copy_store

    root = tmp_path_factory.mktemp("fp8_pair")
    copy_store(open_store(ci_tiny_inputs / "features"), root / "fp8", "fp8")
    copy_store(open_store(root / "fp8"), root / "bf16", "none")
    return root / "fp8", root / "bf16"


@pytest.fixture(scope="session")
def trained_4_steps(ci_tiny_inputs, ci_tiny_fp8_pair, tmp_path_factory):
    """One 4-step ci-tiny training on two gloo workers at the Kimi preset's ZeRO stage with a held-out
    share (test_train.py's TRAIN_4) on the bf16 store of ``ci_tiny_fp8_pair``: test_train.py's
    two-worker, ZeRO, checkpoint, resume, export and held-out tests inspect it, and
    test_compact_train.py trains the fp8 store alike and compares (a Ray Train run costs ~30-60 s
    here). Returns (out, final checkpoint name relative to out, the store trained on); tests work on
    copies of ``out``."""
    from eagle3_ray.config import load_config
    from eagle3_ray.train.trainer import run_training
    from test_train import CI_CONFIG, TRACKED, TRAIN_4

    features = ci_tiny_fp8_pair[1]
    out = tmp_path_factory.mktemp("trained_4_steps") / "train"
    ckpt = run_training(load_config(CI_CONFIG, [*TRAIN_4, *TRACKED]), features, ci_tiny_inputs / "vocab_groups", out)
    return out, ckpt.relative_to(out), features


@pytest.fixture(scope="session")
def trained_4_then_6(trained_4_steps, ci_tiny_inputs, tmp_path_factory):
    """A copy of ``trained_4_steps`` resumed to step 6 (the same command with train.max_steps=6), its
    trackers continuing their runs: test_train.py's resume, export and keep-best tests and
    test_trackers.py read it. Returns (out, final checkpoint)."""
    import shutil

    from eagle3_ray.config import load_config
    from eagle3_ray.train.trainer import run_training
    from test_train import CI_CONFIG, TRACKED, TRAIN_4

    out = shutil.copytree(trained_4_steps[0], tmp_path_factory.mktemp("trained_4_then_6") / "train")
    more = load_config(CI_CONFIG, [*TRAIN_4, *TRACKED, "train.max_steps=6"])
    return out, run_training(more, trained_4_steps[2], ci_tiny_inputs / "vocab_groups", out)


@pytest.fixture(scope="session")
def ci_tiny_run(tmp_path_factory):
    """ci-tiny's whole `eagle3-ray run`, its training worker killed once (Ray Train restarts it), then
    stopped hard mid-training and rerun to the end (one run for the session: test_fault_injection.py
    checks the restart and the resume, test_run_pipeline.py the outputs)."""
    from test_fault_injection import stopped_and_rerun

    return stopped_and_rerun(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct, converted from GGUF to safetensors once and cached."""
    from eagle3_ray.engines.targets import smollm2_dir as _smollm2_dir

    return _smollm2_dir()


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """(model, tokenizer) of the real SmolLM2, fp32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    return model, tok


@pytest.fixture(scope="session")
def tiny_llama_config():
    """A seeded random tiny Llama config (SmolLM2's family) for shape and speed tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


# ---------------------------------------------------------------- a local head of the tests' own

_HEAD_FIXTURE = "local_head"
_head: dict = {}


@pytest.fixture
def local_head():
    """A local head started by cluster/local-head.sh (free ports, its own token; test_jobs.py), shared
    by the job test and the metrics test: one start and one stop instead of one per test. It is
    stopped after the last test that uses it (pytest_runtest_teardown below), not left idle for the
    rest of the session."""
    from test_jobs import start_local_head

    if "env" not in _head:
        _head["env"] = start_local_head()
    return _head["env"]


@pytest.fixture
def submitted_pipeline_job(local_head, tmp_path_factory):
    """ci-tiny's pipeline (prepare .. train) submitted once with `ray job submit` to `local_head`;
    the head's metric series seen while it ran in "series_seen" (test_metrics.py)."""
    from test_jobs import submit_pipeline_job
    from test_metrics import SeriesWatch

    if "job" not in _head:
        with SeriesWatch(int(local_head["RAY_METRICS_PORT"])) as watch:
            _head["job"] = submit_pipeline_job(local_head, tmp_path_factory.mktemp("pipeline_job") / "run")
        _head["job"]["series_seen"] = watch.seen
    return _head["job"]


def pytest_runtest_teardown(item, nextitem):
    if "env" not in _head:
        return
    items = item.session.items
    later = items[items.index(item) + 1:] if item in items else []
    if not any(_HEAD_FIXTURE in getattr(i, "fixturenames", ()) for i in later):
        _stop_head()


def pytest_sessionfinish(session, exitstatus):
    """An interrupted session (Ctrl-C, -x) may end before that teardown: stop the head here then."""
    if "env" in _head:
        _stop_head()


def _stop_head() -> None:
    from test_jobs import stop_local_head

    env = _head["env"]
    _head.clear()
    stop_local_head(env)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Batch-1 decoding and tiny tensors are hundreds of small ops: on a shared 2-core machine one
    torch thread runs them far faster than two that wait on each other. Use with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
