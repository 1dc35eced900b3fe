"""The offline feature store: metadata, manifest (completion markers), rejects, writer.

Layout (docs/feature-store.md has the full description, readable without this package):

    <root>/store_meta.json                   format version, hidden_size, aux_layers, target, vocab
    <root>/shards/<writer>-<seq>.safetensors offsets int64 [n+1], aux_hidden bf16 [N, 3H],
                                             last_hidden bf16 [N, H], input_ids int32 [N],
                                             loss_mask uint8 [N]; n samples, N tokens in all
                                             (compact="fp8": the two hidden states in F8_E4M3 plus
                                             aux_hidden_scale f32 [N, 3], last_hidden_scale f32 [N, 1])
    <root>/shards/<writer>-<seq>.done.json   completion marker: sample_ids, tokens, bytes, sha256,
                                             producer (host:pid)
    <root>/rejects.jsonl                     {"sample_id", "source", "reason", "stage"} per line

Many writer processes share one directory. None of them appends to a shared index: each shard is
published by (temp file, fsync, rename, fsync dir) and only then gets its marker, written the same
way. The manifest is the set of markers, so a crash at any point leaves only complete shards
visible; a shard without a marker is an orphan and ignored. One shard's file names, tensor layout,
streamed write and checked load live in ``features/shards.py``, the reader in ``features/reader.py``,
the rejects file in ``eagle3_ray/rejects.py``; callers ask these modules, never build store paths
themselves. No Ray in here.
"""

from __future__ import annotations

import errno
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Sequence

import numpy as np

from eagle3_ray import __version__, atomic
from eagle3_ray.atomic import TMP_PREFIX, open_exclusive, remove_quietly
from eagle3_ray.errors import ConfigError, StoreError
from eagle3_ray.features.compact import check_format, compact_record
from eagle3_ray.features.record import (
    SAMPLE_ID,
    TENSOR_FIELDS,
    bytes_per_token,
    record_num_tokens,
    to_torch_record,
    validate_record,
)
from eagle3_ray.features.shards import (
    FORMAT_VERSION,
    MARKER_SUFFIX,
    SHARD_SUFFIX,
    existing_seqs,
    marker_bytes,
    marker_file,
    marker_files,
    marker_path,
    read_marker,
    read_token_columns,
    shard_file,
    shard_intact,
    shard_metadata,
    shard_name,
    shard_path,
    shards_dir,
    stream_shard,
)
from eagle3_ray.rejects import REJECTS_FILE, append_rejects, rejected_ids

logger = logging.getLogger(__name__)

META_FILE = "store_meta.json"
DEFAULT_SHARD_MAX_BYTES = 256 * 2**20

# Fields two runs must agree on to share a store; model_type and created_by are informational.
COMPAT_FIELDS = ("format_version", "hidden_size", "aux_layers", "target_fingerprint", "vocab_size", "dtype",
                 "compact")

_WRITER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class StoreMeta:
    hidden_size: int
    aux_layers: list[int]  # HF hidden_states indices (k = residual after k layers)
    target_fingerprint: str
    model_type: str
    vocab_size: int
    dtype: str = "bfloat16"  # of the records written and read; the shards hold it unless compact
    compact: str = "none"  # "fp8": shards hold fp8 + per-token scales (features/compact.py)
    format_version: int = FORMAT_VERSION
    created_by: str = f"eagle3_ray {__version__}"

    def __post_init__(self) -> None:
        check_format(self.compact)

    @classmethod
    def from_engine_info(cls, info: Any, compact: str = "none") -> "StoreMeta":
        """From an ``engines.base.EngineInfo``; records are bf16, stored as such or as ``compact``."""
        return cls(
            hidden_size=info.hidden_size,
            aux_layers=list(info.aux_layers),
            target_fingerprint=info.fingerprint,
            model_type=info.model_type,
            vocab_size=info.vocab_size,
            compact=compact,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StoreMeta":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**known)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mismatches(have: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    return [f"{k}: store has {have.get(k)!r}, expected {want[k]!r}" for k in want if have.get(k) != want[k]]


def check_compatible(store_meta: StoreMeta | Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Raise StoreError naming every field of ``expected`` (e.g. hidden_size, aux_layers,
    vocab_size) on which the store differs."""
    have = store_meta.to_dict() if isinstance(store_meta, StoreMeta) else dict(store_meta)
    unknown = [k for k in expected if k not in StoreMeta.__dataclass_fields__]
    assert not unknown, f"not store meta fields: {unknown}"
    bad = _mismatches(have, {k: list(v) if isinstance(v, tuple) else v for k, v in expected.items()})
    if bad:
        raise StoreError(
            "feature store does not match this run: " + "; ".join(bad) + ". Extract features for this "
            "target and config into a new --out, or train with the config the store was made for."
        )


# ---------------------------------------------------------------- atomic writes (eagle3_ray/atomic.py)


def _open_for_write(path: Path) -> BinaryIO:
    """Every store file is written through here (tests swap in a disk-full fake)."""
    return open_exclusive(path)


def _write_atomic(final: Path, data: bytes) -> None:
    atomic.write_bytes(final, data, opener=_open_for_write)


def _io_error(e: OSError, path: Path) -> StoreError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"disk full at {path} ({e.strerror}); free space on that disk"
    else:
        what = f"I/O error writing {path} ({e}); fix the storage"
    return StoreError(f"{what} and rerun: completed shards are kept and resume skips their samples")


# ---------------------------------------------------------------- store meta


def read_meta(root: str | Path) -> StoreMeta:
    path = Path(root) / META_FILE
    if not path.is_file():
        raise StoreError(f"no feature store at {root} ({META_FILE} missing); run extraction with --out {root}")
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise StoreError(f"{path} is unreadable ({e}); restore it or extract into a new --out") from e
    if d.get("format_version", 0) > FORMAT_VERSION:
        raise StoreError(f"{path} has format_version {d['format_version']}; this eagle3_ray reads up to "
                         f"{FORMAT_VERSION}: upgrade eagle3_ray")
    try:
        return StoreMeta.from_dict(d)  # a store from before the compact field reads as compact="none"
    except (TypeError, ConfigError) as e:
        raise StoreError(f"{path} lacks or has invalid fields ({e}); restore it or extract into a new --out") from e


def ensure_meta(root: str | Path, meta: StoreMeta) -> StoreMeta:
    """Create ``store_meta.json`` or check the existing one matches ``meta`` (safe under races)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(meta.to_dict(), indent=2) + "\n").encode()
    try:
        if not (root / META_FILE).exists() and atomic.publish_if_absent(root / META_FILE, data, _open_for_write):
            return meta
    except OSError as e:
        raise _io_error(e, root / META_FILE) from e
    existing = read_meta(root)
    bad = _mismatches(existing.to_dict(), {k: getattr(meta, k) for k in COMPAT_FIELDS})
    if existing.compact != meta.compact:
        raise StoreError(
            f"feature store {root} holds extract.compact={existing.compact!r} features and this run writes "
            f"{meta.compact!r} (" + "; ".join(bad) + "): a store has one format. Set "
            f"extract.compact={existing.compact} to add to it, or use a new --out for {meta.compact!r} features."
        )
    if bad:
        raise StoreError(
            f"feature store {root} was written for another target or config: " + "; ".join(bad)
            + ". Use a new --out for this run, or rerun with the same target and target.aux_layers."
        )
    return existing


def create_store(root: str | Path, meta: StoreMeta) -> StoreMeta:
    """Create the store at ``root`` for ``meta``, or check that the one there matches (as
    ``ensure_meta``); returns the store's meta. Call before any work that writes to it."""
    meta = ensure_meta(root, meta)
    shards_dir(root).mkdir(exist_ok=True)
    return meta


# ---------------------------------------------------------------- manifest (completion markers)


def manifest(root: str | Path) -> list[dict[str, Any]]:
    """Every readable completion marker, in shard-name order; unreadable ones are logged and left
    out (their samples are then not complete and get redone)."""
    out = []
    for m in marker_files(root):
        try:
            out.append(read_marker(m))
        except (OSError, ValueError) as e:
            logger.warning("ignoring unreadable completion marker %s: %s", m, e)
    return out


def _completed_markers(root: str | Path) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(marker path, marker) of every completed shard: marker readable, shard of the recorded size."""
    for m in marker_files(root):
        try:
            marker = read_marker(m)
        except (OSError, ValueError):
            continue
        if shard_intact(m, marker):
            yield m, marker


def completed_ids(root: str | Path) -> set[str]:
    """Sample ids in completed shards (marker present, shard of the recorded size): skip these
    when resuming. Cheap: reads markers and stats shards, never shard contents."""
    return {sid for _, marker in _completed_markers(root) for sid in marker["sample_ids"]}


def committed_tokens(root: str | Path) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """(sample id, input_ids int32 [T], loss_mask uint8 [T]) of every sample in a completed shard,
    read from the shards' token columns only (4 + 1 bytes a token, never the hidden states). A shard
    whose header cannot be read is passed over here (the readers' ``on_corrupt`` policy decides)."""
    for m, marker in _completed_markers(root):
        try:
            offsets, ids, mask = read_token_columns(shard_path(m), with_offsets=True)
        except Exception:  # noqa: BLE001 (safetensors raises its own types for a bad header)
            continue
        for k, sid in enumerate(marker["sample_ids"]):
            yield sid, ids[offsets[k]:offsets[k + 1]], mask[offsets[k]:offsets[k + 1]]


def finished(root: str | Path, sample_ids: Sequence[str]) -> np.ndarray:
    """Which of ``sample_ids`` the store is done with -> bool [n]: committed to a complete shard or
    quarantined in its rejects (a resumed extraction skips both). Reads the markers and the rejects
    once, never shard contents."""
    done = completed_ids(root) | rejected_ids(root)
    return np.fromiter((sid in done for sid in sample_ids), dtype=bool, count=len(sample_ids))


def batch_committed(root: str | Path, writer_id: str) -> bool:
    """Whether ``writer_id``'s first shard is complete. A writer named after its batch (one shard
    per batch, as extraction's engine actors write) then has nothing left to redo."""
    return marker_file(root, shard_name(writer_id, 0)).exists()


def writer_committed_ids(root: str | Path, writer_id: str) -> set[str]:
    """Sample ids in ``writer_id``'s completed shards. Reads only that writer's markers: a call named
    after its batch (hybrid training's capture actor) that is retried finds what its first attempt
    committed and does not write it again."""
    out: set[str] = set()
    try:
        seqs = sorted(set(existing_seqs(root, writer_id)))
    except FileNotFoundError:  # no shard written yet
        return out
    for seq in seqs:
        m = marker_file(root, shard_name(writer_id, seq))
        try:
            marker = read_marker(m)
        except (OSError, ValueError):
            continue
        if shard_intact(m, marker):
            out.update(marker["sample_ids"])
    return out


def cleanup_orphans(root: str | Path) -> list[Path]:
    """Remove what a crash leaves behind: temp files, shards without a marker, and markers whose
    shard is missing or truncated. Only call while no writer is running on ``root`` (a live
    writer's shard is unmarked for a moment). Returns the removed paths."""
    d = shards_dir(root)
    if not d.is_dir():
        return []
    removed: list[Path] = []
    names = {p.name for p in d.iterdir()}
    for name in sorted(names):
        p = d / name
        if name.startswith(TMP_PREFIX):
            removed.append(p)
        elif name.endswith(SHARD_SUFFIX) and marker_path(p).name not in names:
            removed.append(p)
        elif name.endswith(MARKER_SUFFIX):
            try:
                intact = shard_intact(p, read_marker(p))
            except (OSError, ValueError):
                intact = False
            if not intact:
                removed += [p] + ([shard_path(p)] if shard_path(p).name in names else [])
    for p in removed:
        logger.info("removing incomplete store file %s", p)
        remove_quietly(p)
    return removed


# ---------------------------------------------------------------- rejects (eagle3_ray/rejects.py)


def append_reject(root: str | Path, sample_id: str, source: str, reason: str, stage: str) -> None:
    """Quarantine one sample in the store's rejects file."""
    try:
        append_rejects(root, [{"sample_id": sample_id, "source": source, "reason": reason, "stage": stage}])
    except OSError as e:
        raise _io_error(e, Path(root) / REJECTS_FILE) from e


# ---------------------------------------------------------------- writer


def _publish_shard(
    shard: Path, records: Sequence[Mapping[str, Any]], metadata: dict[str, str], meta: StoreMeta
) -> tuple[int, str]:
    """Temp file, fsync, rename, fsync dir. Returns (bytes, sha256). On OSError nothing is left."""
    try:
        sha = atomic.write_stream(
            shard, lambda f: stream_shard(f, records, metadata, meta.compact, meta.hidden_size),
            _open_for_write)
    except OSError as e:
        raise _io_error(e, shard) from e
    return shard.stat().st_size, sha


class FeatureStoreWriter:
    """Buffers validated records and writes them as atomic shards of about ``shard_max_bytes``
    (``extract.shard_max_bytes``), or, with ``shard_max_bytes=None``, as one shard on ``close``.

    One writer per process (Ray Data actor); ``writer_id`` must be unique among the writers
    running on ``root`` at the same time. A writer restarted with an old id continues its
    sequence numbers, so it never replaces a completed shard. Records are referenced, not
    copied, until their shard is written: do not modify them after ``add``.

    ``on_shard(shard name, notes)``, called before each shard is published with the ``note`` given
    to ``add`` for each of its records, returns more marker fields; an exception it raises (the
    capture audit's ``AuditFailed``) leaves the shard unwritten and its records dropped.
    """

    def __init__(self, root: str | Path, meta: StoreMeta, writer_id: str,
                 shard_max_bytes: int | None = DEFAULT_SHARD_MAX_BYTES, node: Mapping[str, str] | None = None,
                 on_shard: Callable[[str, list[Any]], Mapping[str, Any]] | None = None):
        if not _WRITER_ID.match(writer_id):
            raise StoreError(f"writer_id {writer_id!r} must match {_WRITER_ID.pattern} (it names shard files)")
        if shard_max_bytes is not None and shard_max_bytes < 1:
            raise ConfigError(f"extract.shard_max_bytes={shard_max_bytes} must be >= 1")
        self.root = Path(root)
        self.meta = create_store(self.root, meta)
        self.writer_id = writer_id
        self.node = dict(node) if node else None  # recorded in each marker: which Ray node wrote the shard
        self.shard_max_bytes = shard_max_bytes
        self._seq = max(existing_seqs(self.root, writer_id), default=-1) + 1
        self._buffer: list[dict[str, Any]] = []
        self._notes: list[Any] = []
        self._on_shard = on_shard
        self._buffer_bytes = 0
        self._bpt = bytes_per_token(self.meta.hidden_size, self.meta.compact)
        self._closed = False
        self.shards_written: list[Path] = []
        self.samples_written = 0
        self.tokens_written = 0

    def add(self, record: Mapping[str, Any], note: Any = None) -> None:
        """Validate (SampleRejected on a bad record: pass it to ``reject``), buffer, and write a
        shard once the buffer holds ``shard_max_bytes``. Records are bf16 in every format; an fp8
        store quantizes them here, after validation. ``note``: handed to ``on_shard``."""
        if self._closed:
            raise StoreError(f"writer {self.writer_id} is closed")
        rec = to_torch_record(record)
        validate_record(rec, self.meta.hidden_size, self.meta.vocab_size)
        rec = {SAMPLE_ID: rec[SAMPLE_ID], **{k: rec[k].detach().cpu() for k in TENSOR_FIELDS}}
        if self.meta.compact == "fp8":
            rec = compact_record(rec)
        self._buffer.append(rec)
        self._notes.append(note)
        self._buffer_bytes += record_num_tokens(rec) * self._bpt
        if self.shard_max_bytes is not None and self._buffer_bytes >= self.shard_max_bytes:
            self.flush()

    def reject(self, sample_id: str, source: str, reason: str, stage: str) -> None:
        append_reject(self.root, sample_id, source, reason, stage)

    def _next_name(self) -> str:
        while True:
            name = shard_name(self.writer_id, self._seq)
            self._seq += 1
            if not (shard_file(self.root, name).exists() or marker_file(self.root, name).exists()):
                return name

    def flush(self) -> Path | None:
        """Write the buffered records as one shard plus its marker; returns the shard path. On a
        disk error raises StoreError and keeps the buffer, so a later flush can retry."""
        if not self._buffer:
            return None
        name = self._next_name()
        shard = shard_file(self.root, name)
        ids = [r[SAMPLE_ID] for r in self._buffer]
        try:
            extra = self._on_shard(name, self._notes) if self._on_shard is not None else None
        except BaseException:
            self._buffer, self._notes, self._buffer_bytes = [], [], 0
            raise
        metadata = shard_metadata(self.writer_id, ids, self.meta.aux_layers, self.meta.hidden_size,
                                  self.meta.compact)
        nbytes, sha = _publish_shard(shard, self._buffer, metadata, self.meta)
        tokens = sum(record_num_tokens(r) for r in self._buffer)
        marker = marker_path(shard)
        try:
            _write_atomic(marker, marker_bytes(shard, self.writer_id, ids, tokens, nbytes, sha,
                                                  self.node, extra))
        except OSError as e:
            remove_quietly(shard)  # unmarked it is an orphan anyway; free its space now
            raise _io_error(e, marker) from e
        self.shards_written.append(shard)
        self.samples_written += len(ids)
        self.tokens_written += tokens
        self._buffer, self._notes, self._buffer_bytes = [], [], 0
        return shard

    def close(self) -> None:
        if not self._closed:
            self.flush()
            self._closed = True

    def __enter__(self) -> "FeatureStoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # buffered samples are not complete, so a resumed run redoes them
            self._buffer, self._notes, self._closed = [], [], True
