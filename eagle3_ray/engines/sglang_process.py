"""The processes of an SGLang engine: starting them so that a failure is an error and not a crash,
watching them while a call waits, and ending them. No Ray in here.

``sglang.Engine`` starts a scheduler per TP rank and a detokenizer as child processes of the calling
process. Their liveness is polled (``live_children``) while a call waits on the engine's asyncio loop
(``EngineLoop.call``, ``SGLangEngine``): a process that died never answers, so the wait would
otherwise last forever. Used by ``engines/sglang.py`` (``SGLangEngine``) and ``bench/sglang_bench.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import threading
import time
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Coroutine

from eagle3_ray.errors import EngineError, EngineStartError, exception_line

logger = logging.getLogger(__name__)

# How often a call waiting on SGLang checks that the engine's processes are alive.
LIVENESS_POLL_S = 1.0
class EngineDied(Exception):
    """An SGLang process of this engine exited (killed, crashed) while a call was in flight."""


def live_children() -> set[int]:
    """Pids of this process's live child processes (zombies count as dead)."""
    import psutil

    alive = set()
    for child in psutil.Process().children(recursive=False):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


# Failing to start, SGLang's processes take this process with them unless told otherwise. A scheduler
# (or detokenizer) that raises logs "<Scheduler> hit an exception: <traceback>" to its stderr, which it
# shares with this process, and SIGQUITs its parent; the handler sglang.Engine installs for its launch
# then kills the whole process tree, this process included. Under Ray that is a worker crash, which Ray
# retries, failing the same way each time, with no error for the caller (a deep_gemm import failing in
# CUDA-graph capture did that to the benchmark on an H200). Given ServerArgs.custom_sigquit_handler,
# SGLang registers that instead (0.5.17 and 0.5.23, from the main thread): ours only notes the signal,
# SGLang's own start-up wait notices the dead scheduler and raises, and launch_sglang reads the failed
# process's exception back from the shared stderr (a Ray worker's log file). It stays installed after
# the start, so a scheduler failing later is a dead process that SGLangEngine restarts, not a kill.
SIGQUIT_KWARG = "custom_sigquit_handler"
_sigquits: list[float] = []  # when a child's SIGQUIT came (keep_running_on_sigquit)
# What SGLang's processes log when they fail (scheduler.py, detokenizer_manager.py, ...).
_HIT = re.compile(r"(\w+) hit an exception: ")
_STDERR_TAIL_BYTES = 4 << 20  # the end of stderr read back for that line after a failed start


def keep_running_on_sigquit(signum: int, frame: Any) -> None:
    """SIGQUIT handler given to SGLang (``custom_sigquit_handler``): a process of the engine failed.
    Noted only; the process keeps running (see launch_sglang). Pickled by reference into SGLang's
    processes (a module-level function)."""
    _sigquits.append(time.monotonic())


class StderrTail:
    """What this process's stderr (fd 2, shared with the processes SGLang starts) receives from now
    on, where it is a regular file (a Ray worker's log file, pytest's capture); nothing elsewhere."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.start, self.path = 0, ""
        try:
            st = os.fstat(2)
            if stat.S_ISREG(st.st_mode):
                self.path = os.readlink("/proc/self/fd/2").removesuffix(" (deleted)")
                self.fd = os.open("/proc/self/fd/2", os.O_RDONLY)  # its own offset, the same file
                self.start = st.st_size
        except OSError:  # no /proc (not Linux), or stderr closed
            self.close()

    def read(self) -> str:
        if self.fd is None:
            return ""
        try:
            end = os.fstat(self.fd).st_size
            start = max(self.start, end - _STDERR_TAIL_BYTES)
            return os.pread(self.fd, max(0, end - start), start).decode("utf-8", "replace")
        except OSError:
            return ""

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def logged_failure(text: str) -> str | None:
    """``"<Process> failed with <Type>: <message>"`` from the first "<Process> hit an exception:
    <traceback>" that SGLang logged in ``text``, the traceback's final exception; None without one."""
    hit = _HIT.search(text)
    if hit is None:
        return None
    cause, in_frames = None, False
    for line in text[hit.end():].splitlines()[:5000]:
        if line.startswith("Traceback (most recent call last)"):
            in_frames = True
        elif not line.strip() or line.startswith((" ", "\t", "During handling of the above exception",
                                                  "The above exception was the direct cause")):
            continue  # a frame, a blank line, or the link to a chained exception's traceback
        elif in_frames:  # the first line after the frames: the exception
            cause, in_frames = line.strip(), False
        else:
            break  # past the traceback (the next log line, or a message's continuation)
    return f"{hit.group(1)} failed with {cause}" if cause else None


def kill_tree(pids: set[int]) -> None:
    import psutil

    every = set(pids)
    for pid in pids:
        try:
            every.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    kill_pids(every)


def launch_sglang(kwargs: dict[str, Any], factory: Callable[..., Any],
                  what: str = "the SGLang engine") -> tuple[Any, set[int]]:
    """``factory(**kwargs)`` (``sglang.Engine``, or a test's fake) and the pids of the processes it started.

    A failure to start is an ``EngineStartError`` raised here, its one-line message naming ``what`` and
    the cause: the exception the failed SGLang process logged where this process's stderr is a file
    (a Ray worker's log), else SGLang's own error and where the traceback went. SGLang is given
    ``custom_sigquit_handler`` (unless ``kwargs`` sets one) so that the failure does not kill this
    process (see keep_running_on_sigquit); the processes the failed start left are killed.
    """
    import signal

    kwargs = {SIGQUIT_KWARG: keep_running_on_sigquit, **kwargs}
    if threading.current_thread() is not threading.main_thread() and \
            signal.getsignal(signal.SIGQUIT) in (signal.SIG_DFL, None):
        logger.warning("%s is started outside the main thread, where SGLang cannot register its SIGQUIT "
                       "handler: an SGLang process that fails will end this process", what)
    before, quits, tail = live_children(), len(_sigquits), StderrTail()
    try:
        try:
            engine = factory(**kwargs)
        except Exception as e:
            kill_tree(live_children() - before)
            raise EngineStartError(_start_failure(what, e, tail, len(_sigquits) > quits)) from e
        procs = live_children() - before
        if len(_sigquits) > quits:  # a process failed while starting, yet the engine returned
            try:
                engine.shutdown()
            except Exception:
                logger.exception("shutting down the half-started SGLang engine failed; killing its processes")
            kill_tree(procs | (live_children() - before))
            raise EngineStartError(_start_failure(what, None, tail, True))
        return engine, procs
    finally:
        tail.close()


def _start_failure(what: str, e: BaseException | None, tail: StderrTail, child_failed: bool) -> str:
    """The one-line message of a failed start (launch_sglang)."""
    cause = logged_failure(tail.read())
    sglang = "" if e is None else exception_line(e, 300)
    if cause is not None:
        said = f" (SGLang: {sglang.split('. ')[0]})" if sglang else ""
        where = f"; its traceback is in {tail.path}" if tail.path else ""
        return f"{what} could not start: {cause}{said}{where}"
    if not child_failed and "died during initialization" not in sglang and "Initialization failed" not in sglang:
        return f"{what} could not start: {sglang}"  # raised by this process, not by one SGLang started
    where = (f"read the failed process's traceback ('hit an exception') in {tail.path}" if tail.path else
             "the failed process logged its traceback ('hit an exception') to this process's stderr")
    return f"{what} could not start: {sglang or 'an SGLang process failed while starting'}; {where}"


def run_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The engine's loop thread: SGLang's tokenizer manager and every call's coroutine run here."""
    asyncio.set_event_loop(loop)
    loop.run_forever()


def cancel_tasks(loop: asyncio.AbstractEventLoop, timeout: float = 10.0) -> None:
    """Cancel what is left on a stopped engine loop (calls a dead scheduler never answered, the
    tokenizer manager's own loops): SGLang 0.5.23 hands the same loop to the next engine built in
    this thread. The loop stays open for that reason."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        try:
            loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
        except Exception:
            logger.exception("cancelling the stopped SGLang engine's tasks failed")


def kill_pids(pids: set[int], timeout: float = 60.0) -> None:
    """SIGKILL what is left of ``pids`` and wait for them, so their GPU memory is free again."""
    import psutil

    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


class EngineLoop:
    """A started engine's asyncio loop (``engine.loop``) run by a thread of its own; ``call`` hands it a
    coroutine and waits, watching the engine's processes (``procs``) and its progress meanwhile.

    ``progress()`` (a counter the coroutine advances, e.g. requests answered) that stands still for
    ``stall_s`` seconds ends the call with an ``EngineError`` (an engine that hangs fails loudly rather
    than holding the stage until its time limit); ``report`` is called every ``report_s`` seconds."""

    def __init__(self, engine: Any, procs: set[int], what: str):
        self.engine, self.procs, self.what = engine, set(procs), what
        self.loop = engine.loop
        self.closed = False
        self.thread = threading.Thread(target=run_loop, args=(self.loop,), name="eagle3-ray-sglang-loop", daemon=True)
        self.thread.start()

    def dead(self) -> list[int]:
        """The engine's processes that exited (all of them once it is closed)."""
        return sorted(self.procs) if self.closed else sorted(self.procs - live_children())

    def call(self, coro: Coroutine[Any, Any, Any], progress: Callable[[], int] | None = None,
             stall_s: float | None = None, report: Callable[[], None] | None = None, report_s: float = 30.0) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        seen, moved = (progress() if progress else 0), time.monotonic()
        reported = time.monotonic()
        tail = StderrTail()
        try:
            while True:
                try:
                    return future.result(timeout=LIVENESS_POLL_S)
                except FutureTimeout:
                    pass
                except FutureCancelled as e:  # close() cancels what is left on the loop
                    raise EngineDied(f"{self.what} was stopped during the call") from e
                except Exception as e:  # raised by the call: a dying engine's, or the call's own
                    if self.dead():
                        raise EngineDied(f"{self.what}: SGLang processes {self.dead()} exited during the call ({e})") from e
                    raise
                now = time.monotonic()
                if self.closed:  # stopped by another thread (an engine restarted): never answered
                    future.cancel()
                    raise EngineDied(f"{self.what} was stopped during the call")
                dead = self.dead()
                if dead:
                    # SGLang's tokenizer manager waits forever for an answer a dead scheduler never sends
                    future.cancel()
                    cause = logged_failure(tail.read())
                    raise EngineDied(f"{self.what}: SGLang processes {dead} exited during the call"
                                     + (f" ({cause})" if cause else ""))
                if progress is not None:
                    count = progress()
                    if count != seen:
                        seen, moved = count, now
                    elif stall_s is not None and now - moved > stall_s:
                        future.cancel()
                        raise EngineError(
                            f"{self.what} answered nothing for {stall_s:.0f} s (its processes are alive): the engine "
                            "hangs; SGLang's own log (target.sglang.extra_engine_kwargs.log_level=info) shows its "
                            "last batches"
                        )
                if report is not None and now - reported >= report_s:
                    reported = now
                    report()
        finally:
            tail.close()

    def close(self) -> None:
        """Stop the loop, shut the engine down, kill what is left of its processes."""
        self.closed = True
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            if not self.thread.is_alive():
                cancel_tasks(self.loop)
        try:
            self.engine.shutdown()
        except Exception:
            logger.exception("shutting down %s failed; killing its processes", self.what)
        kill_pids(self.procs)
