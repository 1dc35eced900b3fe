"""The draft tree's selection, layout and greedy acceptance run as fixed-shape device ops (inside the
static proposer's CUDA graph, one host transfer per verify); here they are checked against the plain
host walks they replaced, on random EAGLE-2-shaped drafts with tied scores."""

from __future__ import annotations

import torch

from eagle3_ray.decode.sampling import Sampling
from eagle3_ray.decode.drafts import DraftTree, tree_layout
from eagle3_ray.decode.tree import accept_greedy, accept_path, eagle2_depths, select_nodes


def _reference_select(tokens, scores, parents, total_tokens):
    """The host walk: the best ``total_tokens`` by score (stable), reordered by depth then score."""
    order = scores.sort(descending=True, stable=True).indices[:total_tokens].tolist()
    parent = parents.tolist()
    depth: dict[int, int] = {}
    for i in sorted(order):
        depth[i] = 1 if parent[i] < 0 else depth[parent[i]] + 1
    order.sort(key=lambda i: depth[i])
    new_index = {old: new for new, old in enumerate(order)}
    return [tokens[i].item() for i in order], [-1 if parent[i] < 0 else new_index[parent[i]] for i in order]


def _reference_layout(parents):
    n = len(parents)
    parent = [-1] + [p + 1 for p in parents]
    depth, visible = [0] * (n + 1), torch.eye(n + 1, dtype=torch.bool)
    for i in range(1, n + 1):
        depth[i] = depth[parent[i]] + 1
        visible[i] |= visible[parent[i]]
    return depth, visible


def _eagle2_draft(topk: int, depth: int, g: torch.Generator, ties: bool):
    """Nodes laid out as eagle2_tree lays them out: topk roots, then topk*topk children per level,
    each hanging from one of the previous level's best topk; child scores = parent + log-prob <= 0."""
    tokens = torch.randperm(1000, generator=g)[:topk]
    scores = -torch.rand(topk, generator=g)
    parents = torch.full((topk,), -1)
    frontier, frontier_scores, count = torch.arange(topk), scores, topk
    all_t, all_s, all_p = [tokens], [scores], [parents]
    for _ in range(1, depth):
        step = -torch.rand(topk, topk, generator=g)
        if ties:  # log-prob exactly 0 (a certain child): equal to its parent's score
            step[torch.rand(topk, topk, generator=g) < 0.3] = 0.0
        cand = (frontier_scores[:, None] + step).flatten()
        kids = torch.stack([torch.randperm(1000, generator=g)[:topk] for _ in range(topk)]).flatten()
        all_t.append(kids)
        all_s.append(cand)
        all_p.append(frontier.repeat_interleave(topk))
        frontier_scores, best = cand.topk(topk)
        frontier = count + best
        count += topk * topk
    return torch.cat(all_t), torch.cat(all_s), torch.cat(all_p)


def test_select_nodes_is_the_host_walk():
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        topk, depth = 1 + trial % 5, 1 + trial % 6
        tokens, scores, parents = _eagle2_draft(topk, depth, g, ties=trial % 2 == 0)
        for total in (1, topk, 3 * topk + 1, tokens.shape[0], tokens.shape[0] + 5):
            tree = select_nodes(tokens, scores, parents, total)
            known = select_nodes(tokens, scores, parents, total, eagle2_depths(topk, depth, tokens.device))
            assert torch.equal(known.tokens, tree.tokens) and torch.equal(known.parents, tree.parents)
            want_tokens, want_parents = _reference_select(tokens, scores, parents, total)
            assert tree.tokens.tolist() == want_tokens and tree.parents.tolist() == want_parents
            want_depth, want_visible = _reference_layout(want_parents)
            assert tree.depth.tolist() == want_depth and torch.equal(tree.visible, want_visible)


def test_layout_of_a_hand_tree():
    # root -> a, b; a -> c; c -> d; b -> e
    depth, visible = tree_layout(torch.tensor([-1, -1, 0, 2, 1]))
    assert depth.tolist() == [0, 1, 1, 2, 3, 2]
    assert visible[4].nonzero().flatten().tolist() == [0, 1, 3, 4]  # d sees root, a, c, itself
    assert visible[5].nonzero().flatten().tolist() == [0, 2, 5]


def test_accept_greedy_is_the_host_walk():
    g = torch.Generator().manual_seed(1)
    vocab = 12
    for trial in range(200):
        tokens, scores, parents = _eagle2_draft(3, 4, g, ties=False)
        tree = select_nodes(tokens % vocab, scores, parents, 12)  # duplicate siblings happen mod vocab
        n = tree.tokens.shape[0]
        ids = torch.cat([torch.tensor([5]), tree.tokens])
        logits = torch.randn(n + 1, vocab, generator=g)
        for i in range(n):  # make some paths correct: the target's argmax is a child's token
            if torch.rand(1, generator=g) < 0.6:
                logits[tree.parents[i] + 1, tree.tokens[i]] = 10.0 + i
        want_path, want_token = accept_path(logits, tree, Sampling())
        got = accept_greedy(logits, tree, ids)
        if got is None:  # two matching siblings: the caller walks on the host
            kids = tree.children()
            best = logits.argmax(-1).tolist()
            assert any(sum(ids[c] == best[node] for c in kids[node]) > 1 for node in range(n + 1))
            continue
        path, new_tokens = got
        assert path == want_path
        assert new_tokens == ids[path[1:]].tolist() + [want_token]


def test_a_tree_without_layout_computes_it():
    tree = DraftTree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))
    depth, visible = tree.layout()
    assert depth.tolist() == [0, 1, 2, 2] and visible[3].tolist() == [True, True, False, True]
