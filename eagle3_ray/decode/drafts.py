"""What a drafter proposes and the interface decoding drafts through.

``Draft``: a chain of K tokens; ``DraftTree``: an EAGLE-2 tree under the last committed token, with
the verify's layout (each node's depth, its ancestors) computed on the device; ``Proposer``: what
chain and tree decoding need from a drafter (``spec.chain.Eagle3Proposer`` is the eager one,
``spec.static_draft.StaticProposer`` the CUDA-graphed one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from eagle3_ray.decode.sampling import Sampling


@dataclass
class Draft:
    tokens: torch.Tensor | list[int]  # [K] target vocab; on the device, the verify needs no host sync
    q: torch.Tensor | None  # [K, V] distributions the ids were sampled from; None = deterministic

    @property
    def ids(self) -> list[int]:
        """The drafts on the host (a sync when they are on the device)."""
        return self.tokens.tolist() if isinstance(self.tokens, torch.Tensor) else list(self.tokens)


@dataclass
class DraftTree:
    """Draft tokens under the root (the last committed token), parents listed before children.

    ``depth`` / ``visible``: the verify's layout (see ``layout``), computed on the tokens' device
    by ``select_nodes`` (inside the drafter's CUDA graph on the static path); a tree built from
    tokens and parents alone computes it on first use.
    """

    tokens: torch.Tensor  # [N] long, target vocab
    parents: torch.Tensor  # [N] long, index into tokens; -1 = the root
    depth: torch.Tensor | None = None  # [N+1] long, root-inclusive
    visible: torch.Tensor | None = None  # [N+1, N+1] bool, root-inclusive ancestor-or-self

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth [N+1], ancestor-or-self mask [N+1, N+1] bool), row/column 0 = the root; on the
        tokens' device, without a host sync."""
        if self.depth is None or self.visible is None:
            if self.parents.device.type == "cpu":  # a check a device tree would pay a sync for
                n = self.parents.shape[0]
                assert bool((self.parents < torch.arange(n)).all()) and bool((self.parents >= -1).all()), \
                    "a parent must precede its children"
            self.depth, self.visible = tree_layout(self.parents)
        return self.depth, self.visible

    def children(self) -> list[list[int]]:
        """Per root-inclusive node, its children's root-inclusive indices in draft order."""
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0] + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i + 1)
        return kids


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Root-inclusive (depth [N+1], ancestor-or-self [N+1, N+1] bool) of a tree whose ``parents``
    [N] (-1 = the root) precede their children: fixed-shape device ops (no host sync, graph-safe),
    the ancestor relation closed by squaring the parent-or-self matrix ceil(log2(N+1)) times."""
    n = parents.shape[0] + 1
    up = torch.cat([parents.new_zeros(1), parents + 1])  # root-inclusive parent; the root's own is itself
    # Row i: i and its parent (a scalar scatter: no host-to-device copy, which a graph capture refuses).
    step = torch.eye(n, dtype=torch.float32, device=parents.device).scatter_(1, up[:, None], 1.0)
    reach = step
    for _ in range(max(1, (n - 1).bit_length())):  # paths of up to 2^j edges
        reach = (reach @ reach).clamp_(max=1.0)  # 0/1 entries: exact in any matmul precision
    visible = reach > 0
    return visible.sum(-1) - 1, visible


@runtime_checkable
class Proposer(Protocol):
    """What chain and tree decoding need from a drafter."""

    aux_layers: list[int]  # target hidden_states indices ``extend`` receives (concatenated)

    def begin(self, prompt: torch.Tensor) -> None:
        """Start a generation for the [T] prompt (drops any previous state)."""

    def extend(self, next_ids: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Commit m target states: ``aux`` [m, 3Ht] at the next m positions, each paired with the
        token it produced, ``next_ids`` [m]. Discards every draft made since the last commit."""

    def draft_chain(self, k: int, s: Sampling) -> Draft:
        """K tokens following the last committed one."""

    def draft_tree(self, topk: int, depth: int, total_tokens: int) -> DraftTree:
        """A draft tree under the last committed token."""
