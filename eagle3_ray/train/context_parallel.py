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

Exactness: `cp_exactness` (tests/test_context_parallel.py) compares a P-rank gloo run with one
process, loss and every parameter gradient.
"""

from __future__ import annotations

import math
import os
import tempfile
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


# ------------------------------------------------------------------ the exactness check

# A tiny drafter (fp32 on CPU in the tests): hidden, heads, kv heads, head dim, intermediate, target vocab, draft vocab.
TINY_SHAPE = dict(hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=32, vocab=40, draft_vocab=24)
# Packs of sample lengths for a 2-way split (44, 44, 37 and 42 tokens: T = 22, 22, 19, 21): a sample boundary
# exactly at the split; one 3 tokens before it (within ttt_steps: rank 0's last steps read rank 1's tokens);
# one sample over the whole pack with padding after it; a sample ending 2 tokens after the split.
SPLIT_PACKS = ((10, 12, 9, 13), (19, 6, 19), (37,), (23, 19))


def tiny_drafter(shape: dict | None = None, seed: int = 0):
    """A seeded drafter of ``shape`` (`TINY_SHAPE`) with a random draft vocab map, and a target lm_head
    whose argmax mostly (not always) falls in the draft vocab."""
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    s = {**TINY_SHAPE, **(shape or {})}
    torch.manual_seed(seed)
    d = Eagle3Drafter(DrafterConfig(
        hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
        draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], aux_layers=[2, 3, 4], rms_norm_eps=1e-5))
    g = torch.Generator().manual_seed(seed)
    d.bind_embedding(torch.randn(s["vocab"], s["hidden"], generator=g))
    ids = torch.randperm(s["vocab"], generator=g)[: s["draft_vocab"]].sort().values
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(s["draft_vocab"]), t2d)
    lm_head = torch.randn(s["vocab"], s["hidden"], generator=g)
    lm_head[~t2d] *= 0.5
    return d, lm_head


def random_pack(lengths: Sequence[int], shape: dict | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed [1, N] batch of random samples of ``lengths`` (random loss masks, about 80% on)."""
    s = {**TINY_SHAPE, **(shape or {})}
    g = torch.Generator().manual_seed(seed)
    n = int(sum(lengths))
    return {
        "input_ids": torch.randint(0, s["vocab"], (1, n), generator=g),
        "aux_hidden": torch.randn(1, n, 3 * s["hidden"], generator=g),
        "last_hidden": torch.randn(1, n, s["hidden"], generator=g),
        "loss_mask": (torch.rand(1, n, generator=g) > 0.2).long(),
        "position_ids": torch.cat([torch.arange(m) for m in lengths])[None],
        "seq_ids": torch.cat([torch.full((m,), j) for j, m in enumerate(lengths)])[None],
    }


# The option sets `cp_exactness` runs by default: each attention path, alone and with the long-sample options.
CHECK_CASES = (
    {"attention": "sdpa"},
    {"attention": "varlen"},
    {"attention": "sdpa", "loss_chunk_tokens": 5, "recompute_steps": True},
    {"attention": "varlen", "loss_chunk_tokens": 7, "recompute_steps": True},
)


def _case_name(case: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(case.items()))


class _AveragingEngine:
    """DeepSpeed's gradient handling in miniature (grad_accum 1): ``backward``, then ``step`` averages every
    gradient over the whole world (the data-parallel all-reduce DeepSpeed runs with no model-parallel unit)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        world = dist.get_world_size()
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= world

    def get_lr(self) -> list[float]:
        return [0.0]


def _step_config(case: dict, ttt_steps: int):
    from eagle3_ray.train.step import StepConfig

    return StepConfig(ttt_steps=ttt_steps, attention=case.get("attention", "sdpa"), loss_kernel=case.get("kernel", "torch"),
                      loss_chunk_tokens=case.get("loss_chunk_tokens", 0),
                      recompute_steps=case.get("recompute_steps", False))


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu().clone() for n, p in module.named_parameters() if p.grad is not None}


def _check_worker(rank: int, world: int, init: str, path: str, spec: dict) -> None:
    """One rank of `cp_exactness`: every case on its group's pack, through `TrainStep` (P x the rank's loss
    backpropagated) and `_AveragingEngine`; rank 0 saves the results."""
    from eagle3_ray.drafter.ttt import _metrics
    from eagle3_ray.train.step import TrainStep

    torch.set_num_threads(1)
    device = torch.device(spec["device"] if spec["device"] == "cpu" else f"cuda:{rank}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(spec["backend"], init_method=init, rank=rank, world_size=world)
    try:
        cp = setup(spec["context_parallel"])
        results = {}
        for case in spec["cases"]:
            for j, group_packs in enumerate(spec["packs"]):
                drafter, lm_head = tiny_drafter(spec["shape"], spec["seed"])
                drafter.to(device=device, dtype=spec["dtype"])
                step = TrainStep(_AveragingEngine(drafter), lm_head.to(device, spec["dtype"]),
                                 _step_config(case, spec["ttt_steps"]), cp=cp)
                pack = {k: v.to(device) for k, v in group_packs[cp.dp_rank].items()}
                if pack["aux_hidden"].is_floating_point():
                    pack["aux_hidden"] = pack["aux_hidden"].to(spec["dtype"])
                    pack["last_hidden"] = pack["last_hidden"].to(spec["dtype"])
                shard = shard_batch(pack, cp.size, cp.rank, spec["ttt_steps"])
                held = step.held_out_sums([(shard, shard["cp_shard"].tokens)])  # evaluation: no gradient
                dist.all_reduce(held)  # every group's pack, as the training loop's evaluate sums them
                out = step(shard)
                part = out.loss.detach().float().reshape(1)
                dist.all_reduce(part, group=cp.group)  # the group's loss: its ranks' parts
                m = torch.tensor([part.item(), _metrics(out.stats.tolist(), out.loss_decay)["loss"]],
                                 dtype=torch.float64)
                dist.all_reduce(m)
                stats = out.stats.detach().float().cpu().clone()
                dist.all_reduce(stats)
                results[(_case_name(case), j)] = {"loss_sum": m[0].item() / world, "loss": m[1].item() / world,
                                                  "stats": stats / world, "grads": _grads(drafter), "held": held}
        if rank == 0:
            torch.save(results, path)
    finally:
        dist.destroy_process_group()


def cp_exactness(context_parallel: int = 2, data_parallel: int = 1, packs: Sequence[Sequence[int]] = SPLIT_PACKS,
                 cases: Sequence[dict] = CHECK_CASES, ttt_steps: int = 4, shape: dict | None = None, seed: int = 0,
                 device: str = "cpu", backend: str = "gloo", dtype: torch.dtype = torch.float32) -> dict:
    """The context-parallel training step against one process, loss and every parameter gradient.

    ``context_parallel`` x ``data_parallel`` processes (torch.multiprocessing, ``backend``; on CUDA one GPU
    each) run `TrainStep` with `ContextParallel` groups on ``packs`` (sample lengths; group g of pack
    set j trains on pack j + g, so that the groups differ), gradients averaged over the world as DeepSpeed
    does; this process runs the same packs whole through `ttt_forward` (the mean over the groups' packs).
    Returns, per case (``"attention=sdpa"``, ...; ``cases``: `TrainStep` options) and over all packs, the
    largest absolute differences: ``loss`` (the group's metric), ``loss_sum`` (the sum of the ranks' losses,
    what is backpropagated), ``stats`` (every per-step figure), ``grad`` (every parameter's gradient entry),
    ``grad_rel`` (``grad`` over the largest gradient entry), ``held_out`` (every held-out metric of the
    groups' packs, `TrainStep.held_out_sums` summed over the ranks, the walked chain's tau included),
    ``walk`` (the walked chain's tokens and cycles: integers, so exactly 0), and under ``"max"`` the largest
    of each.
    """
    import torch.multiprocessing as mp

    from eagle3_ray.drafter.ttt import WALK_STEPS, held_out_metrics, held_out_sums, ttt_forward

    world = context_parallel * data_parallel
    pack_sets = [[random_pack(packs[(j + g) % len(packs)], shape, seed + j + g) for g in range(data_parallel)]
                 for j in range(len(packs))]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        spec = dict(context_parallel=context_parallel, cases=list(cases), packs=pack_sets, ttt_steps=ttt_steps,
                    shape=shape, seed=seed, device=device, backend=backend, dtype=dtype)
        mp.spawn(_check_worker, args=(world, f"file://{os.path.join(tmp, 'store')}", out, spec), nprocs=world)
        got = torch.load(out, weights_only=True)
    report: dict[str, Any] = {}
    for case in cases:
        name = _case_name(case)
        worst = dict(loss=0.0, loss_sum=0.0, stats=0.0, grad=0.0, grad_rel=0.0, held_out=0.0, walk=0.0)
        for j, group_packs in enumerate(pack_sets):
            loss, stats, grads = 0.0, 0.0, {}
            held = torch.zeros_like(got[(_case_name(case), j)]["held"])
            for pack in group_packs:
                drafter, lm_head = tiny_drafter(shape, seed)
                drafter.to(dtype=dtype)
                c = _step_config(case, ttt_steps)
                pack = {k: v.to(dtype) if v.is_floating_point() else v for k, v in pack.items()}

                def forward(b, walk_steps=0, drafter=drafter, lm_head=lm_head, c=c):
                    return ttt_forward(drafter, b, lm_head.to(dtype), c.ttt_steps, c.loss_decay, c.attention,
                                       loss_kernel=c.loss_kernel, loss_chunk_tokens=c.loss_chunk_tokens,
                                       recompute_steps=c.recompute_steps, walk_steps=walk_steps)

                held += held_out_sums(drafter, [(pack, int((pack["seq_ids"] >= 0).sum()))],
                                      lambda b, f=forward: f(b, walk_steps=min(WALK_STEPS, ttt_steps)))
                ref = forward(pack)
                ref.loss.backward()
                loss += ref.loss.item() / data_parallel
                stats = stats + ref.stats.float() / data_parallel
                for n, gr in _grads(drafter).items():
                    grads[n] = grads.get(n, 0) + gr / data_parallel
            r = got[(name, j)]
            if r["grads"].keys() != grads.keys():
                raise AssertionError(f"{name}: gradients of {sorted(r['grads'])} against {sorted(grads)}")
            largest = max(float(g.abs().max()) for g in grads.values())
            grad = max(float((r["grads"][n] - g).abs().max()) for n, g in grads.items())
            if float(held[-1]) == 0:
                raise AssertionError(f"{name}: the packs of set {j} give no walked chain to compare")
            mine, ref_m = held_out_metrics(r["held"]), held_out_metrics(held)
            if mine.keys() != ref_m.keys():
                raise AssertionError(f"{name}: held-out metrics {sorted(mine)} against {sorted(ref_m)}")
            for k, v in (("loss", abs(r["loss"] - loss)), ("loss_sum", abs(r["loss_sum"] - loss)),
                         ("stats", float((r["stats"] - stats).abs().max())), ("grad", grad),
                         ("grad_rel", grad / max(largest, 1e-30)),
                         ("held_out", max(abs(mine[k] - ref_m[k]) for k in ref_m)),
                         ("walk", float((r["held"][-2:] - held[-2:]).abs().max()))):
                worst[k] = max(worst[k], v)
        report[name] = worst
    report["max"] = {k: max(r[k] for r in report.values())
                     for k in ("loss", "loss_sum", "stats", "grad", "grad_rel", "held_out", "walk")}
    return report


# ------------------------------------------------------------------ what a rank holds

# configs/kimi-k2.5.yaml's drafter (benchmarks/train_step.py's "kimi-k2.5" preset), draft vocab 32000
KIMI_SHAPE = dict(hidden=7168, heads=56, kv_heads=8, head_dim=128, intermediate=18432, vocab=163840,
                  draft_vocab=32000)


class _PrependKV(DrafterKVCache):
    def __init__(self, k, v):
        super().__init__()
        self.earlier = (k, v)

    def append(self, k, v):
        if self.k is None:
            k, v = torch.cat([self.earlier[0], k], dim=2), torch.cat([self.earlier[1], v], dim=2)
        return super().append(k, v)


class _PrependTTT(TTTCache):
    def __init__(self, k, v):
        super().__init__()
        self.earlier = (k, v)

    def append(self, k, v):
        if not self.keys:
            k, v = torch.cat([self.earlier[0], k], dim=2), torch.cat([self.earlier[1], v], dim=2)
        super().append(k, v)


@dataclass(frozen=True)
class _LastRankAlone:
    """The last rank of a group of ``size``, alone on one device (`rank_step_memory`): the earlier ranks'
    step-0 keys and values are given tensors (what the gather would bring), the group's sums its own.
    For measuring what the rank holds, not for training."""

    size: int
    earlier_k: torch.Tensor
    earlier_v: torch.Tensor

    def kv_cache(self, shard):
        return _PrependKV(self.earlier_k, self.earlier_v)

    def ttt_cache(self, shard):
        return _PrependTTT(self.earlier_k, self.earlier_v)

    def attention_mask(self, seq_ids, shard, step):
        return cp_attention_mask(seq_ids, shard.key_shift, step)

    def all_reduce(self, t):
        return t


def rank_step_memory(tokens: int, size: int, shape: dict | None = None, attention: str = "varlen",
                     ttt_steps: int = 7, loss_chunk_tokens: int = 4096, recompute_steps: bool = True,
                     loss_kernel: str = "auto", device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Device memory of one context-parallel training step (forward and backward, no optimizer step) of the
    rank that holds the most: the last of a group of ``size`` on one ``tokens``-token sample, which owns
    T = tokens / size tokens and attends to all the sample's step-0 keys. Run alone on one device: the
    gather's result stands in for the collective (`_LastRankAlone`), so the gather's send buffers (its
    own keys and values, [2, kv, T, head dim]) are not counted. ``shape``: `KIMI_SHAPE` by default.

    Returns GiB: ``static`` (bf16 drafter with the target embedding, target lm_head, the shard's
    features: before the step), ``step_peak`` (the peak during the step, on top of ``static``; it
    includes the bf16 parameter gradients), ``params`` (trainable parameters, millions), ``seconds``;
    or ``oom`` and ``error`` where the device ran out of memory."""
    import time

    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.drafter.ttt import ttt_forward
    from eagle3_ray.drafter.ttt_attention import Segments

    s = {**KIMI_SHAPE, **(shape or {})}
    dev = torch.device(device)
    gib = 2.0**30
    t = local_tokens(tokens, size)
    shard = CPShard(t, (size - 1) * t, (size - 1) * t, min(t, tokens - (size - 1) * t))
    with torch.device(dev):
        torch.manual_seed(0)
        drafter = Eagle3Drafter(DrafterConfig(
            hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
            head_dim=s["head_dim"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
            draft_vocab_size=s["draft_vocab"], target_hidden_size=s["hidden"], aux_layers=[2, 3, 4],
            max_position_embeddings=tokens + 16))
        drafter.to(dtype)
        drafter.bind_embedding(torch.randn(s["vocab"], s["hidden"], dtype=dtype) * 0.02)
        lm_head = torch.randn(s["vocab"], s["hidden"], dtype=dtype) * 0.02
        n = t + ttt_steps
        real = min(n, tokens - shard.offset)
        batch = {"input_ids": torch.randint(0, s["vocab"], (1, n)),
                 "aux_hidden": torch.randn(1, n, 3 * s["hidden"], dtype=dtype),
                 "last_hidden": torch.randn(1, n, s["hidden"], dtype=dtype),
                 "loss_mask": torch.ones(1, n, dtype=torch.bool),
                 "position_ids": torch.arange(n)[None] + shard.offset,
                 "seq_ids": (torch.arange(n) >= real).long()[None] * -1}
        batch["cp_shard"] = shard
        if attention == "varlen":
            batch["segments"] = Segments.of(batch["seq_ids"][:, :t], dev, key_shift=shard.key_shift)
        earlier = [torch.randn(1, s["kv_heads"], shard.key_shift, s["head_dim"], dtype=dtype) for _ in range(2)]
    cp = _LastRankAlone(size, *earlier)
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    torch.cuda.synchronize(dev)
    static = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    try:
        out = ttt_forward(drafter, batch, lm_head, ttt_steps, attention=attention, loss_kernel=loss_kernel,
                          loss_chunk_tokens=loss_chunk_tokens, recompute_steps=recompute_steps, cp=cp)
        (out.loss * size).backward()
        torch.cuda.synchronize(dev)
    except torch.OutOfMemoryError as e:
        return {"oom": True, "error": str(e).splitlines()[0], "static": static / gib,
                "peak_before_oom": (torch.cuda.max_memory_allocated(dev) - static) / gib}
    return {"static": static / gib, "step_peak": (torch.cuda.max_memory_allocated(dev) - static) / gib,
            "params": params / 1e6, "seconds": time.perf_counter() - t0, "tokens": tokens, "size": size,
            "local_tokens": t, "attention": attention, "loss_chunk_tokens": loss_chunk_tokens,
            "recompute_steps": recompute_steps}
