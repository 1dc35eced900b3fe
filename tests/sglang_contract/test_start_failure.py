"""An SGLang engine that fails while starting: an EngineStartError naming the failed process's own
exception, and this process alive (issue 47: on an H200 the benchmark's scheduler failed with
``ModuleNotFoundError: deep_gemm`` in CUDA-graph capture, SGLang's launch SIGQUIT handler killed the
whole process tree, the Ray worker with it, and Ray retried the task, printing no error).

SGLang's engine needs CUDA, so ``FailingSGLangEngine`` (a FAKE ``sglang.Engine``, named as such)
stands in for it, built from SGLang's own code where that imports on CPU: it registers the SIGQUIT
handler the way ``_set_envs_and_config`` does (pinned against the source below), starts a
detokenizer and a scheduler process, and waits with SGLang's real ``_wait_for_scheduler_ready`` and
``_scheduler_died_error`` (compiled from the installed engine.py). The scheduler fails in an import of
``deep_gemm`` and runs the real ``except`` block of ``run_scheduler_process`` (compiled from the
installed scheduler.py, with the real ``get_exception_traceback``): it logs "Scheduler hit an
exception: <traceback>" to the stderr it shares with this process and SIGQUITs this process.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Dict, List

import pytest

from eagle3_ray.engines.sglang_args import server_args_fields
from eagle3_ray.engines.sglang import SGLangEngine
from eagle3_ray.engines import sglang_process as sp  # noqa: E402
from eagle3_ray.errors import EngineStartError

from conftest import source_root  # noqa: E402

SRT = source_root() / "srt"
REPO = Path(__file__).resolve().parents[2]


def _function(path: Path, name: str) -> ast.FunctionDef:
    found = [n for n in ast.parse(path.read_text(encoding="utf-8")).body
             if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{name} is gone from {path}"
    return found[0]


def _compile(node: ast.FunctionDef, namespace: dict):
    exec(compile(ast.Module([node], []), f"<sglang {node.name}>", "exec"), namespace)
    return namespace[node.name]


def _scheduler_except_block() -> str:
    """The source of ``run_scheduler_process``'s ``except Exception:`` around ``Scheduler(...)``."""
    fn = _function(SRT / "managers" / "scheduler.py", "run_scheduler_process")
    for node in ast.walk(fn):
        if isinstance(node, ast.Try) and any("Scheduler(" in ast.unparse(s) for s in node.body):
            (handler,) = [h for h in node.handlers if h.type is not None and ast.unparse(h.type) == "Exception"]
            return ast.unparse(ast.Module(handler.body, []))
    raise AssertionError("run_scheduler_process has no try/except Exception around Scheduler(...) any more")


# SGLang's start-up wait, from its own source: it raises once a scheduler died (pipe closed, or dead).
_WAIT_NS: dict = {"List": List, "Dict": Dict}
_compile(_function(SRT / "entrypoints" / "engine.py", "_scheduler_died_error"), _WAIT_NS)
wait_for_scheduler_ready = _compile(_function(SRT / "entrypoints" / "engine.py", "_wait_for_scheduler_ready"), _WAIT_NS)
TRACEBACK_SRC = ast.unparse(_function(SRT.parent / "utils.py", "get_exception_traceback"))
EXCEPT_SRC = _scheduler_except_block()

# The scheduler of the fake: a model start-up that needs deep_gemm, and SGLang's own except block.
# Logging as SGLang's configure_logger sets it up in a scheduler ("[time prefix] message" on stderr).
_SCHEDULER = textwrap.dedent(
    """
    import logging, os, signal, sys, traceback, types
    import psutil
    logging.basicConfig(level=logging.ERROR, format="[%(asctime)s TP0] %(message)s", force=True)
    tb_ns = {"sys": sys, "traceback": traceback}
    exec(sys.argv[1], tb_ns)
    flag = types.SimpleNamespace(get=lambda: False)
    ns = {"get_exception_traceback": tb_ns["get_exception_traceback"], "signal": signal, "os": os,
          "logger": logging.getLogger("sglang.srt.managers.scheduler"),
          "parent_process": psutil.Process().parent(),
          "envs": types.SimpleNamespace(SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION=flag)}

    def capture_cuda_graphs():
        import deep_gemm  # noqa: F401  (the H200's failure)

    try:
        capture_cuda_graphs()
    except Exception:
        exec(sys.argv[2], ns)
    """
)


class _PopenAsProcess:
    """What ``_wait_for_scheduler_ready`` reads of a multiprocessing.Process, for a Popen."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout=None):
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    @property
    def exitcode(self):
        return self.popen.poll()


class FailingSGLangEngine:
    """FAKE ``sglang.Engine`` whose scheduler fails while starting (see the module docstring)."""

    last: "FailingSGLangEngine | None" = None

    def __init__(self, **kwargs):
        FailingSGLangEngine.last = self
        self.kwargs = kwargs
        # As _set_envs_and_config: from the main thread, the given handler, else SGLang's own, which
        # kills the process tree (test_sglang_registers_a_given_sigquit_handler_instead_of_its_own).
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, kwargs.get(sp.SIGQUIT_KWARG) or _sglang_launch_handler)
        self.detokenizer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        read, write = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, str(REPO)])}
        self.scheduler = subprocess.Popen([sys.executable, "-c", _SCHEDULER, TRACEBACK_SRC, EXCEPT_SRC],
                                          pass_fds=(write,), env=env)
        os.close(write)  # the scheduler holds the pipe's only write end: it closes when the scheduler exits
        reader = Connection(read, writable=False)
        try:
            wait_for_scheduler_ready([reader], [_PopenAsProcess(self.scheduler)])
        finally:
            reader.close()
        raise AssertionError("the fake's scheduler was meant to fail")


def _sglang_launch_handler(signum, frame):
    raise AssertionError("SGLang's own launch handler would have killed this process tree here")


@contextlib.contextmanager
def stderr_to(path: Path):
    """fd 2 (inherited by the processes SGLang starts) written to ``path``, as in a Ray worker."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def test_a_scheduler_failing_at_start_is_an_engine_start_error_naming_its_exception(target, tmp_path):
    log = tmp_path / "worker.err"
    quits = len(sp._sigquits)
    t = time.monotonic()
    with stderr_to(log), pytest.raises(EngineStartError) as err:
        SGLangEngine(target, mode="capture", engine_factory=FailingSGLangEngine)
    seconds = time.monotonic() - t
    msg = str(err.value)
    fake = FailingSGLangEngine.last
    assert "Scheduler hit an exception: Traceback" in log.read_text()  # where SGLang's scheduler logged it
    assert fake.kwargs[sp.SIGQUIT_KWARG] is sp.keep_running_on_sigquit and len(sp._sigquits) > quits
    assert "\n" not in msg and msg.startswith(f"the SGLang engine (mode capture) of target.model={target.model!r} "
                                              "could not start: Scheduler failed with ModuleNotFoundError: No "
                                              "module named 'deep_gemm'"), msg
    assert "Rank 0 scheduler died during initialization" in msg and str(log) in msg, msg
    assert seconds < 30, seconds
    # What the failed start left running is gone, and so is the engine's capture directory.
    assert fake.scheduler.poll() is not None and fake.detokenizer.wait(timeout=10) is not None
    assert fake.detokenizer.pid not in sp.live_children()
    assert list(Path(target.sglang.capture_dir).iterdir()) == []


def test_without_a_log_file_the_message_says_where_the_traceback_went(target):
    """stderr a pipe (a terminal, a pipe to a supervisor): SGLang's own error, and where to look."""
    read, write = os.pipe()
    seen: list[bytes] = []
    drain = threading.Thread(target=lambda: seen.extend(iter(lambda: os.read(read, 65536), b"")), daemon=True)
    drain.start()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(write, 2)
    os.close(write)
    try:
        with pytest.raises(EngineStartError) as err:
            SGLangEngine(target, mode="generate", engine_factory=FailingSGLangEngine)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    drain.join(timeout=10)
    msg = str(err.value)
    assert "\n" not in msg and "could not start: RuntimeError: Rank 0 scheduler died during initialization" in msg
    assert msg.endswith("the failed process logged its traceback ('hit an exception') to this process's stderr"), msg
    assert b"ModuleNotFoundError: No module named 'deep_gemm'" in b"".join(seen)


def test_an_engine_constructor_that_raises_names_its_error(target, tmp_path):
    """A failure in this process (here ServerArgs refusing a value) is named as it is, no log hint."""
    def refusing(**kwargs):
        raise ValueError("mem_fraction_static=1.5 must be in (0, 1)")

    with stderr_to(tmp_path / "worker.err"), pytest.raises(EngineStartError) as err:
        SGLangEngine(target, mode="generate", engine_factory=refusing)
    assert str(err.value) == (f"the SGLang engine (mode generate) of target.model={target.model!r} could not start: "
                              "ValueError: mem_fraction_static=1.5 must be in (0, 1)")


def test_sglang_registers_a_given_sigquit_handler_instead_of_its_own():
    """What launch_sglang relies on: ServerArgs takes custom_sigquit_handler, and the launch registers it
    in place of the handler that kills the process tree; a failing scheduler logs its traceback as
    "Scheduler hit an exception" and SIGQUITs its parent (the block the fake's scheduler runs)."""
    assert sp.SIGQUIT_KWARG in server_args_fields()
    src = ast.unparse(_function(SRT / "entrypoints" / "engine.py", "_set_envs_and_config"))
    assert re.search(r"if (\w+)\.custom_sigquit_handler is None:.*kill_process_tree\(os\.getpid\(\)\).*"
                     r"else:.*signal\.signal\(signal\.SIGQUIT, \1\.custom_sigquit_handler\)", src, re.S), src
    assert "Scheduler hit an exception: {traceback}" in EXCEPT_SRC and "send_signal(signal.SIGQUIT)" in EXCEPT_SRC
