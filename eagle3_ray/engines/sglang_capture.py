"""Reading the capture hook's files: one request's rows of its batch's safetensors file, mapped
without a copy and checked, and the filesystem check the hook's hard links need.

The hook (``engines/sglang_hooks.py``) writes each forward batch as one safetensors file and links
it once per request as ``<dir>/<rid>.safetensors``; ``SGLangEngine.capture`` waits for a request's
link and hands it to ``read_capture``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from eagle3_ray.audit.rows import RowFigures
from eagle3_ray.engines.base import Capture
from eagle3_ray.engines.sglang_hooks import CAPTURE_SUFFIX
from eagle3_ray.errors import ConfigError, EngineError

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
    check they cover the whole sequence, and delete the link. The request's capture audit figures
    come with it where the hook computed them (``Capture.audit``; None where it did not)."""
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
    audit = None
    if "audit" in tensors and rid in (index := json.loads(meta.get("audit", "{}"))):
        first, count = index[rid]
        audit = RowFigures.unpacked(tensors["audit"][first:first + count].clone())
    return Capture(aux_hidden=aux, last_hidden=last, audit=audit)


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
