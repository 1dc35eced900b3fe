"""The decoding loop chain and tree decoding share: prefill, then draft, verify and count until EOS or
the length limit. A mode brings its draft (``Proposer.draft_chain`` / ``draft_tree``) and its verify
step (``spec.chain.chain_step`` / ``spec.tree.tree_step``)."""

from __future__ import annotations

from typing import Callable

import torch

from eagle3_ray.decode.drafts import Draft, DraftTree, Proposer
from eagle3_ray.decode.sampling import Sampling, pick
from eagle3_ray.decode.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.decode.target import TargetRunner

# (runner, proposer, root, draft, sampling, clock) -> (new tokens, accepted drafts, the next root)
Verify = Callable[..., tuple[list[int], int, torch.Tensor]]


def prefill(runner: TargetRunner, proposer: Proposer, prompt: torch.Tensor, s: Sampling) -> int:
    """Run the prompt through the target, pick the first new token, and prime the proposer with the
    (aux state at t, token t+1) pairs of the prompt, exactly the pairs the drafter was trained on."""
    out = runner.forward(prompt)  # logits [T, V], aux [T, 3Ht]
    first = pick(out.logits[-1], s)
    proposer.begin(prompt)
    proposer.extend(torch.cat([prompt[1:], prompt.new_tensor([first])]), out.aux)
    return first


def start(runner: TargetRunner, proposer: Proposer, prompt: torch.Tensor, tally: Tally, s: Sampling,
          clock: Stopwatch) -> tuple[int, bool]:
    """Prefill and count the first new token: (the token, whether the generation is done already)."""
    token = prefill(runner, proposer, prompt, s)
    done = tally.first(token)
    clock.mark("prefill")
    return token, done


def speculate(runner: TargetRunner, proposer: Proposer, prompt: torch.Tensor, tally: Tally, s: Sampling,
              clock: Stopwatch, draft: Callable[[], Draft | DraftTree], verify: Verify) -> SpecStats:
    """Prefill, then ``draft()`` and ``verify`` it until EOS or the length limit."""
    token, done = start(runner, proposer, prompt, tally, s, clock)
    root: int | torch.Tensor = token
    while not done:
        proposal = draft()
        clock.mark("draft")
        new_tokens, accepted, root = verify(runner, proposer, root, proposal, s, clock)
        done = tally.step(new_tokens, accepted)
        clock.mark("accept")
    return tally.stats(clock.seconds(), clock.parts())
