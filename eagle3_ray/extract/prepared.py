"""The prepared dataset: ``prepared.parquet``, what the prepare stage writes and extraction, online
training and the online vocab map read.

One row per kept sample, sorted by ``sample_id``: ``sample_id`` string, ``input_ids`` list<int32>,
``loss_mask`` list<uint8>, ``num_tokens`` int64, ``source`` string, ``greedy_by`` string (the
fingerprint of the target that answered the sample greedily, "" if none; absent in files written
before it existed) (docs/pipeline.md, "prepare").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from eagle3_ray.errors import DataError

PREPARED_FILE = "prepared.parquet"


def prepared_path(data: str | Path) -> Path | None:
    """A prepared dataset: a prepare output dir or its parquet file; None if `data` is raw input."""
    p = Path(data)
    if p.is_dir() and (p / PREPARED_FILE).is_file():
        return p / PREPARED_FILE
    if p.is_file() and p.suffix == ".parquet":
        return p
    return None


def require_prepared(data: str | Path) -> Path:
    """``prepared_path(data)``, or ``DataError`` when ``data`` is not a prepared dataset."""
    src = prepared_path(data)
    if src is None:
        raise DataError(f"{data} is not a prepared dataset; run `eagle3-ray prepare` first")
    return src


def read_prepared(prepared: str | Path):
    """(sample_ids [N], lengths int64 [N], input_ids [N] int32 arrays, loss_mask [N] uint8 arrays)."""
    table = pq.read_table(require_prepared(prepared), columns=["sample_id", "input_ids", "loss_mask", "num_tokens"])
    ids = [np.asarray(a, dtype=np.int32) for a in table.column("input_ids").to_numpy(zero_copy_only=False)]
    masks = [np.asarray(a, dtype=np.uint8) for a in table.column("loss_mask").to_numpy(zero_copy_only=False)]
    return table.column("sample_id").to_pylist(), table.column("num_tokens").to_numpy(), ids, masks


def read_greedy_by(prepared: str | Path) -> list[str]:
    """Each row's ``greedy_by`` ("" for every row of a prepared file written before the column)."""
    src = require_prepared(prepared)
    if "greedy_by" not in pq.read_schema(src).names:
        return [""] * pq.read_metadata(src).num_rows
    return [str(s) for s in pq.read_table(src, columns=["greedy_by"]).column("greedy_by").to_pylist()]
