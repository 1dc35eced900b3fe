"""The feature store's reader: the completed shards as a sized, indexable iterable of records.

``open_store`` checks every completed shard (``features/shards.py``: header, shapes, offsets, size;
optionally its sha256) against the store's metadata (``features/store.py``) and serves their samples
by index, each read alone from its shard. No Ray in here.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np

from eagle3_ray.errors import ConfigError, StoreError
from eagle3_ray.features.shards import (
    CorruptShard,
    ShardInfo,
    load_shard,
    marker_files,
    open_shard,
    read_sample,
    shard_path,
)
from eagle3_ray.features.store import StoreMeta, read_meta

logger = logging.getLogger(__name__)


class FeatureStore:
    """Read-only view of the completed shards: a sized, indexable iterable of feature records.

    Order is deterministic (shard name, then position in shard). A sample id that appears in
    several shards (a duplicated extraction) is served once, first occurrence wins; the others are
    listed in ``duplicate_ids``. ``store[i]`` reads only that sample's rows from the shard.
    Hidden states come back in bf16 whatever the store's format (fp8 is dequantized on read), unless
    read with ``read(i, as_stored=True)``.
    """

    _MAX_OPEN = 8  # open shard handles kept for random access

    def __init__(self, root: Path, meta: StoreMeta, infos: list[ShardInfo], skipped: list[dict[str, str]]):
        self.root = root
        self.meta = meta
        self.shards = infos
        self.skipped_shards = skipped
        seen: set[str] = set()
        loc: list[tuple[int, int]] = []
        self.duplicate_ids: list[str] = []
        for k, s in enumerate(infos):
            for j, sid in enumerate(s.sample_ids):
                if sid in seen:
                    self.duplicate_ids.append(sid)
                    continue
                seen.add(sid)
                loc.append((k, j))
        self._loc = np.array(loc, dtype=np.int64).reshape(-1, 2)  # [n, 2] (shard, row)
        self.sample_ids = [infos[k].sample_ids[j] for k, j in loc]
        shard_lengths = [np.diff(s.offsets) for s in infos]
        self.lengths = np.array([shard_lengths[k][j] for k, j in loc], dtype=np.int64)  # [n] tokens
        self.num_tokens = int(self.lengths.sum())
        self._handles: OrderedDict[int, Any] = OrderedDict()
        if self.duplicate_ids:
            logger.warning("feature store %s: %d duplicated sample ids served once (first shard wins), "
                           "e.g. %s", root, len(self.duplicate_ids), self.duplicate_ids[:3])

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]

    def _handle(self, k: int) -> Any:
        if k in self._handles:
            self._handles.move_to_end(k)
        else:
            self._handles[k] = open_shard(self.shards[k].path)
            if len(self._handles) > self._MAX_OPEN:
                self._handles.popitem(last=False)
        return self._handles[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.read(i)

    def read(self, i: int, as_stored: bool = False) -> dict[str, Any]:
        """Sample ``i`` (``store[i]``); ``as_stored=True``: its hidden states as the shards hold
        them (an fp8 store: float8_e4m3fn plus ``aux_hidden_scale`` / ``last_hidden_scale`` fp32
        [T, B], see features/compact.py; a bf16 store: the same as ``store[i]``)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample index {i} out of range for a store of {len(self)} samples")
        k, j = (int(x) for x in self._loc[i])
        start, end = (int(x) for x in self.shards[k].offsets[j:j + 2])
        return read_sample(self._handle(k), self.shards[k].sample_ids[j], start, end, self.meta.compact,
                           as_stored=as_stored)

    def close(self) -> None:
        """Release the open shard files (reading again reopens them)."""
        self._handles.clear()

    def __getstate__(self) -> dict[str, Any]:
        # open file handles do not cross process boundaries; each process reopens lazily
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        return state


def open_store(root: str | Path, on_corrupt: Literal["abort", "skip"] = "abort", verify: bool = False) -> FeatureStore:
    """Open the completed shards of a store. Every shard's header, tensor shapes, offsets and size
    are checked; ``verify=True`` also checks each shard's sha256 (reads every byte). A corrupt shard
    raises StoreError (``on_corrupt="abort"``) or is left out, logged and listed in
    ``store.skipped_shards`` (``"skip"``)."""
    if on_corrupt not in ("abort", "skip"):
        raise ConfigError(f"extract.on_corrupt_shard={on_corrupt!r} must be 'abort' or 'skip'")
    root = Path(root)
    meta = read_meta(root)
    infos, skipped = [], []
    for m in marker_files(root):
        try:
            infos.append(load_shard(m, meta.compact, meta.hidden_size, meta.aux_layers, verify))
        except CorruptShard as e:
            path = shard_path(m)
            if on_corrupt == "abort":
                raise StoreError(
                    f"corrupt feature shard {path}: {e}. Delete {path.name} and {m.name}, then rerun "
                    f"extraction with the same --out to regenerate its samples, or read with "
                    f"extract.on_corrupt_shard=skip to leave them out"
                ) from None
            logger.warning("skipping corrupt feature shard %s: %s", path, e)
            skipped.append({"path": str(path), "reason": str(e)})
    return FeatureStore(root, meta, infos, skipped)
