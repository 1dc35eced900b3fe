"""What the TTT loss reports (`drafter/ttt.py`'s ``ttt_forward``): its output (`TTTOutput`), the
per-step metrics and the simulated acceptance (tau) derived from them in one host sync (`step_metrics`),
held-out sums that ranks and groups add before turning them into metrics (`held_out_sums`,
`held_out_metrics`), and chain speculative decoding walked over teacher-forced drafts (`chain_walk`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

@dataclass
class TTTOutput:
    loss: torch.Tensor  # scalar, with grad
    # Per TTT step: (ce_i, acc_i, count_i, served_acc_i), detached, on the batch's device.
    stats: torch.Tensor
    loss_decay: float
    # With ``walk_steps``: float64 [tokens, cycles] of the chain walked over each assistant turn (`chain_walk`).
    walk: torch.Tensor | None = None

    @functools.cached_property
    def metrics(self) -> dict[str, float]:
        """loss, tau, tau_served, tokens, and per step i: loss_i, acc_i, tokens_i (valid
        positions). Python floats: the first access waits for the device (one host sync); a
        training loop can keep `stats` and convert a whole logging window at once (`mean_metrics`)."""
        return step_metrics(self.stats.tolist(), self.loss_decay)


def mean_metrics(stats: list[torch.Tensor], loss_decay: float) -> dict[str, float]:
    """The mean over steps of each step's `TTTOutput.metrics`, from their `stats`, in one host sync."""
    per_step = [step_metrics(s, loss_decay) for s in torch.stack(stats).tolist()]
    return {k: sum(m[k] for m in per_step) / len(per_step) for k in per_step[0]}


HELD_OUT_SUMS = ("loss", "tau", "acc_0", "tau_chain3")  # token-weighted columns of held_out_sums, then tokens
# held_out_sums' row: HELD_OUT_SUMS x tokens, tokens, then the walked chain's tokens and verify cycles
HELD_OUT_WIDTH = len(HELD_OUT_SUMS) + 3
WALK_STEPS = 3  # drafts per cycle of the walked chain: the bench's chain (bench.num_steps' default)


def held_out_sums(drafter: torch.nn.Module, batches, forward) -> torch.Tensor:
    """float64 [loss, tau, acc_0, tau_chain3 (each x tokens), tokens, walk tokens, walk cycles] summed
    over ``batches`` of (batch, tokens), each run through ``forward(batch) -> TTTOutput`` without
    gradients, the drafter in eval mode (its mode is restored); the walk columns stay 0 where
    ``forward`` does not walk (``ttt_forward(walk_steps=0)``). Sums, so that ranks (and packs of a
    group) can add theirs before `held_out_metrics`."""
    sums = torch.zeros(HELD_OUT_WIDTH, dtype=torch.float64)
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.no_grad():
            for batch, tokens in batches:
                out = forward(batch)
                m = out.metrics
                sums[:-2] += torch.tensor([m[k] * tokens for k in HELD_OUT_SUMS] + [tokens], dtype=torch.float64)
                if out.walk is not None:
                    sums[-2:] += out.walk
    finally:
        drafter.train(was_training)
    return sums


def held_out_metrics(sums: torch.Tensor, suffix: str = "") -> dict[str, float]:
    """Token-weighted val_loss, val_tau, val_acc_0, val_tau_chain3 and val_tokens from `held_out_sums`,
    and val_tau_walk3 (the walked chain's tokens per verify cycle, where it walked), each name followed
    by ``suffix`` (a group's "/<name>")."""
    n = max(float(sums[-3]), 1.0)
    out = {f"val_{k}{suffix}": float(sums[i]) / n for i, k in enumerate(HELD_OUT_SUMS)}
    out[f"val_tokens{suffix}"] = int(sums[-3])
    if float(sums[-1]) > 0:
        out[f"val_tau_walk3{suffix}"] = float(sums[-2]) / float(sums[-1])
    return out


def chain_walk(hits: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """float64 [tokens, cycles]: chain speculative decoding replayed over the teacher-forced drafts.

    ``hits`` [K, B, T] bool: draft step i at position t equals the target's argmax at t+1+i (a draft
    vocab token, same sample); ``loss_mask`` [B, T] marks the assistant turns, ``seq_ids`` [B, T]
    their samples. A cycle whose last committed token is x[t+1] drafts what the unroll drafted at t
    (cycle for cycle in real decoding: benchmarks/results/tau_consistency_product7_256_cpu.md), so it
    accepts L(t) drafts, the leading hits, and commits L(t) + 1 tokens: the next cycle drafts from
    t + L(t) + 1. Each assistant turn x[s..e] is walked as the bench decodes it: the prefill gives x[s]
    (not counted, as the bench's tau does not count it), the first cycle drafts from t = s - 1, and no
    cycle commits past x[e]. tokens / cycles is then the bench's chain(K) tau on this text, where the
    text is the target's greedy answer. Per-position means (``tau_chain3``) weigh every position once,
    while cycles start more often where drafts fail: they overstate this figure as the drafter gets
    better (in the same file, 2.47 per position against 2.28 walked and decoded).
    """
    lead = hits.to(torch.int32).cumprod(dim=0).sum(dim=0)  # [B, T] leading hits, at most K
    mask, seq = loss_mask.bool(), seq_ids
    same_prev = torch.zeros_like(mask)  # t and t-1 in one (non-padding) sample
    same_prev[:, 1:] = (seq[:, 1:] == seq[:, :-1]) & (seq[:, 1:] >= 0)
    after = torch.zeros_like(mask)  # t-1 is an assistant token of the same sample
    after[:, 1:] = mask[:, :-1]
    after &= same_prev
    # A turn's first token after a prompt of its own sample (a turn that opens its sample has no prefill).
    starts = (mask & ~after & same_prev).flatten().nonzero().flatten()
    ends_mask = mask.clone()  # a turn's last token: the next one is not the same turn's
    ends_mask[:, :-1] &= ~(mask[:, 1:] & same_prev[:, 1:])
    ends = ends_mask.flatten().nonzero().flatten()
    if starts.numel() == 0:
        return torch.zeros(2, dtype=torch.float64)
    ends = ends[torch.searchsorted(ends, starts)]  # each turn's end (rows never share a flat index run)
    lead_flat = lead.flatten().tolist()
    tokens = cycles = 0
    for s, e in zip(starts.tolist(), ends.tolist()):
        at = s - 1
        while at + 2 <= e:
            accepted = min(lead_flat[at], e - at - 2)
            tokens += accepted + 1
            cycles += 1
            at += accepted + 1
    return torch.tensor([tokens, cycles], dtype=torch.float64)


def step_metrics(stats: list[list[float]], loss_decay: float) -> dict[str, float]:
    """Metrics from one host sync; tau = 1 + sum_k prod_{j<=k} acc_j (simulated acceptance).

    ``tau_served`` uses accuracies that count targets outside the draft vocab as misses, as real
    decoding does, and so tracks real chain acceptance more closely than ``tau``
    (benchmarks/results/tau_consistency_cpu.md). ``tau_chain3`` is ``tau_served`` over the first
    three drafts only: the simulated counterpart of the bench's chain(3) tau (``tau`` runs over all
    ``ttt_steps`` drafts, more than a chain of 3 can accept).
    """
    out = {"loss": sum(loss_decay**i * ce for i, (ce, *_) in enumerate(stats))}
    tau, chain, served, served_chain = 1.0, 1.0, 1.0, 1.0
    for i, (ce, acc, count, served_acc) in enumerate(stats):
        out[f"loss_{i}"], out[f"acc_{i}"], out[f"tokens_{i}"] = ce, acc, count
        chain *= acc
        tau += chain
        served_chain *= served_acc
        served += served_chain
        if i == min(2, len(stats) - 1):
            out["tau_chain3"] = served
    out["tau"] = tau
    out["tau_served"] = served
    out["tokens"] = stats[0][2]
    return out
