"""Where SGLang keeps the modules the capture hooks, per model class. No SGLang import in here.

SGLang builds the class that the checkpoint's config.json names first in ``architectures``
(``model_loader/utils.py:get_model_architecture`` -> ``models/registry.py:resolve_model_cls``; every
``models/<file>.py`` registers its ``EntryClass`` under the class name). Our ``forward_hooks`` specs
are then matched with ``fnmatch`` against that class's ``named_modules()`` names
(``model_executor/hook_manager.py:register_forward_hooks``), and a spec that matches nothing only logs
a warning: the capture then waits for files that never come. So each spec names one module by its
exact path in the class SGLang builds (no wildcard, so it can match no second module and write each
capture twice), and an architecture missing here is refused before the engine starts.

Every text model here is a ``*ForCausalLM`` holding ``self.model`` (whose ``self.layers`` is a
``ModuleList`` from ``make_layers``/``make_pp_layers``: decoder layer i is ``model.layers.<i>``) and
``self.logits_processor``. A multimodal wrapper holds that CausalLM under an attribute of its own
(``language_model``), which prefixes both paths. ``tests/sglang_contract/test_module_paths.py`` builds
each class's module tree from the source of every supported SGLang version and checks each entry.
Paths below are under ``sglang/srt/``; docs/sglang.md "Module paths" has the lines per version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from eagle3_ray.errors import ConfigError


@dataclass(frozen=True)
class ModulePaths:
    """Where one SGLang model class keeps its text CausalLM, and what that CausalLM serves."""

    language_model: str  # attribute path from the built class to its text *ForCausalLM ("" for that class itself)
    aux_states: bool  # set_eagle3_layers_to_capture reaches the CausalLM, whose logits_processor gets the aux states
    source: str  # the source that makes these names

    @property
    def _prefix(self) -> str:
        return f"{self.language_model}." if self.language_model else ""

    def decoder_layer(self, i: int) -> str:
        return f"{self._prefix}model.layers.{i}"

    @property
    def logits_processor(self) -> str:
        return f"{self._prefix}logits_processor"


def _causal_lm(source: str) -> ModulePaths:
    return ModulePaths("", True, source)


# architecture (config.json "architectures"[0] = SGLang's class name) -> its module paths.
SGLANG_MODULES: dict[str, ModulePaths] = {
    "LlamaForCausalLM": _causal_lm("models/llama.py: LlamaForCausalLM.model = _init_model() -> LlamaModel.layers"),
    "MistralForCausalLM": _causal_lm("models/mistral.py: MistralForCausalLM(LlamaForCausalLM)"),
    "Qwen2ForCausalLM": _causal_lm("models/qwen2.py: Qwen2ForCausalLM.model = Qwen2Model -> .layers"),
    "Qwen2MoeForCausalLM": _causal_lm("models/qwen2_moe.py: Qwen2MoeForCausalLM.model = Qwen2MoeModel -> .layers"),
    "Qwen3ForCausalLM": _causal_lm("models/qwen3.py: Qwen3ForCausalLM.model = Qwen3Model(Qwen2Model) -> .layers"),
    "Qwen3MoeForCausalLM": _causal_lm("models/qwen3_moe.py: Qwen3MoeForCausalLM.model = Qwen3MoeModel -> .layers"),
    "Glm4MoeForCausalLM": _causal_lm("models/glm4_moe.py: Glm4MoeForCausalLM.model = Glm4MoeModel -> .layers"),
    "Glm4MoeLiteForCausalLM": _causal_lm("models/glm4_moe_lite.py: Glm4MoeLiteForCausalLM.model = Glm4MoeLiteModel"),
    "DeepseekV2ForCausalLM": _causal_lm("models/deepseek_v2.py: DeepseekV2ForCausalLM.model = DeepseekV2Model"),
    # Kimi-K2 ships DeepseekV3ForCausalLM itself.
    "DeepseekV3ForCausalLM": _causal_lm("models/deepseek_v2.py: DeepseekV3ForCausalLM(DeepseekV2ForCausalLM)"),
    "DeepseekV32ForCausalLM": _causal_lm("models/deepseek_v2.py: DeepseekV32ForCausalLM(DeepseekV2ForCausalLM)"),
    # Kimi-K2.5: its `model` is a property (not a submodule) returning language_model, and its
    # set_eagle3_layers_to_capture hands the ids on to language_model.
    "KimiK25ForConditionalGeneration": ModulePaths(
        "language_model", True,
        "models/kimi_k25.py: KimiK25ForConditionalGeneration.language_model = DeepseekV3ForCausalLM; "
        "forward -> general_mm_embed_routine(language_model=self.language_model)"),
    # Audio wrappers: no set_eagle3_layers_to_capture, so SGLang refuses their aux capture; the
    # layer hooks (SGLang without enable_return_aux_hidden_states) serve them.
    "Qwen2AudioForConditionalGeneration": ModulePaths(
        "language_model", False,
        "models/qwen2_audio.py: Qwen2AudioForConditionalGeneration.language_model = Qwen2ForCausalLM"),
    "VoxtralForConditionalGeneration": ModulePaths(
        "language_model", False,
        "models/voxtral.py: VoxtralForConditionalGeneration.language_model = LlamaForCausalLM"),
}

# What a config.json without "architectures" gets (an EngineInfo built by hand; SGLang itself needs the
# field to pick a class): the plain *ForCausalLM layout.
NO_ARCHITECTURE = _causal_lm("a *ForCausalLM (the config names no architectures)")
# ServerArgs.model_impl values that build SGLang's own classes (the table's); "transformers" and
# "mindspore" build other module trees.
NATIVE_MODEL_IMPLS = ("auto", "sglang")


def sglang_module_paths(architectures: Sequence[str], extra_engine_kwargs: Mapping[str, Any] | None = None) -> ModulePaths:
    """The module paths of the class SGLang builds for a config whose ``architectures`` is given.

    Refuses (``ConfigError``) an architecture without an entry in ``SGLANG_MODULES`` and a
    ``model_impl`` that builds anything but SGLang's own classes.
    """
    impl = (extra_engine_kwargs or {}).get("model_impl", "auto")
    if impl not in NATIVE_MODEL_IMPLS:
        raise ConfigError(
            f"target.sglang.extra_engine_kwargs.model_impl={impl!r}: the capture hooks name the modules of "
            f"SGLang's own model classes; remove it or set model_impl='auto'"
        )
    if not architectures:
        return NO_ARCHITECTURE
    arch = architectures[0]
    paths = SGLANG_MODULES.get(arch)
    if paths is None:
        raise ConfigError(
            f"the target's config.json names architecture {arch!r}, whose SGLang module paths eagle3_ray does not "
            f"know (the capture hooks its decoder layers and logits_processor by name; known: "
            f"{', '.join(sorted(SGLANG_MODULES))}): add it to eagle3_ray.engines.sglang_modules.SGLANG_MODULES "
            "with the attribute chain from sglang/srt/models/ (and a case in "
            "tests/sglang_contract/test_module_paths.py), or capture with target.backend=hf"
        )
    return paths
