"""The draft vocabulary map (docs/contracts.md, "Vocab map"). No Ray in here.

The drafter predicts over the ``draft_vocab_size`` most frequent target tokens (counted over
loss-masked tokens only). Two tensors translate between the vocabularies:

    d2t  int64 [draft_vocab]  target_id = draft_id + d2t[draft_id]   (draft ids in target-id order)
    t2d  bool  [vocab]        t2d[target_id] is True iff the target token is in the draft vocab

``count_tokens`` results add up, so counting can run per block anywhere and be summed.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file, save_file

from eagle3_ray.atomic import write_file
from eagle3_ray.errors import ConfigError, DataError, StoreError

VOCAB_FILE = "vocab_map.safetensors"  # the map's file in a vocab stage's --out
_FINGERPRINT_VERSION = "vocab-map-v1"


def _as_numpy(a: Any) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def count_tokens(input_ids: Any, loss_mask: Any, vocab_size: int) -> np.ndarray:
    """Frequency of each target token over loss-masked positions -> int64 [vocab_size].
    ``input_ids`` and ``loss_mask`` are same-shape arrays or tensors (any rank, e.g. a padded batch)."""
    ids, mask = _as_numpy(input_ids), _as_numpy(loss_mask)
    if ids.shape != mask.shape:
        raise DataError(f"input_ids {ids.shape} and loss_mask {mask.shape} must have the same shape")
    picked = ids[mask.astype(bool)].astype(np.int64)  # [M] loss-masked token ids
    if picked.size and (picked.min() < 0 or picked.max() >= vocab_size):
        raise DataError(f"token id {int(picked.max())} is outside the target vocab [0, {vocab_size}): "
                        "the data was tokenized with another tokenizer than the target's")
    return np.bincount(picked, minlength=vocab_size).astype(np.int64)


def build_vocab_map(counts: Any, draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft], t2d bool [vocab]) from token counts int64 [vocab].

    Picks the ``draft_vocab_size`` most frequent ids, ties broken by the lower id; when fewer
    distinct tokens occur, the lowest unseen ids fill the rest so the draft vocab is full."""
    counts = _as_numpy(counts).astype(np.int64)
    vocab = counts.shape[0]
    if not 1 <= draft_vocab_size <= vocab:
        raise ConfigError(f"vocab.draft_vocab_size={draft_vocab_size} must be in [1, target vocab size "
                          f"{vocab}]; set it to at most {vocab}")
    # lexsort: last key is primary -> by count descending, then id ascending (zero counts last,
    # lowest ids first: exactly the padding rule)
    order = np.lexsort((np.arange(vocab), -counts))
    chosen = np.sort(order[:draft_vocab_size])  # [draft] target ids, ascending
    d2t = chosen - np.arange(draft_vocab_size, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target_ids(d2t: np.ndarray) -> np.ndarray:
    """Target id of every draft id -> int64 [draft]."""
    return np.arange(d2t.shape[0], dtype=np.int64) + d2t


def vocab_coverage(counts: Any, t2d: np.ndarray) -> float:
    """Fraction of loss-masked tokens whose target id is in the draft vocab (0.0 with no tokens)."""
    counts = _as_numpy(counts)
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


def data_fingerprint(sample_ids: Iterable[str], lengths: Iterable[int]) -> str:
    """Identifies a set of samples by their ids and token counts (int [N]), whatever their order or
    shard layout: the same for a feature store and for the prepared data it was extracted from."""
    h = hashlib.sha256()
    for sid, n in sorted(zip(sample_ids, lengths)):
        h.update(f"{sid}:{n};".encode())
    return h.hexdigest()[:16]


def vocab_fingerprint(data_fingerprint: str, target_fingerprint: str, draft_vocab_size: int) -> str:
    """Cache key of a vocab map: same data, same target, same size -> same map."""
    key = json.dumps([_FINGERPRINT_VERSION, data_fingerprint, target_fingerprint, draft_vocab_size])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _check_consistent(d2t: np.ndarray, t2d: np.ndarray, path: Path) -> None:
    target_ids = draft_to_target_ids(d2t)
    ok = (d2t.dtype == np.int64 and t2d.dtype == np.bool_ and d2t.ndim == 1 and t2d.ndim == 1
          and int(t2d.sum()) == d2t.shape[0] and np.array_equal(np.flatnonzero(t2d), target_ids))
    if not ok:
        raise StoreError(f"vocab map {path} is inconsistent (d2t and t2d disagree); delete it and rerun "
                         "`eagle3-ray vocab`")


def save_vocab_map(path: str | Path, d2t: np.ndarray, t2d: np.ndarray, meta: Mapping[str, Any]) -> Path:
    """Write ``d2t``/``t2d`` to a safetensors file with ``meta`` (data_fingerprint,
    target_fingerprint, draft_vocab_size, coverage, ...) as JSON-encoded metadata; atomic."""
    path = Path(path)
    d2t, t2d = _as_numpy(d2t), _as_numpy(t2d)
    _check_consistent(d2t, t2d, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {k: json.dumps(v) for k, v in meta.items()}
    write_file(path, lambda tmp: save_file({"d2t": d2t, "t2d": t2d}, str(tmp), metadata=metadata))
    return path


def load_vocab_map(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """(d2t int64 [draft], t2d bool [vocab], meta) as saved by ``save_vocab_map``."""
    path = Path(path)
    if not path.is_file():
        raise StoreError(f"vocab map {path} does not exist; run `eagle3-ray vocab` first")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="np") as f:
            raw_meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise StoreError(f"vocab map {path} is unreadable ({e}); delete it and rerun `eagle3-ray vocab`") from e
    if set(tensors) != {"d2t", "t2d"}:
        raise StoreError(f"{path} holds {sorted(tensors)}, not a vocab map (d2t, t2d)")
    _check_consistent(tensors["d2t"], tensors["t2d"], path)
    return tensors["d2t"], tensors["t2d"], {k: json.loads(v) for k, v in raw_meta.items()}
