"""The feature record: what extraction produces for one sample and training consumes.

One record per sample (docs/contracts.md, "Feature record"):

    sample_id    str
    input_ids    int32 [T]
    loss_mask    uint8 [T]      1 on assistant tokens incl. end-of-turn
    aux_hidden   bf16  [T, 3H]  the three aux states concatenated in id order
    last_hidden  bf16  [T, H]   final hidden state after the final norm (the lm_head input)

bfloat16 encoding: numpy and Arrow have no bfloat16, so outside torch (Ray Data blocks, numpy
batches) the two hidden-state fields travel as uint16 arrays holding the raw bf16 bit patterns.
``bf16_to_uint16`` / ``uint16_to_bf16`` convert between the two without changing a bit; a record
may carry either form and ``to_torch_record`` normalises it.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from eagle3_ray.errors import SampleRejected

SAMPLE_ID = "sample_id"
INPUT_IDS = "input_ids"
LOSS_MASK = "loss_mask"
AUX_HIDDEN = "aux_hidden"
LAST_HIDDEN = "last_hidden"

TENSOR_FIELDS = (INPUT_IDS, LOSS_MASK, AUX_HIDDEN, LAST_HIDDEN)
FIELD_DTYPES = {
    INPUT_IDS: torch.int32,
    LOSS_MASK: torch.uint8,
    AUX_HIDDEN: torch.bfloat16,
    LAST_HIDDEN: torch.bfloat16,
}
BF16_FIELDS = (AUX_HIDDEN, LAST_HIDDEN)


def bytes_per_token(hidden_size: int, compact: str = "none") -> int:
    """Stored bytes per token: aux (3H) + last (H) in bf16, an int32 id and a uint8 mask bit.
    ``compact="fp8"`` (features/compact.py): the 4H values in fp8 plus four fp32 scales."""
    hidden = 4 * hidden_size + 4 * 4 if compact == "fp8" else 4 * hidden_size * 2
    return hidden + 4 + 1


def bf16_to_uint16(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> uint16 array of its bit patterns (same shape). Zero-copy for a contiguous
    CPU tensor; a CUDA or strided tensor is copied to contiguous CPU memory first."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"bf16_to_uint16 needs a bfloat16 tensor, got {t.dtype}")
    return t.detach().cpu().contiguous().view(torch.uint16).numpy()


def uint16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """uint16 array of bf16 bit patterns -> bf16 tensor (same shape). Zero-copy for a writeable
    array; a read-only one (Arrow / Ray object store memory) is copied, since a torch tensor cannot
    be marked read-only and writing into shared object memory would corrupt it."""
    if a.dtype != np.uint16:
        raise TypeError(f"uint16_to_bf16 needs a uint16 array of bf16 bits, got {a.dtype}")
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).view(torch.bfloat16)


def ragged(arrays: list[np.ndarray]) -> np.ndarray:
    """An object array of per-row ndarrays (Ray Data stores it as a variable-shaped tensor column)."""
    out = np.empty(len(arrays), dtype=object)
    for i, a in enumerate(arrays):
        out[i] = a
    return out


def _field_to_torch(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if name in BF16_FIELDS and value.dtype == np.uint16:
            return uint16_to_bf16(value)
        if not value.flags.writeable:
            value = value.copy()
        return torch.from_numpy(value)
    raise SampleRejected(f"{name} must be a torch tensor or numpy array, got {type(value).__name__}")


def to_torch_record(rec: Mapping[str, Any]) -> dict[str, Any]:
    """A record with torch tensors; numpy fields are wrapped (uint16 hidden states viewed as bf16).
    Dtypes are not converted: ``validate_record`` decides whether they are right."""
    missing = [k for k in (SAMPLE_ID, *TENSOR_FIELDS) if k not in rec]
    if missing:
        raise SampleRejected(f"record is missing fields {missing}")
    out: dict[str, Any] = {SAMPLE_ID: rec[SAMPLE_ID]}
    for name in TENSOR_FIELDS:
        out[name] = _field_to_torch(name, rec[name])
    return out


def _check_sample_id(sample_id: Any) -> None:
    if not isinstance(sample_id, str) or not sample_id:
        raise SampleRejected(f"sample_id must be a non-empty str, got {sample_id!r}")


def _check_dtypes(rec: Mapping[str, torch.Tensor]) -> None:
    for name, want in FIELD_DTYPES.items():
        if rec[name].dtype != want:
            raise SampleRejected(f"{name} has dtype {rec[name].dtype}, the record contract needs {want}")


def _check_shapes(rec: Mapping[str, torch.Tensor], hidden_size: int) -> int:
    """Returns T after checking every field agrees on it and the widths are 3H and H."""
    ids, mask = rec[INPUT_IDS], rec[LOSS_MASK]
    aux, last = rec[AUX_HIDDEN], rec[LAST_HIDDEN]
    if ids.dim() != 1 or mask.dim() != 1 or aux.dim() != 2 or last.dim() != 2:
        raise SampleRejected(
            f"wrong ranks: input_ids {tuple(ids.shape)}, loss_mask {tuple(mask.shape)} must be [T]; "
            f"aux_hidden {tuple(aux.shape)}, last_hidden {tuple(last.shape)} must be [T, width]"
        )
    t = ids.shape[0]
    if t == 0:
        raise SampleRejected("empty sample: 0 tokens")
    lengths = {INPUT_IDS: t, LOSS_MASK: mask.shape[0], AUX_HIDDEN: aux.shape[0], LAST_HIDDEN: last.shape[0]}
    if len(set(lengths.values())) != 1:
        raise SampleRejected(
            f"token count mismatch between fields {lengths}: the captured states must cover exactly the "
            "tokenized sequence (check prefix caching / chunked prefill in the capture engine)"
        )
    if aux.shape[1] != 3 * hidden_size:
        raise SampleRejected(f"aux_hidden width {aux.shape[1]} != 3 x hidden_size ({3 * hidden_size})")
    if last.shape[1] != hidden_size:
        raise SampleRejected(f"last_hidden width {last.shape[1]} != hidden_size ({hidden_size})")
    return t


def _check_values(rec: Mapping[str, torch.Tensor], vocab_size: int | None) -> None:
    mask = rec[LOSS_MASK]
    if bool((mask > 1).any()):
        raise SampleRejected("loss_mask must hold only 0 and 1")
    if not bool(mask.any()):
        raise SampleRejected("loss_mask has no 1s: the sample has no assistant tokens to train on")
    ids = rec[INPUT_IDS]
    if vocab_size is not None and (bool((ids < 0).any()) or bool((ids >= vocab_size).any())):
        raise SampleRejected(f"input_ids outside [0, {vocab_size}): tokenizer and target disagree")
    for name in BF16_FIELDS:
        # min/max propagate nan and keep +-inf: one reduction, no [T, W] bool temporary (isfinite on
        # bf16 CPU tensors was ~18x slower and dominated the offline write path).
        if not all(bool(torch.isfinite(v)) for v in torch.aminmax(rec[name])):
            raise SampleRejected(f"{name} has non-finite values (inf/nan): the target overflowed")


def validate_record(rec: Mapping[str, Any], hidden_size: int, vocab_size: int | None = None) -> None:
    """Raise SampleRejected with the precise reason if ``rec`` breaks the record contract.

    ``rec`` holds torch tensors (use ``to_torch_record`` for numpy input). ``vocab_size``, when
    given, also range-checks the token ids."""
    _check_sample_id(rec.get(SAMPLE_ID))
    missing = [k for k in TENSOR_FIELDS if not isinstance(rec.get(k), torch.Tensor)]
    if missing:
        raise SampleRejected(f"fields {missing} are missing or not torch tensors")
    _check_dtypes(rec)
    _check_shapes(rec, hidden_size)
    _check_values(rec, vocab_size)


def record_num_tokens(rec: Mapping[str, Any]) -> int:
    return int(rec[INPUT_IDS].shape[0])
