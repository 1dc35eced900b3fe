"""The EAGLE-3 drafter: model and KV cache (``model``), the TTT loss (``ttt``) and what it reports
(``ttt_metrics``), files (``export``).

The aux-layer id rules export applies live with the engines (``eagle3_ray.engines.aux_layers``)."""

from eagle3_ray.drafter.export import (
    export_drafter,
    init_drafter_from,
    load_drafter,
    load_drafter_weights,
    save_drafter_weights,
)
from eagle3_ray.drafter.model import DrafterConfig, DrafterKVCache, Eagle3Drafter
from eagle3_ray.drafter.ttt import ttt_attention_mask, ttt_forward
from eagle3_ray.drafter.ttt_metrics import TTTOutput

__all__ = [
    "DrafterConfig",
    "DrafterKVCache",
    "Eagle3Drafter",
    "TTTOutput",
    "export_drafter",
    "init_drafter_from",
    "load_drafter",
    "load_drafter_weights",
    "save_drafter_weights",
    "ttt_attention_mask",
    "ttt_forward",
]
