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

import torch

from eagle3_ray.drafter.model import DrafterKVCache, Eagle3Drafter
from eagle3_ray.decode.drafts import DraftTree, Proposer, tree_layout
from eagle3_ray.decode.loop import speculate, start
from eagle3_ray.decode.sampling import Sampling, probs, sample, verify_children
from eagle3_ray.decode.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.decode.target import HostRead, TargetRunner, as_root


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
    return select_nodes(tree_ids, torch.cat(all_scores), torch.cat(all_parents), total_tokens,
                        eagle2_depths(topk, depth, device))


def eagle2_depths(topk: int, depth: int, device: torch.device) -> torch.Tensor:
    """Depth of every node ``eagle2_tree`` drafts, in its order: ``topk`` at depth 1, then ``topk``
    squared per further depth."""
    return torch.cat([torch.ones(topk, dtype=torch.long, device=device)]
                     + [torch.full((topk * topk,), d, dtype=torch.long, device=device) for d in range(2, depth + 1)])


def select_nodes(
    tokens: torch.Tensor,  # [M] target ids, parents before children
    scores: torch.Tensor,  # [M] cumulative log-prob
    parents: torch.Tensor,  # [M], -1 = root
    total_tokens: int,
    depths: torch.Tensor | None = None,  # [M] each node's depth (1 = under the root), when the caller knows it
) -> DraftTree:
    """The ``total_tokens`` best nodes, reordered by depth then score, with their layout.

    A child's score is its parent's plus a log-prob <= 0, and the stable sort keeps a parent ahead
    of an equal-scoring child (created later), so the chosen set always holds every ancestor.
    Fixed-shape device ops only: the static proposer runs this inside its CUDA graph.
    """
    m = tokens.shape[0]
    n = min(total_tokens, m)
    dev = tokens.device
    chosen = scores.sort(descending=True, stable=True).indices[:n]  # [n] by score
    depth_all = _node_depths(parents) if depths is None else depths  # [M], 1 = a child of the root
    key = depth_all[chosen] * n + torch.arange(n, device=dev)  # by depth, then score order
    order = chosen[key.argsort()]  # [n] old indices in their new order
    new_index = torch.full((m,), -1, dtype=torch.long, device=dev)
    new_index[order] = torch.arange(n, device=dev)
    old_parent = parents[order]
    new_parents = torch.where(old_parent >= 0, new_index[old_parent.clamp(min=0)], -1)
    depth, visible = tree_layout(new_parents)
    return DraftTree(tokens[order], new_parents, depth, visible)


def _node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node of a parent-pointer forest (-1 = the root, depth 1 under it): pointer
    jumping, ceil(log2(M + 1)) rounds of fixed-shape ops."""
    dist = torch.ones_like(parents)
    jump = parents
    for _ in range(max(1, parents.shape[0].bit_length())):
        up = jump.clamp(min=0)
        has = jump >= 0
        dist = dist + torch.where(has, dist[up], 0)
        jump = torch.where(has, jump[up], jump)
    return dist


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


def greedy_verdict(best: torch.Tensor, tree: DraftTree, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance on the device: ([N+1] bool, the root and each node that it and each of its
    ancestors is the target's argmax at its parent; [N+1] root-inclusive parents).

    ``best`` [N+1]: the target's argmax at the root and at every node; ``ids`` [N+1]: the root and
    the tree's tokens, as verified."""
    _, visible = tree.layout()
    up = torch.cat([tree.parents.new_zeros(1), tree.parents + 1])  # root-inclusive parent
    match = (ids == best[up]) | (torch.arange(ids.shape[0], device=ids.device) == 0)  # the root always
    return ~(visible & ~match[None, :]).any(-1), up


def accepted_order(accepted: torch.Tensor) -> torch.Tensor:
    """[N+1] node indices, the accepted ones first in index order (a path: ancestors first), then the
    rest; fixed-shape device ops."""
    i = torch.arange(accepted.shape[0], device=accepted.device)
    return torch.where(accepted, i, i + accepted.shape[0]).argsort()


def _greedy_path(flags: list[int], best: list[int], ids: list[int], parent: list[int]
                 ) -> tuple[list[int], list[int]] | None:
    """The host's reading of ``greedy_verdict``: (accepted root-inclusive path, new tokens = its drafts
    + the target's next token), or None when the accepted nodes are not one path (duplicate siblings)."""
    path = [i for i, a in enumerate(flags) if a]  # ancestors precede their children: path order
    if any(parent[b] != a for a, b in zip(path, path[1:])):
        return None
    return path, [ids[i] for i in path[1:]] + [best[path[-1]]]


def accept_greedy(logits: torch.Tensor, tree: DraftTree, ids: torch.Tensor) -> tuple[list[int], list[int]] | None:
    """``accept_path`` for greedy decoding, on the device (``greedy_verdict``). One host transfer per
    verify: returns (accepted root-inclusive path, new tokens = its drafts + the target's next token),
    or None when the accepted nodes do not form one path (duplicate siblings: walk with ``accept_path``).

    ``ids`` [N+1]: the root and the tree's tokens, as verified.
    """
    best = logits.argmax(dim=-1)  # [N+1]
    accepted, up = greedy_verdict(best, tree, ids)
    return _greedy_path(*torch.stack([accepted.long(), best, ids, up]).tolist())


def tree_step(
    runner: TargetRunner, proposer: Proposer, root: int | torch.Tensor, tree: DraftTree, s: Sampling,
    clock: Stopwatch | None = None,
) -> tuple[list[int], int, torch.Tensor]:
    """Verify one tree under ``root`` (as ``chain_step``'s); returns (new tokens = accepted drafts +
    the target's token, accepted count, the last new token as a [1] device tensor)."""
    mark = clock.mark if clock is not None else lambda part: None
    past = runner.length  # the root sits here
    depth, visible = tree.layout()  # [N+1], [N+1, N+1]
    ids = torch.cat([as_root(root, tree.tokens), tree.tokens])  # [N+1]
    mark("draft")  # a tree built without its layout computes it here: drafting's work
    out = runner.forward(ids, positions=past + depth, mask=visible)
    mark("verify")
    walked = accept_greedy(out.logits, tree, ids) if s.greedy else None
    if walked is None:
        path, token = accept_path(out.logits, tree, s)
        new_tokens = ids[path[1:]].tolist() + [token]
    else:
        path, new_tokens = walked
    runner.keep_path(past, path)
    mark("accept")
    new_ids = torch.tensor(new_tokens, device=ids.device)  # the device is idle here (the walk's host transfer)
    proposer.extend(new_ids, None if out.aux is None else out.aux[path])
    mark("commit")
    return new_tokens, len(path) - 1, new_ids[-1:]


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
    if s.greedy and hasattr(proposer, "tree_after_verify"):
        return _tree_generate_ahead(runner, proposer, prompt, tally, s, clock, topk, depth, total_tokens)
    return speculate(runner, proposer, prompt, tally, s, clock,
                     lambda: proposer.draft_tree(topk, depth, total_tokens), tree_step)


def _tree_generate_ahead(
    runner, proposer, prompt: torch.Tensor, tally: Tally, s: Sampling, clock: Stopwatch, topk: int, depth: int,
    total_tokens: int,
) -> SpecStats:
    """Greedy tree decoding with a proposer that takes the verdict on the device
    (``StaticProposer.tree_after_verify``; the runner is a ``StaticRunner``), as the chain's
    (``spec.chain._chain_generate_ahead``): the commit and the next tree are queued right behind the
    verify and its verdict, and the device drafts while the host reads the path, moves the target's
    keys onto it and counts."""
    token, done = start(runner, proposer, prompt, tally, s, clock)
    if done:
        return tally.stats(clock.seconds(), clock.parts())
    tree = proposer.draft_tree(topk, depth, total_tokens)
    clock.mark("draft")
    root: int | torch.Tensor = token
    read = HostRead(runner.device)
    while not done:
        past = runner.length  # the root sits here
        positions, visible = tree.layout()  # [N+1], [N+1, N+1]
        ids = torch.cat([as_root(root, tree.tokens), tree.tokens])  # [N+1]
        out = runner.forward(ids, positions=past + positions, mask=visible)
        clock.mark("verify")
        best = out.logits.argmax(dim=-1)  # [N+1]
        accepted, up = greedy_verdict(best, tree, ids)
        order = accepted_order(accepted)  # the path's offsets first, on the device: the target's move reads them
        read.start(torch.stack([accepted.long(), best, ids, up]))
        clock.mark("accept")
        tree = proposer.tree_after_verify(best, accepted, out.aux, topk, depth, total_tokens)  # behind the copy
        clock.mark("draft")
        walked = _greedy_path(*read.values())  # waits for the copy, not for the draft
        if walked is None:
            raise RuntimeError("the accepted nodes of a draft tree are not one path (duplicate siblings); "
                               "the static drafter's EAGLE-2 trees have distinct siblings")
        path, new_tokens = walked
        proposer.settle(len(path))
        runner.keep_path(past, path, order[: len(path)])
        done = tally.step(new_tokens, len(path) - 1)
        root = best[path[-1] : path[-1] + 1]  # the next root, on the device
        clock.mark("accept")
    return tally.stats(clock.seconds(), clock.parts())
