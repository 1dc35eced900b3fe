"""The target-engine interface every capture/generation backend implements. No Ray in here.

Aux layer convention (docs/contracts.md "Aux layer ids"): ids are HF ``hidden_states`` indices, k = the residual stream
after k decoder layers (0 = embeddings). Default ``[2, L//2, L-3]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

from eagle3_ray.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from eagle3_ray.audit.rows import RowFigures


def check_generate_args(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """The sampling arguments every backend's ``generate`` takes, checked the same way."""
    if max_new_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise EngineError(
            f"generate(max_new_tokens={max_new_tokens}, temperature={temperature}, top_p={top_p}): need "
            "max_new_tokens >= 1, temperature >= 0 (0 = greedy), 0 < top_p <= 1"
        )


def cut_at_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Tokens up to and including the first EOS; generate pads finished rows after it."""
    for pos, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: pos + 1]
    return tokens


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def resolve_aux_layers(aux_layers: Sequence[int] | None, num_layers: int) -> list[int]:
    """Config ids (or the default) checked against the target depth."""
    ids = list(aux_layers) if aux_layers is not None else default_aux_layers(num_layers)
    # hidden_states[L] is post-final-norm in transformers but the raw residual in SGLang/vLLM: the
    # last usable aux state is L-1, so every backend captures the same tensor.
    bad = [k for k in ids if not 1 <= k <= num_layers - 1]
    if bad or len(ids) != 3 or sorted(set(ids)) != ids:
        raise ConfigError(
            f"target.aux_layers={ids} is invalid for a target with {num_layers} layers: give 3 strictly "
            f"increasing HF hidden_states indices in [1, {num_layers - 1}] (default "
            f"{default_aux_layers(num_layers)})"
        )
    return ids


@dataclass(frozen=True)
class EngineInfo:
    model_type: str  # HF config model_type, e.g. "llama", "deepseek_v3"
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layers: list[int]  # resolved, HF hidden_states indices
    dtype: str  # dtype of captured features as computed ("bfloat16", "float32")
    fingerprint: str  # identifies the target weights+config (for caches and mismatch checks)
    extra: dict = field(default_factory=dict)
    # config.json's top-level "architectures" (the class SGLang builds, e.g. KimiK25ForConditionalGeneration
    # around a DeepSeek-V3 text model): where SGLang keeps the modules the capture hooks. () if none.
    architectures: tuple[str, ...] = ()


@dataclass
class Capture:
    """One sample's features. Rows are token positions; T equals len(input_ids)."""

    aux_hidden: torch.Tensor  # [T, 3H], the three aux states concatenated in id order
    last_hidden: torch.Tensor  # [T, H], post-final-norm (the lm_head input)
    # The capture audit's figures of some rows (audit/rows.py), computed by the engine with the target's
    # lm_head where the states are; None when the engine was built without an audit share.
    audit: RowFigures | None = None
    # rms(last_hidden[t] / final norm weight) per row, float32 [T] (audit/rows.py: normed_rms), where the
    # engine holds the norm next to the states (the HF engine); None: the actor computes it on the host.
    normed: torch.Tensor | None = None


@runtime_checkable
class TargetEngine(Protocol):
    info: EngineInfo

    def capture(self, batch: Sequence[Sequence[int]]) -> list[Capture]:
        """Full-sequence forward of each token-id sequence; one Capture per input, same order, with
        the audit's figures of ``audit_positions(T, share)`` when built with an audit share > 0."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
    ) -> list[list[int]]:
        """New token ids per prompt (excluding the prompt, stopping at and including EOS)."""
        ...

    def close(self) -> None:
        ...
