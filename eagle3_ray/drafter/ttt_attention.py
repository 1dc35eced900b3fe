"""TTT attention split in two exact parts: each sample's causal prefix, and the TTT diagonal.

Query t of TTT step i attends to step 0's keys s <= t of its own sample (the prefix) and to the
keys of steps 1..i at its own position t (the diagonal, i keys). A dense mask over the whole
(i + 1) * T cache (``ttt_attention_mask``) makes the kernel compute every one of those columns:
28 T^2 scores over 7 steps where 3.5 T^2 + 21 T are needed. Here instead:

- the prefix runs as variable-length causal attention over the samples of the pack (one segment
  per run of equal ``seq_ids``; flash attention's varlen kernel on CUDA, ``_prefix_reference``
  elsewhere), which also returns each row's log-sum-exp;
- the diagonal's i scores per query are computed directly ([..., T, i]);
- the two are merged with their log-sum-exps into the exact softmax over all keys.

The backward is the one ring attention uses: the prefix kernel's backward is given the merged
output and log-sum-exp (softmax probabilities ``exp(s - lse)`` and ``D = rowsum(dO * O)`` are
then those of the whole row), and the diagonal's gradient is written out below. So the loss and
gradients are those of ``ttt_attention_mask`` with sdpa (tests/test_ttt_attention.py), at about
the cost of causal attention over each sample, once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segments:
    """Runs of equal sample id in a flattened [B * T] batch: cumulative starts (int32, on the
    batch's device), the longest run, and the [B, T] shape. Padding runs are segments too: they
    only ever attend to padding.

    ``key_shift`` (context parallelism, train/context_parallel.py; B = 1): the step-0 keys are this
    many keys of the first run's sample from earlier workers, then the T local ones. The first
    segment's keys then start ``key_shift`` earlier than its queries (``cu_seqlens_k``), and causal
    attention aligned at the segment's end (flash attention's rule when there are more keys than
    queries) lets query j see the first ``key_shift + j + 1`` of them. 0: keys are the queries' tokens."""

    cu_seqlens: torch.Tensor  # [n + 1] int32 (the queries' runs)
    max_len: int
    batch: int
    length: int
    token_segment: torch.Tensor  # [B*T] long: each token's segment
    token_offset: torch.Tensor  # [B*T] long: its position within the segment
    key_shift: int = 0
    cu_seqlens_k: torch.Tensor | None = None  # [n + 1] int32, the keys' runs (None: cu_seqlens)
    max_len_k: int = 0  # the longest key run (0: max_len)

    @classmethod
    def of(cls, seq_ids: torch.Tensor, device: torch.device | str | None = None, key_shift: int = 0) -> Segments:
        """From [B, T] sample ids, on ``device`` (default: theirs). From ids on the GPU this waits for
        them (a host sync); the training loop's prefetch thread builds them from the host's ids
        instead (``train.data.row_to_batch``), so that the step never waits. ``key_shift``: see the
        class docstring."""
        b, t = seq_ids.shape
        ids = seq_ids.detach().cpu()
        change = torch.ones(b, t, dtype=torch.bool)
        change[:, 1:] = ids[:, 1:] != ids[:, :-1]  # a new run at every row start and id change
        starts = torch.nonzero(change.flatten()).flatten()
        cu = torch.cat([starts, torch.tensor([b * t])])
        segment = change.flatten().long().cumsum(0) - 1
        offset = torch.arange(b * t) - starts[segment]
        dev = torch.cat([cu, segment, offset]).to(device or seq_ids.device)  # one copy, not three
        n = cu.shape[0]
        lengths = cu[1:] - cu[:-1]
        if not key_shift:
            return cls(dev[:n].to(torch.int32), int(lengths.max()), b, t, dev[n : n + b * t], dev[n + b * t :])
        if b != 1:
            raise ValueError(f"key_shift needs one row (a context-parallel shard), got {b} rows")
        cu_k = torch.cat([cu[:1], cu[1:] + key_shift]).to(device or seq_ids.device, torch.int32)
        return cls(dev[:n].to(torch.int32), int(lengths.max()), b, t, dev[n : n + b * t], dev[n + b * t :],
                   key_shift, cu_k, max(int(lengths.max()), int(lengths[0]) + key_shift))

    @property
    def cu_k(self) -> torch.Tensor:
        return self.cu_seqlens if self.cu_seqlens_k is None else self.cu_seqlens_k

    @property
    def max_k(self) -> int:
        return self.max_len_k or self.max_len

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """As ``Tensor.record_stream``, for its tensors (made on a prefetch stream, used on another)."""
        for x in (self.cu_seqlens, self.token_segment, self.token_offset, self.cu_seqlens_k):
            if x is not None:
                x.record_stream(stream)

    def mask(self) -> torch.Tensor:
        """[B*T, key_shift + B*T] bool: key s is visible to query t (same segment, s <= t); the
        reference's mask. Keys before the queries' tokens (``key_shift``) belong to the first segment."""
        seg, off = self.token_segment, self.token_offset
        if not self.key_shift:
            return (seg[:, None] == seg[None, :]) & (off[:, None] >= off[None, :])
        d = self.key_shift
        seg_k = torch.cat([seg.new_zeros(d), seg])  # the earlier keys: the first run's sample
        pos_k = torch.arange(d + seg.shape[0], device=seg.device)
        pos_q = torch.arange(seg.shape[0], device=seg.device) + d
        return (seg[:, None] == seg_k[None, :]) & (pos_k[None, :] <= pos_q[:, None])


class TTTCache:
    """The TTT unroll's keys and values for `ttt_attention`: step 0's (the prefix) and each later
    step's (the diagonal), [B, kv, T, D] each, kept apart rather than concatenated."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys.append(k)
        self.values.append(v)


def ttt_attention(q: torch.Tensor, cache: TTTCache, segments: Segments, fused: bool | None = None) -> torch.Tensor:
    """[B, h, T, D] queries of the latest step over ``cache`` (its last entry is this step's keys)
    -> [B, h, T, D]. ``fused``: flash attention's varlen kernel for the prefix (default: on CUDA in
    bf16/fp16), otherwise the reference (explicit fp32 scores, any device)."""
    keys, values = cache.keys, cache.values
    kind = q.device.type
    if torch.is_autocast_enabled(kind):  # as sdpa is under autocast: q, k, v in its dtype; the Function runs without
        dtype = torch.get_autocast_dtype(kind)
        q, keys, values = q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]
    if fused is None:
        fused = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
    k0, v0 = keys[0], values[0]
    if len(keys) > 1:
        kd = torch.stack(keys[1:], dim=3)  # [B, kv, T, i, D]
        vd = torch.stack(values[1:], dim=3)
    else:
        kd = vd = None
    with torch.autocast(kind, enabled=False):  # its fp32 parts stay fp32
        return _TTTAttention.apply(q, k0, v0, kd, vd, segments, fused)


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k0, v0, kd, vd, segments: Segments, fused: bool):
        b, h, t, d = q.shape
        kv = k0.shape[1]
        scale = 1.0 / math.sqrt(d)
        prefix = _prefix_flash if fused else _prefix_reference
        qf, kf, vf = _flat(q), _flat(k0), _flat(v0)  # [B*T, heads, D]
        out_p, lse_p = prefix.forward(qf, kf, vf, segments, scale)  # [B*T, h, D], [B*T, h] fp32
        out_p = _unflat(out_p, b, t)  # [B, h, T, D]
        lse_p = lse_p.view(b, t, h).permute(0, 2, 1)  # [B, h, T]
        if kd is None:
            out, lse = out_p, lse_p
        else:
            s = _diag_scores(q, kd, kv, scale)  # [B, h, T, i] fp32
            lse = torch.logaddexp(lse_p, torch.logsumexp(s, dim=-1))
            p = torch.exp(s - lse[..., None])  # [B, h, T, i]
            out = (_wide(out_p) * torch.exp(lse_p - lse)[..., None] + _diag_values(p, vd, kv)).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, kd, vd, out, lse)
        ctx.segments, ctx.fused, ctx.scale = segments, fused, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, kd, vd, out, lse = ctx.saved_tensors
        b, h, t, d = q.shape
        kv = k0.shape[1]
        scale, segments = ctx.scale, ctx.segments
        grad_out = grad_out.contiguous()
        prefix = _prefix_flash if ctx.fused else _prefix_reference
        lse_flat = lse.permute(0, 2, 1).reshape(b * t, h).contiguous()
        dq, dk0, dv0 = prefix.backward(_flat(grad_out), _flat(q), _flat(k0), _flat(v0), _flat(out), lse_flat,
                                       segments, scale)
        tk = k0.shape[2]  # t + segments.key_shift
        dq, dk0, dv0 = _unflat(dq, b, t), _unflat(dk0, b, tk), _unflat(dv0, b, tk)
        if kd is None:
            return dq, dk0, dv0, None, None, None, None
        # Diagonal: p = exp(s - lse); dv = p dO; ds = p (dO.v - D), D = rowsum(dO * O); dq += ds k; dk = ds q.
        g = h // kv
        go = _wide(grad_out).view(b, kv, g, t, d)
        delta = (go * _wide(out).view(b, kv, g, t, d)).sum(-1)  # [B, kv, g, T]
        s = _diag_scores(q, kd, kv, scale).view(b, kv, g, t, -1)
        p = torch.exp(s - lse.view(b, kv, g, t)[..., None])  # [B, kv, g, T, i]
        dvd = torch.einsum("bngti,bngtd->bntid", p, go)
        dp = torch.einsum("bngtd,bntid->bngti", go, _wide(vd))
        ds = p * (dp - delta[..., None]) * scale
        dq = dq + torch.einsum("bngti,bntid->bngtd", ds, _wide(kd)).reshape(b, h, t, d).to(dq.dtype)
        dkd = torch.einsum("bngti,bngtd->bntid", ds, _wide(q).view(b, kv, g, t, d))
        return dq, dk0, dv0, dkd.to(kd.dtype), dvd.to(vd.dtype), None, None


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (float64 stays float64, for gradcheck)."""
    return x if x.dtype == torch.float64 else x.float()


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, D] -> [B*T, heads, D] (contiguous: the varlen kernel's layout)."""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b * t, n, d).contiguous()


def _unflat(x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """[B*T, heads, D] -> [B, heads, T, D]."""
    return x.view(b, t, *x.shape[1:]).transpose(1, 2)


def _diag_scores(q: torch.Tensor, kd: torch.Tensor, kv: int, scale: float) -> torch.Tensor:
    """q [B, h, T, D], kd [B, kv, T, i, D] -> fp32 scores [B, h, T, i] of each query against its own
    position's key of every later step (query head n reads key head n // (h / kv))."""
    b, h, t, d = q.shape
    qg = _wide(q).view(b, kv, h // kv, t, d)
    return (torch.einsum("bngtd,bntid->bngti", qg, _wide(kd)) * scale).reshape(b, h, t, -1)


def _diag_values(p: torch.Tensor, vd: torch.Tensor, kv: int) -> torch.Tensor:
    """p [B, h, T, i] fp32, vd [B, kv, T, i, D] -> fp32 [B, h, T, D] = sum_j p_j v_j."""
    b, h, t, i = p.shape
    out = torch.einsum("bngti,bntid->bngtd", p.view(b, kv, h // kv, t, i), _wide(vd))
    return out.reshape(b, h, t, -1)


class _prefix_reference:
    """Causal attention within segments from explicit fp32 scores: any device, O((B*T)^2) memory.
    The CPU path, and what the fused kernel is checked against."""

    @staticmethod
    def _probs(q, k, segments, scale, lse=None):
        n, h, d = q.shape
        kv = k.shape[1]
        kx = _wide(k).repeat_interleave(h // kv, dim=1)  # [N, h, D]
        s = torch.einsum("qhd,khd->hqk", _wide(q), kx) * scale  # [h, N, N]
        s = s.masked_fill(~segments.mask(), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)  # [h, N]; every query sees at least itself
        return torch.exp(s - lse[..., None]), lse, kx

    @staticmethod
    def forward(q, k, v, segments, scale):
        h, kv = q.shape[1], k.shape[1]
        p, lse, _ = _prefix_reference._probs(q, k, segments, scale)
        out = torch.einsum("hqk,khd->qhd", p, _wide(v).repeat_interleave(h // kv, dim=1))
        return out.to(q.dtype), lse.transpose(0, 1)  # [N, h, D], [N, h]

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, segments, scale):
        """Gradients of q, k, v given the whole row's output ``out`` and log-sum-exp ``lse`` [N, h]."""
        _, h, d = q.shape
        kv = k.shape[1]
        p, _, kx = _prefix_reference._probs(q, k, segments, scale, lse.transpose(0, 1))
        go = _wide(grad_out)
        vx = _wide(v).repeat_interleave(h // kv, dim=1)
        dv = torch.einsum("hqk,qhd->khd", p, go)
        dp = torch.einsum("qhd,khd->hqk", go, vx)
        delta = (go * _wide(out)).sum(-1).transpose(0, 1)  # [h, N]
        ds = p * (dp - delta[..., None]) * scale
        dq = torch.einsum("hqk,khd->qhd", ds, kx)
        dk = torch.einsum("hqk,qhd->khd", ds, _wide(q))
        fold = lambda x: x.view(x.shape[0], kv, h // kv, d).sum(2)  # noqa: E731 (query heads -> their kv head)
        return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


class _prefix_flash:
    """The same through flash attention's varlen kernels (CUDA, fp16/bf16; grouped kv heads natively)."""

    @staticmethod
    def forward(q, k, v, segments, scale):
        cu, m, cu_k, m_k = segments.cu_seqlens, segments.max_len, segments.cu_k, segments.max_k
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu_k, m, m_k, 0.0, True, False,
                                                               scale=scale)
        return out, _lse_rows(lse, segments)

    @staticmethod
    def backward(grad_out, q, k, v, out, lse, segments, scale):
        cu, m, cu_k, m_k = segments.cu_seqlens, segments.max_len, segments.cu_k, segments.max_k
        seed = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: the rng state is unused
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, _lse_kernel(lse, segments), cu, cu_k, m, m_k, 0.0, True, seed, unused,
            scale=scale)
        return dq, dk, dv


def _lse_rows(lse: torch.Tensor, segments: Segments) -> torch.Tensor:
    """The varlen kernel's log-sum-exp -> [N, h] fp32. Flash attention builds differ in its layout:
    [h, N] (unpadded) or [segments, h, max_len] (padded per segment); both are read, and the layout
    seen is kept for `_lse_kernel` (the backward takes the forward's)."""
    _LSE_PADDED[0] = lse.dim() == 3
    if not _LSE_PADDED[0]:
        n = segments.batch * segments.length
        assert lse.shape[1] == n, f"unexpected flash log-sum-exp shape {tuple(lse.shape)} for {n} tokens"
        return lse.transpose(0, 1).float()
    return lse[segments.token_segment, :, segments.token_offset].float()  # [N, h]


def _lse_kernel(lse: torch.Tensor, segments: Segments) -> torch.Tensor:
    """[N, h] -> the layout the varlen kernel returned in the forward (see `_lse_rows`)."""
    if not _LSE_PADDED[0]:
        return lse.transpose(0, 1).contiguous()
    n_seg = segments.cu_seqlens.shape[0] - 1
    out = lse.new_zeros(n_seg, lse.shape[1], segments.max_len)
    out[segments.token_segment, :, segments.token_offset] = lse
    return out


_LSE_PADDED = [False]  # the layout of this torch's varlen log-sum-exp, set by every forward
