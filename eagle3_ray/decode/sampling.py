"""Sampling and the acceptance rules of speculative decoding.

Temperature 0 is exact argmax (no randomness): a draft token is accepted iff it is the target's
argmax, which makes the output token-for-token the target's greedy decoding. Otherwise the target
distribution p and the draft distribution q are warped the same way (temperature, then top-p) and
the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) keeps the output distributed
exactly as the warped p. A proposer that drafts deterministically (argmax, top-k of a tree) has
q = a point mass on its token, written ``q=None`` here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_ray.errors import ConfigError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None  # on the target's device; None when greedy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_sampling(temperature: float, top_p: float, seed: int, device: torch.device) -> Sampling:
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} is negative; use 0 for greedy or a positive value")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p={top_p} is outside (0, 1]; use 1.0 to disable nucleus sampling")
    if temperature == 0:
        return Sampling()
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return Sampling(float(temperature), float(top_p), generator)


def probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature and top-p."""
    p = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p >= 1.0:
        return p
    sorted_p, order = p.sort(dim=-1, descending=True)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= s.top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    p = torch.zeros_like(p).scatter(-1, order, sorted_p)
    return p / p.sum(dim=-1, keepdim=True)


def sample(p: torch.Tensor, s: Sampling) -> int:
    """One token from the [V] distribution ``p``."""
    return int(torch.multinomial(p, 1, generator=s.generator))


def pick(logits: torch.Tensor, s: Sampling) -> int:
    """The next token from [V] logits: argmax when greedy, else a sample of the warped distribution."""
    return int(logits.argmax()) if s.greedy else sample(probs(logits, s), s)


def _uniform(s: Sampling, device: torch.device) -> float:
    return float(torch.rand((), generator=s.generator, device=device))


def accept(p: torch.Tensor, q: torch.Tensor | None, token: int, s: Sampling) -> bool:
    """Accept a draft ``token`` drawn from q with probability min(1, p(token) / q(token))."""
    qx = 1.0 if q is None else float(q[token])
    # u < p/q written as u*q < p: q >= p always accepts, q = point mass accepts with probability p.
    return _uniform(s, p.device) * qx < float(p[token])


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """norm(max(p - q, 0)): the distribution to resample from after rejecting ``token``."""
    if q is None:
        r = p.clone()
        r[token] = 0.0  # p - point mass at token, clamped at 0
    else:
        r = (p - q).clamp_min(0.0)
    total = r.sum()
    # Zero mass means p <= q everywhere, where rejection has probability 0; only rounding gets here.
    return r / total if total > 0 else p


def verify_chain(
    logits: torch.Tensor,  # [K+1, V] target logits at the last committed token and each draft
    draft_ids: list[int],  # K draft tokens (target vocab)
    draft_q: torch.Tensor | None,  # [K, V] draft distributions (target vocab), None = point masses
    s: Sampling,
) -> tuple[int, int]:
    """(number of accepted drafts a, the token after them): the bonus when a == K, else the correction."""
    if s.greedy:
        return accept_greedy_chain(draft_ids, logits.argmax(dim=-1).tolist())
    p = probs(logits, s)  # [K+1, V]
    for i, token in enumerate(draft_ids):
        q = None if draft_q is None else draft_q[i]
        if not accept(p[i], q, token, s):
            return i, sample(residual(p[i], q, token), s)
    return len(draft_ids), sample(p[-1], s)  # every draft accepted: the bonus comes from p itself


def accept_greedy_chain(draft_ids: list[int], best: list[int]) -> tuple[int, int]:
    """Greedy ``verify_chain`` on the target's argmax ``best`` [K+1] at the root and each draft."""
    for i, token in enumerate(draft_ids):
        if token != best[i]:  # greedy accepts exactly the target's argmax
            return i, best[i]
    return len(draft_ids), best[-1]


def verify_children(p: torch.Tensor, children: list[int], s: Sampling) -> tuple[int | None, int | None]:
    """Sequential multi-draft rule over a tree node's deterministic children (SpecInfer / EAGLE).

    ``p`` [V] is the warped target distribution at the node, ``children`` its child tokens in draft
    order. Returns (index of the accepted child, None) or (None, token sampled from the residual).
    Each rejection removes the rejected token from p and renormalises, so the next child is
    tested against what p puts on tokens not yet tried: the output is distributed exactly as p.
    """
    for j, token in enumerate(children):
        if accept(p, None, token, s):
            return j, None
        p = residual(p, None, token)
    return None, sample(p, s)
