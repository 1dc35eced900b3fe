"""Asking a transformers model for only some ``hidden_states``, the same way on every transformers 5.x.

The project's aux layer ids are HF ``hidden_states`` indices: k is the residual stream after k decoder
layers (0 = the embedding output). transformers accepts a list of indices as ``output_hidden_states``
and keeps only those states, which the capture needs (all of them would hold every layer's activations
until the forward returns). What the list means changed within 5.x:

- 5.24 (and later): index k of the list and of the returned tuple is ``hidden_states[k]``, as with
  ``output_hidden_states=True``.
- 5.17 (the H200 image's): the embedding output is left out of a selective capture, so index k is the
  output of decoder layer k, ``hidden_states[k + 1]``: one layer deeper than asked.

Which one a model does is detected, not read from a version string: ``HiddenStateSelection`` runs the
model once on one token, with ``True`` and with a one-index list, and finds where the selected state
sits among all of them (``offset``). No Ray in here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from eagle3_ray.errors import ConfigError

_OFFSET_ATTR = "_eagle3_ray_hidden_state_offset"


def hidden_state_offset(model: torch.nn.Module) -> int:
    """How far a selective ``output_hidden_states=[i]`` of ``model`` lands from ``hidden_states[i]``:
    0 (the list holds ``hidden_states[i]`` at i) or 1 (it holds ``hidden_states[i + 1]`` at i). Measured
    once per model object (one-token forwards) and remembered on it."""
    known = getattr(model, _OFFSET_ATTR, None)
    if known is not None:
        return known
    weight = next(model.parameters())
    ids = torch.zeros(1, 1, dtype=torch.long, device=weight.device)
    with torch.inference_mode():
        full = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        picked = model(input_ids=ids, output_hidden_states=[0], use_cache=False).hidden_states[0]
    if picked is None:
        raise ConfigError(
            f"{type(model).__name__}: a selective output_hidden_states=[0] returned nothing at index 0 "
            f"(transformers {_transformers_version()}); this transformers does not select hidden states "
            "the ways eagle3_ray.engines.hidden_states knows: use transformers 5.17-5.24"
        )
    errors = [float((picked.float() - full[j].float()).abs().max()) for j in (0, 1)]
    offset = 0 if errors[0] <= errors[1] else 1
    if errors[offset] > 1e-3 * (1.0 + float(full[offset].float().abs().max())):
        raise ConfigError(
            f"{type(model).__name__}: a selective output_hidden_states=[0] matches neither hidden_states[0] nor "
            f"[1] of a full capture (max errors {errors[0]:.3g}, {errors[1]:.3g}; transformers "
            f"{_transformers_version()}): cannot tell which layers a selective capture returns"
        )
    setattr(model, _OFFSET_ATTR, offset)
    return offset


class HiddenStateSelection:
    """The ``output_hidden_states`` argument that keeps only ``indices`` (HF ``hidden_states`` indices),
    and where each of them is in the returned tuple, for this ``model``'s transformers."""

    def __init__(self, model: torch.nn.Module, indices: Sequence[int]):
        self.indices = list(indices)
        self.offset = hidden_state_offset(model) if self.indices else 0
        if self.offset and any(k < self.offset for k in self.indices):
            raise ConfigError(
                f"aux layers {self.indices}: hidden_states[0] (the embedding output) cannot be captured "
                "selectively by this transformers; use ids of 1 and above"
            )
        self.request: list[int] | bool = [k - self.offset for k in self.indices] or False

    def take(self, hidden_states: Sequence[Any]) -> list[torch.Tensor]:
        """The selected states, in the order of ``indices``, from a forward's ``hidden_states``."""
        return [hidden_states[k - self.offset] for k in self.indices]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
