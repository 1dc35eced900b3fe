"""SGLang target engine: tensor-parallel hidden-state capture and generation. No Ray in here.

One ``sglang.Engine`` per node, created inside the (Ray) process that owns its ``tp_size`` GPUs;
SGLang spawns its TP scheduler processes itself. Capture needs no fork of SGLang: a forward hook
on ``logits_processor`` (``engines/sglang_hooks.py``) writes each request's features from TP rank 0
to node-local shared memory, and ``SGLangEngine.capture`` reads, checks and deletes them.

``engine_kwargs`` returns the exact ``sglang.Engine`` kwargs of each mode, so they can be read and
are tested against SGLang's own ``ServerArgs``. SGLang is imported lazily: ``eagle3_ray`` imports
without it. Versions differ (0.5.17 and 0.5.23 are tested): the kwargs follow the installed
``ServerArgs`` fields, never a version string. Facts behind each setting: docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
import uuid
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Literal, Sequence

import torch

from eagle3_ray.config import BenchConfig, TargetConfig
from eagle3_ray.engines.aux_layers import translate_aux_ids
from eagle3_ray.engines.base import Capture, EngineInfo, check_generate_args
from eagle3_ray.engines import sglang_process as sp
from eagle3_ray.engines.sglang_process import (
    EngineDied,
    cancel_tasks,
    kill_pids,
    launch_sglang,
    live_children,
    run_loop,
)
from eagle3_ray.engines.sglang_hooks import CAPTURE_SUFFIX, FACTORY_PATH, LAYER_FACTORY_PATH, capture_path
from eagle3_ray.engines.sglang_modules import sglang_module_paths
from eagle3_ray.engines.sglang_tp import layer_hook_tp_kwargs
from eagle3_ray.errors import ConfigError, EngineError

logger = logging.getLogger(__name__)

Mode = Literal["capture", "generate", "spec"]
MODES: tuple[str, ...] = ("capture", "generate", "spec")
TESTED_VERSIONS = ("0.5.17", "0.5.23")  # the range the `sglang` extra allows; contract-tested
INSTALL_HINT = "pip install 'eagle3-ray[sglang]' (sglang 0.5.17 to 0.5.23, needs CUDA GPUs)"
HOOK_NAME = "eagle3_ray_capture"
# In SGLang 0.5.23 (not 0.5.17): hands aux states to logits_processor without loading a draft.
AUX_FLAG = "enable_return_aux_hidden_states"
# Models whose decoder layers return (hidden_states, residual[, ...]) with forward_batch as the
# third positional argument: the layer-hook capture (SGLang without AUX_FLAG) works on these.
# DeepSeek-V2/V3 (and Kimi-K2, which ships DeepseekV3ForCausalLM) return a third item, topk_indices.
LAYER_HOOK_MODELS = ("llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3", "kimi_k2")

# One forward per request, nothing decoded: max_new_tokens=0 returns no output at all.
CAPTURE_SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}

# Settings the capture mode forces, each with what breaks without it.
CAPTURE_FORCED: dict[str, tuple[Any, str]] = {
    "disable_radix_cache": (True, "a prefix-cache hit skips the cached rows, so a sample loses tokens"),
    "chunked_prefill_size": (-1, "chunked prefill splits one sample over several forwards"),
    "disable_cuda_graph": (True, "CUDA graph replay never runs Python forward hooks"),
}
# Forced in addition where the installed ServerArgs has AUX_FLAG.
CAPTURE_FORCED_AUX_FLAG: dict[str, tuple[Any, str]] = {
    AUX_FLAG: (True, "the model only hands aux states to logits_processor with it"),
    "speculative_algorithm": ("EAGLE3", "it names the aux capture convention (no draft is loaded)"),
}

# Server settings that capture cannot work with, whatever their value elsewhere.
_CAPTURE_REFUSED: dict[str, tuple[Any, str]] = {
    "pp_size": (1, "aux capture needs pp_size == 1 (SGLang refuses it otherwise)"),
    "dp_size": (1, "TP rank 0 of one engine writes the features; scale with more engine actors"),
    "attn_dp_size": (1, "with attention DP, TP rank 0 does not see every request"),
    "enable_dp_attention": (False, "with attention DP, TP rank 0 does not see every request"),
    "enable_layernorm_sp": (False, "the hook would see sequence-sharded hidden states"),
    "enable_mixed_chunk": (False, "mixed batches interleave decode rows with prompt rows"),
    "cuda_graph_config": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "cuda_graph_backend_prefill": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "cuda_graph_backend_decode": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "forward_hooks": (None, "the capture hook is set by eagle3_ray"),
    "return_aux_hidden_state_layer_ids": (None, "set target.aux_layers instead (HF hidden_states indices)"),
    "speculative_draft_model_path": (None, "capture runs the target alone"),
}

# Keys owned by TargetConfig fields in every mode.
_MANAGED = {
    "model_path": "target.model",
    "tp_size": "target.tp_size",
    "dtype": "target.dtype",
    "nnodes": "target.sglang.nnodes",
    "dist_init_addr": "target.sglang.dist_init_addr",
    "node_rank": "the engine actor's node (one engine per node)",
    "mem_fraction_static": "target.sglang.mem_fraction_static",
    "skip_tokenizer_init": "nothing (the engine takes and returns token ids)",
    "sampling_defaults": "nothing (unset sampling knobs stay neutral)",
    "load_format": "target.model ('random:<config>' loads dummy weights)",
}


def import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise EngineError(f"target.backend='sglang' needs SGLang: {INSTALL_HINT} ({e})") from e
    return sglang


def sglang_aux_ids(aux_layers: Sequence[int], model_type: str, num_layers: int) -> list[int]:
    """HF hidden_states indices -> the ids SGLang's ``set_eagle3_layers_to_capture`` expects.

    The per-architecture rules live in ``eagle3_ray.engines.aux_layers.translate_aux_ids`` (shared with
    export). SGLang captures the *input* of a decoder layer, so index ``num_layers`` (the output of
    the last layer, before the final norm) has no layer to capture it at.
    """
    ks = list(aux_layers)
    if max(ks) >= num_layers:
        raise ConfigError(
            f"target.aux_layers={ks}: SGLang captures the input of a decoder layer, so HF index "
            f"{num_layers} (the last layer's output) cannot be captured for a {num_layers}-layer target; "
            f"use indices <= {num_layers - 1} (default [2, L//2, L-3])"
        )
    return translate_aux_ids(ks, model_type, "sglang")


def _dtype(target: TargetConfig) -> str:
    # "auto" matches the HF backend on GPU (bf16); SGLang's own "auto" would follow the checkpoint.
    return "bfloat16" if target.dtype == "auto" else target.dtype


def _model_source(target: TargetConfig) -> dict[str, Any]:
    from eagle3_ray.engines.targets import resolve_target

    resolved = resolve_target(target.model, target.cache_dir)
    if resolved.model_path is None:  # random:<config>: SGLang builds it with dummy weights
        return {"model_path": str(Path(resolved.config_source).parent), "load_format": "dummy"}
    return {"model_path": str(resolved.model_path)}


def _base_kwargs(target: TargetConfig, node_rank: int) -> dict[str, Any]:
    sg = target.sglang
    kw: dict[str, Any] = {
        **_model_source(target),
        "tp_size": target.tp_size,
        "dtype": _dtype(target),
        "skip_tokenizer_init": True,
        # Unset sampling knobs stay neutral instead of following generation_config.json
        # (top_k, repetition_penalty, ...), which would skew self-distilled answers.
        "sampling_defaults": "openai",
    }
    if sg.nnodes > 1:
        if not sg.dist_init_addr:
            raise ConfigError(
                f"target.sglang.nnodes={sg.nnodes} needs target.sglang.dist_init_addr (host:port of node 0, "
                "shared by every node of the engine)"
            )
        if not 0 <= node_rank < sg.nnodes:
            raise ConfigError(f"node_rank={node_rank} must lie in [0, target.sglang.nnodes={sg.nnodes})")
        kw.update(nnodes=sg.nnodes, node_rank=node_rank, dist_init_addr=sg.dist_init_addr)
    if sg.mem_fraction_static is not None:
        kw["mem_fraction_static"] = sg.mem_fraction_static
    return kw


def server_args_fields() -> frozenset[str]:
    """Field names of the installed SGLang's ``ServerArgs``: a msgspec Struct (0.5.23) or a dataclass (0.5.17)."""
    from sglang.srt.server_args import ServerArgs

    struct_fields = getattr(ServerArgs, "__struct_fields__", None)
    if struct_fields is not None:
        return frozenset(struct_fields)
    return frozenset(f.name for f in dataclasses.fields(ServerArgs))


def check_extra_kwargs(extra: dict[str, Any], mode: Mode) -> None:
    """Refuse ``target.sglang.extra_engine_kwargs`` that another field owns or that break ``mode``."""
    for key in extra:
        if key in _MANAGED:
            raise ConfigError(f"target.sglang.extra_engine_kwargs.{key}: set it through {_MANAGED[key]}")
    if mode != "capture":
        return
    forced = {**CAPTURE_FORCED, **CAPTURE_FORCED_AUX_FLAG}
    for key, value in extra.items():
        if key in forced and value != forced[key][0]:
            want, why = forced[key]
            raise ConfigError(
                f"target.sglang.extra_engine_kwargs.{key}={value!r} breaks hidden-state capture ({why}); "
                f"capture forces {key}={want!r}: remove it"
            )
        if key in _CAPTURE_REFUSED and value != _CAPTURE_REFUSED[key][0]:
            want, why = _CAPTURE_REFUSED[key]
            raise ConfigError(
                f"target.sglang.extra_engine_kwargs.{key}={value!r} breaks hidden-state capture ({why}); "
                f"remove it or set {key}={want!r}"
            )


def _spec_kwargs(drafter_dir: str | Path | None, bench: BenchConfig | None,
                 shape: Literal["chain", "tree"] | None = None) -> dict[str, Any]:
    """EAGLE-3 with the drafter in ``drafter_dir``: a ``chain`` (top-1, ``bench.num_steps`` drafts) or a
    ``tree`` (``bench.topk`` x ``bench.depth``, ``bench.total_tokens`` verified); default: the tree
    when ``bench.modes`` lists it."""
    if drafter_dir is None or bench is None:
        raise ConfigError("mode='spec' needs drafter_dir (an exported drafter) and the bench config")
    if shape not in (None, "chain", "tree"):
        raise ConfigError(f"spec_shape={shape!r}: use 'chain' or 'tree'")
    if shape == "tree" or (shape is None and "tree" in bench.modes):
        steps, topk, tokens = bench.depth, bench.topk, bench.total_tokens
    else:  # a chain verifies its K drafts plus the bonus token
        steps, topk, tokens = bench.num_steps, 1, bench.num_steps + 1
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(drafter_dir),
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
    }


def _capture_kwargs(
    target: TargetConfig, info: EngineInfo, capture_dir: str | Path | None, fields: frozenset[str]
) -> dict[str, Any]:
    if capture_dir is None:
        raise ConfigError("mode='capture' needs capture_dir (where the hook writes features)")
    ids = sglang_aux_ids(info.aux_layers, info.model_type, info.num_layers)  # also refuses index L
    hook_config = {"dir": str(capture_dir), "tp_size": target.tp_size}
    forced = {k: v for k, (v, _) in CAPTURE_FORCED.items()}
    # Exact module names of the class SGLang builds (a wrapper such as Kimi-K2.5 nests its text model).
    paths = sglang_module_paths(info.architectures, target.sglang.extra_engine_kwargs)
    if AUX_FLAG in fields:
        if not paths.aux_states:
            raise ConfigError(
                f"SGLang's {info.architectures[0]} does not hand set_eagle3_layers_to_capture to its language model, "
                f"so SGLang refuses {AUX_FLAG} for it and no aux states reach {paths.logits_processor}: capture this "
                "target with target.backend=hf, or with an SGLang without that flag (sglang 0.5.17: layer hooks)"
            )
        lp_hook = {"name": HOOK_NAME, "target_modules": [paths.logits_processor], "hook_factory": FACTORY_PATH,
                   "config": hook_config}
        return {**forced, **{k: v for k, (v, _) in CAPTURE_FORCED_AUX_FLAG.items()},
                "return_aux_hidden_state_layer_ids": ids, "forward_hooks": [lp_hook]}
    if info.model_type not in LAYER_HOOK_MODELS:
        raise ConfigError(
            f"capturing a {info.model_type!r} target needs SGLang's {AUX_FLAG} (sglang 0.5.23); the installed "
            f"SGLang lacks it, and the layer-hook capture covers only {LAYER_HOOK_MODELS}: install sglang==0.5.23"
        )
    # Under TP a hooked layer must return reduced, whole rows: force off or refuse what breaks that.
    forced.update(layer_hook_tp_kwargs(target.tp_size, target.sglang.extra_engine_kwargs, fields))
    # HF hidden_states[k] is the summed output of decoder layer k - 1 (layer 0's output is k = 1).
    layer_hooks = [
        {"name": f"{HOOK_NAME}_aux{slot}", "target_modules": [paths.decoder_layer(k - 1)],
         "hook_factory": LAYER_FACTORY_PATH, "config": {**hook_config, "slot": slot}}
        for slot, k in enumerate(info.aux_layers)
    ]
    lp_hook = {"name": HOOK_NAME, "target_modules": [paths.logits_processor], "hook_factory": FACTORY_PATH,
               "config": {**hook_config, "layer_slots": len(info.aux_layers)}}
    return {**forced, "forward_hooks": [*layer_hooks, lp_hook]}


def engine_kwargs(
    config: TargetConfig,
    mode: Mode = "capture",
    *,
    info: EngineInfo | None = None,
    capture_dir: str | Path | None = None,
    drafter_dir: str | Path | None = None,
    bench: BenchConfig | None = None,
    node_rank: int = 0,
    fields: frozenset[str] | None = None,
    spec_shape: Literal["chain", "tree"] | None = None,
) -> dict[str, Any]:
    """The exact kwargs given to ``sglang.Engine`` for ``mode``.

    capture: target only, hooks + forced settings; generate: plain decoding (prefix cache on);
    spec: EAGLE-3 speculative decoding with ``drafter_dir`` (``spec_shape`` chain or tree, sized by
    ``bench``).
    ``info`` (aux layers, model type, depth) is read from the target config when not given;
    ``fields`` (the ServerArgs field names, which pick the capture path) from the installed SGLang.
    """
    if mode not in MODES:
        raise ConfigError(f"engine mode {mode!r} is unknown; use one of {MODES}")
    extra = dict(config.sglang.extra_engine_kwargs)
    check_extra_kwargs(extra, mode)
    kw = _base_kwargs(config, node_rank)
    if mode == "capture":
        if info is None:
            from eagle3_ray.engines.describe import describe_target

            info = describe_target(config)
        kw.update(_capture_kwargs(config, info, capture_dir, server_args_fields() if fields is None else fields))
    elif mode == "spec":
        kw.update(_spec_kwargs(drafter_dir, bench, spec_shape))
    return {**kw, **extra}


def check_server_args(kwargs: dict[str, Any]) -> None:
    """Refuse kwargs that are not fields of the installed SGLang's ServerArgs."""
    unknown = sorted(set(kwargs) - server_args_fields())
    if unknown:
        raise ConfigError(
            f"sglang.Engine kwargs {unknown} are not ServerArgs fields of the installed SGLang; "
            f"fix target.sglang.extra_engine_kwargs (eagle3_ray is tested with sglang {' and '.join(TESTED_VERSIONS)})"
        )


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _map_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a safetensors file as views of one private memory map (no copy; the file
    can be unlinked at once), and its metadata."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    size = path.stat().st_size
    data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)[8 + n:]
    out = {}
    for name, h in header.items():
        start, end = h["data_offsets"]
        out[name] = data[start:end].view(_DTYPES[h["dtype"]]).view(h["shape"])
    return out, meta


def read_capture(path: Path, num_tokens: int, hidden_size: int) -> Capture:
    """Map one request's link to its batch's hook file, take the request's rows (views, no copy),
    check they cover the whole sequence, and delete the link."""
    rid = path.name.removesuffix(CAPTURE_SUFFIX)
    tensors, meta = _map_safetensors(path)
    path.unlink()
    requests = json.loads(meta.get("requests", "{}"))
    if rid not in requests:
        raise EngineError(f"the capture file {path} holds no rows of request {rid} (it has {sorted(requests)[:4]})")
    start, rows, cached = requests[rid]
    aux = tensors["aux_hidden"][start:start + rows]  # [T, 3H]
    last = tensors["last_hidden"][start:start + rows]  # [T, H]
    if cached or aux.shape[0] != num_tokens or last.shape[0] != num_tokens:
        raise EngineError(
            f"SGLang captured {aux.shape[0]} rows (prefix cache hit: {cached} tokens) for a {num_tokens}-token "
            "sample; capture needs the whole sequence in one forward (disable_radix_cache, "
            "chunked_prefill_size=-1): check target.sglang.extra_engine_kwargs"
        )
    if tuple(aux.shape[1:]) != (3 * hidden_size,) or tuple(last.shape[1:]) != (hidden_size,):
        raise EngineError(
            f"captured aux {tuple(aux.shape)} / last {tuple(last.shape)} do not match hidden size {hidden_size} "
            "with 3 aux layers; the SGLang model captured another layer set"
        )
    return Capture(aux_hidden=aux, last_hidden=last)


def check_hard_links(directory: Path) -> None:
    """The hook links each batch's file once per request (sglang_hooks.write_linked): refuse a
    ``target.sglang.capture_dir`` whose filesystem cannot, before SGLang starts."""
    probe = directory / ".link-check"
    probe.touch()
    try:
        os.link(probe, directory / ".link-check-2")
    except OSError as e:
        raise ConfigError(
            f"target.sglang.capture_dir={directory.parent}: its filesystem does not support hard links ({e}), "
            "which the capture hook needs; use a node-local tmpfs such as /dev/shm"
        ) from e
    finally:
        for p in (probe, directory / ".link-check-2"):
            p.unlink(missing_ok=True)


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
                 max_restarts: int = MAX_RESTARTS, engine_factory: Callable[..., Any] | None = None):
        """``engine_factory`` builds the engine from the kwargs (default ``sglang.Engine``; tests
        pass a fake, since the real engine needs CUDA)."""
        from eagle3_ray.engines.describe import describe_target

        sglang = import_sglang()
        described = describe_target(target_cfg)
        self.info = replace(described, extra={"backend": "sglang", "mode": mode, "tp_size": target_cfg.tp_size})
        self.mode = mode
        self.restarts = 0
        self.max_restarts = max_restarts
        self._target, self._node_rank = target_cfg, node_rank
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
        self._loop: Any = None
        self._loop_thread: threading.Thread | None = None
        limit = target_cfg.sglang.max_concurrent_calls
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        # Where capture calls spend their time, summed since the engine was built (seconds): waiting
        # for a call slot (max_concurrent_calls), inside SGLang (submitted until answered), collecting
        # the hook's files; and `engine_idle`, the time no capture call of ours was inside SGLang.
        # `max_in_flight`: the most capture calls inside SGLang at once. Read by
        # benchmarks/device/sglang_h200_2.py.
        self.capture_seconds = {"calls": 0, "slot_wait": 0.0, "generate": 0.0, "collect": 0.0, "engine_idle": 0.0,
                                "max_in_flight": 0}
        self._in_flight = 0
        self._idle_since: float | None = None
        self._stats_lock = threading.Lock()
        self._restart_lock = threading.Lock()
        self._start()

    def _kwargs(self) -> dict[str, Any]:
        return engine_kwargs(self._target, self.mode, info=self.info, capture_dir=self._dir, node_rank=self._node_rank)

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
            what = f"the SGLang engine (mode {self.mode}) of target.model={self._target.model!r}"
            self._engine, self._procs = launch_sglang(kwargs, self._factory, what)
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
        self._loop = loop
        self._loop_thread = threading.Thread(target=run_loop, args=(loop,), name="eagle3-ray-sglang-loop", daemon=True)
        self._loop_thread.start()
        logger.info("SGLang engine up (mode %s, processes %s)", self.mode, sorted(self._procs))

    def _dead(self) -> list[int]:
        return sorted(self._procs - live_children())

    def _current(self, generation: int) -> tuple[Any, Any, Path | None]:
        """The engine, its loop and its capture directory, if ``generation`` is still the live engine."""
        with self._restart_lock:  # not halfway through a restart
            if generation != self._generation or self._engine is None:
                raise EngineDied("the engine was restarted")
            return self._engine, self._loop, self._dir

    def _call(self, generation: int, fn: Callable[[Any], Coroutine[Any, Any, Any]]) -> Any:
        """Await ``fn(sglang_engine)`` on the engine's loop, watching the engine's processes meanwhile."""
        engine, loop, _ = self._current(generation)
        future = asyncio.run_coroutine_threadsafe(fn(engine), loop)
        while True:
            try:
                return future.result(timeout=sp.LIVENESS_POLL_S)
            except FutureTimeout:
                dead = self._dead() if generation == self._generation else [-1]
                if not dead:
                    continue
                # SGLang's tokenizer manager waits forever for an answer the dead scheduler will never send.
                future.cancel()
                raise EngineDied(f"SGLang processes {dead} exited during the call")
            except Exception as e:
                dead = self._dead() if generation == self._generation else [-1]
                if dead:
                    raise EngineDied(f"SGLang processes {dead} exited during the call ({e})") from e
                raise

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
        loop, thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            if not thread.is_alive():
                cancel_tasks(loop)
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()  # kills this process's child tree (SGLang's own shutdown)
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


def generate_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict[str, Any]:
    """Per-request SamplingParams; ``sampling_seed`` is honoured under enable_deterministic_inference."""
    if temperature == 0:
        return {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "sampling_seed": seed}
