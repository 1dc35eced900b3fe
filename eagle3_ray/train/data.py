"""Training data on Ray Data: pack descriptors -> packed feature micro-batches per worker shard.

The driver turns the packing plan into rows `{"key", "samples"}`; `LoadPackUDF` reads those samples
from the feature store (safetensors slices) and emits one packed row per micro-batch; workers read
them through `ray.train.get_dataset_shard("train")`.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from eagle3_ray.drafter.ttt import split_rows
from eagle3_ray.features import open_store
from eagle3_ray.features.record import bf16_to_uint16, uint16_to_bf16
from eagle3_ray.train.packing import Pack, collate


def _ragged(arrays):
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


class LoadPackUDF:
    def __init__(self, store_root: str, on_corrupt: str = "abort"):
        self.store = open_store(store_root, on_corrupt=on_corrupt)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        cols: dict[str, list] = {k: [] for k in ("input_ids", "loss_mask", "aux_hidden", "last_hidden",
                                                "position_ids", "seq_ids")}
        for samples in batch["samples"]:
            packed = collate([self.store[int(i)] for i in samples])
            for k in cols:
                t = packed[k][0]
                cols[k].append(bf16_to_uint16(t) if t.dtype == torch.bfloat16 else t.numpy())
        return {"key": batch["key"], **{k: _ragged(v) for k, v in cols.items()}}


def pack_rows(packs: list[Pack]) -> list[dict]:
    return [{"key": p.key, "samples": np.asarray(p.samples, dtype=np.int64)} for p in packs]


def build_train_dataset(packs: list[Pack], store_root: str, on_corrupt: str, loaders: int = 2,
                        num_cpus: float | None = None):
    """Packed rows of `packs` read from the store by up to `loaders` LoadPackUDF actors (each
    reserving `num_cpus`, Ray Data's default when None)."""
    rows = pack_rows(packs)
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 200)))
    return ds.map_batches(
        LoadPackUDF,
        fn_constructor_kwargs=dict(store_root=store_root, on_corrupt=on_corrupt),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=loaders),
        batch_size=1,
        batch_format="numpy",
        **({} if num_cpus is None else {"num_cpus": num_cpus}),
    )


def row_to_batch(row: dict[str, np.ndarray], device, hidden_dtype, row_tokens: int | None = None) -> dict:
    """One packed row as the shard yields it (numpy, bf16 as uint16) -> `ttt_forward` batch tensors
    on `device`.

    [1, N] as packed; with `row_tokens` (sdpa) already laid out as [B, R] rows of whole samples
    (`split_rows`), done here on the host so the training step does not wait for the device to
    find the sample boundaries.
    """
    out = {k: uint16_to_bf16(np.ascontiguousarray(row[k]))[None] for k in ("aux_hidden", "last_hidden")}
    for k, dtype in (("input_ids", np.int64), ("loss_mask", np.bool_), ("position_ids", np.int64),
                     ("seq_ids", np.int64)):
        out[k] = torch.from_numpy(np.asarray(row[k], dtype=dtype))[None]
    if row_tokens:
        out = split_rows(out, row_tokens)
    return {k: v.to(device=device, dtype=hidden_dtype if k.endswith("_hidden") else v.dtype)
            for k, v in out.items()}
