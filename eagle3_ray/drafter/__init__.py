"""The EAGLE-3 drafter: model and KV cache (``model``), the TTT loss (``ttt``), files (``export``)."""

from eagle3_ray.drafter.export import (
    aux_ids_to_hf_indices,
    export_drafter,
    init_drafter_from,
    load_drafter,
    load_drafter_weights,
    save_drafter_weights,
    translate_aux_ids,
)
from eagle3_ray.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter
from eagle3_ray.drafter.ttt import TTTOutput, ttt_attention_mask, ttt_forward

__all__ = [
    "DrafterConfig",
    "DrafterKVCache",
    "Eagle3Drafter",
    "TTTOutput",
    "aux_ids_to_hf_indices",
    "export_drafter",
    "init_drafter_from",
    "load_drafter",
    "load_drafter_weights",
    "save_drafter_weights",
    "translate_aux_ids",
    "ttt_attention_mask",
    "ttt_forward",
]
