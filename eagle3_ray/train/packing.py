"""Length-bucketed packing of samples into micro-batches of at most `batch_tokens` tokens.

The plan is a pure function of (lengths, batch_tokens, epochs, seed), so every process and every
resumed run computes the same packs; a pack is identified by (epoch, index) and the training data
position is the set of packs already consumed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from eagle3_ray.data.groups import base_id, sample_groups

BUCKET_WINDOW = 512  # samples sorted by length together: low padding, still well shuffled


@dataclass(frozen=True)
class Pack:
    epoch: int
    index: int  # position in the epoch's shuffled order
    samples: tuple[int, ...]  # store indices
    tokens: int

    @property
    def key(self) -> str:
        return f"{self.epoch}:{self.index}"


def plan_epoch(lengths: np.ndarray, batch_tokens: int, epoch: int, seed: int) -> list[Pack]:
    """Shuffle, sort within windows by length, first-fit pack, shuffle the packs.

    A sample longer than `batch_tokens` forms a pack of its own (never truncated here: truncation is
    a data decision made in `prepare`).
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(lengths))
    groups: list[list[int]] = []
    for start in range(0, len(order), BUCKET_WINDOW):
        window = sorted(order[start : start + BUCKET_WINDOW].tolist(), key=lambda i: -int(lengths[i]))
        bins: list[list[int]] = []
        room: list[int] = []
        for i in window:
            n = int(lengths[i])
            for b, free in enumerate(room):
                if n <= free:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(batch_tokens - n)
        groups.extend(bins)
    perm = rng.permutation(len(groups))
    return [
        Pack(epoch, k, tuple(groups[g]), int(sum(int(lengths[i]) for i in groups[g])))
        for k, g in enumerate(perm)
    ]


def plan(lengths: np.ndarray, batch_tokens: int, epochs: int, seed: int) -> list[Pack]:
    return [p for e in range(epochs) for p in plan_epoch(lengths, batch_tokens, e, seed)]


def holdout(n: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) sample indices, both sorted: a seeded ``share`` of ``n`` samples held out
    (at least one of each when share > 0)."""
    if share <= 0:
        return np.arange(n), np.arange(0)
    k = min(n - 1, max(1, round(share * n)))
    held = np.sort(np.random.default_rng([seed, 0x5EED]).choice(n, size=k, replace=False))
    return np.setdiff1d(np.arange(n), held), held


def holdout_groups(groups: Sequence, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``holdout`` over groups of samples: ``groups[i]`` is sample i's group key; a seeded ``share``
    of the groups (numbered in order of first appearance) is held out whole, so no group is split
    between training and held-out. All keys distinct: exactly ``holdout(len(groups), share, seed)``."""
    index: dict = {}
    of = np.fromiter((index.setdefault(g, len(index)) for g in groups), dtype=np.int64, count=len(groups))
    if len(index) == len(groups):
        return holdout(len(groups), share, seed)
    _, held_groups = holdout(len(index), share, seed)
    mask = np.isin(of, held_groups)
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def split_store(sample_ids: Sequence[str], val_share: float, seed: int, val_groups: dict[str, str],
                eval_only: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """(training, held-out, eval-only mask, groups) of a store's samples, as training splits them:
    the samples of the ``eval_only`` groups are all held out, a seeded ``val_share`` of the rest's
    prompts (a prompt's answers ``<id>``, ``<id>#s1``, ... together) too. Indices sorted."""
    ids = [str(sid) for sid in sample_ids]
    groups = sample_groups(ids, val_groups)
    only = np.fromiter((g in eval_only for g in groups), dtype=bool, count=len(groups))
    rest = np.flatnonzero(~only)
    keep, held = holdout_groups([base_id(ids[i]) for i in rest], val_share, seed)
    return rest[keep], np.sort(np.concatenate([rest[held], np.flatnonzero(only)])), only, groups


def plan_held_out(lengths: np.ndarray, held: np.ndarray, groups: Sequence[str | None], batch_tokens: int,
                  seed: int) -> tuple[list[Pack], dict[str, str]]:
    """One epoch of packs over the held-out samples ``held`` (store indices), each pack within one
    group (``groups[i]``: sample i's group or None), numbered in one sequence so that keys are unique;
    and {pack key: group name} of the packs of named groups. Without named groups: the plain plan of
    ``held``."""
    lengths = np.asarray(lengths)
    names = sorted({groups[i] for i in held if groups[i] is not None})
    if not names:
        return (remap(plan(lengths[held], batch_tokens, 1, seed), held) if len(held) else []), {}
    packs: list[Pack] = []
    of: dict[str, str] = {}
    for name in [None, *names]:
        idx = np.asarray([i for i in held if groups[i] == name], dtype=np.int64)
        for p in remap(plan(lengths[idx], batch_tokens, 1, seed), idx) if len(idx) else []:
            pack = Pack(0, len(packs), p.samples, p.tokens)
            packs.append(pack)
            if name is not None:
                of[pack.key] = name
    return packs, of


def remap(packs: list[Pack], indices: np.ndarray) -> list[Pack]:
    """Packs planned over ``lengths[indices]`` -> the same packs over the full index space."""
    return [Pack(p.epoch, p.index, tuple(int(indices[i]) for i in p.samples), p.tokens) for p in packs]


def padding_efficiency(packs: list[Pack], batch_tokens: int) -> float:
    """Real tokens / tokens a padded [1, batch_tokens] micro-batch would hold."""
    cap = sum(max(batch_tokens, p.tokens) for p in packs)
    return sum(p.tokens for p in packs) / max(cap, 1)


def collate(records: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate records on the token axis into one [1, N] packed batch for `ttt_forward`."""
    position_ids = torch.cat([torch.arange(int(r["input_ids"].numel())) for r in records])
    seq_ids = torch.cat(
        [torch.full((int(r["input_ids"].numel()),), j, dtype=torch.long) for j, r in enumerate(records)]
    )
    return {
        "input_ids": torch.cat([r["input_ids"].long() for r in records])[None],
        "loss_mask": torch.cat([r["loss_mask"].bool() for r in records])[None],
        "aux_hidden": torch.cat([r["aux_hidden"] for r in records])[None],
        "last_hidden": torch.cat([r["last_hidden"] for r in records])[None],
        "position_ids": position_ids[None],
        "seq_ids": seq_ids[None],
    }
