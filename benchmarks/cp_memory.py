"""What the heaviest rank of a context-parallel group holds (`train.context_parallel`): device memory of
one training step of the last rank of a group of P on one long sample, alone on one GPU (the figures
`cp_128k_kimi_rank_gib_p2` / `_p4` of record long_samples_goal; docs/drafter.md, "Context parallelism").

    python3 benchmarks/cp_memory.py --tokens 131072 --sizes 2,4 --out $OUT/cp_memory.json    # 1 GPU, ~1 min

Run by benchmarks/device/long_train.sh (its part ``cp``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_ray.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter  # noqa: E402
from eagle3_ray.drafter.ttt import ttt_forward  # noqa: E402
from eagle3_ray.drafter.ttt_attention import Segments, TTTCache  # noqa: E402
from eagle3_ray.train.context_parallel import CPShard, cp_attention_mask, local_tokens  # noqa: E402

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

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=131072, help="the sample's length")
    p.add_argument("--sizes", default="2,4", help="group sizes P, comma-separated")
    p.add_argument("--out", help="write the figures here (JSON)")
    a = p.parse_args(argv)
    out = {"device": torch.cuda.get_device_name(0)}
    for size in (int(x) for x in a.sizes.split(",")):
        out[f"{a.tokens}_over_{size}"] = r = rank_step_memory(a.tokens, size)
        print(f"[cp] {a.tokens} tokens over {size} workers, heaviest rank: {r}", flush=True)
        torch.cuda.empty_cache()
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
