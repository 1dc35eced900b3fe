"""Chain speculative decoding (top-1, K steps), and the eager EAGLE-3 proposer both modes draft with.

The EAGLE-3 drafter (``Eagle3Proposer``, a ``spec.drafts.Proposer``) is fed exactly as in training
(``drafter/ttt.py``): position p pairs fc(target aux state at p) with the token at p+1, and the i-th
draft step's token sits at position ``committed + i``. After each verify, the drafter cache is
cropped back to the committed pairs and extended with the target's aux states of the root and the
accepted drafts, each paired with the token it produced (the accepted drafts, then the target's own
next token). Draft-step keys are never kept: they were computed from drafted, not target, hidden
states.

One chain step::

    drafts d_1..d_K  <- K drafter steps from the last committed token x
    target([x, d_1..d_K])  -> logits at K+1 positions (one forward)
    accept the longest prefix the target agrees with, then the target's own token at the first
    disagreement (or the bonus after d_K); crop the target cache to the accepted prefix.
"""

from __future__ import annotations

import torch

from eagle3_ray.drafter.model import DrafterKVCache, Eagle3Drafter
from eagle3_ray.decode.drafts import Draft, DraftTree, Proposer
from eagle3_ray.decode.loop import speculate, start
from eagle3_ray.decode.sampling import Sampling, accept_greedy_chain, probs, verify_chain
from eagle3_ray.decode.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.decode.target import HostRead, TargetRunner, as_root
from eagle3_ray.decode.tree import eagle2_tree


class Eagle3Proposer:
    """An ``Eagle3Drafter`` (on the target's device/dtype, embedding bound) and its KV cache."""

    def __init__(self, drafter: Eagle3Drafter):
        self.drafter = drafter
        self.aux_layers = list(drafter.config.aux_layers)
        self.begin(torch.empty(0))

    def begin(self, prompt: torch.Tensor) -> None:
        self.cache = DrafterKVCache(growing=True)
        self.committed = 0  # drafter positions backed by target states
        self.hidden: torch.Tensor | None = None  # [1, 1, H] output that predicts the next draft token

    @torch.no_grad()
    def extend(self, next_ids: torch.Tensor, aux: torch.Tensor | None) -> None:
        assert aux is not None and aux.shape[0] == next_ids.shape[0], "EAGLE-3 needs one aux state per token"
        self.cache.crop(self.committed)
        positions = torch.arange(self.committed, self.committed + next_ids.shape[0], device=next_ids.device)
        out = self.drafter(next_ids[None], self.drafter.fuse(aux[None]), positions[None], cache=self.cache)  # [1, m, H]
        self.committed += next_ids.shape[0]
        self.hidden = out[:, -1:]

    @torch.no_grad()
    def draft_chain(self, k: int, s: Sampling) -> Draft:
        h = self.hidden  # [1, 1, H]
        ids, qs = [], []
        for i in range(k):
            logits = self.drafter.logits(h)[0, -1]  # [Vd]
            if s.greedy:
                draft_id = logits.argmax()
            else:
                q = probs(logits, s)  # [Vd]
                draft_id = torch.multinomial(q, 1, generator=s.generator)[0]
                qs.append(self._to_target_vocab(q))
            token = self.drafter.draft_to_target(draft_id)
            ids.append(token)  # stays on the device: one host sync for the whole chain, below
            if i + 1 < k:
                position = torch.full((1, 1), self.committed + i, device=h.device)
                h = self.drafter(token.view(1, 1), h, position, cache=self.cache)
        return Draft(torch.stack(ids), torch.stack(qs) if qs else None)

    def _to_target_vocab(self, q: torch.Tensor) -> torch.Tensor:
        """[Vd] draft-vocab distribution -> [V] target-vocab distribution (0 outside the draft vocab)."""
        rows = self.drafter.draft_to_target(torch.arange(q.shape[0], device=q.device))
        return q.new_zeros(self.drafter.config.vocab_size).index_copy(0, rows, q)

    def draft_tree(self, topk: int, depth: int, total_tokens: int) -> DraftTree:
        return eagle2_tree(self.drafter, self.cache, self.hidden, self.committed, topk, depth, total_tokens)


def chain_step(
    runner: TargetRunner, proposer: Proposer, root: int | torch.Tensor, draft: Draft, s: Sampling,
    clock: Stopwatch | None = None,
) -> tuple[list[int], int, torch.Tensor]:
    """Verify one chain under ``root`` (the last committed token; a [1] tensor on the target's device
    or an int); returns (new tokens = accepted drafts + the target's token, accepted count, the last
    new token as a [1] device tensor: the next cycle's root)."""
    mark = clock.mark if clock is not None else lambda part: None
    past = runner.length  # the root sits here
    drafts = torch.as_tensor(draft.tokens, device=runner.device)  # [K]
    ids = torch.cat([as_root(root, drafts), drafts])  # [K+1]
    out = runner.forward(ids)  # logits [K+1, V]: row i predicts the token after ids[i]
    mark("verify")
    if s.greedy:  # one host transfer: the drafts and the target's argmax at every position
        best = out.logits.argmax(dim=-1)  # [K+1]
        host = torch.cat([drafts, best]).tolist()
        accepted, token = accept_greedy_chain(host[: drafts.shape[0]], host[drafts.shape[0]:])
        draft_ids = host[: drafts.shape[0]]
        new_ids = torch.cat([drafts[:accepted], best[accepted : accepted + 1]])  # the same, never copied in
    else:
        draft_ids = draft.ids
        accepted, token = verify_chain(out.logits, draft_ids, draft.q, s)
        new_ids = None
    runner.crop(past + 1 + accepted)  # root + accepted drafts; the new token is not in the cache yet
    new_tokens = draft_ids[:accepted] + [token]
    if new_ids is None:
        new_ids = torch.tensor(new_tokens, device=runner.device)
    mark("accept")
    aux = None if out.aux is None else out.aux[: accepted + 1]  # the states that produced new_tokens
    proposer.extend(new_ids, aux)
    mark("commit")
    return new_tokens, accepted, new_ids[-1:]


def chain_generate(
    runner: TargetRunner,
    proposer: Proposer,
    prompt: torch.Tensor,  # [T] long
    tally: Tally,
    s: Sampling,
    clock: Stopwatch,
    num_steps: int,
) -> SpecStats:
    """Prefill, then draft K tokens and verify them until EOS or the length limit."""
    if s.greedy and hasattr(proposer, "chain_after_verify"):
        return _chain_generate_ahead(runner, proposer, prompt, tally, s, clock, num_steps)
    return speculate(runner, proposer, prompt, tally, s, clock, lambda: proposer.draft_chain(num_steps, s), chain_step)


def _chain_generate_ahead(
    runner: TargetRunner, proposer, prompt: torch.Tensor, tally: Tally, s: Sampling, clock: Stopwatch, k: int,
) -> SpecStats:
    """Greedy chain decoding with a proposer that takes the verdict on the device
    (``StaticProposer.chain_after_verify``): the commit and the next draft are queued right behind
    the verify, before the host has read the verdict, so the device drafts while the host reads the
    argmax, accepts, crops and counts. A cycle on the device: the verify, the argmax, the verdict and
    its copy out, the commit and next draft (one graph). The draft queued after the last verify is
    never used. Parts: ``verify``; ``accept``, the verdict and its copy out plus the device's wait for
    the host after the draft; ``draft``, the commit and the next draft."""
    token, done = start(runner, proposer, prompt, tally, s, clock)
    if done:
        return tally.stats(clock.seconds(), clock.parts())
    draft = proposer.draft_chain(k, s)
    clock.mark("draft")
    root: int | torch.Tensor = token
    read = HostRead(runner.device)
    while not done:
        past = runner.length  # the root sits here
        drafts = draft.tokens  # [K] on the device
        out = runner.forward(torch.cat([as_root(root, drafts), drafts]))  # logits [K+1, V]
        clock.mark("verify")
        best = out.logits.argmax(dim=-1)  # [K+1]: the target's token after the root and each draft
        accepted = torch.cat([best.new_ones(1), (drafts == best[:-1]).long().cumprod(0)]).bool()  # [K+1]
        read.start(torch.cat([drafts, best]))
        clock.mark("accept")
        draft = proposer.chain_after_verify(best, accepted, out.aux, k)  # queued behind the copy
        clock.mark("draft")
        host = read.values()  # waits for the copy, not for the draft
        n, token = accept_greedy_chain(host[:k], host[k:])
        proposer.settle(n + 1)
        runner.crop(past + 1 + n)  # root + accepted drafts; the new token is not in the cache yet
        done = tally.step(host[:n] + [token], n)
        root = best[n : n + 1]  # the next root, on the device: the next verify needs no copy in
        clock.mark("accept")
    return tally.stats(clock.seconds(), clock.parts())
