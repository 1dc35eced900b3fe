"""The engine dies, nothing is lost: a scheduler SIGKILLed mid-capture, against the real hook path.

SGLang's engine needs CUDA, so ``FakeSGLangEngine`` (a FAKE, named as such) stands in for
``sglang.Engine``: like the real one it starts a separate scheduler process, registers the capture
hooks it is given through SGLang's real ``register_forward_hooks`` there, runs a forward per batch
that calls them the way SGLang's models do, and answers through an asyncio loop that waits forever
when the scheduler is gone (the real tokenizer manager never hears from a dead scheduler). It
watches its scheduler with SGLang's real ``SubprocessWatchdog``, which SIGQUITs this process on a
crash unless the engine stops it. What is real: SGLangEngine, its kwargs, the hooks and their
writer thread, SGLang's hook registration and watchdog, the files, a real SIGKILL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from eagle3_ray.engines import sglang as sg
from eagle3_ray.engines import sglang_process as sp  # noqa: E402
from eagle3_ray.errors import EngineError

REPO = Path(__file__).resolve().parents[2]
H = 64

# The scheduler of the fake: hooks registered by SGLang's own register_forward_hooks on a module
# tree with SGLang's names; one JSON batch per stdin line, one answer per stdout line.
# hook_manager.py is loaded from the installed version's file by path: ``sglang/__init__`` (imported
# by ``from sglang.srt...``) pulls in transformers and torch._dynamo, 3.5 of the 4.7 s a scheduler
# took to start here, while the module itself needs only the standard library and torch
# (test_the_hook_manager_needs_only_torch pins that).
_SCHEDULER = textwrap.dedent(
    """
    import importlib.util, json, os, sys, time, torch
    _root = importlib.util.find_spec("sglang").submodule_search_locations[0]
    _spec = importlib.util.spec_from_file_location(
        "sglang_hook_manager", os.path.join(_root, "srt", "model_executor", "hook_manager.py"))
    _hm = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_hm)
    register_forward_hooks = _hm.register_forward_hooks
    from eagle3_ray.engines.sglang_hooks import flush
    H, kw = int(sys.argv[1]), json.loads(sys.argv[2])
    delay = float(sys.argv[3])

    class Mode:
        def is_extend(self): return True
        def is_target_verify(self): return False

    class Batch:  # the ForwardBatch fields the hook reads (pinned against the source in test_contract)
        def __init__(self, rids, lens):
            self.forward_mode, self.rids = Mode(), rids
            self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu = lens, [0] * len(lens)
            self.extend_seq_lens = torch.tensor(lens)

    def state(ids, k):  # the residual stream after k layers, a function of the token ids
        return ids[:, None].float() * (k + 1) + torch.arange(H).float()[None] / H

    class Layer(torch.nn.Module):
        def __init__(self, k): super().__init__(); self.k = k
        def forward(self, positions, hidden_states, forward_batch, residual):
            return state(positions, self.k + 1) - 1.0, torch.ones_like(hidden_states)

    class LogitsProcessor(torch.nn.Module):
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return hidden_states.sum(-1)

    class Model(torch.nn.Module):
        def __init__(self, layers, aux_ids):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.layers = torch.nn.ModuleList(Layer(k) for k in range(layers))
            self.logits_processor, self.aux_ids = LogitsProcessor(), aux_ids
        def forward(self, ids, batch):
            h = torch.zeros(ids.shape[0], H)
            for layer in self.model.layers:
                h, _ = layer(ids, h, batch, None)
            aux = None
            if self.aux_ids is not None:  # enable_return_aux_hidden_states: SGLang captures layer inputs
                aux = [state(ids, c) for c in self.aux_ids]
            return self.logits_processor(ids, state(ids, 99), None, batch, aux)

    layers = int(sys.argv[4])
    aux_ids = kw.get("return_aux_hidden_state_layer_ids")
    if aux_ids is not None:
        aux_ids = [c + 1 for c in aux_ids]  # the llama rule: id c captures HF hidden_states[c + 1]
    model = Model(layers, aux_ids)
    register_forward_hooks(model, kw["forward_hooks"])
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        time.sleep(delay)
        ids = torch.tensor([t for s in req["input_ids"] for t in s])
        model(ids, Batch(req["rid"], [len(s) for s in req["input_ids"]]))
        print(json.dumps(req["rid"]), flush=True)
    """
)


class _PopenAsProcess:
    """What SubprocessWatchdog reads of a multiprocessing.Process, for a Popen."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self):
        return self.popen.poll()


class FakeSGLangEngine:
    """FAKE ``sglang.Engine`` (the real one needs CUDA); see the module docstring."""

    started: list["FakeSGLangEngine"] = []

    def __init__(self, delay: float = 0.2, layers: int = 6, **kwargs):
        from sglang.srt.utils.watchdog import SubprocessWatchdog

        # As sglang.Engine's launch: the engine's SIGQUIT handler, registered from the main thread
        # (its start-up failures: test_start_failure.py). Not a kwarg the scheduler needs.
        handler = kwargs.pop(sp.SIGQUIT_KWARG, None)
        if handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, handler)

        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, str(REPO)])}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SCHEDULER, str(H), json.dumps(kwargs), str(delay), str(layers)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert self.proc.stdout.readline().strip() == "ready"
        self.loop = asyncio.new_event_loop()
        self._waiting: dict[str, asyncio.Future] = {}
        threading.Thread(target=self._read_answers, daemon=True).start()
        self.tokenizer_manager = type("TokenizerManager", (), {})()
        self.tokenizer_manager._subprocess_watchdog = SubprocessWatchdog(
            processes=[_PopenAsProcess(self.proc)], process_names=["scheduler_0"], interval=0.1)
        self.tokenizer_manager._subprocess_watchdog.start()
        self.shut = False
        FakeSGLangEngine.started.append(self)

    def _read_answers(self):
        for line in self.proc.stdout:  # a dead scheduler just stops answering
            rids = tuple(json.loads(line))
            fut = self._waiting.pop(rids)
            self.loop.call_soon_threadsafe(fut.set_result, rids)

    def generate(self, input_ids, sampling_params, rid):  # like Engine.generate: blocks on its loop
        return self.loop.run_until_complete(self.async_generate(input_ids, sampling_params, rid))

    async def async_generate(self, input_ids, sampling_params, rid):
        """Like Engine.async_generate: a coroutine of the engine's loop (the scheduler answers in
        order; calls in flight together queue in its stdin)."""
        assert asyncio.get_running_loop() is self.loop
        fut = self.loop.create_future()
        self._waiting[tuple(rid)] = fut
        self.proc.stdin.write(json.dumps({"input_ids": input_ids, "rid": rid}) + "\n")
        self.proc.stdin.flush()
        await fut
        return [{"meta_info": {"id": r}, "output_ids": [0]} for r in rid]

    def shutdown(self):  # as Engine.shutdown: the watchdog first, then the process tree
        self.tokenizer_manager._subprocess_watchdog.stop()
        self.shut = True
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _expected(seq: list[int], aux: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(seq)

    def state(k):
        return ids[:, None].float() * (k + 1) + torch.arange(H).float()[None] / H

    return torch.cat([state(k) for k in aux], -1), state(99)


def test_the_hook_manager_needs_only_torch():
    """The fake scheduler loads hook_manager.py by its path, without ``sglang/__init__``: that is the
    same code only while the module imports nothing of SGLang's (else this fails, naming it)."""
    import ast
    import importlib.util

    path = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "model_executor" / "hook_manager.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    assert names - set(sys.stdlib_module_names) <= {"torch"}, f"{path} imports {sorted(names)}"


def test_scheduler_sigkill_mid_capture_restarts_and_loses_nothing(target, monkeypatch):
    monkeypatch.setattr(sp, "LIVENESS_POLL_S", 0.1)
    FakeSGLangEngine.started.clear()
    engine = sg.SGLangEngine(target, mode="capture", engine_factory=FakeSGLangEngine)
    first = FakeSGLangEngine.started[0]
    assert engine._procs == {first.proc.pid}  # the engine knows the process it has to watch
    assert first.tokenizer_manager._subprocess_watchdog._thread is None  # stopped: it would SIGQUIT us
    first_dir = engine._dir
    batches = [[[b * 10 + i + 3] * (5 + i) for i in range(3)] for b in range(6)]

    got: list[list] = []

    def extract():
        for batch in batches:
            got.append(engine.capture(batch))

    worker = threading.Thread(target=extract)
    worker.start()
    while len(got) < 2:
        time.sleep(0.01)
    time.sleep(0.05)  # batch 3 is inside the scheduler now
    os.kill(first.proc.pid, signal.SIGKILL)
    worker.join(timeout=120)
    assert not worker.is_alive()

    assert engine.restarts == 1 and len(FakeSGLangEngine.started) == 2 and first.shut
    assert not first_dir.exists() and engine._dir != first_dir  # the dead engine's files went with it
    assert len(got) == len(batches)  # every batch once, in order, each sample with its own states
    for batch, caps in zip(batches, got):
        assert len(caps) == len(batch)
        for seq, cap in zip(batch, caps):
            aux, last = _expected(seq, [2, 3, 4])
            assert torch.equal(cap.aux_hidden, aux) and torch.equal(cap.last_hidden, last)
    assert engine.capture_seconds["calls"] == len(batches)  # the call that died is retried, counted once
    engine.close()
    assert FakeSGLangEngine.started[1].shut and not list(Path(target.sglang.capture_dir).iterdir())


def test_capture_calls_account_for_their_time(target):
    """capture_seconds: the scheduler's 0.2 s per batch shows inside generate; one caller never waits
    for a slot, and the engine idles between its calls while it collects."""
    engine = sg.SGLangEngine(target, mode="capture", engine_factory=lambda **kw: FakeSGLangEngine(delay=0.2, **kw))
    try:
        for b in range(3):
            engine.capture([[b + 3] * 5, [b + 4] * 7])
        acc = engine.capture_seconds
        assert acc["calls"] == 3 and acc["max_in_flight"] == 1
        assert acc["generate"] >= 0.6 and acc["slot_wait"] == 0.0
        assert acc["collect"] > 0 and acc["engine_idle"] > 0  # two gaps, each at least one collect
    finally:
        engine.close()


@pytest.mark.parametrize("limit", [0, 1])
def test_capture_calls_from_threads_overlap_inside_sglang(target, limit):
    """Callers in threads (CaptureWriteUDF's concurrent batches) have their calls in SGLang together,
    so the scheduler always has the next batch: the engine is never idle while one is queued, and
    each call still gets its own samples' states. max_concurrent_calls=1 has them wait their turn."""
    from concurrent.futures import ThreadPoolExecutor

    target = target.model_copy(update={"sglang": target.sglang.model_copy(update={"max_concurrent_calls": limit})})
    engine = sg.SGLangEngine(target, mode="capture", engine_factory=lambda **kw: FakeSGLangEngine(delay=0.2, **kw))
    batches = [[[b + 3] * (4 + b), [b + 40] * 3] for b in range(6)]
    try:
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(engine.capture, batches))
        for batch, caps in zip(batches, got):
            for seq, cap in zip(batch, caps):
                aux, last = _expected(seq, [2, 3, 4])
                assert torch.equal(cap.aux_hidden, aux) and torch.equal(cap.last_hidden, last)
        acc = engine.capture_seconds
        assert acc["calls"] == 6
        if limit == 0:
            assert acc["max_in_flight"] == 3 and acc["slot_wait"] == 0.0
            assert acc["engine_idle"] < 0.1  # 6 x 0.2 s of scheduler time, the next call always queued
        else:
            assert acc["max_in_flight"] == 1 and acc["slot_wait"] > 0.3  # the others waited for the slot
    finally:
        engine.close()


def test_engine_gives_up_after_max_restarts(target, monkeypatch):
    monkeypatch.setattr(sp, "LIVENESS_POLL_S", 0.1)
    FakeSGLangEngine.started.clear()

    def dying(**kw):  # every scheduler dies before answering
        fake = FakeSGLangEngine(delay=30.0, **kw)
        threading.Timer(1.0, fake.proc.kill).start()
        return fake

    engine = sg.SGLangEngine(target, mode="capture", engine_factory=dying, max_restarts=1)
    with pytest.raises(EngineError, match="died 2 times.*max_restarts=1"):
        engine.capture([[5, 6, 7]])
    assert engine.restarts == 1 and len(FakeSGLangEngine.started) == 2
    engine.close()


def test_an_error_from_a_live_engine_is_not_retried(target, monkeypatch):
    monkeypatch.setattr(sp, "LIVENESS_POLL_S", 0.1)

    class Refusing(FakeSGLangEngine):
        async def async_generate(self, input_ids, sampling_params, rid):
            raise ValueError("input too long")

    engine = sg.SGLangEngine(target, mode="capture", engine_factory=Refusing)
    with pytest.raises(ValueError, match="input too long"):
        engine.capture([[5, 6, 7]])
    assert engine.restarts == 0
    engine.close()


def test_a_failed_start_after_a_death_is_tried_again(target, monkeypatch):
    """The dead engine's GPU memory can take a moment to come back: a failed rebuild is retried."""
    monkeypatch.setattr(sp, "LIVENESS_POLL_S", 0.1)
    monkeypatch.setattr(sg, "START_RETRY_S", 0.0)
    FakeSGLangEngine.started.clear()
    calls = []

    def flaky(**kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (the dead scheduler still holds it)")
        return FakeSGLangEngine(**kw)

    engine = sg.SGLangEngine(target, mode="capture", engine_factory=flaky)
    os.kill(FakeSGLangEngine.started[0].proc.pid, signal.SIGKILL)
    (cap,) = engine.capture([[5, 6, 7]])
    aux, last = _expected([5, 6, 7], [2, 3, 4])
    assert torch.equal(cap.aux_hidden, aux) and torch.equal(cap.last_hidden, last)
    assert len(calls) == 3 and engine.restarts == 1
    engine.close()


def test_a_sample_sglang_would_refuse_for_its_length_is_a_config_error_before_the_call(target):
    """SGLang refuses an input of ``tokenizer_manager.max_req_input_len`` tokens or more (and fails the
    whole batch); the capture names the samples and the settings instead, before anything is sent."""
    from eagle3_ray.errors import ConfigError

    engine = sg.SGLangEngine(target, mode="capture", engine_factory=FakeSGLangEngine)
    try:
        engine._engine.tokenizer_manager.max_req_input_len = 7  # set by sglang.Engine from the scheduler
        with pytest.raises(ConfigError, match=r"up to 9 tokens.*fewer than 7.*data\.max_length <= 6"):
            engine.capture([[3] * 5, [4] * 9])
        assert engine.capture_seconds["calls"] == 0  # refused before the call
        (cap,) = engine.capture([[3] * 6])
        assert cap.aux_hidden.shape[0] == 6
    finally:
        engine.close()
