"""The drafter-free generators speculative decoding is measured against: plain decoding (one
target forward per token, over the model or a ``StaticTarget``) and transformers' prompt lookup."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import GenerationConfig

from eagle3_ray.errors import ConfigError
from eagle3_ray.decode.sampling import Sampling, make_sampling, pick
from eagle3_ray.decode.static import StaticTarget
from eagle3_ray.decode.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.decode.target import TargetRunner, check_max_new_tokens, eos_set, model_device, prompt_tensor


@torch.inference_mode()
def target_generate(
    target: torch.nn.Module | StaticTarget,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[list[int], SpecStats]:
    """Plain decoding, one target forward per token, timed like ``generate``: the speedup baseline.

    ``target``: the model, or a ``StaticTarget`` (preallocated cache, CUDA graphs) built over it.
    """
    tokens, stats, _ = _plain_decode(target, input_ids, max_new_tokens, temperature, top_p, seed, eos_token_id)
    return tokens, stats


@torch.inference_mode()
def target_top2(
    target: torch.nn.Module | StaticTarget,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    forced: Sequence[int] | None = None,
) -> tuple[list[int], list[tuple[float, float, float]]]:
    """Greedy plain decoding as ``target_generate`` runs it (same forwards, same kernels), keeping
    per new token the two largest logits it was chosen from and the largest logit magnitude of that
    row: (tokens, [(top1, top2, max |logit|)]). Untimed;
    the divergence audit (``eagle3_ray.bench.audit``) reads the gap at a differing position.

    ``forced``: feed these tokens instead of the argmax (teacher forcing, ``len(forced)`` steps,
    ``max_new_tokens`` and EOS ignored), so every top-2 is taken in the context of ``forced``
    itself (the audited baseline's answer) even where a free replay would decode otherwise; the
    tokens returned are the argmax at each step (== ``forced`` iff a replay reproduces it)."""
    if forced is not None:
        return _forced_top2(target, input_ids, list(forced))
    tokens, _, top2 = _plain_decode(target, input_ids, max_new_tokens, 0.0, 1.0, 0, eos_token_id, keep_top2=True)
    return tokens, top2


def _top2_scale(logits: torch.Tensor) -> torch.Tensor:
    """[V] logits -> [3]: the two largest and the largest magnitude (the row's scale: ``bench.audit``)."""
    return torch.cat([logits.topk(2).values, logits.abs().max().view(1)])


def _forced_top2(target, input_ids, forced: list[int]) -> tuple[list[int], list[tuple[float, float, float]]]:
    static = target if isinstance(target, StaticTarget) else None
    model = static.model if static is not None else target
    device = model_device(model)
    runner = static.runner() if static is not None else TargetRunner(model)
    feed = torch.tensor(forced, dtype=torch.long, device=device)
    argmax, top2 = [], []
    logits = runner.forward(prompt_tensor(input_ids, device)).logits[-1]
    for i in range(len(forced)):
        argmax.append(logits.argmax())
        top2.append(_top2_scale(logits))
        if i + 1 < len(forced):
            logits = runner.forward(feed[i : i + 1]).logits[-1]  # a [1] device tensor, as plain decoding feeds
    if not forced:
        return [], []
    return torch.stack(argmax).tolist(), [tuple(p) for p in torch.stack(top2).tolist()]


def _plain_decode(target, input_ids, max_new_tokens, temperature, top_p, seed, eos_token_id, keep_top2=False):
    check_max_new_tokens(max_new_tokens)
    static = target if isinstance(target, StaticTarget) else None
    model = static.model if static is not None else target
    device = model_device(model)
    prompt = prompt_tensor(input_ids, device)
    s = make_sampling(temperature, top_p, seed, device)
    tally = Tally(max_new_tokens, eos_set(model, eos_token_id), max_drafts=0)
    clock = Stopwatch(device)
    runner = static.runner() if static is not None else TargetRunner(model)
    top2: list[torch.Tensor] = []
    logits = runner.forward(prompt).logits[-1]
    clock.mark("prefill")
    while True:
        if keep_top2:
            top2.append(_top2_scale(logits))  # stays on the device until the end
        token, next_ids = _next_token(logits, s)
        done = tally.first(token) if not tally.tokens else tally.step([token], accepted=0)
        clock.mark("accept")
        if done:
            break
        logits = runner.forward(next_ids).logits[-1]
        clock.mark("verify")
    seconds = clock.seconds()
    pairs = [tuple(p) for p in torch.stack(top2).tolist()] if top2 else []
    return tally.tokens, tally.stats(seconds, clock.parts()), pairs


def _next_token(logits: torch.Tensor, s: Sampling) -> tuple[int, torch.Tensor]:
    """(the next token, the same as a [1] tensor on the logits' device to feed back). Greedy keeps
    the argmax on the device: no host-to-device copy per token."""
    if s.greedy:
        ids = logits.argmax()[None]
        return int(ids[0]), ids
    token = pick(logits, s)
    return token, torch.tensor([token], device=logits.device)


@torch.inference_mode()
def prompt_lookup_generate(
    target: torch.nn.Module,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    num_tokens: int = 10,
    *,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[list[int], SpecStats]:
    """Greedy prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens``), drafter-free.

    Target forwards are counted with a forward hook. transformers verifies the first candidates
    in the prefill forward itself, so tau here is new tokens / target forwards (docs/decode.md).
    """
    check_max_new_tokens(max_new_tokens)
    if num_tokens < 1:
        raise ConfigError(f"num_tokens={num_tokens}; prompt lookup needs at least 1 candidate token")
    device = model_device(target)
    prompt = prompt_tensor(input_ids, device)
    eos = sorted(eos_set(target, eos_token_id))
    forwards = [0]
    hook = target.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        clock = Stopwatch(device)
        out = target.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt)[None],
            generation_config=_lookup_config(target, eos, max_new_tokens, num_tokens),
        )
        seconds = clock.seconds()
    finally:
        hook.remove()
    tokens = out[0, prompt.shape[0] :].tolist()
    n = len(tokens)
    return tokens, SpecStats(
        tau=n / forwards[0] if forwards[0] else None,
        accept_by_position=[],
        verify_steps=forwards[0],
        new_tokens=n,
        seconds=seconds,
        tokens_per_s=n / seconds if seconds > 0 else 0.0,
        target_forwards=forwards[0],
        accept_hist=[],
    )


def _lookup_config(target: torch.nn.Module, eos: list[int], max_new_tokens: int, num_tokens: int) -> GenerationConfig:
    """A copy of the target's generation config; a copy so that ``eos=[]`` can switch EOS off."""
    config = copy.deepcopy(target.generation_config)
    config.update(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        prompt_lookup_num_tokens=num_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else config.pad_token_id,
    )
    return config
