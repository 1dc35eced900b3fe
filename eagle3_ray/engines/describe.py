"""What a target is, without loading its weights: shapes, aux layers, tokenizer, identity.

The driver plans stages (store metadata, preflight, drafter shape) from this; loading a 1T-parameter
target on the driver only to read its hidden size is not an option. ``describe`` resolves the target
once (a GGUF is converted on first use) and hands back what it read with what it resolved, so a
planner that also needs the transformers config or the target's files asks nothing twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.base import EngineInfo, resolve_aux_layers
from eagle3_ray.engines.targets import ResolvedTarget, resolve_target
from eagle3_ray.errors import ConfigError, TargetLoadError

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_VOLATILE = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config"}


@dataclass(frozen=True)
class DescribedTarget:
    """One description of a target: its EngineInfo, its transformers config and its files."""

    info: EngineInfo
    hf_config: Any  # the transformers config of the text model (a multimodal wrapper's text config)
    resolved: ResolvedTarget


def target_hf_config(cfg: TargetConfig):
    """The transformers config of the target (text config for multimodal wrappers)."""
    return _text_config(_top_hf_config(cfg, resolve_target(cfg.model, cfg.cache_dir)))


def _text_config(hf: Any) -> Any:
    return hf.get_text_config() if hasattr(hf, "get_text_config") else hf


def _top_hf_config(cfg: TargetConfig, resolved: ResolvedTarget):
    """The transformers config of the target as config.json has it (a multimodal wrapper's own)."""
    from transformers import AutoConfig

    try:
        if resolved.model_path is not None:
            hf = AutoConfig.from_pretrained(resolved.model_path, trust_remote_code=False)
        else:
            hf = AutoConfig.for_model(**json.loads(resolved.config_source.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as e:
        raise TargetLoadError(f"target.model={cfg.model!r}: cannot read its config ({e})") from e
    return hf


def tokenizer_path_for(cfg: TargetConfig) -> Path:
    return resolve_target(cfg.model, cfg.cache_dir).tokenizer_path


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path_for(cfg))


def _weights_identity(cfg: TargetConfig, resolved: ResolvedTarget) -> dict[str, Any]:
    if resolved.kind == "random":
        return {"random_seed": cfg.seed}
    if resolved.gguf_file is not None:
        st = resolved.gguf_file.stat()
        return {"gguf": resolved.gguf_file.name, "bytes": st.st_size}
    files = sorted(p for p in Path(resolved.model_path).iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    return {"weights": [(p.name, p.stat().st_size) for p in files]}


def check_tp_size(hf: Any, tp_size: int) -> None:
    """Tensor parallelism shards attention heads over ranks: refuse a tp_size the heads do not divide
    here, on the driver, rather than after an engine has been given its GPUs."""
    heads = getattr(hf, "num_attention_heads", None)
    if tp_size == 1 or heads is None:
        return
    kv = getattr(hf, "num_key_value_heads", None) or heads
    # KV heads are split when there are at least tp of them, otherwise replicated tp // kv times.
    kv_ok = kv % tp_size == 0 if kv >= tp_size else tp_size % kv == 0
    if heads % tp_size or not kv_ok:
        raise ConfigError(
            f"target.tp_size={tp_size} does not divide the target's {heads} attention heads / {kv} KV heads; "
            f"use a tp_size that divides {heads} (and divides or is a multiple of {kv})"
        )


def describe_target(cfg: TargetConfig) -> EngineInfo:
    """EngineInfo from the config and weight-file identity only (no weights loaded)."""
    return describe(cfg).info


def describe(cfg: TargetConfig) -> DescribedTarget:
    """``describe_target``'s EngineInfo with the transformers config and the files it was read from,
    the target resolved once."""
    resolved = resolve_target(cfg.model, cfg.cache_dir)
    top = _top_hf_config(cfg, resolved)
    hf = _text_config(top)
    check_tp_size(hf, cfg.tp_size)
    num_layers = int(hf.num_hidden_layers)
    config = {k: v for k, v in hf.to_dict().items() if k not in _VOLATILE}
    ident = json.dumps({"config": config, "weights": _weights_identity(cfg, resolved)}, sort_keys=True, default=str)
    info = EngineInfo(
        model_type=str(hf.model_type),
        num_layers=num_layers,
        hidden_size=int(hf.hidden_size),
        vocab_size=int(hf.vocab_size),
        aux_layers=resolve_aux_layers(cfg.aux_layers, num_layers),
        dtype="bfloat16",
        fingerprint=hashlib.sha256(ident.encode()).hexdigest()[:16],
        # What SGLang builds (the wrapper for a multimodal checkpoint, e.g. Kimi-K2.5), not the text model.
        architectures=tuple(getattr(top, "architectures", None) or ()),
    )
    return DescribedTarget(info, hf, resolved)
