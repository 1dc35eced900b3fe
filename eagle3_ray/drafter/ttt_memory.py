"""Long samples: what a TTT step keeps for the backward (``train.loss_chunk_tokens``,
``train.recompute_ttt_steps``; docs/drafter.md "Long samples"). Both change what the backward
recomputes, never the loss or the gradients.

- ``chunked_soft_ce``: a step's draft logits and soft cross-entropy over chunks of positions, each under
  activation checkpointing, so no [tokens, draft vocab] tensor is kept per step;
- ``recomputed_step``: a step's drafter pass under activation checkpointing, rerun in the backward on a
  copy of the KV cache as it was before the step.
"""

from __future__ import annotations

import copy
import functools

import torch

from eagle3_ray.drafter.model import Eagle3Drafter
from eagle3_ray.drafter.soft_ce import soft_cross_entropy
from eagle3_ray.drafter.ttt_attention import TTTCache
from eagle3_ray.drafter.ttt_cache import FixedLengthTTTCache


def built_mask(mask):
    """A step's attention mask: ``mask`` itself, or what it builds (sdpa's dense mask, a partial)."""
    return mask() if isinstance(mask, functools.partial) else mask


def recomputed_step(drafter: Eagle3Drafter, ids: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                     mask, cache) -> torch.Tensor:
    """``drafter(ids, hidden, pos, built_mask(mask), cache)`` under activation checkpointing (non-reentrant):
    the backward reruns the pass instead of keeping its activations. The pass runs on a copy of
    ``cache`` (a rerun must see the keys of the steps before it, not those appended since), and what it
    appended is then put into ``cache``: the keys and values stay, later steps attend to them."""
    from torch.utils.checkpoint import checkpoint

    before = _cache_copy(cache)  # as it is now: ``cache`` itself grows before the backward reruns ``run``

    def run(h: torch.Tensor):
        c = _cache_copy(before)
        out = drafter(ids, h, pos, attention_mask=built_mask(mask), cache=c)
        return out, *_cache_added(c)

    out, k, v = checkpoint(run, hidden, use_reentrant=False)
    _cache_take(cache, k, v)
    return out


def _cache_copy(cache):
    """A cache of the same kind over the same tensors, whose appends leave ``cache`` as it is (the
    list caches get lists of their own; `DrafterKVCache` rebinds ``k``/``v`` on append, never writes)."""
    c = copy.copy(cache)
    if isinstance(cache, (TTTCache, FixedLengthTTTCache)):
        c.keys, c.values = list(cache.keys), list(cache.values)
    return c


def _cache_added(c) -> tuple[torch.Tensor, torch.Tensor]:
    """What a step's pass appended to its cache copy: the new keys/values (list caches), or the whole
    grown cache (`DrafterKVCache`, which keeps one concatenated tensor)."""
    if isinstance(c, (TTTCache, FixedLengthTTTCache)):
        return c.keys[-1], c.values[-1]
    return c.k, c.v


def _cache_take(cache, k: torch.Tensor, v: torch.Tensor) -> None:
    """Make ``cache`` what the copy became (`_cache_added`'s tensors, from the checkpoint's outputs)."""
    if isinstance(cache, (TTTCache, FixedLengthTTTCache)):
        cache.keys.append(k)
        cache.values.append(v)
    else:
        cache.k, cache.v = k, v


def chunked_soft_ce(drafter: Eagle3Drafter, hidden: torch.Tensor, target_p: torch.Tensor, shift: int,
                     kernel: str, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``soft_cross_entropy(drafter.logits(hidden), target_p, shift, kernel)`` over chunks of positions,
    at most ``chunk_tokens`` tokens of the [B, T] batch each (all rows, ``chunk_tokens // B`` columns),
    each chunk under activation checkpointing: its logits live only while it runs, in the forward and
    again in the backward (which recomputes them, one chunk at a time); nothing of [T, draft vocab]
    is kept per step. Without gradients (evaluation) the chunks just run one after the other."""
    from torch.utils.checkpoint import checkpoint

    b, t = hidden.shape[:2]
    width = max(1, chunk_tokens // b)
    ces, preds = [], []
    for at in range(0, t, width):
        h = hidden[:, at : at + width]
        if torch.is_grad_enabled():
            ce, pred = checkpoint(_chunk_soft_ce, drafter, h, target_p, at + shift, kernel, use_reentrant=False)
        else:
            ce, pred = _chunk_soft_ce(drafter, h, target_p, at + shift, kernel)
        ces.append(ce)
        preds.append(pred)
    if len(ces) == 1:
        return ces[0], preds[0]
    return torch.cat(ces, dim=1), torch.cat(preds, dim=1)


def _chunk_soft_ce(drafter: Eagle3Drafter, h: torch.Tensor, target_p: torch.Tensor, start: int, kernel: str):
    """One chunk of `chunked_soft_ce`: rows of ``h`` [B, n, H] are scored against ``target_p`` rows
    ``start ..``; rows whose target lies past the end get zero targets (ce 0, no gradient), as
    `soft_cross_entropy` gives them."""
    n = h.shape[1]
    target = target_p[:, start : start + n]
    if target.shape[1] < n:  # the last chunk(s): built here, so that it is not kept for the backward
        target = torch.cat([target, target.new_zeros(target.shape[0], n - target.shape[1], target.shape[2])], 1)
    return soft_cross_entropy(drafter.logits(h), target, 0, kernel)
