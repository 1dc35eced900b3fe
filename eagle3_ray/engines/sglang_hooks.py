"""The forward hook SGLang attaches to ``logits_processor`` to capture EAGLE-3 features.

SGLang imports this module inside every TP scheduler process (``ServerArgs.forward_hooks``,
registered by ``sglang/srt/model_executor/hook_manager.py:register_forward_hooks``), so it imports
only the standard library, torch and safetensors: no Ray, nothing heavy from ``eagle3_ray``.

What the hook sees (SGLang 0.5.17 and 0.5.23, verified in docs/sglang.md): ``LlamaForCausalLM.forward``
and ``DeepseekV2ForCausalLM.forward`` call ``self.logits_processor(input_ids, hidden_states, lm_head,
forward_batch, aux_hidden_states)`` positionally, with ``hidden_states`` [N, H] already through the
final norm (the lm_head input). N is the sum of the batch's extend lengths, requests in
``forward_batch.rids`` order. The aux states arrive one of two ways:

- SGLang with ``enable_return_aux_hidden_states`` (0.5.23): the model hands them to
  ``logits_processor`` as a list of three [N, H] tensors or one packed [N, 3H] tensor.
- SGLang without it (0.5.17): aux capture is tied to loading an EAGLE-3 draft, so
  ``aux_hidden_states`` is None. Instead one more hook per aux layer sits on decoder layer ``c``
  (``model.layers.<c>``; ``language_model.model.layers.<c>`` in a wrapper such as Kimi-K2.5,
  engines/sglang_modules.py), whose output ``(hidden_states, residual)`` sums to the residual stream
  after ``c + 1`` layers, HF ``hidden_states[c + 1]``: the same sum SGLang's own capture takes at
  the next layer's input (``hidden_states + residual``, models/llama.py). The layer hooks park
  their rows here, in this process, and the ``logits_processor`` hook of the same forward takes them.

Only TP rank 0 writes: every rank holds the same full rows, and one writing rank keeps
/dev/shm traffic at one copy. With a capture audit share (``audit_share`` in the hook's config, from
``extract.audit_rows``) the hook also computes the audit's figures of ``audit_positions`` of each
request (``eagle3_ray/audit/rows.py``) with the model's own lm_head, on the GPU: at TP > 1 the lm_head
is vocab-parallel, so every TP rank gets the hook, computes its vocab slice's partials of those rows
and the ranks all-gather them (20 bytes a row and rank); rank 0 merges them and writes the figures
into the batch's file (tensor ``audit`` [n, 4], metadata ``audit`` = {rid: [first row, rows]}). The hook does not stall the forward: it starts non-blocking copies
of the batch's rows to pinned host buffers on a side stream and hands them to a writer thread of
the scheduler process, which waits for the copy and writes. Each forward batch becomes one
safetensors file holding ``aux_hidden`` [N, 3H] and ``last_hidden`` [N, H] in the model dtype and,
as metadata, each request's rows and cached prefix length; every request gets a hard link to it,
``<dir>/<rid>.safetensors``, made once the file is whole (a reader never sees half a file, and
waits for the link: it may land after SGLang has answered the request). The file's memory goes
back when the last link is unlinked and unmapped. One file per batch, not per request: the writer
shares its process with SGLang's scheduler loop, which runs Python without pause, so each system
call the writer returns from waits for the GIL (up to the 5-ms switch interval); a batch costs a
few calls plus one link per request instead of five or six calls per request
(benchmarks/results/capture_writer_gil_cpu.json).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3_ray.audit.rows import RowFigures, audit_positions, combine_partials, vocab_partials

logger = logging.getLogger(__name__)

CAPTURE_SUFFIX = ".safetensors"
FACTORY_PATH = "eagle3_ray.engines.sglang_hooks:capture_hook_factory"
LAYER_FACTORY_PATH = "eagle3_ray.engines.sglang_hooks:layer_hook_factory"

# Positions in LogitsProcessor.forward(input_ids, hidden_states, lm_head, logits_metadata,
# aux_hidden_states, ...) (sglang/srt/layers/logits_processor.py); pinned by the contract tests.
HIDDEN_ARG, LM_HEAD_ARG, BATCH_ARG, AUX_ARG = 1, 2, 3, 4
# Position of forward_batch in a decoder layer's forward(positions, hidden_states, forward_batch,
# residual) (models/llama.py, qwen2.py, qwen3.py); pinned by the contract tests.
LAYER_BATCH_ARG = 2


def capture_path(directory: str | Path, rid: str) -> Path:
    return Path(directory) / f"{rid}{CAPTURE_SUFFIX}"


def world_rank() -> int:
    # SGLang's WORLD rank is ep_join_rank_offset + tp_size * pp_rank + tp_rank
    # (sglang/srt/runtime_context.py:spawn_world_rank); the offset is 0 outside elastic EP.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _is_prefill(forward_batch: Any) -> bool:
    # Decode steps and speculative verification carry no new prompt rows to capture.
    mode = forward_batch.forward_mode
    return mode.is_extend() and not mode.is_target_verify()


# Rows parked by the layer hooks of the forward in progress, per capture dir: {slot: [N, H]}.
_LAYER_ROWS: dict[str, dict[int, torch.Tensor]] = {}


def capture_hook_factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of the ``logits_processor`` spec.

    config = {"dir": str, "tp_size": int, "layer_slots": int, "audit_share": float}; ``layer_slots``
    > 0 means the aux states come from that many layer hooks (``layer_hook_factory``) rather than from
    SGLang; ``audit_share`` > 0: the capture audit's figures of that share of rows (every TP rank takes
    part). Returns None on TP ranks other than 0 without an audit; SGLang then registers nothing there.
    """
    share = float(config.get("audit_share", 0.0))
    writes = world_rank() % int(config["tp_size"]) == 0
    if not writes and share <= 0:
        return None
    directory = Path(config["dir"])
    slots, key = int(config.get("layer_slots", 0)), str(directory)
    if writes:
        directory.mkdir(parents=True, exist_ok=True)

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        t0 = time.perf_counter()
        if not _is_prefill(args[BATCH_ARG]):
            return None
        audit = audit_rows(args[BATCH_ARG], args[HIDDEN_ARG], args[LM_HEAD_ARG], share) if share > 0 else None
        batch = batch_rows(args, slots, key) if writes else None
        if batch is not None:
            write_batch(directory, *batch, t0=t0, audit=audit)
        return None

    return hook


def vocab_slice(lm_head: torch.nn.Module) -> tuple[torch.Tensor, int, int]:
    """(this rank's rows of the lm_head [V_slice, H] without padding, the id of its first row, the
    number of slices the vocab is split into). SGLang's ``ParallelLMHead`` (a
    ``VocabParallelEmbedding``) keeps rank r's slice of the original vocab in its first
    ``shard_indices.num_org_elements`` rows; a plain linear holds the whole vocab."""
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        return lm_head.weight, 0, 1
    if getattr(lm_head, "use_attn_tp_group", False):
        raise RuntimeError("the capture audit does not read an lm_head split over the attention TP group "
                           "(data-parallel attention); set extract.audit_rows=0")
    return lm_head.weight[: shard.num_org_elements], int(shard.org_vocab_start_index), int(getattr(lm_head, "tp_size", 1))


def _gather_slices(parts: torch.Tensor, slices: int) -> torch.Tensor:
    """[slices, n, k]: every TP rank's ``parts`` [n, k], in rank order (= vocab order), gathered over
    SGLang's TP group (the default group where SGLang's is not set up: a test's gloo ranks)."""
    if slices == 1:
        return parts[None]
    group = None
    try:
        from sglang.srt.distributed import get_tp_group

        group = get_tp_group().device_group
    except (ImportError, AssertionError):
        pass
    out = [torch.empty_like(parts) for _ in range(slices)]
    torch.distributed.all_gather(out, parts.contiguous(), group=group)
    return torch.stack(out)


def audit_rows(forward_batch: Any, hidden: torch.Tensor, lm_head: torch.nn.Module,
               share: float) -> tuple[torch.Tensor, dict[str, list[int]]] | None:
    """The audit figures of ``audit_positions(rows, share)`` of each request of an extend batch, with
    ``lm_head`` (vocab-parallel: every TP rank calls this with the same batch): ([n, 4] float32 on
    the device, {rid: [first row, rows]}); on ranks other than the writing one the figures are
    computed too (the gather needs every rank) and dropped by the caller. None when the lm_head
    cannot be read (said in SGLang's log; the engine then reports captures without figures)."""
    lens = forward_batch.extend_seq_lens_cpu
    if lens is None:
        lens = forward_batch.extend_seq_lens.tolist()
    local, rows, index, start = [], [], {}, 0
    for rid, n in zip(forward_batch.rids, lens):
        pos = audit_positions(int(n), share)
        index[rid] = [sum(len(p) for p in local), len(pos)]
        local.append(pos)
        rows.append(pos + start)
        start += int(n)
    positions, flat = torch.cat(local), torch.cat(rows).to(hidden.device)
    try:
        weight, vocab_start, slices = vocab_slice(lm_head)
    except (AttributeError, RuntimeError) as e:
        logger.error("eagle3_ray capture audit: cannot read the lm_head (%s)", e)
        return None
    next_ids = forward_batch.input_ids[flat + 1]
    nll, entropy, argmax = combine_partials(_gather_slices(vocab_partials(hidden[flat], weight, next_ids, vocab_start),
                                                           slices))
    return RowFigures(positions.to(nll.device), nll, entropy, argmax).packed(), index


def batch_rows(args: tuple, slots: int, key: str) -> tuple[Any, torch.Tensor, torch.Tensor] | None:
    """(forward_batch, hidden [N, H], aux [N, 3H]) of the prefill batch a ``logits_processor`` call
    was given (``args``, its positional arguments), or None: a decode or verify batch, or capture not
    enabled. ``slots`` > 0: the aux rows are the ones that many layer hooks parked under ``key``."""
    forward_batch = args[BATCH_ARG]
    if not _is_prefill(forward_batch):
        return None
    if slots:
        parked = _LAYER_ROWS.pop(key, {})
        aux = [parked[j] for j in range(slots)] if len(parked) == slots else None
    else:
        aux = args[AUX_ARG] if len(args) > AUX_ARG else None
    if aux is None:
        return None  # capture not enabled: the engine reports the missing files with the cause
    aux_packed = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)  # [N, 3H]
    return forward_batch, args[HIDDEN_ARG], aux_packed


def layer_hook_factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of one aux layer's spec: config = {"dir", "tp_size", "slot": int}.

    The hook sits on a decoder layer whose forward is ``(positions, hidden_states, forward_batch,
    residual, ...) -> (hidden_states, residual[, ...])`` and parks ``hidden_states + residual`` [N, H].
    """
    if world_rank() % int(config["tp_size"]) != 0:
        return None
    key, slot = str(Path(config["dir"])), int(config["slot"])

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not _is_prefill(args[LAYER_BATCH_ARG]):
            return None
        hidden, residual = output[0], output[1]  # DeepSeek layers return topk_indices third
        _LAYER_ROWS.setdefault(key, {})[slot] = hidden if residual is None else hidden + residual  # [N, H]
        return None

    return hook


def write_batch(
    directory: Path,
    forward_batch: Any,
    hidden: torch.Tensor,  # [N, H] post-final-norm
    aux: torch.Tensor,  # [N, 3H]
    t0: float | None = None,
    audit: tuple[torch.Tensor, dict[str, list[int]]] | None = None,
) -> None:
    """Hand one extend batch to the writer threads, which write it as one file linked per request.

    On CUDA the rows go to pinned host buffers with non-blocking copies on a side stream, so the
    forward is not stalled by the device-to-host copy or the file writes; a writer waits for the
    copy's event, then writes. ``flush()`` waits until every batch handed over so far is written.
    ``t0``: when the hook began (the writer's ``hook_s`` counts from it; default: now). ``audit``:
    the capture audit's figures of the batch (``audit_rows``), written into the same file.
    """
    t0 = time.perf_counter() if t0 is None else t0
    lens = forward_batch.extend_seq_lens_cpu
    if lens is None:
        lens = forward_batch.extend_seq_lens.tolist()
    prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(lens)
    # zip stops at the real requests: padded batch slots have no rid.
    reqs = [(rid, int(n), int(c)) for rid, n, c in zip(forward_batch.rids, lens, prefix)]
    rows = sum(n for _, n, _ in reqs)
    hosts, ready = to_host_all([aux[:rows], hidden[:rows], *([audit[0]] if audit is not None else [])])
    host_audit = (hosts[2], audit[1]) if audit is not None else None
    writer().put(Path(directory), reqs, hosts[0], hosts[1], ready, t0, audit=host_audit)


def flush(timeout: float | None = None) -> None:
    """Wait until the writer threads have written every batch handed to them so far."""
    w = _WRITER
    if w is not None:
        w.flush(timeout)


def to_host(aux: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Start copying both tensors to host memory; returns them and an event to wait on (or None)."""
    (host_aux, host_last), done = to_host_all([aux, last])
    return host_aux, host_last, done


def to_host_all(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """``to_host`` of any tensors on one device: their host copies and one event for them all."""
    if not tensors[0].is_cuda:
        return [t.detach().clone() for t in tensors], None
    global _SIDE_STREAM
    if _SIDE_STREAM is None:
        _SIDE_STREAM = torch.cuda.Stream(device=tensors[0].device)
    side, main = _SIDE_STREAM, torch.cuda.current_stream(tensors[0].device)
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]  # torch caches pinned blocks
    side.wait_stream(main)  # the rows are final once the forward's work so far is done
    with torch.cuda.stream(side):
        for h, t in zip(hosts, tensors):
            h.copy_(t.detach(), non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    # The caching allocator must not hand these blocks to the next forward before the copy ends.
    for t in tensors:
        t.record_stream(side)
    return hosts, done


_SIDE_STREAM: Any = None
# Batches copied but not written yet: at most this many, so host memory stays bounded when the
# writes fall behind (the forward then waits for a writer).
MAX_PENDING_BATCHES = 8
# Writer threads of a scheduler process (each writes whole batches; os.writev releases the GIL, so
# they write in parallel). EAGLE3_RAY_CAPTURE_WRITERS, read when the first batch arrives, sets it.
WRITERS_ENV = "EAGLE3_RAY_CAPTURE_WRITERS"
DEFAULT_WRITERS = 1
# Written next to the captures whenever the writers catch up (no batch waiting: each write is four
# system calls, each a wait for the GIL, module docstring): where the hook's time goes (_Writer.stats),
# for whoever watches a capture run (docs/sglang.md, step 3).
STATS_FILE = "writer-stats.json"


class _Writer:
    """Daemon threads of the scheduler process writing the captured batches.

    ``stats()``: batches, rows and bytes written, and seconds spent: ``hook_s`` in the forward's
    thread (the pinned buffers, the copies' launch, the hand-over), of which ``put_blocked_s``
    waiting for room in the queue (the writes fell behind); ``copy_wait_s`` writers waiting for the
    device-to-host copies; ``write_s`` writing files (summed over the writers).
    """

    def __init__(self, writers: int = DEFAULT_WRITERS) -> None:
        self.writers = max(1, writers)
        self._queue: queue.Queue = queue.Queue(maxsize=MAX_PENDING_BATCHES)
        self._done = threading.Condition()
        self._submitted = self._finished = 0
        self._stats = {"writers": self.writers, "batches": 0, "rows": 0, "bytes": 0, "hook_s": 0.0,
                       "put_blocked_s": 0.0, "copy_wait_s": 0.0, "write_s": 0.0}
        for i in range(self.writers):
            threading.Thread(target=self._run, name=f"eagle3-ray-capture-writer-{i}", daemon=True).start()

    def put(self, directory: Path, reqs: list, host_aux: torch.Tensor, host_last: torch.Tensor, ready: Any,
            t0: float | None = None, audit: tuple[torch.Tensor, dict] | None = None) -> None:
        """Queue a batch's host rows (``ready``: the copy's event, or None) for a writer; with no
        ``reqs`` the writer waits for the copy and writes nothing. ``audit``: its audit figures."""
        with self._done:
            self._submitted += 1
        t = time.perf_counter()
        self._queue.put((directory, reqs, host_aux, host_last, ready, audit))
        now = time.perf_counter()
        with self._done:
            self._stats["put_blocked_s"] += now - t
            self._stats["hook_s"] += now - (t if t0 is None else t0)

    def flush(self, timeout: float | None = None) -> None:
        with self._done:
            target = self._submitted
            if not self._done.wait_for(lambda: self._finished >= target, timeout):
                raise TimeoutError(f"the capture writer did not finish within {timeout} s")

    def stats(self) -> dict[str, float]:
        with self._done:
            return dict(self._stats)

    def _run(self) -> None:
        while True:
            directory, reqs, host_aux, host_last, ready, audit = self._queue.get()
            t0 = time.perf_counter()
            try:
                if ready is not None:
                    ready.synchronize()
                t1 = time.perf_counter()
                start = sum(n for _, n, _ in reqs)
                if reqs:
                    write_linked(directory, reqs, host_aux[:start], host_last[:start], audit)
                t2 = time.perf_counter()
                with self._done:
                    st = self._stats
                    st["batches"] += 1
                    st["rows"] += start
                    st["bytes"] += start * (host_aux.shape[-1] * host_aux.element_size()
                                            + host_last.shape[-1] * host_last.element_size())
                    st["copy_wait_s"] += t1 - t0
                    st["write_s"] += t2 - t1
                    snapshot = dict(st)
                if self._queue.empty():
                    _write_stats(directory / STATS_FILE, snapshot)
            except Exception:  # the engine reports the missing files; the cause goes to SGLang's log
                logger.exception("eagle3_ray capture writer failed for requests %s", [r for r, _, _ in reqs])
            finally:
                del host_aux, host_last  # the pinned blocks go back to torch's cache now, not at the next batch
                with self._done:
                    self._finished += 1
                    self._done.notify_all()


def _write_stats(path: Path, stats: dict) -> None:
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, path)


_WRITER: _Writer | None = None
_WRITER_LOCK = threading.Lock()


def writer() -> _Writer:
    """This process's writer threads (started on first use)."""
    global _WRITER
    with _WRITER_LOCK:
        if _WRITER is None:
            _WRITER = _Writer(_writer_count())
        return _WRITER


def _writer_count() -> int:
    """EAGLE3_RAY_CAPTURE_WRITERS, or the default where it is unset or not a positive integer (said
    in SGLang's log: this runs inside its forward, where raising would fail the batch)."""
    value = os.environ.get(WRITERS_ENV, "").strip()
    if not value:
        return DEFAULT_WRITERS
    if value.isdigit() and int(value) > 0:
        return int(value)
    logger.error("%s=%r is not a positive integer; using %d capture writer thread(s)", WRITERS_ENV, value,
                 DEFAULT_WRITERS)
    return DEFAULT_WRITERS


def _raw(t: torch.Tensor) -> memoryview:
    # Bytes of a contiguous CPU tensor without a copy (numpy has no bfloat16: view it as bytes).
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _write_all(fd: int, parts: list) -> None:
    """``os.writev`` until every byte of ``parts`` is written (one system call for most batches)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        done = os.writev(fd, views)
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def write_linked(directory: Path, reqs: list, aux_hidden: torch.Tensor, last_hidden: torch.Tensor,
                 audit: tuple[torch.Tensor, dict] | None = None) -> None:
    """One safetensors file for a batch's rows (``aux_hidden`` [N, 3H], ``last_hidden`` [N, H]), with
    ``requests`` = {rid: [first row, rows, cached prefix]} as metadata, and one hard link to it per
    request, ``capture_path(directory, rid)``. Written by hand: the header, then the tensors' bytes
    straight from the (pinned) buffers in one ``writev`` (``safetensors.save_file`` copies twice).
    ``audit``: ([n, 4] float32 figures, {rid: [first row, rows]}), stored as tensor and metadata
    ``audit``."""
    index, start = {}, 0
    for rid, n, cached in reqs:
        index[rid] = [start, n, cached]
        start += n
    tensors = {"aux_hidden": aux_hidden, "last_hidden": last_hidden}
    header: dict[str, Any] = {"__metadata__": {"requests": json.dumps(index, separators=(",", ":"))}}
    if audit is not None:
        tensors["audit"] = audit[0]
        header["__metadata__"]["audit"] = json.dumps(audit[1], separators=(",", ":"))
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the data start to 8 bytes
    tmp = directory / f"batch-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _write_all(fd, [struct.pack("<Q", len(head)), head, *(_raw(t) for t in tensors.values())])
    finally:
        os.close(fd)
    try:
        for rid in index:
            os.link(tmp, capture_path(directory, rid))
    finally:
        os.unlink(tmp)
