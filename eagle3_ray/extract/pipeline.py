"""Ray Data stages: prepare (read -> tokenize), extract (engine actor pool -> validated shards).

    prepare:  read_samples (driver, quarantines bad lines) -> map_batches(TokenizeUDF) -> kept rows,
              sorted by id -> prepared.parquet (written by a Ray task; the driver reads only counts)
    extract:  ids the store has finished (one ask) -> read_parquet -> drop those ids (one vectorised
              filter) -> map_batches(CaptureWriteUDF, ActorPoolStrategy): capture, validate, commit
              one atomic shard per batch in the actor; the engine actors start (and build their
              engines) while the driver describes the target and runs the store / disk / shared-storage
              checks, and write nothing before those pass (the run's start file); the summary times
              the first shard and the steady rate

Every stage writes its resolved config and a summary.json next to its outputs and resumes where it
stopped: prepare is atomic (all or nothing), extract skips samples already committed to the store.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import secrets
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3_ray.atomic import tmp_path, write_file, write_json
from eagle3_ray.config import ExtractConfig, PipelineConfig, save_resolved
from eagle3_ray.errors import ConfigError, DataError, StoreError
from eagle3_ray.progress import say

log = logging.getLogger(__name__)

PREPARED_FILE = "prepared.parquet"
REJECTS_FILE = "rejects.jsonl"
SUMMARY_FILE = "summary.json"
TOKENIZE_BATCH = 64
# Ray Data restarts a dead engine actor and retries its batches without limit by default
# (max_restarts=-1, max_task_retries=-1): a batch that kills its actor every time (host OOM, a
# driver crash on one input) would loop forever. Bounded, such a run fails and a rerun resumes.
ENGINE_ACTOR_RESTARTS = 4
# Batches in flight per GPU engine actor unless extract.concurrent_batches says; each holds a batch
# of pinned host memory. The published GPU extraction figure (0.944 of the bare forward,
# extract_gpu_8b_pinned.json) ran with 3; SGLang capture gave 0.834 of its prefill with 3 against
# 0.612 with 2 (sglang6_async_probes_h200.json).
GPU_CONCURRENT_BATCHES = 3


def concurrent_batches(extract: ExtractConfig) -> int:
    """Capture calls one engine actor runs at once (threads): 1 on CPU."""
    return extract.concurrent_batches or (GPU_CONCURRENT_BATCHES if extract.num_gpus_per_actor > 0 else 1)


def write_json_atomic(path: Path, obj) -> None:
    write_json(path, obj, sort_keys=True, newline=False)


def append_rejects(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()


@dataclass
class PrepareSummary:
    samples: int
    tokens: int
    loss_tokens: int
    rejected: int
    max_tokens: int
    mean_tokens: float
    seconds: float
    prepared: str


def prepared_path(data: str | Path) -> Path | None:
    """A prepared dataset: a prepare output dir or its parquet file; None if `data` is raw input."""
    p = Path(data)
    if p.is_dir() and (p / PREPARED_FILE).is_file():
        return p / PREPARED_FILE
    if p.is_file() and p.suffix == ".parquet":
        return p
    return None


def read_prepared(prepared: str | Path):
    """(sample_ids [N], lengths int64 [N], input_ids [N] int32 arrays, loss_mask [N] uint8 arrays)."""
    src = prepared_path(prepared)
    if src is None:
        raise DataError(f"{prepared} is not a prepared dataset; run `eagle3-ray prepare` first")
    table = pq.read_table(src, columns=["sample_id", "input_ids", "loss_mask", "num_tokens"])
    ids = [np.asarray(a, dtype=np.int32) for a in table.column("input_ids").to_numpy(zero_copy_only=False)]
    masks = [np.asarray(a, dtype=np.uint8) for a in table.column("loss_mask").to_numpy(zero_copy_only=False)]
    return table.column("sample_id").to_pylist(), table.column("num_tokens").to_numpy(), ids, masks


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


def _tokenizer_actors(resources: dict) -> int:
    """Tokenizer actors for prepare: half the cluster's CPUs, at least 2 (each takes one CPU). A fixed
    2 tokenized 42,040 conversations in 72 s on a 16-CPU H200 host while 14 CPUs stood idle
    (benchmarks/results/README.md, the product's third run)."""
    return max(2, int(resources.get("CPU", 2)) // 2)


def run_prepare(cfg: PipelineConfig, data: str | None, out: str | Path) -> PrepareSummary:
    """Read conversations, quarantine bad records, tokenize with loss masks on Ray Data."""
    import ray

    from eagle3_ray.data.sources import Reject, read_samples, resolve_data_path
    from eagle3_ray.engines.describe import tokenizer_path_for
    from eagle3_ray.extract.udfs import TokenizeUDF

    t0 = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out)
    source = resolve_data_path(data or cfg.data.path or "builtin:demo_prompts")
    rejects_path = out / REJECTS_FILE
    rejects_path.unlink(missing_ok=True)

    rows, rejects = [], []
    for item in read_samples(source, cfg.data.format, cfg.data.max_samples, cfg.data.system_prompt):
        if isinstance(item, Reject):
            rejects.append({**asdict(item), "stage": "prepare"})
            continue
        rows.append(
            {"sample_id": item.sample_id, "messages": json.dumps(item.messages), "source": item.source}
        )
    if not rows:
        append_rejects(rejects_path, rejects)
        raise DataError(
            f"no usable samples in {source} ({len(rejects)} rejected, reasons in {rejects_path}); "
            "pass --data with conversations in ShareGPT or OpenAI form"
        )

    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // TOKENIZE_BATCH))
    # Tokenized once; the rows stay in Ray Data (object store): the driver reads back only each row's
    # counts (and a rejected row's id, source and reason), and a Ray task writes the parquet.
    tokenized = ds.map_batches(
        TokenizeUDF,
        fn_constructor_kwargs=dict(
            tokenizer_path=str(tokenizer_path_for(cfg.target)),
            max_length=cfg.data.max_length,
            truncate=cfg.data.truncate,
            run=cfg.name,
        ),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=_tokenizer_actors(ray.cluster_resources())),
        batch_size=TOKENIZE_BATCH,
        batch_format="numpy",
    ).materialize()
    lengths, loss_tokens = [], 0
    counts = tokenized.select_columns(["sample_id", "source", "num_tokens", "loss_tokens", "reject"])
    for batch in counts.iter_batches(batch_format="numpy", batch_size=None):
        bad = np.asarray([bool(r) for r in batch["reject"]], dtype=bool)
        for sid, origin, reason in zip(batch["sample_id"][bad], batch["source"][bad], batch["reject"][bad]):
            rejects.append({"sample_id": str(sid), "source": str(origin), "reason": str(reason),
                            "stage": "prepare"})
        lengths.append(np.asarray(batch["num_tokens"][~bad], dtype=np.int64))
        loss_tokens += int(np.asarray(batch["loss_tokens"][~bad]).sum())
    append_rejects(rejects_path, rejects)
    lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if not lengths.size:
        raise DataError(
            f"every sample of {source} was rejected (reasons in {rejects_path}); prompt-only data "
            "needs `eagle3-ray generate` first to write the assistant turns"
        )
    target = out / PREPARED_FILE
    _write_prepared(tokenized, target, rows=int(lengths.size))
    summary = PrepareSummary(
        samples=int(lengths.size),
        tokens=int(lengths.sum()),
        loss_tokens=loss_tokens,
        rejected=len(rejects),
        max_tokens=int(lengths.max()),
        mean_tokens=float(lengths.mean()),
        seconds=round(time.monotonic() - t0, 2),
        prepared=str(target),
    )
    write_json_atomic(out / SUMMARY_FILE, asdict(summary))
    say(
        f"[prepare] {summary.samples} samples, {summary.tokens:,} tokens "
        f"({summary.loss_tokens:,} loss tokens), {summary.rejected} rejected -> {target}"
    )
    return summary


def _kept_rows(batch: pa.Table) -> pa.Table:
    """Tokenized rows -> the kept ones, in the prepared parquet's columns."""
    return batch.filter(pc.equal(batch["reject"], "")).drop_columns(["reject", "loss_tokens"])


def _sorted_by_id(batch: pa.Table) -> pa.Table:
    return batch.sort_by("sample_id")


def _write_prepared(tokenized, target: Path, rows: int) -> None:
    """Write the kept rows of `tokenized` (a Ray Dataset), sorted by sample id, as the one parquet
    file `target` (`rows` rows), published atomically. The file is written by a Ray task on the
    driver's node, where `target` is (prepare's --out need not be shared by the cluster)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    staging = tmp_path(target)  # a directory: Ray Data writes files under a directory
    try:
        (tokenized.map_batches(_kept_rows, batch_format="pyarrow", batch_size=None)
         .repartition(1)
         .map_batches(_sorted_by_id, batch_format="pyarrow", batch_size=None)
         .write_parquet(str(staging), min_rows_per_file=rows, ray_remote_args={"scheduling_strategy": here}))
        written = sorted(staging.glob("*.parquet"))
        if len(written) != 1:
            raise RuntimeError(f"prepare wrote {len(written)} parquet files under {staging}, expected one")
        write_file(target, lambda tmp: os.replace(written[0], tmp))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    # This run's timeline, from the stage's start (run_extract called); None where it committed nothing.
    run_tokens: int = 0  # tokens this run committed (tokens counts the whole store)
    plan_s: float | None = None  # driver planning done, the dataset's execution (and engine actors) starting
    # The driver's checks done (target described, store created or checked, disk, shared storage): the
    # engine actors, starting since plan_s, may write from then on (the part of the start-up overlapped).
    checks_s: float | None = None
    # The first engine actor's start-up, on its clock against the driver's (negative: before the stage
    # started, e.g. a worker process Ray had started in advance): its process started, its constructor
    # entered (the process imported Ray Data and the stage's modules), the engine's modules (torch) imported.
    actor_process_s: float | None = None
    actor_init_s: float | None = None
    actor_imported_s: float | None = None
    engine_s: float | None = None  # the slowest engine actor's construction (model build), in the actor
    engine_ready_s: float | None = None  # the first engine actor ready (its wall clock against the driver's)
    first_shard_s: float | None = None  # the first committed shard reported to the driver
    steady_tokens_per_s: float | None = None  # after the first shard: tokens / (last - first report)


class _Steps:
    """Seconds per named step of the driver's planning, for one log line (where start-up time goes)."""

    def __init__(self) -> None:
        self.t = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.steps.append((name, now - self.t))
        self.t = now

    def line(self) -> str:
        return ", ".join(f"{name} {s:.2f}s" for name, s in self.steps)


ACTOR_STARTS = ("process_at", "init_at", "imported_at")  # CaptureWriteUDF's start-up columns


@dataclass
class _Timeline:
    """When this run's planning ended and its committed batches reached the driver (monotonic seconds)."""

    t0: float
    t0_wall: float = 0.0  # time.time() at t0: engine actors report when they were ready on that clock
    plan: float | None = None
    checks: float | None = None
    first: float | None = None
    last: float | None = None
    tokens: int = 0  # every committed token of this run
    later_tokens: int = 0  # those after the first report
    engine_s: float | None = None
    ready_at: float | None = None
    # the earliest engine actor's start-up (time.time()): process_at, init_at, imported_at (ACTOR_STARTS)
    actor_at: dict[str, float] = field(default_factory=dict)

    def batch(self, tokens: int, engine_s: float | None, ready_at: float | None = None,
              actor_at: dict[str, float] | None = None) -> None:
        now = time.monotonic()
        if engine_s is not None:
            self.engine_s = max(self.engine_s or 0.0, engine_s)
        if ready_at is not None:
            self.ready_at = min(self.ready_at or ready_at, ready_at)
        for k, v in (actor_at or {}).items():
            if not math.isnan(v):
                self.actor_at[k] = min(self.actor_at.get(k, v), v)
        if tokens <= 0:
            return
        if self.first is None:
            self.first = now
        else:
            self.later_tokens += tokens
        self.last, self.tokens = now, self.tokens + tokens

    def fields(self) -> dict:
        since = (lambda t: None if t is None else round(t - self.t0, 2))
        span = (self.last - self.first) if self.first is not None else 0.0
        at = {f"actor_{k[:-3]}_s": round(self.actor_at[k] - self.t0_wall, 2) if k in self.actor_at else None
              for k in ACTOR_STARTS}
        return {"run_tokens": self.tokens, "plan_s": since(self.plan), "checks_s": since(self.checks), **at,
                "engine_s": None if self.engine_s is None else round(self.engine_s, 2),
                "engine_ready_s": None if self.ready_at is None else round(self.ready_at - self.t0_wall, 2),
                "first_shard_s": since(self.first),
                "steady_tokens_per_s": round(self.later_tokens / span, 1) if span > 0 else None}


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
    steps = _Steps()
    import ray

    from eagle3_ray.extract.udfs import CaptureWriteUDF
    from eagle3_ray.features.record import bytes_per_token
    from eagle3_ray.features.store import cleanup_orphans, finished
    from eagle3_ray.progress import RateMeter

    steps("imports")
    t0 = time.monotonic()
    timeline = _Timeline(t0, time.time())
    src = prepared_path(prepared)
    if src is None:
        raise DataError(f"{prepared} is not a prepared dataset; run `eagle3-ray prepare` first")
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
            start_file=str(start_file),
        ),
        compute=ray.data.ActorPoolStrategy(
            min_size=cfg.extract.num_actors,
            max_size=cfg.extract.max_actors or cfg.extract.num_actors,
            max_concurrent_calls_per_actor=concurrent,
            enable_true_multi_threading=concurrent > 1,
        ),
        num_gpus=cfg.extract.num_gpus_per_actor or None,
        num_cpus=cfg.extract.num_cpus_per_actor,
        max_restarts=ENGINE_ACTOR_RESTARTS,
        max_task_retries=ENGINE_ACTOR_RESTARTS,
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
        actors: dict[str, str] = {}  # engine actor id -> its node's address, in order of first result
        while (batch := results.get()) is not _END:
            if isinstance(batch, BaseException):
                raise batch
            _note_actors(actors, batch)
            ok = batch["status"] == "ok"
            engine_s, ready_at = batch.get("engine_s"), batch.get("engine_ready_at")
            timeline.batch(int(batch["num_tokens"][ok].sum()),
                           float(np.max(engine_s)) if engine_s is not None and len(engine_s) else None,
                           float(np.min(ready_at)) if ready_at is not None and len(ready_at) else None,
                           {k: float(np.min(batch[k])) for k in ACTOR_STARTS if k in batch and len(batch[k])})
            meter.update(samples=int(ok.sum()), tokens=int(batch["num_tokens"][ok].sum()),
                         nbytes=int(batch["num_tokens"][ok].sum()) * bytes_per_token(info.hidden_size,
                                                                                     cfg.extract.compact),
                         rejected=int((batch["status"] == "rejected").sum()))
            if time.monotonic() - last > 10:
                say(meter.line())
                last = time.monotonic()
    finally:  # on every exit: no iteration of this run's dataset outlives the stage (or its Ray session)
        results.close()
        start_file.unlink(missing_ok=True)
    say(meter.line())
    return _finish_extract(out, timeline, skipped, meter.rejected)


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


def _finish_extract(out: Path, timeline: _Timeline, skipped: int, rejected: int) -> ExtractSummary:
    from eagle3_ray.features import open_store

    store = open_store(out)
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
    )
    if not store.shards:
        raise StoreError(f"extraction wrote no samples to {out}; see {out / REJECTS_FILE}")
    write_json_atomic(out / SUMMARY_FILE, asdict(summary))
    say(
        f"[extract] store has {summary.samples} samples, {summary.tokens:,} tokens, "
        f"{summary.bytes_written / 1e9:.3f} GB; this run {summary.seconds}s, {rejected} rejected"
    )
    if summary.first_shard_s is not None:
        steady = f"{summary.steady_tokens_per_s:,.0f}" if summary.steady_tokens_per_s else "?"
        engine = (f", an engine actor ready after {summary.engine_ready_s}s, its build {summary.engine_s}s"
                  if summary.engine_s is not None else "")
        if summary.actor_init_s is not None:
            engine += (f" (its process started at {summary.actor_process_s}s, its constructor at "
                       f"{summary.actor_init_s}s, the engine's modules imported at {summary.actor_imported_s}s)")
        say(f"[extract] this run: {summary.run_tokens:,} tokens; first shard after {summary.first_shard_s}s "
            f"(planning {summary.plan_s}s, the driver's checks done at {summary.checks_s}s{engine}); {summary.run_tokens / seconds:,.0f} tokens/s end to end, "
            f"{steady} tokens/s after the first shard")
    return summary
