"""One feature shard: its file names, tensor layout, safetensors header, streamed write and checked load.

A shard is ``shards/<writer>-<seq>.safetensors`` with its completion marker
``shards/<writer>-<seq>.done.json`` next to it (docs/feature-store.md). Only this module knows
those names and the tensor layout inside; ``features/store.py`` builds the store on top of it.
No Ray in here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Mapping, Sequence

import numpy as np
import torch
from safetensors import safe_open

from eagle3_ray.atomic import TMP_PREFIX
from eagle3_ray.features.compact import FIELD_BLOCKS, FP8_DTYPE, SCALE_DTYPE, expand_record, scale_name
from eagle3_ray.features.record import (
    AUX_HIDDEN,
    INPUT_IDS,
    LAST_HIDDEN,
    LOSS_MASK,
    SAMPLE_ID,
    TENSOR_FIELDS,
    record_num_tokens,
)

FORMAT_NAME = "eagle3_ray.features"
FORMAT_VERSION = 1
SHARDS_DIR = "shards"
SHARD_SUFFIX = ".safetensors"
MARKER_SUFFIX = ".done.json"
MARKERS_GLOB = f"{SHARDS_DIR}/*{MARKER_SUFFIX}"  # every completion marker, from the store's root (for messages)
OFFSETS = "offsets"

ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bfloat16: "BF16",
             torch.float32: "F32", FP8_DTYPE: "F8_E4M3"}
_HIDDEN_FIELDS = (AUX_HIDDEN, LAST_HIDDEN)


# ---------------------------------------------------------------- file names


def shards_dir(root: str | Path) -> Path:
    return Path(root) / SHARDS_DIR


def shard_name(writer_id: str, seq: int) -> str:
    """``<writer>-<seq>``, the stem of a shard and of its marker."""
    return f"{writer_id}-{seq:06d}"


def shard_file(root: str | Path, name: str) -> Path:
    return shards_dir(root) / f"{name}{SHARD_SUFFIX}"


def marker_file(root: str | Path, name: str) -> Path:
    return shards_dir(root) / f"{name}{MARKER_SUFFIX}"


def marker_path(shard: Path) -> Path:
    return shard.with_name(shard.name[: -len(SHARD_SUFFIX)] + MARKER_SUFFIX)


def shard_path(marker: Path) -> Path:
    return marker.with_name(marker.name[: -len(MARKER_SUFFIX)] + SHARD_SUFFIX)


def marker_files(root: str | Path) -> list[Path]:
    """Every completion marker under ``root``, in shard-name order."""
    d = shards_dir(root)
    if not d.is_dir():
        return []
    return sorted(p for p in d.iterdir() if p.name.endswith(MARKER_SUFFIX) and not p.name.startswith(TMP_PREFIX))


def existing_seqs(root: str | Path, writer_id: str) -> list[int]:
    """Sequence numbers of ``writer_id``'s shards and markers present under ``root``."""
    pat = re.compile(rf"^{re.escape(writer_id)}-(\d+)({re.escape(SHARD_SUFFIX)}|{re.escape(MARKER_SUFFIX)})$")
    return [int(m.group(1)) for p in shards_dir(root).iterdir() if (m := pat.match(p.name))]


# ---------------------------------------------------------------- completion marker


def read_marker(path: Path) -> dict[str, Any]:
    """Parsed marker; ValueError/OSError when it cannot be used."""
    d = json.loads(path.read_text(encoding="utf-8"))
    for key, typ in (("sample_ids", list), ("tokens", int), ("bytes", int), ("sha256", str)):
        if not isinstance(d.get(key), typ):
            raise ValueError(f"marker field {key!r} missing or not {typ.__name__}")
    return d


def marker_bytes(shard: Path, writer_id: str, sample_ids: list[str], tokens: int, nbytes: int, sha256: str,
                 node: Mapping[str, str] | None = None, extra: Mapping[str, Any] | None = None) -> bytes:
    """The completion marker of a published shard, as written to disk. ``node`` (informational, like
    ``producer``): the Ray node of the writing process, {"ip": ..., "id": ...}, when it runs in Ray.
    ``extra``: more fields (the capture audit's ``audit`` and ``greedy_ids``), which readers that do
    not know them ignore."""
    marker = {"format_version": FORMAT_VERSION, "shard": shard.name, "writer": writer_id,
              "producer": f"{socket.gethostname()}:{os.getpid()}",  # which process wrote it (informational)
              "sample_ids": sample_ids, "num_samples": len(sample_ids), "tokens": tokens, "bytes": nbytes,
              "sha256": sha256}
    if node:
        marker["node"] = dict(node)
    marker.update(extra or {})
    return (json.dumps(marker) + "\n").encode()


def shard_intact(marker: Path, content: Mapping[str, Any]) -> bool:
    """The marker's shard exists with the size the marker recorded."""
    try:
        return shard_path(marker).stat().st_size == content["bytes"]
    except OSError:
        return False


# ---------------------------------------------------------------- layout and header


def shard_layout(compact: str, n: int, n_tok: int, hidden: int) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of every shard tensor in data-section order. Every tensor starts
    naturally aligned in an mmap: the 8-byte offsets first, and each tensor's byte size before
    the int32 ids is a multiple of 4 (8·(n+1), 16·N scales, 8·H·N bf16 or 4·H·N fp8)."""
    widths = {AUX_HIDDEN: 3 * hidden, LAST_HIDDEN: hidden}
    layout = [(OFFSETS, torch.int64, [n + 1])]
    if compact == "fp8":
        layout += [(scale_name(k), SCALE_DTYPE, [n_tok, FIELD_BLOCKS[k]]) for k in _HIDDEN_FIELDS]
        layout += [(k, FP8_DTYPE, [n_tok, widths[k]]) for k in _HIDDEN_FIELDS]
    else:
        layout += [(k, torch.bfloat16, [n_tok, widths[k]]) for k in _HIDDEN_FIELDS]
    return layout + [(INPUT_IDS, torch.int32, [n_tok]), (LOSS_MASK, torch.uint8, [n_tok])]


def shard_metadata(writer_id: str, sample_ids: list[str], aux_layers: list[int], hidden_size: int,
                   compact: str) -> dict[str, str]:
    """The safetensors ``__metadata__`` of a shard."""
    metadata = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "writer": writer_id,
                "sample_ids": json.dumps(sample_ids), "aux_layers": json.dumps(aux_layers),
                "hidden_size": str(hidden_size)}
    if compact != "none":  # bf16 shards keep the metadata they always had
        metadata["compact"] = compact
    return metadata


def _raw_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def safetensors_header(tensors: Sequence[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]) -> bytes:
    """The safetensors header for tensors laid out back to back in the given order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    start = 0
    for name, dtype, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": shape, "data_offsets": [start, start + nbytes]}
        start += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # keeps the data section 8-byte aligned
    return struct.pack("<Q", len(blob)) + blob


def stream_shard(f: BinaryIO, records: Sequence[Mapping[str, Any]], metadata: dict[str, str], compact: str,
                 hidden_size: int) -> str:
    """Write one shard in safetensors format straight from the per-sample tensors (no concatenated
    copy of a 256 MiB shard in memory) and return its sha256. Records are already in the shard's
    format (``compact_record`` applied for fp8)."""
    lengths = [record_num_tokens(r) for r in records]
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64)  # [n+1]
    layout = shard_layout(compact, len(records), int(offsets[-1]), hidden_size)
    sha = hashlib.sha256()

    def put(buf: bytes | memoryview) -> None:
        f.write(buf)
        sha.update(buf)

    put(safetensors_header(layout, metadata))
    put(_raw_bytes(offsets))
    for name, dtype, _ in layout[1:]:
        for r in records:
            assert r[name].dtype == dtype, f"{name} is {r[name].dtype}, the shard layout says {dtype}"
            put(_raw_bytes(r[name]))
    return sha.hexdigest()


# ---------------------------------------------------------------- checked load


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    sample_ids: list[str]
    tokens: int
    bytes: int
    sha256: str
    offsets: np.ndarray = field(repr=False)  # int64 [n+1], token offsets of the samples


class CorruptShard(Exception):
    pass


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _check_layout(f: Any, compact: str, hidden_size: int, n: int) -> int:
    """Checks tensor names, dtypes and shapes of an open shard; returns its token count N."""
    names = {name for name, _, _ in shard_layout(compact, n, 0, hidden_size)}
    if set(f.keys()) != names:
        raise CorruptShard(f"tensors {sorted(f.keys())}, expected {sorted(names)} "
                           f"(store format compact={compact!r})")
    n_tok = (f.get_slice(INPUT_IDS).get_shape() or [-1])[0]
    for name, dtype, shape in shard_layout(compact, n, n_tok, hidden_size):
        s = f.get_slice(name)
        if (s.get_dtype(), list(s.get_shape())) != (ST_DTYPES[dtype], shape):
            raise CorruptShard(f"{name} is {s.get_dtype()} {s.get_shape()}, expected {ST_DTYPES[dtype]} {shape}")
    return n_tok


def _json_field(metadata: Mapping[str, str], key: str) -> Any:
    try:
        return json.loads(metadata[key])
    except (KeyError, ValueError) as e:
        raise CorruptShard(f"shard metadata {key!r} missing or not JSON") from e


def load_shard(marker: Path, compact: str, hidden_size: int, aux_layers: list[int], verify: bool) -> ShardInfo:
    """Check the shard of ``marker`` against the marker and the store's format; CorruptShard if it
    does not hold. ``verify`` also compares its sha256 (reads every byte)."""
    path = shard_path(marker)
    try:
        content = read_marker(marker)
    except (OSError, ValueError) as e:
        raise CorruptShard(f"unreadable completion marker {marker.name}: {e}") from e
    if not path.is_file():
        raise CorruptShard("shard file missing (its marker exists)")
    size = path.stat().st_size
    if size != content["bytes"]:
        raise CorruptShard(f"size {size} bytes, marker says {content['bytes']} (truncated or overwritten)")
    if verify and _sha256_file(path) != content["sha256"]:
        raise CorruptShard("sha256 differs from its marker (bytes changed on disk)")
    ids = content["sample_ids"]
    try:
        with safe_open(str(path), framework="pt") as f:
            n_tok = _check_layout(f, compact, hidden_size, len(ids))
            md = f.metadata() or {}
            offsets = f.get_tensor(OFFSETS).numpy()  # [n+1]
    except CorruptShard:
        raise
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CorruptShard(f"bad safetensors header: {e}") from e
    if _json_field(md, "sample_ids") != ids:
        raise CorruptShard("sample ids in the shard differ from its marker")
    if _json_field(md, "aux_layers") != list(aux_layers):
        raise CorruptShard(f"aux layers {md.get('aux_layers')} differ from the store's {aux_layers}")
    if md.get("compact", "none") != compact:
        raise CorruptShard(f"format compact={md.get('compact', 'none')!r} differs from the store's {compact!r}")
    if n_tok != content["tokens"] or offsets[0] != 0 or offsets[-1] != n_tok or (np.diff(offsets) <= 0).any():
        raise CorruptShard(f"offsets inconsistent with {n_tok} tokens (marker: {content['tokens']})")
    return ShardInfo(path=path, sample_ids=list(ids), tokens=n_tok, bytes=size, sha256=content["sha256"],
                     offsets=offsets.astype(np.int64))


def open_shard(path: Path) -> Any:
    """A safetensors handle on a shard for ``read_sample``."""
    return safe_open(str(path), framework="pt")


def read_sample(handle: Any, sample_id: str, start: int, end: int, compact: str,
                as_stored: bool = False) -> dict[str, Any]:
    """One record from rows [start, end) of an open shard; hidden states in bf16 whatever ``compact``.
    ``as_stored``: as the shard holds it instead (fp8: float8_e4m3fn plus ``<field>_scale`` fp32
    [T, B], for ``compact.expand_record`` or a reader that dequantizes elsewhere)."""
    fp8 = compact == "fp8"
    names = TENSOR_FIELDS + (tuple(scale_name(n) for n in FIELD_BLOCKS) if fp8 else ())
    rec: dict[str, Any] = {SAMPLE_ID: sample_id}
    for name in names:
        rec[name] = handle.get_slice(name)[start:end]  # reads rows [start, end) only
    return expand_record(rec) if fp8 and not as_stored else rec


def read_token_columns(path: str | Path, with_offsets: bool = False) -> tuple[np.ndarray, ...]:
    """``input_ids`` int32 [N] and ``loss_mask`` uint8 [N] of every token in a shard; with
    ``with_offsets``, the samples' token offsets int64 [n+1] first."""
    with safe_open(str(path), framework="np") as f:
        columns = (f.get_tensor(INPUT_IDS), f.get_tensor(LOSS_MASK))
        return (f.get_tensor(OFFSETS), *columns) if with_offsets else columns
