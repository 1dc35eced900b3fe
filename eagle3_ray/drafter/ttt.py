"""Training-time test (TTT): the EAGLE-3 loss over ``ttt_steps`` unrolled drafting steps.

At step 0, position t pairs h_t = fc(aux_hidden_t) with the embedding of x_{t+1} and predicts
x_{t+2}; the target is the target model's distribution at t+1, restricted to the draft vocab, in
fp32. Step i shifts tokens/targets/masks one more position and feeds step i-1's output hidden
state, as the drafter does when it drafts i tokens ahead at serving time. Step i's token sits at
position ``position_ids + i``, the position SGLang gives the i-th draft token. What the loss reports
(its output, per-step metrics, held-out sums, the walked chain): `drafter/ttt_metrics.py`.

Packed batches: ``seq_ids`` says which sample each token belongs to (-1 = padding); attention and
targets never cross samples. Attention of step i runs over the drafter's own KV cache (step j's keys
in block j) with one of three equivalent implementations:

- ``"varlen"`` (``drafter/ttt_attention.py``; the training default on CUDA): each sample's causal
  prefix through flash attention's varlen kernel, the diagonal of later steps computed apart, the
  two merged by their log-sum-exps: about the cost of causal attention per sample per step.

- ``"sdpa"``: the cache grows by T per step and a dense bool mask (``ttt_attention_mask``) selects
  the causal prefix of step 0 plus the diagonal of later steps; O(T * i * T) mask memory and work.
- ``"flex"``: ``flex_attention`` with a block-sparse mask (``ttt_block_mask``) over a cache of fixed
  length ``ttt_steps * T`` (unwritten blocks are zeros that the mask never reads), so every step has
  the same shapes and the kernel compiles once per padded T; only the prefix blocks of each sample
  and the diagonal blocks of later steps are computed. T is padded to a multiple of 128.

Long samples (two memory options, off by default; the same loss and gradients, tested):

- ``loss_chunk_tokens`` > 0: each step's draft logits and soft cross-entropy run over chunks of at
  most that many tokens, each under activation checkpointing (`ttt_memory.chunked_soft_ce`): no [T, draft
  vocab] logits (or fp32 log-probabilities) are kept between forward and backward, and the backward
  recomputes one chunk's logits at a time (one more lm_head forward per token and step).
- ``recompute_steps``: True (every step) or k (the first k steps): each such TTT step's drafter pass runs
  under activation checkpointing (`ttt_memory.recomputed_step`): only its input hidden state, its output and
  its keys/values (which later steps attend to) are kept; the rest is recomputed in the backward (one more
  drafter forward of that step). With k, the later steps keep all their activations: more memory kept
  for the backward, k extra step forwards instead of ``ttt_steps``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal

import torch

from eagle3_ray.drafter.model import DrafterKVCache, Eagle3Drafter
from eagle3_ray.drafter.soft_ce import soft_cross_entropy
from eagle3_ray.drafter.ttt_attention import Segments, TTTCache
from eagle3_ray.drafter.ttt_cache import FixedLengthTTTCache
from eagle3_ray.drafter.ttt_memory import built_mask, chunked_soft_ce, recomputed_step
from eagle3_ray.drafter.ttt_metrics import TTTOutput, chain_walk

FLEX_BLOCK = 128  # flex_attention's default block size; T is padded to a multiple of it

BATCH_KEYS = ("input_ids", "aux_hidden", "last_hidden", "loss_mask", "position_ids", "seq_ids")


def ttt_attention_mask(seq_ids: torch.Tensor, step: int) -> torch.Tensor:
    """[B, T] sample ids -> bool [B, 1, T, (step + 1) * T] mask of TTT step ``step``.

    Columns are the cache after step ``step``: block 0 holds step 0's keys (query t sees keys
    s <= t of its own sample), block j >= 1 holds step j's keys, of which query t sees only
    its own position (the diagonal). Padding (-1) attends to padding, never to a sample.
    """
    b, t = seq_ids.shape
    pos = torch.arange(t, device=seq_ids.device)
    causal = pos[:, None] >= pos[None, :]  # [T, T]
    prefix = causal & (seq_ids[:, :, None] == seq_ids[:, None, :])  # [B, T, T]
    diag = torch.eye(t, dtype=torch.bool, device=seq_ids.device).expand(b, t, t)
    return torch.cat([prefix] + [diag] * step, dim=-1)[:, None]


def ttt_block_mask(seq_ids: torch.Tensor, step: int, ttt_steps: int):
    """[B, T] sample ids -> flex ``BlockMask`` of TTT step ``step`` over a cache of ``ttt_steps * T`` keys.

    The same pattern as ``ttt_attention_mask`` (block 0: causal within the sample; blocks 1..step:
    the diagonal); blocks past ``step`` are masked out, so their content is never read.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = seq_ids.shape

    def mask_mod(bi, head, q, kv):
        block, key = kv // t, kv % t
        prefix = (block == 0) & (key <= q) & (seq_ids[bi, key] == seq_ids[bi, q])
        return prefix | ((block > 0) & (block <= step) & (key == q))

    return create_block_mask(mask_mod, b, None, t, ttt_steps * t, device=seq_ids.device)


def _pad_batch(batch: dict[str, torch.Tensor], multiple: int, at_least: int | None) -> dict[str, torch.Tensor]:
    """Pad every [B, T, ...] tensor to max(T, at_least) rounded up to a multiple; padding is seq id
    -1 and loss mask 0."""
    t = batch["input_ids"].shape[1]
    target = max(t, at_least or 0)
    extra = target - t + (-target % multiple)
    if extra == 0:
        return batch
    out = {}
    for k, v in batch.items():
        fill = -1 if k == "seq_ids" else 0
        out[k] = torch.cat([v, v.new_full((v.shape[0], extra, *v.shape[2:]), fill)], dim=1)
    return out


def split_rows(batch: dict[str, torch.Tensor], row_tokens: int) -> dict[str, torch.Tensor]:
    """A packed [1, N] batch -> [B, R] rows of whole samples (first-fit, longest first), R =
    max(row_tokens, longest sample), padded with seq id -1 and loss mask 0.

    Same positions, targets and masks, so the same loss and metrics; the dense (sdpa) attention of
    every TTT step then costs B * R * S_R instead of N * S_N, e.g. 8x less for a 16K-token pack
    of 2K-token rows.
    """
    seq = batch["seq_ids"]
    if seq.shape[0] != 1 or seq.shape[1] <= row_tokens:
        return batch
    ids = seq[0].cpu()
    bounds = (torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist()
    spans = [(a, b) for a, b in zip([0, *bounds], [*bounds, ids.shape[0]]) if ids[a] >= 0]  # padding dropped
    spans.sort(key=lambda se: se[0] - se[1])  # longest first
    cap = max(row_tokens, spans[0][1] - spans[0][0])
    rows: list[list[tuple[int, int]]] = []
    room: list[int] = []
    for start, end in spans:
        n = end - start
        r = next((j for j, free in enumerate(room) if n <= free), None)
        if r is None:
            rows.append([])
            room.append(cap)
            r = len(rows) - 1
        rows[r].append((start, end))
        room[r] -= n
    index = torch.full((len(rows), cap), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for start, end in row:
            index[r, at : at + end - start] = torch.arange(start, end)
            at += end - start
    pad = (index < 0).to(seq.device)
    index = index.clamp(min=0).to(seq.device)
    out = {}
    for k, v in batch.items():
        rows_v = v[0][index]  # [B, R, ...]
        if k == "seq_ids":
            rows_v = rows_v.masked_fill(pad, -1)
        elif k == "loss_mask":
            rows_v = rows_v.masked_fill(pad, 0)
        out[k] = rows_v
    return out


def _shift(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """out[:, t] = x[:, t + n]; positions past the end get ``fill``."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], n, *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


def _same_sample(seq_ids: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T] bool: position t and t + n exist and belong to the same (non-padding) sample."""
    return (_shift(seq_ids, n, -1) == seq_ids) & (seq_ids >= 0)


@torch.no_grad()
def target_distribution(
    last_hidden: torch.Tensor,  # [B, T, Ht]
    lm_head_weight: torch.Tensor,  # [V, Ht], frozen target lm_head
    d2t: torch.Tensor,  # [Vd] int64
    t2d: torch.Tensor,  # [V] bool
    vocab_chunk: int = 16384,
    token_chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [B, T, Vd] fp32 softmax over draft-vocab target logits, in_draft [B, T] bool).

    ``in_draft``: the target's full-vocab argmax is a draft token. The full logits are never
    held at once: the argmax runs over row chunks of the lm_head (V x T fp32 would not fit for
    163K-token vocabularies), and both the argmax and the draft-vocab softmax run over chunks of
    at most ``token_chunk`` tokens, each written into the output. So the working memory beyond the
    outputs (token_chunk x max(vocab_chunk, Vd) fp32 logits, the lm_head rows widened to fp32)
    does not grow with the sequence length.
    """
    with torch.autocast(last_hidden.device.type, enabled=False):  # fp32 even inside a caller's autocast
        return _target_distribution(last_hidden, lm_head_weight, d2t, t2d, vocab_chunk, token_chunk)


def _target_distribution(last_hidden, lm_head_weight, d2t, t2d, vocab_chunk, token_chunk):
    draft_rows = torch.arange(d2t.shape[0], device=d2t.device) + d2t  # [Vd] target ids
    draft_w = lm_head_weight[draft_rows]  # [Vd, Ht]
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])  # [N, Ht]
    n = flat.shape[0]
    p = torch.empty(n, d2t.shape[0], dtype=torch.float32, device=flat.device)  # [N, Vd]
    best_id = torch.empty(n, dtype=torch.long, device=flat.device)
    for at in range(0, n, token_chunk):
        h = flat[at : at + token_chunk]
        p[at : at + token_chunk] = torch.softmax(_logits_fp32(h, draft_w), dim=-1)
        best_id[at : at + token_chunk] = _argmax_rows(h, lm_head_weight, vocab_chunk)
    return p.view(*last_hidden.shape[:-1], -1), t2d[best_id].view(last_hidden.shape[:-1])


def _argmax_rows(h: torch.Tensor, lm_head_weight: torch.Tensor, vocab_chunk: int) -> torch.Tensor:
    """[N, Ht] -> [N] argmax over the full vocabulary of fp32 logits, lm_head rows ``vocab_chunk`` at a time."""
    best = torch.full(h.shape[:-1], float("-inf"), device=h.device)
    best_id = torch.zeros(h.shape[:-1], dtype=torch.long, device=h.device)
    for start in range(0, lm_head_weight.shape[0], vocab_chunk):
        chunk = _logits_fp32(h, lm_head_weight[start : start + vocab_chunk])  # [N, C]
        value, idx = chunk.max(dim=-1)
        better = value > best  # strict: ties keep the lower id, like argmax
        best = torch.where(better, value, best)
        best_id = torch.where(better, idx + start, best_id)
    return best_id


def _logits_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[..., Ht] x [N, Ht] -> [..., N] fp32 logits.

    bf16/fp16 values are exact in TF32 (TF32 keeps 10 mantissa bits, bf16 7, fp16 10, and TF32 has
    fp32's exponent range), and tensor cores accumulate TF32 products in fp32; so on CUDA with half
    inputs the TF32 matmul gives the fp32 result at tensor-core speed.
    """
    half = (torch.bfloat16, torch.float16)
    if h.is_cuda and h.dtype in half and w.dtype == h.dtype and _mm_out_fp32(h.device):
        # Better still: the half inputs' products accumulated in fp32, written as fp32 (torch.mm's
        # out_dtype), at the half-precision tensor-core rate (twice TF32's) and with no fp32 copies.
        return torch.mm(h.reshape(-1, h.shape[-1]), w.T, out_dtype=torch.float32).view(*h.shape[:-1], -1)
    if h.is_cuda and h.dtype in half and w.dtype in half:
        with _tf32_matmul():
            return h.float() @ w.float().T
    return h.float() @ w.float().T


@functools.cache
def _mm_out_fp32(device: torch.device) -> bool:
    """Whether this torch has ``torch.mm(..., out_dtype=torch.float32)`` for bf16 inputs on ``device``."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


@contextlib.contextmanager
def _tf32_matmul():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def ttt_forward(
    drafter: Eagle3Drafter,
    batch: dict[str, torch.Tensor],
    target_lm_head_weight: torch.Tensor,
    ttt_steps: int = 7,
    loss_decay: float = 0.8,
    attention: Literal["sdpa", "flex", "varlen"] = "sdpa",
    pad_to: int | None = None,
    row_tokens: int | None = None,
    loss_kernel: Literal["auto", "torch", "triton"] = "auto",
    walk_steps: int = 0,
    loss_chunk_tokens: int = 0,
    recompute_steps: bool | int = False,
    cp=None,
) -> TTTOutput:
    """TTT loss and metrics of one (packed) batch; see the module docstring for the semantics.

    ``batch``: ``input_ids`` [B, T] long, ``aux_hidden`` [B, T, 3Ht], ``last_hidden`` [B, T, Ht],
    ``loss_mask`` [B, T], ``position_ids`` [B, T] (restart at 0 per packed sample), ``seq_ids``
    [B, T] (-1 = padding), all on the drafter's device.
    Loss = sum_i loss_decay**i * CE_i, CE_i the soft cross-entropy averaged over step i's valid
    positions (loss_mask x target argmax in the draft vocab x target inside the sample).
    ``attention``: "sdpa" (dense mask, any device) or "flex" (block-sparse; compiled on CUDA);
    both compute the same function (see the module docstring). ``pad_to`` (flex): pad T up to this
    length too, so that packs of varying length share one compiled kernel (torch.compile recompiles
    per shape and falls back to an unfused kernel, which materialises the scores, after 8 shapes).
    ``row_tokens`` (sdpa): split a packed [1, N] batch into rows of whole samples of about this
    many tokens (``split_rows``): the same loss at a fraction of the dense attention's cost.
    ``batch["segments"]`` (varlen, optional): the `Segments` of ``seq_ids``, built ahead.
    ``loss_kernel``: how each step's soft cross-entropy runs (`drafter.soft_ce`; the same function).
    ``walk_steps`` (evaluation): also replay chain decoding of that many drafts per cycle over the
    batch's assistant turns (`chain_walk`; at most ``ttt_steps``), into ``TTTOutput.walk``.
    ``loss_chunk_tokens`` (0 = off) and ``recompute_steps`` (True = every step, False or 0 = none, k = steps
    0..k-1): the memory options of long samples (module docstring); they change what is kept for the
    backward, not the result.
    ``cp`` (context parallelism, `train.context_parallel.ContextParallel` of more than one rank): the batch is
    this rank's shard of a pack (`context_parallel.shard_batch`: ``batch["cp_shard"]`` says where it sits; its
    tensors carry ``ttt_steps`` tokens past its own), step 0's keys are gathered over the group, each step's
    loss is divided by the group's count of valid positions, and the stats are the group's. The returned
    loss is then this rank's part: the group's ranks' losses add up to the loss of the whole pack on one
    worker, and so do their gradients. sdpa or varlen attention. ``walk_steps``: the walk crosses the split, so
    the group's draft hits, loss masks and sample ids are gathered and the group's first rank walks the whole
    pack (its ``walk``; the other ranks' is zeros: summed over the group, the pack's walk once).
    """
    assert set(BATCH_KEYS) <= set(batch), f"batch lacks {sorted(set(BATCH_KEYS) - set(batch))}"
    shard = batch.get("cp_shard")
    if (shard is not None) != (cp is not None and cp.size > 1):
        raise ValueError("a context-parallel shard (batch['cp_shard']) runs with its group (cp of more than one "
                         "rank), and a group only on shards")
    if shard is not None and (attention not in ("sdpa", "varlen") or batch["seq_ids"].shape[0] != 1):
        raise ValueError(f"context parallelism runs one packed row with sdpa or varlen attention; got "
                         f"attention={attention!r}, {batch['seq_ids'].shape[0]} rows "
                         "(set train.attention=sdpa or varlen)")
    if attention == "flex":
        batch = _pad_batch(batch, FLEX_BLOCK, pad_to)
    elif row_tokens and attention == "sdpa" and shard is None:
        batch = split_rows(batch, row_tokens)
    # Under context parallelism the batch holds t + ttt_steps tokens: the rank's own t, then the ones its
    # shifted tokens, targets and masks read (the halo). Without, ``own`` is the whole batch (a full view).
    t = shard.local if shard is not None else batch["input_ids"].shape[1]

    def own(x: torch.Tensor) -> torch.Tensor:
        return x[:, :t]

    ids, seq_all, pos = batch["input_ids"], batch["seq_ids"], own(batch["position_ids"])
    seq = own(seq_all)
    loss_mask = batch["loss_mask"].bool()
    target_p, in_draft = target_distribution(batch["last_hidden"], target_lm_head_weight, drafter.d2t, drafter.t2d)
    target_ids = target_p.argmax(dim=-1)  # [B, T] draft ids

    hidden = drafter.fuse(own(batch["aux_hidden"]))  # [B, T, H]
    if attention == "varlen":
        cache = cp.ttt_cache(shard) if shard is not None else TTTCache()
        # built ahead by the loop's prefetch thread
        segments = batch.get("segments") or Segments.of(seq, key_shift=shard.key_shift if shard is not None else 0)
        if shard is not None and segments.key_shift != shard.key_shift:
            raise ValueError(f"the batch's segments were built with key_shift {segments.key_shift}, its shard has "
                             f"{shard.key_shift}")
    else:
        cache = FixedLengthTTTCache(ttt_steps) if attention == "flex" else (
            cp.kv_cache(shard) if shard is not None else DrafterKVCache())
    # Per step: the positions scored (loss mask, target in the sample), and of those the valid ones (a
    # draft-vocab target), read from the token the step drafts, i + 1 ahead.
    scored_masks, servables = [], []
    for i in range(ttt_steps):
        same = own(_same_sample(seq_all, i + 1))  # [B, T] the target at t+1+i is this sample's
        scored_masks.append(own(_shift(loss_mask, i, False)) & same)
        servables.append(own(_shift(in_draft, i + 1, False)) & same)  # a draft can match it: a draft-vocab target
    if shard is not None:  # the loss is a mean over the group's valid positions: their count, summed
        group_counts = cp.all_reduce(torch.stack([(m & s).float().sum() for m, s in zip(scored_masks, servables)]))
    recomputed = ttt_steps if recompute_steps is True else int(recompute_steps)  # steps 0..recomputed-1
    total = hidden.new_zeros((), dtype=torch.float32)
    stats = []  # per step: (ce_i, acc_i, count_i, served_acc_i), detached; under cp the rank's sums first
    hits_by_step = []  # per step < walk_steps: [B, T] the served draft equals the target's argmax
    for i in range(ttt_steps):
        ahead = i + 1  # step i reads token x_{t+1+i} and the target's distribution at t+1+i
        scored_mask, servable = scored_masks[i], servables[i]
        valid = scored_mask & servable
        if attention == "varlen":
            mask = segments
        elif attention == "flex":
            mask = ttt_block_mask(seq, i, ttt_steps)
        elif shard is not None:
            mask = functools.partial(cp.attention_mask, seq, shard, i)
        else:  # sdpa: built where it is used (under recompute_steps, again in the backward: never kept)
            mask = functools.partial(ttt_attention_mask, seq, i)
        step_ids = own(_shift(ids, ahead))
        if i < recomputed and torch.is_grad_enabled():
            hidden = recomputed_step(drafter, step_ids, hidden, pos + i, mask, cache)
        else:
            hidden = drafter(step_ids, hidden, pos + i, attention_mask=built_mask(mask), cache=cache)
        if loss_chunk_tokens > 0:
            ce, pred = chunked_soft_ce(drafter, hidden, target_p, ahead, loss_kernel, loss_chunk_tokens)
        elif shard is not None:  # the halo's targets: rows t.. of target_p exist
            ce, pred = soft_cross_entropy(drafter.logits(hidden), target_p[:, ahead : ahead + t], 0, loss_kernel)
        else:
            ce, pred = soft_cross_entropy(drafter.logits(hidden), target_p, ahead, loss_kernel)  # [B, T] each
        w = valid.float()
        count = w.sum() if shard is None else group_counts[i]
        ce_sum = (ce * w).sum()
        ce_i = ce_sum / count.clamp(min=1)
        total = total + loss_decay**i * ce_i
        hit = pred == own(_shift(target_ids, ahead))
        if i < walk_steps:
            hits_by_step.append(hit & servable)
        hits = (hit & valid).float().sum()
        # Serving cannot accept a target token outside the draft vocab: count those as misses too.
        scored = scored_mask.float().sum()
        if shard is not None:
            stats.append(torch.stack([ce_sum.detach(), hits, scored]))
        else:
            stats.append(torch.stack([ce_i.detach(), hits / count.clamp(min=1), count, hits / scored.clamp(min=1)]))
    if shard is not None:  # the group's sums -> its stats
        ce_sum, hits, scored = cp.all_reduce(torch.stack(stats)).unbind(dim=1)
        count = group_counts.clamp(min=1)
        stats = torch.stack([ce_sum / count, hits / count, group_counts, hits / scored.clamp(min=1)], dim=1).unbind(0)
    walk = None
    if hits_by_step and shard is None:
        walk = chain_walk(torch.stack(hits_by_step), loss_mask, seq)
    elif hits_by_step:  # a turn may cross the split: the group's rows, walked once, on its first rank
        hits, mask, seq_w = (cp.gather_row(x) for x in (torch.stack(hits_by_step), own(loss_mask), seq))
        walk = chain_walk(hits, mask, seq_w) if cp.rank == 0 else torch.zeros(2, dtype=torch.float64)
    return TTTOutput(loss=total, stats=torch.stack(stats), loss_decay=loss_decay, walk=walk)
