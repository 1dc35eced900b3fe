"""`eagle3-ray extract`: the engine actor pool (Ray Data) captures hidden states into the feature store.

    ids the store has finished (one ask) -> read_parquet -> drop those ids (one vectorised filter)
    -> map_batches(CaptureWriteUDF, ActorPoolStrategy): capture, validate, commit one atomic shard
    per batch in the actor

The engine actors start (and build their engines) while the driver describes the target and runs
the store / disk / shared-storage checks, and write nothing before those pass (the run's start
file). The stage writes its resolved config and a summary.json (its timeline: extract/startup.py)
into the store, and resumes where it stopped: samples already committed to the store are skipped.
"""

from __future__ import annotations

import logging
import math
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3_ray.atomic import write_json
from eagle3_ray.audit.figures import SampleAudit, merged_json, progress_text, sums_from_json
from eagle3_ray.config import ExtractConfig, PipelineConfig, save_resolved
from eagle3_ray.errors import ConfigError, StoreError
from eagle3_ray.extract.capture_audit import COLUMNS as AUDIT_COLUMNS
from eagle3_ray.extract.capture_audit import from_columns
from eagle3_ray.extract.prepared import read_prepared, require_prepared
from eagle3_ray.extract.stage import engine_pool, write_summary
from eagle3_ray.extract.startup import PlanningSteps, Timeline, timeline_line
from eagle3_ray.progress import say
from eagle3_ray.rejects import REJECTS_FILE

log = logging.getLogger(__name__)

# Batches in flight per GPU engine actor unless extract.concurrent_batches says; each holds a batch
# of pinned host memory. The published GPU extraction figure (0.944 of the bare forward,
# extract_gpu_8b_pinned.json) ran with 3; SGLang capture gave 0.834 of its prefill with 3 against
# 0.612 with 2 (sglang6_async_probes_h200.json).
GPU_CONCURRENT_BATCHES = 3


def concurrent_batches(extract: ExtractConfig) -> int:
    """Capture calls one engine actor runs at once (threads): 1 on CPU."""
    return extract.concurrent_batches or (GPU_CONCURRENT_BATCHES if extract.num_gpus_per_actor > 0 else 1)


def check_resumed_tokens(out: Path, prepared: str | Path) -> None:
    """``ConfigError`` when samples already in the store at ``out`` were extracted from other tokens
    (or loss masks) than ``prepared`` now holds under their ids: the extraction resumes by id, so a
    prepared dataset redone under other settings (data.max_length, a system prompt, another chat
    template, new answers) would keep the hidden states of the old tokens. Reads the prepared
    tokens and the store's token columns, never its hidden states."""
    from eagle3_ray.features.store import committed_tokens

    sample_ids, _, ids, masks = read_prepared(prepared)
    where = {sid: k for k, sid in enumerate(sample_ids)}
    stale, checked = [], 0
    for sid, stored_ids, stored_mask in committed_tokens(out):
        k = where.get(sid)
        if k is None:
            continue  # not in this prepared data: never read by training over it
        checked += 1
        if not (np.array_equal(stored_ids, ids[k]) and np.array_equal(stored_mask, masks[k])):
            if len(stored_ids) != len(ids[k]):
                stale.append(f"{sid!r}: {len(stored_ids)} tokens stored, {len(ids[k])} prepared")
            elif np.array_equal(stored_ids, ids[k]):
                stale.append(f"{sid!r}: the same {len(ids[k])} tokens, another loss mask")
            else:
                stale.append(f"{sid!r}: {len(ids[k])} tokens, other ones")
    if stale:
        raise ConfigError(
            f"the feature store {out} holds {len(stale)} of {checked} resumed samples extracted from other "
            f"tokens than the prepared data gives them now ({'; '.join(stale[:3])}{'; ...' if len(stale) > 3 else ''}): "
            "the prepared data changed since they were extracted (data, target or generate settings). "
            f"Delete {out} (or pass another --out) to extract again, or set those options back"
        )


def _drop_ids(batch: pa.Table, drop: pa.Array) -> pa.Table:
    """The rows of `batch` whose sample_id is not in `drop` (one vectorised test per batch)."""
    ids = batch["sample_id"]
    return batch.filter(pc.invert(pc.is_in(ids, value_set=drop.cast(ids.type))))


@dataclass
class ExtractSummary:
    samples: int
    tokens: int
    rejected: int
    skipped_done: int
    bytes_written: int
    seconds: float
    tokens_per_s: float
    store: str
    # This run's timeline (extract/startup.py, docs/pipeline.md), in seconds from the stage's start;
    # None where it committed nothing.
    run_tokens: int = 0  # tokens this run committed (tokens counts the whole store)
    plan_s: float | None = None  # driver planning done, the dataset's execution (and engine actors) starting
    checks_s: float | None = None  # the driver's checks done: the engine actors may write from then on
    actor_process_s: float | None = None  # the first engine actor's process started (negative: before the stage)
    actor_init_s: float | None = None  # ... its constructor entered
    actor_imported_s: float | None = None  # ... the engine's modules imported
    engine_s: float | None = None  # the slowest engine actor's construction (model build), in the actor
    engine_ready_s: float | None = None  # the first engine actor ready
    first_shard_s: float | None = None  # the first committed shard reported to the driver
    steady_tokens_per_s: float | None = None  # after the first shard: tokens / (last - first report)
    # The capture audit's figures over every shard of the store (their markers' "audit"; docs/feature-store.md).
    audit: dict | None = None


def describe_in_background(target) -> Future:
    """``describe_target(target)`` on a daemon thread, as a Future for run_extract's ``target_info``.

    Describing a target imports transformers (and torch) and may convert a GGUF once: seconds the
    caller can overlap with other work (the CLI starts Ray meanwhile). An error is raised where the
    Future's result is asked for, as the same exception describe_target raises."""
    fut: Future = Future()

    def work() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            from eagle3_ray.engines.describe import describe_target

            fut.set_result(describe_target(target))
        except BaseException as e:  # noqa: BLE001 (handed to the caller as is)
            fut.set_exception(e)

    threading.Thread(target=work, name="describe-target", daemon=True).start()
    return fut


def run_extract(cfg: PipelineConfig, prepared: str | Path, out: str | Path,
                target_info: Future | None = None) -> ExtractSummary:
    """Capture hidden states for every prepared sample not yet in the store at `out`.

    ``target_info``: describe_in_background(cfg.target), started earlier by the caller; else the
    target is described here."""
    steps = PlanningSteps()
    import ray

    from eagle3_ray.extract.udfs import CaptureWriteUDF
    from eagle3_ray.features.record import bytes_per_token
    from eagle3_ray.features.store import cleanup_orphans, finished
    from eagle3_ray.progress import RateMeter

    steps("imports")
    t0 = time.monotonic()
    timeline = Timeline(t0, time.time())
    src = require_prepared(prepared)
    out = Path(out)
    if target_info is None:  # described on a thread while the dataset and its engine actors start
        target_info = describe_in_background(cfg.target)
    # What the dataset needs, read before the target's description: the ids and lengths to do. The
    # engine actors start with it and build their engines while the driver describes the target and
    # checks the store, the disk and the shared storage; they write nothing before those checks pass
    # (CaptureWriteUDF waits for the run's start file; a failed check aborts them).
    table = pq.read_table(src, columns=["sample_id", "num_tokens"])
    all_ids = table.column("sample_id")
    lengths = table.column("num_tokens").to_numpy()
    steps("read_ids")
    removed = cleanup_orphans(out)  # shards of a crashed run that never got their completion marker
    if removed:
        say(f"[extract] removed {len(removed)} incomplete shard(s) left by an interrupted run")
    for stale in out.glob(START_PREFIX + "*") if out.is_dir() else ():  # an earlier run's, stopped
        stale.unlink(missing_ok=True)
    done = finished(out, all_ids.to_pylist())  # bool [N]: committed or rejected by an earlier run
    todo = ~done
    steps("finished")
    if done.any():
        check_resumed_tokens(out, src)
        steps("check_resumed")
    todo_tokens = int(lengths[todo].sum())
    skipped = int(done.sum())
    if skipped:
        say(f"[extract] resuming: {skipped} samples already in {out}, {int(todo.sum())} to go")
    if not todo.any():
        _check_store(cfg, out, target_info.result(), todo_tokens=0)
        return _finish_extract(out, timeline, skipped, 0)

    concurrent = concurrent_batches(cfg.extract)
    mean_len = max(1.0, float(lengths[todo].mean()))
    rows_per_batch = max(1, int(cfg.extract.batch_tokens // mean_len))
    start_file = out / f"{START_PREFIX}{secrets.token_hex(8)}.json"
    # A StoreError (disk full) or EngineError raised in the engine actor must reach the caller as itself,
    # not as Ray Data's UserCodeException, whose only trace of it is the remote traceback text.
    ray.data.DataContext.get_current().raise_original_map_exception = True
    ds = ray.data.read_parquet(str(src))
    steps("read_parquet")
    if done.any():  # the finished ids travel once, with the filter
        ds = ds.map_batches(_drop_ids, fn_kwargs=dict(drop=all_ids.filter(pa.array(done)).combine_chunks()),
                            batch_format="pyarrow", batch_size=None)
    # One block per engine batch: a single-block input would run every batch in one sequential task
    # and leave the actor pool (and each actor's concurrent calls) idle. (Not ray.data.from_arrow of
    # blocks built here: it runs one metadata task per block and waits for them all before the engine
    # actors start, 5.5 s for 1,142 blocks on a busy 2-core machine; these read and split tasks run
    # while the actors start.)
    ds = ds.repartition(max(1, math.ceil(int(todo.sum()) / rows_per_batch)))
    ds = ds.map_batches(
        CaptureWriteUDF,
        fn_constructor_kwargs=dict(
            target=cfg.target, batch_tokens=cfg.extract.batch_tokens, root=str(out), meta=None, run=cfg.name,
            start_file=str(start_file), extract=cfg.extract,
        ),
        **engine_pool(cfg.extract, max_concurrent_calls_per_actor=concurrent,
                      enable_true_multi_threading=concurrent > 1),
        batch_size=rows_per_batch,
        batch_format="numpy",
    )
    steps("dataset")
    results = _BackgroundBatches(ds)  # the dataset's execution (and the engine actors) start now
    timeline.plan = time.monotonic()
    try:
        try:
            info = target_info.result()
            steps("describe_target")
            _check_store(cfg, out, info, todo_tokens)
            steps("checks")
        except BaseException as e:
            _write_start(start_file, go=False, reason=f"{type(e).__name__}: {e}")
            raise
        _write_start(start_file, go=True)
        timeline.checks = last = time.monotonic()
        log.info("extract planning: %s", steps.line())
        meter = RateMeter("extract", total_samples=int(todo.sum()), total_tokens=todo_tokens)
        audit = SampleAudit("")  # this run's capture audit sums, for the progress line
        actors: dict[str, str] = {}  # engine actor id -> its node's address, in order of first result
        while (batch := results.get()) is not _END:
            if isinstance(batch, BaseException):
                raise batch
            _note_actors(actors, batch)
            ok = batch["status"] == "ok"
            timeline.batch(batch, int(batch["num_tokens"][ok].sum()))
            meter.update(samples=int(ok.sum()), tokens=int(batch["num_tokens"][ok].sum()),
                         nbytes=int(batch["num_tokens"][ok].sum()) * bytes_per_token(info.hidden_size,
                                                                                     cfg.extract.compact),
                         rejected=int((batch["status"] == "rejected").sum()))
            audit = _add_audit(audit, from_columns(batch, ok))
            if time.monotonic() - last > 10:
                say(_progress(meter, audit))
                last = time.monotonic()
    finally:  # on every exit: no iteration of this run's dataset outlives the stage (or its Ray session)
        results.close()
        start_file.unlink(missing_ok=True)
    say(_progress(meter, audit))
    return _finish_extract(out, timeline, skipped, meter.rejected)


def _add_audit(a: SampleAudit, b: SampleAudit) -> SampleAudit:
    return SampleAudit("", **{k: getattr(a, k) + getattr(b, k) for k in AUDIT_COLUMNS})


def _progress(meter, audit: SampleAudit) -> str:
    """The meter's line with the capture audit's figures so far."""
    text = progress_text(audit)
    return f"{meter.line()}; {text}" if text else meter.line()


START_PREFIX = ".extract-start-"  # the run's start file in the store (see _write_start)
_END = object()  # _BackgroundBatches: the dataset is done


def _check_store(cfg: PipelineConfig, out: Path, info, todo_tokens: int) -> None:
    """The driver's checks before any engine actor writes: create (or check against this target) the
    store, save the resolved config, and, with tokens to do, the disk and the shared storage."""
    from eagle3_ray.features.preflight import check_disk
    from eagle3_ray.features.store import StoreMeta, create_store
    from eagle3_ray.ray_session import check_shared_dir

    # Creating (or re-opening) the store checks its metadata against this target before any work.
    create_store(out, StoreMeta.from_engine_info(info, compact=cfg.extract.compact))
    save_resolved(cfg, out)
    if todo_tokens:
        check_disk(out, todo_tokens, info.hidden_size, margin=cfg.extract.disk_margin, compact=cfg.extract.compact)
        check_shared_dir(out, "--out (the feature store)")  # engine actors on every node write their shards there


def _write_start(path: Path, go: bool, reason: str = "") -> None:
    """Tell the run's engine actors (waiting in CaptureWriteUDF) to write, or to stop with ``reason``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, {"go": go, "reason": reason}, newline=False)


class _BackgroundBatches:
    """``ds.iter_batches`` on a daemon thread, from construction (the dataset's execution and its
    actors start at once): ``get()`` returns its batches, then _END, or the exception that ended it.
    ``close()`` stops the iteration at its next batch and waits for the thread (at most
    ``STOP_WAIT_S``): a stage that fails or is interrupted leaves no thread driving its dataset,
    which would otherwise go on calling Ray after the caller shut it down (and start it again)."""

    STOP_WAIT_S = 60.0

    def __init__(self, ds):
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, args=(ds,), name="extract-results", daemon=True)
        self._thread.start()

    def _pump(self, ds) -> None:
        try:
            for batch in ds.iter_batches(batch_format="numpy", batch_size=None):
                if self._stop.is_set():
                    return  # leaving the loop ends the iterator, and with it the dataset's execution
                self._queue.put(batch)
            self._queue.put(_END)
        except BaseException as e:  # noqa: BLE001 (raised again by the caller, as itself)
            self._queue.put(e)

    def get(self):
        return self._queue.get()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("the extract stage's dataset iteration did not stop within %.0f s", self.STOP_WAIT_S)


def _note_actors(actors: dict[str, str], batch: dict[str, np.ndarray]) -> None:
    """Say so when an engine actor delivers its first result (the elastic pool grew, or a restarted
    actor came back, possibly on another node)."""
    for actor, node in zip(batch.get("actor", ()), batch.get("node", ())):
        actor, node = str(actor), str(node)
        if actor and actor not in actors:
            actors[actor] = node
            say(f"[extract] engine actor {actor[:12]} on node {node or '?'}: {len(actors)} actor(s) on "
                f"{len(set(actors.values()))} node(s) so far")


def _finish_extract(out: Path, timeline: Timeline, skipped: int, rejected: int) -> ExtractSummary:
    from eagle3_ray.features import open_store
    from eagle3_ray.features.store import manifest

    store = open_store(out)
    audited = [m["audit"] for m in manifest(out) if isinstance(m.get("audit"), dict)]
    seconds = time.monotonic() - timeline.t0
    nbytes = sum(s.bytes for s in store.shards) if store.shards else 0
    summary = ExtractSummary(
        samples=len(store),
        tokens=int(store.num_tokens),
        rejected=rejected,
        skipped_done=skipped,
        bytes_written=int(nbytes),
        seconds=round(seconds, 2),
        tokens_per_s=round(store.num_tokens / seconds, 1) if seconds > 0 else 0.0,
        store=str(out),
        **timeline.fields(),
        audit=merged_json(audited) if audited else None,
    )
    if not store.shards:
        raise StoreError(f"extraction wrote no samples to {out}; see {out / REJECTS_FILE}")
    write_summary(out, asdict(summary))
    say(
        f"[extract] store has {summary.samples} samples, {summary.tokens:,} tokens, "
        f"{summary.bytes_written / 1e9:.3f} GB; this run {summary.seconds}s, {rejected} rejected"
    )
    if (line := timeline_line(summary, seconds)) is not None:
        say(line)
    if audited:
        say(f"[extract] capture audit over {len(audited)} shard(s): {progress_text(sums_from_json(summary.audit))}")
    return summary
