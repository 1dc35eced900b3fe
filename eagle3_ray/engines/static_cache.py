"""Static KV-cache primitives shared by the speculative-decoding target (``decode/static.py``) and
batched generation (``engines/static_generate.py``): a preallocated storage written at explicit
slots, exposed to transformers as a ``Cache`` of ``SlotLayer``s, and the transformers API checks
both need. No Ray in here.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import CacheLayerMixin

MASKABLE_ATTENTION = ("sdpa", "eager")  # attentions that add a custom 4D mask to the scores


def cache_api(model: torch.nn.Module) -> tuple[str, bool]:
    """(the forward's cache keyword, whether it takes ``cache_position``): transformers 5.24 renamed
    past_key_values to cache and dropped cache_position; earlier 5.x take the old names."""
    params = inspect.signature(model.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "cache_position" in params


class Slots:
    """Where the current forward writes its keys: one [W] long tensor shared by every layer."""

    pos: torch.Tensor | None = None


class SlotLayer(CacheLayerMixin):
    """One decoder layer's view of the shared storage; writes the new keys at ``slots.pos``."""

    _layer_type = None  # never registered in transformers' layer-type mappings
    is_compileable = True
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: Slots):
        super().__init__()
        self.keys, self.values = keys, values  # [1, kv, S, D] views into the storage
        self.slots = slots
        self.device = keys.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # storage exists from the start
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slots.pos, key_states)
        self.values.index_copy_(2, self.slots.pos, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        # Unused: the runners (StaticTarget, StaticBatchGenerator) always pass positions (and
        # cache_position where the model takes one) plus a 4D mask; the committed length is theirs.
        return 0

    def get_max_length(self) -> int:  # abstract in transformers 5.24
        return self.keys.shape[2]

    def get_max_cache_shape(self) -> int:  # the same, abstract under this name in transformers <= 5.12
        return self.keys.shape[2]
