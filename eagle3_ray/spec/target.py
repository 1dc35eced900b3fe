"""The target side of speculative decoding: forwards over a transformers ``DynamicCache`` that
return fp32 logits and the aux hidden states the drafter reads, cache rollback, and the two
drafter-free generators measured against (plain decoding, prompt lookup).

Tree verification passes a 4D additive mask over (cached prefix + new tokens); transformers 5.x
hands a 4D mask to the attention unchanged (``masking_utils._preprocess_mask_arguments``), and
both the ``sdpa`` and ``eager`` attentions add it to the scores.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.cache_utils import DynamicLayer

from eagle3_ray.drafter.model import sdpa_for_growing_keys
from eagle3_ray.engines.hidden_states import HiddenStateSelection
from eagle3_ray.engines.static_cache import MASKABLE_ATTENTION, cache_api
from eagle3_ray.errors import ConfigError
from eagle3_ray.spec.sampling import Sampling, make_sampling, pick
from eagle3_ray.spec.stats import SpecStats, Stopwatch, Tally

if TYPE_CHECKING:
    from eagle3_ray.spec.chain import Proposer
    from eagle3_ray.spec.static import StaticTarget

@dataclass
class TargetOut:
    logits: torch.Tensor  # [T, V] fp32
    aux: torch.Tensor | None  # [T, 3Ht] in the target dtype; None when no aux layers were asked


class TargetRunner:
    """One generation's target forwards and KV cache (batch size 1)."""

    def __init__(self, model: torch.nn.Module, aux_layers: Sequence[int] = ()):
        self.model = model
        self.aux_layers = list(aux_layers)
        self._select = HiddenStateSelection(model, self.aux_layers)  # what to ask transformers for (its version's way)
        self.cache = DynamicCache(config=model.config)
        self.device = model.get_input_embeddings().weight.device
        self.cache_kwarg, _ = cache_api(model)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    def forward(
        self,
        ids: torch.Tensor,  # [T] long
        positions: torch.Tensor | None = None,  # [T]; default: right after the cache
        mask: torch.Tensor | None = None,  # [T, T] bool among the new tokens, True = attend; None = causal
    ) -> TargetOut:
        past = self.length
        if positions is None:
            positions = torch.arange(past, past + ids.shape[0], device=self.device)
        with sdpa_for_growing_keys(self.device):  # the DynamicCache grows every forward
            out = self.model(
                input_ids=ids[None].to(self.device),
                position_ids=positions[None].to(self.device),
                attention_mask=None if mask is None else self._additive_mask(mask, past),
                use_cache=True,
                output_hidden_states=self._select.request,  # only these states are kept
                **{self.cache_kwarg: self.cache},
            )
        aux = torch.cat([h[0] for h in self._select.take(out.hidden_states)], -1) if self.aux_layers else None
        return TargetOut(out.logits[0].float(), aux)

    def _additive_mask(self, mask: torch.Tensor, past: int) -> torch.Tensor:
        """[T, T] bool -> [1, 1, T, past + T] additive mask (0 = attend) in the model dtype."""
        impl = self.model.config._attn_implementation
        if impl not in MASKABLE_ATTENTION:
            raise ConfigError(
                f"tree verification needs a custom attention mask, which attn_implementation={impl!r} "
                f"does not take; load the target with attn_implementation in {MASKABLE_ATTENTION} or use mode='chain'"
            )
        t = mask.shape[0]
        visible = torch.cat([torch.ones(t, past, dtype=torch.bool, device=mask.device), mask], dim=1)  # [T, S]
        dtype = self.model.get_input_embeddings().weight.dtype
        additive = torch.zeros(visible.shape, dtype=dtype, device=self.device)
        additive.masked_fill_(~visible.to(self.device), torch.finfo(dtype).min)
        return additive[None, None]

    def crop(self, n: int) -> None:
        """Keep the first ``n`` cached positions (drop rejected drafts)."""
        if self.length > n:
            self.cache.crop(n - self.length)  # transformers 5 crops by a negative count of tokens to drop

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the cached positions ``index`` [n], in that order (a tree's accepted path)."""
        index = index.to(self.device)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise ConfigError(
                    f"tree mode gathers cache positions, which the {type(layer).__name__} cache layer of this "
                    "target (sliding window / linear attention) does not support; use mode='chain'"
                )
            layer.keys = layer.keys[:, :, index]
            layer.values = layer.values[:, :, index]

    def keep_path(self, past: int, path: Sequence[int]) -> None:
        """Keep the first ``past`` positions, then the new tokens at offsets ``path`` (a tree's accepted path)."""
        self.keep(torch.cat([torch.arange(past), past + torch.tensor(list(path), dtype=torch.long)]))


class HostRead:
    """The values of a small device tensor for the host, copied out now (into pinned memory, not
    waited for): work queued after the copy runs while the host waits for the copy alone."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self._cuda else None

    def start(self, values: torch.Tensor) -> None:
        if self._host is None or self._host.shape != values.shape or self._host.dtype != values.dtype:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=self._cuda)
        self._host.copy_(values, non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()

    def values(self) -> list:
        assert self._host is not None, "start() first"
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


def prefill(runner: TargetRunner, proposer: Proposer, prompt: torch.Tensor, s: Sampling) -> int:
    """Run the prompt through the target, pick the first new token, and prime the proposer with the
    (aux state at t, token t+1) pairs of the prompt, exactly the pairs the drafter was trained on."""
    out = runner.forward(prompt)  # logits [T, V], aux [T, 3Ht]
    first = pick(out.logits[-1], s)
    proposer.begin(prompt)
    proposer.extend(torch.cat([prompt[1:], prompt.new_tensor([first])]), out.aux)
    return first


def as_root(root: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The root as a [1] tensor on ``like``'s device. A host int is copied in, and a copy from pageable
    host memory waits for the device's queue to drain (the draft in flight): the steps pass the last
    cycle's device tensor instead, so the verify is queued behind the draft without a wait."""
    return root.view(1) if isinstance(root, torch.Tensor) else like.new_tensor([root])


def prompt_tensor(input_ids: torch.Tensor | Sequence[int], device: torch.device) -> torch.Tensor:
    """The prompt as a [T] long tensor on ``device``; refuses batches and empty prompts."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0:
        raise ConfigError(
            f"input_ids has shape {tuple(ids.shape)}; pass one non-empty prompt as a 1-D list or tensor (batch size 1)"
        )
    return ids.to(device)


def eos_set(target: torch.nn.Module, eos_token_id: int | Sequence[int] | None) -> set[int]:
    """EOS ids to stop at; None = the target's generation_config; [] = never stop early."""
    if eos_token_id is None:
        config = getattr(target, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}


def check_max_new_tokens(max_new_tokens: int) -> None:
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens}; ask for at least 1 token")


def model_device(target: torch.nn.Module) -> torch.device:
    return target.get_input_embeddings().weight.device


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
    from eagle3_ray.spec.static import StaticTarget  # static.py builds on this module

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
    from eagle3_ray.spec.static import StaticTarget  # static.py builds on this module

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
    in the prefill forward itself, so tau here is new tokens / target forwards (docs/spec.md).
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
