"""SGLang target engine: tensor-parallel hidden-state capture and generation. No Ray in here.

One ``sglang.Engine`` per node, created inside the (Ray) process that owns its ``tp_size`` GPUs;
SGLang spawns its TP scheduler processes itself. Capture needs no fork of SGLang: a forward hook
on ``logits_processor`` (``engines/sglang_hooks.py``) writes each request's features from TP rank 0
to node-local shared memory, and ``SGLangEngine.capture`` reads, checks and deletes them
(``engines/sglang_capture.py``). The engine's kwargs per mode: ``engines/sglang_args.py``; its
processes' supervision: ``engines/sglang_process.py``.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Sequence

import torch

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines import sglang_process as sp
from eagle3_ray.engines.base import Capture, check_generate_args
from eagle3_ray.engines.sglang_args import (
    CAPTURE_SAMPLING,
    INSTALL_HINT,
    Mode,
    check_server_args,
    engine_kwargs,
    generate_sampling,
    import_sglang,
)
from eagle3_ray.engines.sglang_capture import check_hard_links, read_capture
from eagle3_ray.engines.sglang_hooks import capture_path
from eagle3_ray.engines.sglang_process import (
    EngineDied,
    EngineLoop,
    kill_pids,
    launch_sglang,
)
from eagle3_ray.errors import ConfigError, EngineError

logger = logging.getLogger(__name__)

# The hook's writer thread lands a request's file shortly after SGLang answers it; this long
# without the file (and with the engine alive) means the hook did not run.
CAPTURE_WAIT_S = 120.0
MAX_RESTARTS = 3
START_ATTEMPTS, START_RETRY_S = 3, 5.0  # building the engine again after a death


class SGLangEngine:
    """``TargetEngine`` on ``sglang.Engine``; ``mode`` picks capture or generation settings.

    When a process of the engine dies (a scheduler killed or crashed), the call in flight notices
    (SGLang's own answer never comes: the liveness of the processes the engine started is polled),
    the engine is shut down and built again, and the batch is retried with fresh request ids, up
    to ``max_restarts`` times over the engine's life. SGLang's own subprocess watchdog is stopped:
    it would SIGQUIT this process, which kills the whole process tree (the Ray actor with it).
    """

    # Generate calls a caller may keep in flight (data/distill.py): SGLang's scheduler batches the
    # requests of every call it holds, so the next call's requests fill the forwards that one call's
    # longest answers would leave nearly empty.
    calls_in_flight = 4

    def __init__(self, target_cfg: TargetConfig, mode: Mode = "capture", node_rank: int = 0,
                 max_restarts: int = MAX_RESTARTS, engine_factory: Callable[..., Any] | None = None,
                 max_batch: int | None = None, audit_share: float = 0.0):
        """``engine_factory`` builds the engine from the kwargs (default ``sglang.Engine``; tests
        pass a fake, since the real engine needs CUDA). ``max_batch`` (mode generate): the most
        requests one ``generate`` call sends, the decode batch CUDA graphs are captured up to.
        ``audit_share`` (mode capture): the share of rows the hook computes audit figures of."""
        from eagle3_ray.engines.describe import describe_target

        sglang = import_sglang()
        described = describe_target(target_cfg)
        self.info = replace(described, extra={"backend": "sglang", "mode": mode, "tp_size": target_cfg.tp_size})
        self.mode = mode
        self.restarts = 0
        self.max_restarts = max_restarts
        self._target, self._node_rank, self._max_batch = target_cfg, node_rank, max_batch
        self.audit_share = audit_share if mode == "capture" else 0.0
        self._factory = engine_factory or sglang.Engine
        self._root = Path(target_cfg.sglang.capture_dir) if mode == "capture" else None
        self._dir: Path | None = None
        self._engine: Any = None
        self._procs: set[int] = set()
        self._generation = 0
        # sglang.Engine answers through its asyncio loop (``engine.loop``). A thread of ours runs that
        # loop for the engine's life, and every call is a coroutine (``Engine.async_generate``) handed
        # to it, so calls from several threads (CaptureWriteUDF's concurrent batches, the generate
        # stage's) wait in SGLang's queue together: the scheduler batches across them and has the next
        # requests when a forward ends. (``Engine.generate`` blocks on that loop with
        # ``run_until_complete``: one call at a time, and SGLang idles from one call's answer to the
        # next call's requests.) ``target.sglang.max_concurrent_calls`` bounds the calls in flight.
        self._runner: EngineLoop | None = None
        limit = target_cfg.sglang.max_concurrent_calls
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        # Where capture calls spend their time, summed since the engine was built (seconds): waiting
        # for a call slot (max_concurrent_calls), inside SGLang (submitted until answered), collecting
        # the hook's files; and `engine_idle`, the time no capture call of ours was inside SGLang.
        # `max_in_flight`: the most capture calls inside SGLang at once. Read by the capture timings
        # (`git show 8c13bf9:benchmarks/device/sglang_capture.py`) and tests/sglang_contract/test_restart.py.
        self.capture_seconds = {"calls": 0, "slot_wait": 0.0, "generate": 0.0, "collect": 0.0, "engine_idle": 0.0,
                                "max_in_flight": 0}
        self._in_flight = 0
        self._idle_since: float | None = None
        self._stats_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._start()

    def _kwargs(self) -> dict[str, Any]:
        return engine_kwargs(self._target, self.mode, info=self.info, capture_dir=self._dir, node_rank=self._node_rank,
                             max_batch=self._max_batch, audit_share=self.audit_share)

    def _start(self) -> None:
        if self._root is not None:  # a fresh directory per engine: a dead engine's files stay behind
            self._root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="eagle3_ray_capture_", dir=self._root))
            try:
                check_hard_links(self._dir)
            except ConfigError:
                shutil.rmtree(self._dir, ignore_errors=True)
                raise
        try:
            kwargs = self._kwargs()
            check_server_args(kwargs)
            # A failed start raises EngineStartError naming its cause, and leaves this process alive.
            self._engine, self._procs = launch_sglang(kwargs, self._factory, self._what)
        except BaseException:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
            raise
        watchdog = getattr(getattr(self._engine, "tokenizer_manager", None), "_subprocess_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
        loop = getattr(self._engine, "loop", None)
        if not isinstance(loop, asyncio.AbstractEventLoop) or not hasattr(self._engine, "async_generate"):
            self._stop_engine()
            raise EngineError(f"this sglang.Engine has no asyncio loop (engine.loop) or no async_generate: {INSTALL_HINT}")
        self._runner = EngineLoop(self._engine, self._procs, self._what)
        logger.info("SGLang engine up (mode %s, processes %s)", self.mode, sorted(self._procs))

    @property
    def _what(self) -> str:
        return f"the SGLang engine (mode {self.mode}) of target.model={self._target.model!r}"

    def _dead(self) -> list[int]:
        return self._runner.dead() if self._runner is not None else []

    def _current(self, generation: int) -> tuple[Any, EngineLoop, Path | None]:
        """The engine, its loop runner and its capture directory, if ``generation`` is still the live engine."""
        with self._restart_lock:  # not halfway through a restart
            if generation != self._generation or self._engine is None or self._runner is None:
                raise EngineDied("the engine was restarted")
            return self._engine, self._runner, self._dir

    def _call(self, generation: int, fn: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        """Await ``fn(sglang_engine)`` on the engine's loop, watching the engine's processes meanwhile
        (``EngineLoop.call``: a dead process, or the engine stopped by a restart, is ``EngineDied``)."""
        engine, runner, _ = self._current(generation)
        return runner.call(fn(engine))

    def _slot(self) -> float:
        """Wait for a call slot (``max_concurrent_calls``); returns the seconds waited."""
        if self._slots is None:
            return 0.0
        t = time.perf_counter()
        self._slots.acquire()
        return time.perf_counter() - t

    def _free_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def _restart(self, generation: int, why: EngineDied) -> None:
        with self._restart_lock:
            if generation != self._generation:
                return  # another thread already rebuilt the engine
            if self.restarts >= self.max_restarts:
                raise EngineError(
                    f"the SGLang engine died {self.restarts + 1} times ({why}); giving up after "
                    f"max_restarts={self.max_restarts}: read SGLang's log for the cause"
                ) from why
            self.restarts += 1
            logger.warning("SGLang engine died (%s); restarting it (%d/%d) and retrying the batch",
                           why, self.restarts, self.max_restarts)
            self._stop_engine()
            self._generation += 1
            for attempt in range(START_ATTEMPTS):
                try:
                    self._start()
                    return
                except Exception as e:  # e.g. the dead processes' GPU memory not yet released
                    if attempt == START_ATTEMPTS - 1:
                        raise EngineError(f"the SGLang engine died ({why}) and could not be started again: {e}") from e
                    logger.warning("starting the SGLang engine again failed (%s); retrying in %.0f s", e, START_RETRY_S)
                    self._stop_engine()
                    time.sleep(START_RETRY_S)

    def _retrying(self, attempt: Callable[[int], Any]) -> Any:
        while True:
            generation = self._generation
            try:
                return attempt(generation)
            except EngineDied as why:
                self._restart(generation, why)

    def capture(self, batch: Sequence[Sequence[int]]) -> list[Capture]:
        if self.mode != "capture":
            raise EngineError(f"capture() needs an engine built with mode='capture', this one is {self.mode!r}")
        seqs = [[int(t) for t in s] for s in batch]
        if not seqs:
            return []
        if any(not s for s in seqs):
            raise EngineError("capture: every sequence needs at least one token")
        self._check_lengths(seqs)

        def attempt(generation: int) -> list[Capture]:
            rids = [f"e3r-{uuid.uuid4().hex}" for _ in seqs]  # fresh ids on a retry
            params = [dict(CAPTURE_SAMPLING) for _ in seqs]
            waited = self._slot()
            try:
                _, _, directory = self._current(generation)
                began = self._entered()
                try:
                    outs = self._call(generation, lambda e: e.async_generate(input_ids=seqs, sampling_params=params, rid=rids))
                finally:
                    ended = self._left()
            finally:
                self._free_slot()
            caps = [self._collect(directory, out["meta_info"]["id"], len(s), generation) for out, s in zip(outs, seqs)]
            with self._stats_lock:
                acc = self.capture_seconds
                acc["calls"] += 1
                acc["slot_wait"] += waited
                acc["generate"] += ended - began
                acc["collect"] += time.perf_counter() - ended
            return caps

        return self._retrying(attempt)

    def _check_lengths(self, seqs: Sequence[Sequence[int]]) -> None:
        """SGLang refuses (does not cut) an input of ``max_req_input_len`` tokens or more (min(context
        length, KV pool) less a few, set by its scheduler) and the refusal fails the whole call: name
        the samples and the settings to change instead."""
        tm = getattr(self._engine, "tokenizer_manager", None)
        limit = getattr(tm, "max_req_input_len", None)
        if not isinstance(limit, int) or limit <= 0:
            return
        over = [i for i, s in enumerate(seqs) if len(s) >= limit]
        if over:
            longest = max(len(seqs[i]) for i in over)
            raise ConfigError(
                f"capture: {len(over)} sample(s) of this batch have up to {longest:,} tokens; SGLang accepts fewer "
                f"than {limit:,} for target.model={self._target.model!r} (its context length "
                f"{getattr(tm, 'context_len', '?')} and its KV pool bound it): set data.max_length <= {limit - 1}, or "
                "raise target.sglang.extra_engine_kwargs.context_length (past the model's max_position_embeddings "
                "with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1) or mem_fraction_static"
            )

    def _entered(self) -> float:
        """A capture call goes into SGLang: the engine's idle time ends if none was in."""
        now = time.perf_counter()
        with self._stats_lock:
            if self._in_flight == 0 and self._idle_since is not None:
                self.capture_seconds["engine_idle"] += now - self._idle_since
            self._in_flight += 1
            self.capture_seconds["max_in_flight"] = max(self.capture_seconds["max_in_flight"], self._in_flight)
        return now

    def _left(self) -> float:
        now = time.perf_counter()
        with self._stats_lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle_since = now
        return now

    def _collect(self, directory: Path | None, rid: str, num_tokens: int, generation: int = 0) -> Capture:
        assert directory is not None
        path = capture_path(directory, rid)
        waited, step, next_check = 0.0, 0.0005, sp.LIVENESS_POLL_S
        while not path.is_file():  # the hook's writer thread lands it shortly after SGLang answers
            if waited >= next_check:
                next_check += sp.LIVENESS_POLL_S
                if generation != self._generation:
                    raise EngineDied("the engine was restarted")
                dead = self._dead()
                if dead:
                    raise EngineDied(f"SGLang processes {dead} exited before writing {path.name}")
            if waited >= CAPTURE_WAIT_S:
                raise EngineError(
                    f"SGLang answered request {rid} but the capture hook wrote no {path} within "
                    f"{CAPTURE_WAIT_S:.0f} s: the hook did not run (look for 'Registered forward hook' and "
                    "'capture writer failed' in SGLang's log; CUDA graphs must stay disabled)"
                )
            time.sleep(step)
            waited += step
            step = min(step * 2, 0.01)
        return read_capture(path, num_tokens, self.info.hidden_size)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        check_generate_args(max_new_tokens, temperature, top_p)
        if not prompts:
            return []
        params = [generate_sampling(max_new_tokens, temperature, top_p, seed + i) for i in range(len(prompts))]
        ids = [[int(t) for t in p] for p in prompts]

        def attempt(generation: int) -> list[list[int]]:
            self._slot()
            try:
                outs = self._call(generation, lambda e: e.async_generate(input_ids=ids, sampling_params=params))
            finally:
                self._free_slot()
            return [list(out["output_ids"]) for out in outs]

        return self._retrying(attempt)

    def _stop_engine(self) -> None:
        runner, engine, self._runner, self._engine = self._runner, self._engine, None, None
        if runner is not None:
            runner.close()  # its loop stopped, SGLang's own shutdown, then whatever is left killed
        elif engine is not None:  # started but refused (no loop)
            try:
                engine.shutdown()
            except Exception:
                logger.exception("shutting down the SGLang engine failed; killing its processes")
        kill_pids(self._procs)
        self._procs = set()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        if getattr(self, "_engine", None) is not None or getattr(self, "_procs", None):
            self._stop_engine()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
