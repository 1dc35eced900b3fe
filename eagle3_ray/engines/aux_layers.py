"""Aux layer ids: the project's convention and each serving engine's (docs/contracts.md "Aux layer ids").

Inside the project aux layers are HF ``hidden_states`` indices (k = the residual stream after k
decoder layers). SGLang and vLLM read ``eagle_aux_hidden_state_layer_ids`` differently; these
rules translate between the two, and SGLang silently serves a drafter with the wrong target states
when they are wrong, so they are pinned by tests against SGLang's source. No Ray, no torch in here.
"""

from __future__ import annotations

from typing import Literal

from eagle3_ray.errors import ConfigError

Engine = Literal["sglang", "vllm"]

# How SGLang's `set_eagle3_layers_to_capture` (sglang/srt/models/<file>.py, 0.5.23) reads
# eagle_aux_hidden_state_layer_ids. Its layers_to_capture c captures the input of layer c,
# i.e. HF hidden_states[c].
#   "plus_one": captures id + 1                      -> id = k - 1
#   "deepseek": captures id + 1 when ids[0] == 1,    -> id = k; HF k[0] == 1 is not expressible
#               else the ids as given
# vLLM captures HF hidden_states[id] for every target -> id = k.
SGLANG_AUX_RULES: dict[str, str] = {
    "llama": "plus_one",  # llama.py
    "mistral": "plus_one",  # mistral.py (LlamaForCausalLM subclass)
    "qwen2": "plus_one",  # qwen2.py
    "qwen2_moe": "plus_one",  # qwen2_moe.py
    "qwen3": "plus_one",  # qwen3.py
    "qwen3_moe": "plus_one",  # qwen3_moe.py
    "glm4_moe": "plus_one",  # glm4_moe.py
    "deepseek_v2": "deepseek",  # deepseek_v2.py
    "deepseek_v3": "deepseek",  # deepseek_v2.py (DeepseekV3ForCausalLM)
    "deepseek_v32": "deepseek",  # deepseek_v2.py (DeepseekV32ForCausalLM)
    "kimi_k2": "deepseek",  # deepseek_v2.py (Kimi-K2 ships DeepseekV3ForCausalLM)
    "kimi_k25": "deepseek",  # kimi_k25.py, delegates to DeepseekV3ForCausalLM
    "glm4_moe_lite": "deepseek",  # glm4_moe_lite.py
}


def sglang_aux_rule(target_model_type: str) -> str:
    """How SGLang reads the aux ids of a ``target_model_type`` target (``SGLANG_AUX_RULES``)."""
    rule = SGLANG_AUX_RULES.get(target_model_type)
    if rule is None:
        raise ConfigError(
            f"no SGLang aux-layer rule for target model_type {target_model_type!r}: read "
            "set_eagle3_layers_to_capture in sglang/srt/models/ for this model and add it to "
            "eagle3_ray.engines.aux_layers.SGLANG_AUX_RULES, or export with --engine vllm"
        )
    return rule


def translate_aux_ids(hf_indices: list[int], target_model_type: str, engine: Engine) -> list[int]:
    """HF hidden_states indices -> the engine's ``eagle_aux_hidden_state_layer_ids``."""
    ks = list(hf_indices)
    if engine == "vllm":
        return ks
    if engine != "sglang":
        raise ConfigError(f"engine {engine!r} is unknown; use 'sglang' or 'vllm'")
    if sglang_aux_rule(target_model_type) == "plus_one":
        if min(ks) < 1:
            raise ConfigError(
                f"aux layers {ks} include HF index 0 (the embeddings), which SGLang cannot capture "
                f"for {target_model_type}; use indices >= 1"
            )
        return [k - 1 for k in ks]
    if ks[0] == 1:
        raise ConfigError(
            f"aux layers {ks} cannot be served by SGLang for a {target_model_type} target: SGLang "
            "adds 1 to every id when the first id is 1, so HF index 1 (the output of layer 0) "
            "cannot be requested; retrain with a first index >= 2 (the default is [2, L//2, L-3]) "
            "or serve with vLLM"
        )
    return ks


def aux_ids_to_hf_indices(ids: list[int], target_model_type: str, engine: Engine) -> list[int]:
    """Inverse of ``translate_aux_ids``: the HF hidden_states indices the engine will capture."""
    ids = list(ids)
    if engine == "vllm":
        return ids
    if engine != "sglang":
        raise ConfigError(f"engine {engine!r} is unknown; use 'sglang' or 'vllm'")
    if sglang_aux_rule(target_model_type) == "plus_one" or ids[0] == 1:
        return [i + 1 for i in ids]
    return ids
