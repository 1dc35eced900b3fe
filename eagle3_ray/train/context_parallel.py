"""Context parallelism (``train.context_parallel``): one pack's tokens split over the workers of a group.

No Ray here: torch.distributed only, the same code in a Ray Train worker and in a bare process.

The world's W ranks form W / P groups of P consecutive ranks (P = ``train.context_parallel``); each
group trains on one pack at a time, of up to P x ``train.batch_tokens`` tokens, split contiguously:
rank r of the group owns tokens [r T, (r + 1) T), T = ceil(N / P) (the pack padded to P T with
padding, sample id -1). The groups are data parallel to one another.

What crosses the split, and how (``drafter/ttt.py``'s ``ttt_forward(..., cp=...)``):

- Data. TTT step i at position t reads the token, the target and the sample id at t + i + 1 and the
  loss mask at t + i: each rank's shard carries ``halo`` = ``ttt_steps`` tokens past its own
  (`shard_batch`, or `shard_span` + `cut_shard` in the pack loader), plain data with no gradient.
  The hidden state of step i at t is step i - 1's output at t: local.
- Attention. Query t of step i sees step 0's keys s <= t of its own sample and the keys of steps
  1..i at t (the diagonal: local). Step 0's keys and values are gathered over the group once per
  step 0 (`_GatherKV`: all-gather forward; backward sums the gradients over the ranks and hands
  each rank those of its own keys: reduce-scatter on NCCL, all-reduce then slice elsewhere). A rank
  keeps only the keys its queries can see, [start of its first token's sample, its last token]
  (`CPShard.key_shift` of them from earlier ranks, all of the first local sample, since samples are
  contiguous in a pack). sdpa masks them densely (`cp_attention_mask`); varlen gives flash
  attention more keys than queries for the first segment (`Segments.key_shift`; causal attention is
  then aligned at the segment's end).
- Loss. Each step's soft cross-entropy is a token mean over the valid positions of the whole pack:
  each rank sums its own positions and divides by the group's count (one all-reduce of the counts
  per forward), so the ranks' losses add up to the one-worker loss and their gradients (the keys'
  gradients returned to their owners) add up to its gradient. The metrics (`TTTOutput.stats`) are
  the group's (one all-reduce of the sums).
- Gradient averaging. DeepSpeed averages gradients over all W ranks; the group's gradient is the
  sum over its P ranks. So `TrainStep` backpropagates P x the rank's loss: the average over the W
  ranks is then (P / W) x sum over groups = the mean over the W / P data-parallel groups, as
  W / P workers without context parallelism (or one worker over those packs with grad_accum) give.

Exactness: `tests/cp_exactness.py` (run by tests/test_context_parallel.py and benchmarks/cp_exact.py)
compares a P-rank gloo run with one process, loss and every parameter gradient.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from eagle3_ray.drafter.model import DrafterKVCache
from eagle3_ray.drafter.ttt import ttt_attention_mask
from eagle3_ray.drafter.ttt_attention import TTTCache
from eagle3_ray.errors import ConfigError

# The attention implementations that gather keys over a context-parallel group.
CP_ATTENTION = ("sdpa", "varlen")


class ContextParallelError(ConfigError):
    """``train.context_parallel`` cannot run with this configuration; the message says what to change."""


def check_config(context_parallel: int, num_workers: int, mode: str = "offline", attention: str = "auto",
                 compile: bool = False) -> None:
    """Refuse combinations context parallelism cannot run (`ContextParallelError`, naming the setting)."""
    p = context_parallel
    if p < 1:
        raise ContextParallelError(f"train.context_parallel={p}: give 1 (off) or the number of workers per group")
    if p == 1:
        return
    if num_workers % p:
        raise ContextParallelError(
            f"train.num_workers={num_workers} is not a multiple of train.context_parallel={p}: each group of "
            f"{p} workers splits one pack; set num_workers to a multiple of {p} (e.g. {p * max(1, num_workers // p)}) "
            "or change context_parallel")
    if mode != "offline":
        raise ContextParallelError(
            f"train.context_parallel={p} needs train.mode=offline (the pack loader splits packs read from the "
            f"feature store; train.mode={mode} streams them): set train.mode=offline or train.context_parallel=1")
    if attention not in ("auto", *CP_ATTENTION):
        raise ContextParallelError(
            f"train.attention={attention} does not gather keys over a context-parallel group; use "
            f"train.attention=varlen (CUDA), sdpa, or auto (varlen on CUDA, sdpa elsewhere), or set "
            "train.context_parallel=1")
    if compile:
        raise ContextParallelError(
            f"train.compile=true with train.context_parallel={p}: the compiled drafter layer would trace the key "
            "gather's collectives; set train.compile=false (or train.context_parallel=1)")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the context-parallel layout (`setup`). ``size`` 1: off (no groups)."""

    size: int = 1
    rank: int = 0  # within its group
    group: Any = None  # the group's process group (the default backend: NCCL on GPUs)
    host_group: Any = None  # the same ranks on gloo (the per-step pack check, on the host)
    dp_rank: int = 0  # which group: the data-parallel rank
    dp_size: int = 1  # groups in the world

    @property
    def enabled(self) -> bool:
        return self.size > 1

    # ---- what ttt_forward calls (drafter/ttt.py knows only these methods)

    def kv_cache(self, shard: CPShard):
        """The sdpa path's KV cache: step 0's keys gathered over the group, later steps' local."""
        return CPKVCache(self, shard)

    def ttt_cache(self, shard: CPShard):
        """The varlen path's `TTTCache`, step 0's keys gathered over the group."""
        return CPTTTCache(self, shard)

    def attention_mask(self, seq_ids: torch.Tensor, shard: CPShard, step: int) -> torch.Tensor:
        return cp_attention_mask(seq_ids, shard.key_shift, step)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the group (in place; returned); no gradient."""
        dist.all_reduce(t, group=self.group)
        return t

    def gather_row(self, t: torch.Tensor) -> torch.Tensor:
        """The group's [..., T] tensors (the same shape on every rank) joined along the last dimension in
        rank order: a rank's own tokens -> the pack's [..., P T]; no gradient (held-out evaluation's walk)."""
        wire = t.to(torch.int64) if t.dtype == torch.bool else t  # bool is not on every backend's wire
        parts = [torch.empty_like(wire) for _ in range(self.size)]
        dist.all_gather(parts, wire.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1).to(t.dtype)

    # ---- what the training loop calls

    def check_same_pack(self, key: str) -> None:
        """Every rank of the group must be on the same pack; refuse (RuntimeError) otherwise. One
        small host all-reduce per step on the group's gloo ranks."""
        h = zlib.crc32(key.encode())
        t = torch.tensor([h, -h], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        if int(t[0]) != h or -int(t[1]) != h:
            raise RuntimeError(f"context-parallel rank {self.rank} (group {self.dp_rank}) is on pack {key}, another "
                               "rank of its group on another pack: the ranks' pack streams are out of order")


def setup(context_parallel: int) -> ContextParallel:
    """The layout of this process: groups of ``context_parallel`` consecutive ranks of the default
    process group (every rank calls this, in the same order: it creates every group)."""
    p = context_parallel
    if not dist.is_initialized():
        if p > 1:
            raise ContextParallelError(f"train.context_parallel={p} needs torch.distributed (several workers); "
                                       "set train.context_parallel=1 for one worker")
        return ContextParallel()
    world, rank = dist.get_world_size(), dist.get_rank()
    if p == 1:
        return ContextParallel(dp_rank=rank, dp_size=world)
    if world % p:
        raise ContextParallelError(f"{world} workers do not split into groups of train.context_parallel={p}; "
                                   f"set train.num_workers to a multiple of {p}")
    gloo = dist.get_backend() == "gloo"
    mine = None
    for g in range(world // p):
        ranks = list(range(g * p, (g + 1) * p))
        pg = dist.new_group(ranks)
        hg = pg if gloo else dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            mine = (pg, hg)
    return ContextParallel(size=p, rank=rank % p, group=mine[0], host_group=mine[1], dp_rank=rank // p,
                           dp_size=world // p)


# ------------------------------------------------------------------ splitting a pack


@dataclass(frozen=True)
class CPShard:
    """Where a rank's shard sits in its pack. The shard's tensors hold ``local`` + halo tokens."""

    local: int  # tokens the rank owns (T; the same on every rank of the group)
    offset: int  # the pack position of its first token
    key_shift: int  # step-0 keys of earlier ranks it attends to: offset - the start of its first token's sample
    tokens: int  # sample (non-padding) tokens among its own

    def record_stream(self, stream) -> None:
        """Nothing on the device (the prefetcher records every batch value on the training stream)."""


@dataclass(frozen=True)
class ShardSpan:
    """A rank's shard of a pack of samples (`shard_span`): samples [first, stop) overlap it; the
    concatenation of those samples starts at pack position ``base``."""

    first: int
    stop: int
    base: int
    shard: CPShard
    halo: int


def local_tokens(n: int, size: int) -> int:
    """T: the tokens each of ``size`` ranks owns of an ``n``-token pack."""
    return max(1, math.ceil(n / size))


def shard_span(lengths: Sequence[int], size: int, rank: int, halo: int) -> ShardSpan:
    """Rank ``rank``'s shard of a pack of samples of ``lengths`` (in pack order): which samples to
    read, and where its tokens [offset, offset + T + halo) lie in their concatenation."""
    ends = [0]
    for n in lengths:
        ends.append(ends[-1] + int(n))
    n = ends[-1]
    t = local_tokens(n, size)
    start = rank * t
    stop_at = min(start + t + halo, n)
    if start >= n:  # all padding
        return ShardSpan(len(lengths), len(lengths), n, CPShard(t, start, 0, 0), halo)
    first = next(j for j in range(len(lengths)) if ends[j + 1] > start)
    stop = next(j for j in range(first, len(lengths)) if ends[j + 1] >= stop_at) + 1
    own = min(start + t, n) - start
    return ShardSpan(first, stop, ends[first], CPShard(t, start, start - ends[first], own), halo)


def cut_shard(packed: dict[str, torch.Tensor], span: ShardSpan) -> dict[str, torch.Tensor]:
    """The [1, T + halo] shard of ``packed``, the [1, n] collated samples span.first..span.stop (their
    sample ids already pack-wide), padded past the pack's end (sample id -1, loss mask 0, zeros)."""
    s = span.shard
    return _window(packed, s.offset - span.base, s.local + span.halo)


def shard_batch(batch: dict[str, torch.Tensor], size: int, rank: int, halo: int) -> dict[str, Any]:
    """Rank ``rank``'s shard of a packed [1, N] ``ttt_forward`` batch: every tensor's tokens
    [r T, (r + 1) T + halo) (padding past the end), and ``cp_shard``, its `CPShard`."""
    if batch["seq_ids"].shape[0] != 1:
        raise ValueError(f"context parallelism splits one packed row, got {batch['seq_ids'].shape[0]} rows")
    n = batch["seq_ids"].shape[1]
    t = local_tokens(n, size)
    start = rank * t
    seq = batch["seq_ids"][0].cpu()
    key_start = start
    if start < n and seq[start] >= 0:
        before = torch.nonzero(seq[:start] != seq[start]).flatten()
        key_start = int(before[-1]) + 1 if before.numel() else 0
    tokens = int((seq[start : start + t] >= 0).sum())
    out = _window({k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}, start, t + halo)
    out["cp_shard"] = CPShard(t, start, start - key_start, tokens)
    return out


def _window(batch: dict[str, torch.Tensor], start: int, length: int) -> dict[str, torch.Tensor]:
    """Tokens [start, start + length) of every [1, n, ...] tensor, padded past n (seq id -1, else 0)."""
    out = {}
    for k, v in batch.items():
        part = v[:, start : start + length]
        short = length - part.shape[1]
        if short > 0:
            fill = -1 if k == "seq_ids" else 0
            part = torch.cat([part, part.new_full((part.shape[0], short, *part.shape[2:]), fill)], dim=1)
        out[k] = part
    return out


# ------------------------------------------------------------------ the step-0 key gather


class _GatherKV(torch.autograd.Function):
    """[..., T, D] per rank -> [..., P T, D], the ranks' in rank order. Backward: the sum over the ranks
    of the gathered gradient, each rank's own T rows (reduce-scatter on NCCL; all-reduce elsewhere,
    as gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group, size: int, rank: int):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        ctx.group, ctx.size, ctx.rank = group, size, rank
        return torch.cat(parts, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        chunks = [c.contiguous() for c in grad.chunk(ctx.size, dim=-2)]
        if dist.get_backend(ctx.group) == "nccl":
            out = torch.empty_like(chunks[0])
            dist.reduce_scatter(out, chunks, group=ctx.group)
        else:
            whole = torch.cat(chunks, dim=-2)
            dist.all_reduce(whole, group=ctx.group)
            out = whole.chunk(ctx.size, dim=-2)[ctx.rank].contiguous()
        return out, None, None, None


def gather_prefix(k: torch.Tensor, v: torch.Tensor, cp: ContextParallel, shard: CPShard
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 0's local keys and values [B, kv, T, D] -> the ones this rank's queries can see:
    [B, kv, key_shift + T, D] (pack positions offset - key_shift .. offset + T - 1). One all-gather
    of keys and values together; the gradients go back to the ranks that own them."""
    full = _GatherKV.apply(torch.stack([k, v]), cp.group, cp.size, cp.rank)  # [2, B, kv, P T, D]
    seen = full[..., shard.offset - shard.key_shift : shard.offset + shard.local, :]
    return seen[0], seen[1]


class CPKVCache(DrafterKVCache):
    """sdpa: a `DrafterKVCache` whose first append (step 0) gathers the group's keys (`gather_prefix`)."""

    def __init__(self, cp: ContextParallel, shard: CPShard):
        super().__init__()
        self.cp, self.shard = cp, shard

    def append(self, k, v):
        if self.k is None:
            k, v = gather_prefix(k, v, self.cp, self.shard)
        return super().append(k, v)


class CPTTTCache(TTTCache):
    """varlen: a `TTTCache` whose first append (step 0) gathers the group's keys (`gather_prefix`)."""

    def __init__(self, cp: ContextParallel, shard: CPShard):
        super().__init__()
        self.cp, self.shard = cp, shard

    def append(self, k, v):
        if not self.keys:
            k, v = gather_prefix(k, v, self.cp, self.shard)
        super().append(k, v)


def cp_attention_mask(seq_ids: torch.Tensor, key_shift: int, step: int) -> torch.Tensor:
    """[1, T] local sample ids -> bool [1, 1, T, key_shift + (step + 1) T]: `ttt_attention_mask` of the
    local tokens with ``key_shift`` columns in front, the earlier ranks' keys of the first local
    token's sample (every query of that sample sees them all: they precede it)."""
    local = ttt_attention_mask(seq_ids, step)
    if not key_shift:
        return local
    first = (seq_ids == seq_ids[:, :1]) & (seq_ids[:, :1] >= 0)  # [1, T]
    earlier = first[:, None, :, None].expand(*first.shape[:1], 1, first.shape[1], key_shift)
    return torch.cat([earlier, local], dim=-1)
