"""The target side of speculative decoding: forwards over a transformers ``DynamicCache`` that
return fp32 logits and the aux hidden states the drafter reads, cache rollback, and the small pieces
every decoding loop shares (a prompt as a tensor, EOS ids, a device value read without a wait).

Tree verification passes a 4D additive mask over (cached prefix + new tokens); transformers 5.x
hands a 4D mask to the attention unchanged (``masking_utils._preprocess_mask_arguments``), and
both the ``sdpa`` and ``eager`` attentions add it to the scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eagle3_ray.decode.narrow_linear import narrow_rows
from eagle3_ray.drafter.model import sdpa_for_growing_keys
from eagle3_ray.engines.hidden_states import HiddenStateSelection
from eagle3_ray.engines.static_cache import MASKABLE_ATTENTION, cache_api
from eagle3_ray.errors import ConfigError


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
        # the DynamicCache grows every forward; a verify's few rows take the narrow linear on a CPU
        with sdpa_for_growing_keys(self.device), narrow_rows(self.device, ids.shape[0]):
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
