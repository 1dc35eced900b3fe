"""Tensor parallelism and the layer-hook capture: a hooked decoder layer must return reduced, whole rows.

On SGLang without ``enable_return_aux_hidden_states`` (0.5.17) the aux states come from forward hooks
on decoder layers (``sglang_hooks.layer_hook_factory``), which read the ``(hidden_states, residual)``
a layer returns. At ``tp_size > 1`` that is the residual stream after the layer on every rank only
when the layer completed its own all-reduce and kept every row. In SGLang 0.5.17 (paths under
``sglang/srt/``; each pinned against the installed source by
``tests/sglang_contract/test_tp_reduced.py``) a layer of ``LAYER_HOOK_MODELS`` returns instead:

- a partial sum, its MLP/MoE all-reduce left to the next layer:
  - ``layers/communicator.py:LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer`` (the next
    layer's fused all-reduce + add + RMSNorm, FlashInfer or aiter): ``DeepseekV2DecoderLayer.forward``
    marks the output ``_sglang_needs_allreduce_fusion`` and skips ``postprocess_layer``. SGLang turns
    FlashInfer's on *by itself* for DeepSeek-V3 and Kimi-K2.5 at TP > 1 on Hopper and Blackwell
    (``arg_groups/overrides.py:_flashinfer_allreduce_fusion_auto_enable``), for batches of up to
    2048 tokens; only ``enforce_disable_flashinfer_allreduce_fusion`` overrides that, so it is forced.
  - ``enable_attn_tp_input_scattered``: ``should_use_reduce_scatter`` makes the MLP skip its
    all-reduce and the next layer's ``prepare_attn`` reduce-scatters it.
  - ``dwdp_size > 1``, an all-to-all MoE backend: ``layers/moe/utils.py:should_skip_post_experts_all_reduce``.
- a slice of the rows (each rank its own tokens): an all-to-all MoE backend (``moe_a2a_backend``,
  also set by ``enable_waterfill`` or the environment's ``SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE``),
  ``moe_dense_tp_size == 1``, prefill context parallelism (``LayerScatterModes._compute_mlp_mode``,
  ``ScatterMode.model_input_output``); attention DP and layernorm SP (refused for every capture).
- no call at all: two-batch overlap runs MoE layers as operations (``model_forward_maybe_tbo``).

Llama and Qwen2 layers all-reduce inside ``RowParallelLinear`` (skipped only on the flags
DeepSeek's layer publishes); Qwen3's ``LayerCommunicator`` never fuses or reduce-scatters.

SGLang whose layers hand their output on with the all-reduce owed by construction
(``layers/layer_boundary``, 0.5.23: ``UnreducedOutput`` under TP whatever the settings) cannot serve
the layer hooks at all; it has ``enable_return_aux_hidden_states``, whose captures complete the sum
first, and the engine takes that path there. Features, not version strings: the settings are read
from the installed ``ServerArgs`` fields and the installed source.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Mapping

from eagle3_ray.errors import ConfigError

_FUSED = ("the next layer's fused all-reduce + RMSNorm completes the sum, so each hooked layer returns "
          "an unreduced partial sum on every rank")
_SCATTERED = "each TP rank holds only its own slice of the rows"
_CP = "prefill context parallelism splits each sequence's rows over the ranks"

# Sent with every layer-hook capture at tp_size > 1 where the installed ServerArgs has the field:
# settings SGLang turns on by itself, with the switch that overrides it.
TP_FORCED: dict[str, tuple[Any, str]] = {
    "enforce_disable_flashinfer_allreduce_fusion": (
        True, "SGLang enables FlashInfer all-reduce fusion by itself for DeepSeek-V3/Kimi-K2.5 at TP > 1 on "
              f"Hopper and Blackwell, and then {_FUSED}"),
}

# Left at SGLang's default, which SGLang changes only when one of these is set (pinned by the
# contract suite); a user value other than the safe one is refused at tp_size > 1.
TP_REFUSED: dict[str, tuple[Any, str]] = {
    "flashinfer_allreduce_fusion_backend": (None, _FUSED),
    "enable_flashinfer_allreduce_fusion": (False, _FUSED),
    "enable_aiter_allreduce_fusion": (False, _FUSED),
    "enable_attn_tp_input_scattered": (
        False, "each layer skips its MLP all-reduce and the next one reduce-scatters it, so each hooked layer "
               "returns an unreduced partial sum"),
    "moe_a2a_backend": ("none", f"MoE layers return their outputs combined per token: {_SCATTERED}"),
    "enable_waterfill": (False, f"it switches moe_a2a_backend to deepep: {_SCATTERED}"),
    "moe_dense_tp_size": (None, f"moe_dense_tp_size=1 runs dense layers data-parallel: {_SCATTERED}"),
    "dwdp_size": (1, f"DWDP skips the MoE all-reduce and turns attention DP on: {_SCATTERED}"),
    "attn_cp_size": (1, _CP),
    "enable_prefill_cp": (False, _CP),
    "enable_prefill_context_parallel": (False, _CP),
    "enable_dsa_prefill_context_parallel": (False, _CP),
    "enable_two_batch_overlap": (False, "two-batch overlap runs MoE layers as operations, so their hooks never run"),
}

# Environment of the engine's process (where sglang.Engine resolves its ServerArgs) that turns one on.
TP_REFUSED_ENV: dict[str, str] = {
    "SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE": f"it switches moe_a2a_backend to megamoe: {_SCATTERED}",
}
_ENV_TRUE = ("true", "1", "yes", "y")  # sglang/srt/environ.py:EnvBool

# A ServerArgs with any of these can fuse the MLP all-reduce into the next layer; the off switch
# must exist too, or the fusion cannot be kept off.
_FUSION_FIELDS = ("flashinfer_allreduce_fusion_backend", "enable_flashinfer_allreduce_fusion")
_FUSION_OFF = "enforce_disable_flashinfer_allreduce_fusion"


def sglang_defers_layer_sums() -> bool:
    """Whether the installed SGLang hands each layer's output on with its TP sum owed by construction
    (``sglang/srt/layers/layer_boundary/output.py:UnreducedOutput``, 0.5.23). Read from the source
    without importing it; False when SGLang is not installed."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    owed = Path(next(iter(spec.submodule_search_locations))) / "srt" / "layers" / "layer_boundary" / "output.py"
    return owed.is_file() and "class UnreducedOutput" in owed.read_text(encoding="utf-8")


def layer_hook_tp_kwargs(tp_size: int, extra: Mapping[str, Any], fields: frozenset[str],
                         environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings a layer-hook capture at ``tp_size`` forces (``TP_FORCED``, where ``fields`` has
    them); ``ConfigError`` saying what to change when ``extra`` (``target.sglang.extra_engine_kwargs``),
    the environment or the installed SGLang would make a hooked layer return other than its reduced,
    whole output."""
    if tp_size <= 1:
        return {}
    if sglang_defers_layer_sums():
        raise ConfigError(
            f"target.tp_size={tp_size}: the installed SGLang hands each decoder layer's output on with its "
            "tensor-parallel all-reduce still owed to the next layer (sglang/srt/layers/layer_boundary), so hooks "
            "on decoder layers would capture partial sums, and it lacks enable_return_aux_hidden_states: install "
            "sglang==0.5.23 (its own aux capture completes the sums) or set target.tp_size=1"
        )
    for key, value in extra.items():
        for table in (TP_FORCED, TP_REFUSED):
            if key in table and value != table[key][0]:
                want, why = table[key]
                raise ConfigError(
                    f"target.sglang.extra_engine_kwargs.{key}={value!r} breaks hidden-state capture at "
                    f"target.tp_size={tp_size} ({why}); remove it or set {key}={want!r}"
                )
    env = os.environ if environ is None else environ
    for name, why in TP_REFUSED_ENV.items():
        if env.get(name, "").strip().lower() in _ENV_TRUE:
            raise ConfigError(
                f"the environment sets {name}={env[name]!r}, which breaks hidden-state capture at "
                f"target.tp_size={tp_size} ({why}); unset it in the engine's environment (ray.env_vars included)"
            )
    if any(f in fields for f in _FUSION_FIELDS) and _FUSION_OFF not in fields:
        raise ConfigError(
            f"target.tp_size={tp_size}: the installed SGLang can fuse each layer's MLP all-reduce into the next "
            f"layer but has no {_FUSION_OFF} to keep that off, so hooks on decoder layers could capture partial "
            "sums: install sglang 0.5.17 to 0.5.23 or set target.tp_size=1"
        )
    return {k: v for k, (v, _) in TP_FORCED.items() if k in fields}
