"""The flex attention path's KV cache of the TTT unroll (``ttt_forward(attention="flex")``)."""

from __future__ import annotations

import torch

from eagle3_ray.drafter.model import DrafterKVCache


class FixedLengthTTTCache(DrafterKVCache):
    """KV cache of constant length ``ttt_steps * T``: step j's keys in block j, zeros after the last
    written block. Constant shapes let a compiled flex kernel serve every TTT step.

    Built functionally (``cat``), not by writing into a buffer: earlier steps' saved tensors must
    not change under autograd.
    """

    def __init__(self, ttt_steps: int) -> None:
        super().__init__()
        self.ttt_steps = ttt_steps
        self.keys: list[torch.Tensor] = []  # per step [B, kv, T, D]
        self.values: list[torch.Tensor] = []

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(k)
        self.values.append(v)
        assert len(self.keys) <= self.ttt_steps
        pad = [torch.zeros_like(k)] * (self.ttt_steps - len(self.keys))
        return torch.cat(self.keys + pad, dim=2), torch.cat(self.values + pad, dim=2)
