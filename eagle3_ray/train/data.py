"""Training data on Ray Data: pack descriptors -> packed feature micro-batches per worker shard.

The driver turns the packing plan into rows `{"key", "samples"}`; `LoadPackUDF` reads those samples
from the feature store (safetensors slices) and emits one packed row per micro-batch; workers read
them through `ray.train.get_dataset_shard("train")`.

A packed row comes in one of two forms, told apart by its columns (`row_to_batch` takes both):

- bf16: `aux_hidden` uint16 [N, 3H] and `last_hidden` uint16 [N, H], bf16 bit patterns (bf16
  stores, and the online path's `PackCaptureUDF` rows);
- fp8, as an fp8 store holds it: `aux_hidden` uint8 [N, 3H] and `last_hidden` uint8 [N, H] holding
  float8_e4m3fn bit patterns, plus `aux_hidden_scale` fp32 [N, 3] and `last_hidden_scale` fp32
  [N, 1]. The loader does no dequantization on its CPU (it throttled training: 0.4-0.65 s per
  16K-token pack on one core); `row_to_batch` dequantizes after the copy to the training device,
  which also moves 4H + 16 bytes per token instead of 8H.

Both forms share `input_ids`, `loss_mask`, `position_ids` and `seq_ids`.
"""

from __future__ import annotations

import numpy as np
import ray
import torch

from eagle3_ray.features import open_store
from eagle3_ray.features.compact import FIELD_BLOCKS, dequantize_fp8_bits, scale_name
from eagle3_ray.features.record import AUX_HIDDEN, LAST_HIDDEN, bf16_to_uint16, ragged, uint16_to_bf16
from eagle3_ray.train.packing import Pack, collate

HIDDEN_KEYS = (AUX_HIDDEN, LAST_HIDDEN)
PACKED_KEYS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "position_ids", "seq_ids")
SCALE_KEYS = tuple(scale_name(k) for k in HIDDEN_KEYS)  # present in fp8 rows only


def packed_row(records: list[dict]) -> dict[str, np.ndarray]:
    """Records -> one packed row (``collate``; bf16 as uint16, other tensors as they are)."""
    return row_arrays(collate(records))


def row_arrays(packed: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A collated [1, T] batch -> the row's arrays (bf16 as uint16, other tensors as they are)."""
    return {k: bf16_to_uint16(t[0]) if t.dtype == torch.bfloat16 else t[0].numpy() for k, t in packed.items()}


CP_KEYS = ("cp_local", "cp_offset", "cp_key_shift", "cp_tokens")  # a context-parallel shard's `CPShard`


class LoadPackUDF:
    """Reads packs' samples from the store and emits packed rows (the module docstring's forms): an
    fp8 store's rows carry its hidden states as stored.

    ``cp`` = (size, rank, halo) (``train.context_parallel``): each row is rank ``rank``'s shard of its pack
    instead (`context_parallel.shard_span`: the rank's T tokens and ``halo`` more, padded past the pack's
    end; only the samples it overlaps are read), with the shard's place in `CP_KEYS` columns."""

    def __init__(self, store_root: str, on_corrupt: str = "abort", cp: tuple[int, int, int] | None = None):
        self.store = open_store(store_root, on_corrupt=on_corrupt)
        self.as_stored = self.store.meta.compact == "fp8"
        self.cp = cp

    def _read(self, i: int) -> dict:
        if not self.as_stored:
            return self.store[i]
        rec = self.store.read(i, as_stored=True)
        for k in HIDDEN_KEYS:  # fp8 bits as uint8: numpy and Arrow have no fp8
            rec[k] = rec[k].view(torch.uint8)
        return rec

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        keys = PACKED_KEYS + (SCALE_KEYS if self.as_stored else ())
        cols: dict[str, list] = {k: [] for k in keys}
        shards: dict[str, list] = {k: [] for k in CP_KEYS}
        for samples in batch["samples"]:
            if self.cp is not None:
                row, shard = self._shard_row([int(i) for i in samples])
                for k, v in zip(CP_KEYS, (shard.local, shard.offset, shard.key_shift, shard.tokens)):
                    shards[k].append(v)
            else:
                records = [self._read(int(i)) for i in samples]
                row = packed_row(records)
                if self.as_stored:
                    row.update({k: torch.cat([r[k] for r in records]).numpy() for k in SCALE_KEYS})
            for k in cols:
                cols[k].append(row[k])
        out = {"key": batch["key"], **{k: ragged(v) for k, v in cols.items()}}
        if self.cp is not None:
            out.update({k: np.asarray(v, dtype=np.int64) for k, v in shards.items()})
        return out

    def _shard_row(self, samples: list[int]):
        """(row, `CPShard`): this rank's shard of the pack of ``samples``, from the samples it overlaps."""
        from eagle3_ray.train.context_parallel import cut_shard, shard_span  # torch + the drafter: workers only

        size, rank, halo = self.cp
        span = shard_span([int(self.store.lengths[i]) for i in samples], size, rank, halo)
        records = [self._read(i) for i in samples[span.first : span.stop]]
        if records:
            packed = collate(records)
            packed["seq_ids"] += span.first  # the pack's sample numbers (collate counts from 0)
            if self.as_stored:
                packed.update({k: torch.cat([r[k] for r in records])[None] for k in SCALE_KEYS})
        else:  # a shard of padding only (a pack shorter than its group)
            packed = self._empty()
        return row_arrays(cut_shard(packed, span)), span.shard

    def _empty(self) -> dict[str, torch.Tensor]:
        """A zero-token pack with this store's columns (dtypes and widths from its first sample)."""
        rec = self._read(0)
        packed = {k: v[None, :0] for k, v in collate([rec]).items()}
        if self.as_stored:
            packed.update({k: rec[k][None, :0] for k in SCALE_KEYS})
        return packed


def pack_rows(packs: list[Pack]) -> list[dict]:
    return [{"key": p.key, "samples": np.asarray(p.samples, dtype=np.int64)} for p in packs]


def build_train_dataset(packs: list[Pack], store_root: str, on_corrupt: str, loaders: int = 2,
                        num_cpus: float | None = None, cp: tuple[int, int, int] | None = None):
    """Packed rows of `packs` read from the store by up to `loaders` LoadPackUDF actors (each
    reserving `num_cpus`, Ray Data's default when None); with ``cp`` = (size, rank, halo), rank
    ``rank``'s shards of them, in the packs' order (a context-parallel group's ranks must meet on the
    same pack: the trainer has Ray Data preserve the order of these datasets, trainer.py's ``fit``)."""
    rows = pack_rows(packs)
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), 200)))
    # No Ray Data progress from the training workers' split coordinator: its bars, forwarded to the
    # driver, were ~1,800 lines of one `make demo` log (a line per redraw off a terminal); the
    # trainer's own [train] lines report steps and tokens/s.
    ds.context.enable_progress_bars = False
    return ds.map_batches(
        LoadPackUDF,
        fn_constructor_kwargs=dict(store_root=store_root, on_corrupt=on_corrupt, cp=cp),
        compute=ray.data.ActorPoolStrategy(min_size=1, max_size=loaders),
        batch_size=1,
        batch_format="numpy",
        **({} if num_cpus is None else {"num_cpus": num_cpus}),
    )


def _host_tensor(a: np.ndarray) -> torch.Tensor:
    """A row's array as a CPU tensor; a read-only one (Arrow / object store memory) is copied, as
    `uint16_to_bf16` does."""
    a = np.ascontiguousarray(a)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def row_to_batch(row: dict[str, np.ndarray], device, hidden_dtype, row_tokens: int | None = None,
                 segments: bool = False) -> dict:
    """One packed row as the shard yields it (numpy; bf16 as uint16, or an fp8 store's hidden
    states as stored: see the module docstring) -> `ttt_forward` batch tensors on `device`.

    [1, N] as packed; with `row_tokens` (sdpa) already laid out as [B, R] rows of whole samples
    (`split_rows`, scales laid out with their hidden states), done here on the host so the
    training step does not wait for the device to find the sample boundaries. With ``segments``
    (varlen attention) the batch also gets ``segments``, the `Segments` of its sample ids, found on
    the host for the same reason.

    fp8 rows are dequantized after the copy to `device` (`compact.dequantize_fp8_bits`, the
    arithmetic of the store's own reader): the same bf16 values, bit for bit, as a store read on
    the host, then cast to `hidden_dtype` as bf16 rows are.
    """
    fp8 = all(k in row for k in SCALE_KEYS)
    if fp8:
        out = {k: _host_tensor(row[k])[None] for k in HIDDEN_KEYS + SCALE_KEYS}
        for k in HIDDEN_KEYS:
            if out[k].dtype != torch.uint8 or out[scale_name(k)].dtype != torch.float32:
                raise TypeError(f"fp8 row: {k} must be uint8 fp8 bits and {scale_name(k)} float32, got "
                                f"{out[k].dtype} and {out[scale_name(k)].dtype}")
    else:
        out = {k: uint16_to_bf16(np.ascontiguousarray(row[k]))[None] for k in HIDDEN_KEYS}
    for k, dtype in (("input_ids", np.int64), ("loss_mask", np.bool_), ("position_ids", np.int64),
                     ("seq_ids", np.int64)):
        out[k] = _host_tensor(np.asarray(row[k], dtype=dtype))[None]
    if row_tokens:
        # Imported here, not at the top: the pack loader actors and Ray Data's coordinators import
        # this module (LoadPackUDF) and need no drafter; drafter.ttt pulls in transformers (seconds
        # of CPU per process). The training workers that call this have it imported already.
        from eagle3_ray.drafter.ttt import split_rows

        out = split_rows(out, row_tokens)
    found = {}
    if segments:
        from eagle3_ray.drafter.ttt_attention import Segments  # torch only, but kept beside split_rows

        found["segments"] = Segments.of(out["seq_ids"], device)
    if not fp8:
        return {k: v.to(device=device, dtype=hidden_dtype if k.endswith("_hidden") else v.dtype)
                for k, v in out.items()} | found
    out = {k: v.to(device=device) for k, v in out.items()}
    for k, blocks in FIELD_BLOCKS.items():
        out[k] = dequantize_fp8_bits(out[k], out.pop(scale_name(k)), blocks).to(dtype=hidden_dtype)
    return out | found
