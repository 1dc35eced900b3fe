"""Tree speculative decoding: EAGLE-2 dynamic draft trees verified in one target forward.

Drafting (``eagle2_tree``): the drafter's top-``topk`` tokens form depth 1; at each further depth
the ``topk`` nodes of highest cumulative draft log-prob are expanded together in one drafter
forward (tree mask over the drafter's cache), each proposing its ``topk`` best children. Of all
the nodes drafted, the ``total_tokens`` with the highest cumulative log-prob are verified.

Verification: the last committed token (the root) and the tree's nodes go through the target in
one forward; node i sits at position (root position + depth i) and attends to the cached prefix
and to its ancestors only. The accepted path is walked from the root (greedy: the child equal to
the target's argmax; sampling: the sequential multi-draft rule of ``sampling.verify_children``).
The target cache then keeps exactly the prefix, the root and the accepted path (a gather along
the sequence axis), whose keys/values were computed with the right positions and ancestors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eagle3_ray.drafter.model import DrafterKVCache, Eagle3Drafter
from eagle3_ray.spec.sampling import Sampling, probs, sample, verify_children
from eagle3_ray.spec.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.spec.target import TargetRunner, prefill

if TYPE_CHECKING:
    from eagle3_ray.spec.chain import Proposer


@dataclass
class DraftTree:
    """Draft tokens under the root (the last committed token), parents listed before children."""

    tokens: torch.Tensor  # [N] long, target vocab
    parents: torch.Tensor  # [N] long, index into tokens; -1 = the root

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(depth [N+1], ancestor-or-self mask [N+1, N+1] bool), row/column 0 = the root."""
        n = self.tokens.shape[0]
        parent = [-1] + [p + 1 for p in self.parents.tolist()]  # root-inclusive indices
        depth = [0] * (n + 1)
        visible = torch.eye(n + 1, dtype=torch.bool)
        for i in range(1, n + 1):
            assert 0 <= parent[i] < i, "a parent must precede its children"
            depth[i] = depth[parent[i]] + 1
            visible[i] |= visible[parent[i]]
        return torch.tensor(depth), visible

    def children(self) -> list[list[int]]:
        """Per root-inclusive node, its children's root-inclusive indices in draft order."""
        kids: list[list[int]] = [[] for _ in range(self.tokens.shape[0] + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i + 1)
        return kids


@torch.no_grad()
def eagle2_tree(
    drafter: Eagle3Drafter,
    cache: DrafterKVCache,
    hidden: torch.Tensor,  # [1, 1, H] drafter output that predicts the first draft token
    position: int,  # drafter position of a depth-1 token (= committed drafter cache length)
    topk: int,
    depth: int,
    total_tokens: int,
) -> DraftTree:
    """Grow an EAGLE-2 dynamic tree; appends the expansions to ``cache`` (the caller crops them)."""
    committed = cache.length
    device = hidden.device
    logp = drafter.logits(hidden)[0, -1].float().log_softmax(-1)  # [Vd]
    scores, ids = logp.topk(topk)  # [k] cumulative log-prob, draft ids
    all_ids, all_scores, all_parents = [ids], [scores], [torch.full((topk,), -1, device=device)]
    frontier = torch.arange(topk, device=device)  # node indices being expanded
    frontier_hidden = hidden.expand(1, topk, -1)  # [1, k, H] state that predicted each frontier node
    seen = torch.zeros(topk, 0, dtype=torch.bool, device=device)  # [k, E] expansion keys each row may see
    eye = torch.eye(topk, dtype=torch.bool, device=device)
    count = topk
    for d in range(1, depth):
        mask = torch.cat([torch.ones(topk, committed, dtype=torch.bool, device=device), seen, eye], dim=1)
        out = drafter(
            drafter.draft_to_target(ids)[None],
            frontier_hidden,
            torch.full((1, topk), position + d - 1, device=device),
            attention_mask=mask[None, None],  # [1, 1, k, S]: prefix + own ancestors + self
            cache=cache,
        )  # [1, k, H]
        child_logp, child_ids = drafter.logits(out)[0].float().log_softmax(-1).topk(topk, dim=-1)  # [k, k]
        cand = (scores[:, None] + child_logp).flatten()  # [k*k] cumulative log-prob of each child
        all_ids.append(child_ids.flatten())
        all_scores.append(cand)
        all_parents.append(frontier.repeat_interleave(topk))
        scores, best = cand.topk(topk)  # the next depth expands the best k children
        rows = best // topk  # which frontier row each one hangs from
        ids = child_ids.flatten()[best]
        frontier = count + best
        frontier_hidden = out[:, rows]
        seen = torch.cat([seen, eye], dim=1)[rows]
        count += topk * topk
    tree_ids = drafter.draft_to_target(torch.cat(all_ids))
    return select_nodes(tree_ids, torch.cat(all_scores), torch.cat(all_parents), total_tokens)


def select_nodes(
    tokens: torch.Tensor,  # [M] target ids, parents before children
    scores: torch.Tensor,  # [M] cumulative log-prob
    parents: torch.Tensor,  # [M], -1 = root
    total_tokens: int,
) -> DraftTree:
    """The ``total_tokens`` best nodes, reordered by depth then score.

    A child's score is its parent's plus a log-prob <= 0, and the stable sort keeps a parent ahead
    of an equal-scoring child (created later), so the chosen set always holds every ancestor.
    """
    order = scores.sort(descending=True, stable=True).indices[:total_tokens].tolist()
    parent = parents.tolist()
    depth: dict[int, int] = {}
    for i in sorted(order):
        depth[i] = 1 if parent[i] < 0 else depth[parent[i]] + 1
    order.sort(key=lambda i: depth[i])  # stable: score order within a depth
    new_index = {old: new for new, old in enumerate(order)}
    new_parents = [-1 if parent[i] < 0 else new_index[parent[i]] for i in order]
    index = torch.tensor(order, device=tokens.device)
    return DraftTree(tokens[index], torch.tensor(new_parents, device=tokens.device))


def accept_path(logits: torch.Tensor, tree: DraftTree, s: Sampling) -> tuple[list[int], int]:
    """Walk the tree from the root: (accepted root-inclusive node indices, the target's next token).

    ``logits`` [N+1, V]: target logits at the root and at every node.
    """
    kids = tree.children()
    tokens = [-1] + tree.tokens.tolist()
    best = logits.argmax(dim=-1).tolist() if s.greedy else None
    path = [0]
    while True:
        node = path[-1]
        if s.greedy:
            # Greedy: the target's argmax is the only acceptable child.
            match = next((c for c in kids[node] if tokens[c] == best[node]), None)
            if match is None:
                return path, best[node]
        else:
            if not kids[node]:
                return path, sample(probs(logits[node], s), s)
            j, token = verify_children(probs(logits[node], s), [tokens[c] for c in kids[node]], s)
            if j is None:
                return path, token
            match = kids[node][j]
        path.append(match)


def tree_step(
    runner: TargetRunner, proposer: Proposer, root: int, tree: DraftTree, s: Sampling, clock: Stopwatch | None = None
) -> tuple[list[int], int]:
    """Verify one tree; returns (new tokens = accepted drafts + the target's token, accepted count)."""
    mark = clock.mark if clock is not None else lambda part: None
    past = runner.length  # the root sits here
    depth, visible = tree.layout()  # [N+1], [N+1, N+1]
    ids = torch.cat([torch.tensor([root], device=tree.tokens.device), tree.tokens])  # [N+1]
    mark("draft")  # the tree's layout is drafting's host work
    out = runner.forward(ids, positions=past + depth, mask=visible)
    mark("verify")
    path, token = accept_path(out.logits, tree, s)
    runner.keep_path(past, path)
    new_tokens = ids[path[1:]].tolist() + [token]
    mark("accept")
    proposer.extend(torch.tensor(new_tokens, device=ids.device), None if out.aux is None else out.aux[path])
    mark("commit")
    return new_tokens, len(path) - 1


def tree_generate(
    runner: TargetRunner,
    proposer: Proposer,
    prompt: torch.Tensor,  # [T] long
    tally: Tally,
    s: Sampling,
    clock: Stopwatch,
    topk: int,
    depth: int,
    total_tokens: int,
) -> SpecStats:
    """Prefill, then draft a tree and verify it until EOS or the length limit."""
    token = prefill(runner, proposer, prompt, s)
    done = tally.first(token)
    clock.mark("prefill")
    while not done:
        tree = proposer.draft_tree(topk, depth, total_tokens)
        clock.mark("draft")
        new_tokens, accepted = tree_step(runner, proposer, token, tree, s, clock)
        done, token = tally.step(new_tokens, accepted), new_tokens[-1]
        clock.mark("accept")
    seconds = clock.seconds()
    return tally.stats(seconds, clock.parts())

