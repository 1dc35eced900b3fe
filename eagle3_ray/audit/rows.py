"""Per-row figures of the target's own next-token prediction, from captured lm_head inputs.

For a row t of a sample, with ``z = lm_head(last_hidden[t])`` the logits over the vocab [V]:

    nll     = logsumexp(z) - z[input_ids[t + 1]]    the next token's negative log-likelihood
    entropy = logsumexp(z) - sum(softmax(z) * z)    the target's own uncertainty at t
    argmax  = argmax(z)                             what it answers there greedily (lowest id on ties)

A vocab-parallel lm_head (SGLang at TP > 1) holds one slice of the vocab per rank: ``vocab_partials``
is what a rank computes over its slice, five numbers a row, and ``combine_partials`` merges every
rank's exactly (a log-sum-exp merge), so no rank builds the logits of the whole vocab and the ranks
exchange 20 bytes a row. One rank holding the whole vocab is the case of one slice.

The logits are computed in the weight's dtype, as SGLang's logits processor does (bf16 on a GPU),
then in fp32. Imported by the SGLang capture hook in every TP worker: torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PARTIALS = 5  # per row: max z, its global id, sum exp(z - max), z[next] (-inf outside the slice), sum exp(z - max) z
LOGIT_CHUNK_BYTES = 256 * 2**20  # fp32 logits of one chunk of rows: bounds the audit's memory
NORM_TOLERANCE = 0.1  # a post-norm row has rms(last_hidden / norm.weight) within 1 +- this
_PHI = (math.sqrt(5.0) - 1.0) / 2.0  # golden-ratio steps spread the audited rows evenly


@dataclass
class RowFigures:
    """The figures of some rows of one sample (all tensors [n], on one device)."""

    positions: torch.Tensor  # int64: row t of the sample; the predicted token is input_ids[t + 1]
    nll: torch.Tensor  # float32
    entropy: torch.Tensor  # float32
    argmax: torch.Tensor  # int64

    def to(self, device: str | torch.device) -> RowFigures:
        return RowFigures(*(t.to(device) for t in (self.positions, self.nll, self.entropy, self.argmax)))

    def take(self, index: torch.Tensor) -> RowFigures:
        return RowFigures(self.positions[index], self.nll[index], self.entropy[index], self.argmax[index])

    def packed(self) -> torch.Tensor:
        """[n, 4] float32 (position, nll, entropy, argmax): how the SGLang hook hands them over.
        Positions and token ids are exact in float32 below 2**24."""
        return torch.stack([self.positions.float(), self.nll, self.entropy, self.argmax.float()], dim=-1)

    @classmethod
    def unpacked(cls, rows: torch.Tensor) -> RowFigures:
        rows = rows.float()
        return cls(rows[:, 0].long(), rows[:, 1], rows[:, 2], rows[:, 3].long())


def audit_positions(length: int, share: float) -> torch.Tensor:
    """The rows of a ``length``-token sample the audit reads: about ``share`` of rows 0..length-2
    (the last row has no next token), spread evenly, the same ones on every call. int64 [n]."""
    rows = torch.arange(max(length - 1, 0), dtype=torch.int64)
    if share >= 1.0:
        return rows
    frac = torch.frac((rows + 1).double() * _PHI)
    return rows[frac < share]


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[n, V_slice] fp32 logits, the matmul in the weight's dtype."""
    return torch.matmul(hidden.to(weight.dtype), weight.T).float()


def vocab_partials(hidden: torch.Tensor, weight: torch.Tensor, next_ids: torch.Tensor,
                   vocab_start: int = 0) -> torch.Tensor:
    """One vocab slice's share of the figures: [n, PARTIALS] float32.

    ``hidden`` [n, H] the lm_head inputs, ``weight`` [V_slice, H] the slice's rows of the lm_head
    (ids ``vocab_start`` .. ``vocab_start + V_slice - 1``, padding rows removed), ``next_ids`` [n] the
    token each row must predict. Rows are done in chunks of ``LOGIT_CHUNK_BYTES`` of logits.
    """
    n, width = hidden.shape[0], weight.shape[0]
    out = torch.empty(n, PARTIALS, dtype=torch.float32, device=hidden.device)
    step = max(1, LOGIT_CHUNK_BYTES // (4 * max(width, 1)))
    next_ids = next_ids.to(hidden.device, torch.int64)
    for a in range(0, n, step):
        z = _logits(hidden[a:a + step], weight)  # [c, V_slice]
        top, arg = z.max(dim=-1)  # the first maximal index: the lowest id on a tie, as torch.argmax
        e = torch.exp(z - top[:, None])
        local = next_ids[a:a + step] - vocab_start
        inside = (local >= 0) & (local < width)
        picked = z.gather(1, local.clamp(0, width - 1)[:, None])[:, 0]
        out[a:a + step, 0] = top
        out[a:a + step, 1] = (arg + vocab_start).float()
        out[a:a + step, 2] = e.sum(-1)
        out[a:a + step, 3] = torch.where(inside, picked, torch.full_like(picked, -math.inf))
        out[a:a + step, 4] = (e * z).sum(-1)
    return out


def combine_partials(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nll, entropy, argmax), each [n], from every slice's ``vocab_partials`` stacked in vocab
    order: ``parts`` [slices, n, PARTIALS]."""
    top, first = parts[..., 0].max(dim=0)  # the first slice holding the maximum: the lowest id on a tie
    scale = torch.exp(parts[..., 0] - top)  # [slices, n]: each slice's sums rebased to the global max
    total = (parts[..., 2] * scale).sum(0)
    lse = top + torch.log(total)
    nll = lse - parts[..., 3].max(0).values  # exactly one slice holds the next token
    entropy = lse - (parts[..., 4] * scale).sum(0) / total
    argmax = parts[..., 1].gather(0, first[None])[0].long()
    return nll, entropy, argmax


def row_figures(hidden: torch.Tensor, weight: torch.Tensor, next_ids: torch.Tensor,
                positions: torch.Tensor) -> RowFigures:
    """The figures of rows ``positions`` of one sample, from an lm_head holding the whole vocab."""
    nll, entropy, argmax = combine_partials(vocab_partials(hidden, weight, next_ids)[None])
    return RowFigures(positions.to(nll.device), nll, entropy, argmax)


def normed_rms(last_hidden: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """rms(last_hidden[t] / norm.weight) per row, float32 [T]: 1 for the output of an RMSNorm
    ``x * w / rms(x)`` (up to its eps and bf16 rounding); far from 1 for a state that did not come
    out of the final norm (an aux layer's residual stream, rows never written). Dimensions whose
    weight is (nearly) zero are left out."""
    w = norm_weight.detach().float().to(last_hidden.device)
    keep = w.abs() > 1e-6 * float(w.abs().max())
    x = last_hidden.float()[:, keep] / w[keep]
    return x.pow(2).mean(-1).sqrt()
