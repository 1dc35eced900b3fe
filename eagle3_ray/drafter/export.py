"""Drafter files: training checkpoints, and the exact directory SGLang and vLLM serve.

Training checkpoint dir: ``drafter.safetensors`` (every drafter tensor but ``embed_tokens``, in
training dtype) + ``drafter_config.json`` (``DrafterConfig.to_dict()``).
Exported dir (docs/contracts.md "Export directory"): ``config.json`` + ``model.safetensors`` holding
exactly ``EXPORT_KEYS`` (bf16 weights, d2t int64, t2d bool). Only safetensors, never pickle.

Aux layer ids are HF ``hidden_states`` indices inside this package and are translated per engine
on export (``translate_aux_ids``, whose per-engine rules are in ``engines/aux_layers.py``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_ray.atomic import write_file, write_json
from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
from eagle3_ray.engines.aux_layers import Engine, aux_ids_to_hf_indices, translate_aux_ids
from eagle3_ray.errors import CheckpointError, require_dir

CHECKPOINT_WEIGHTS = "drafter.safetensors"
CHECKPOINT_CONFIG = "drafter_config.json"
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
FORMAT_VERSION = 1

EXPORT_KEYS = frozenset(
    {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
    }
)

def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every exported/checkpointed tensor of a drafter with this config."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(cfg)
    return {k: tuple(v.shape) for k, v in drafter.trainable_state_dict().items()}


def check_state(state: dict[str, torch.Tensor], cfg: DrafterConfig, source: Path) -> None:
    """Refuse missing/extra keys and shape mismatches, naming every one of them."""
    shapes = expected_shapes(cfg)
    assert set(shapes) == EXPORT_KEYS, "the module layout drifted from docs/contracts.md"
    problems = []
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing:
        problems.append(f"missing keys {missing}")
    if extra:
        problems.append(f"unexpected keys {extra}")
    wrong = [
        f"{k}: {tuple(state[k].shape)} != expected {shapes[k]}"
        for k in sorted(set(shapes) & set(state))
        if tuple(state[k].shape) != shapes[k]
    ]
    if wrong:
        problems.append("shape mismatches " + "; ".join(wrong))
    if problems:
        raise CheckpointError(f"{source} does not hold a drafter for its config: " + ", ".join(problems))


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_file(path, lambda tmp: save_file(cpu, str(tmp), metadata={"format": "pt"}))


def save_drafter_weights(drafter: Eagle3Drafter, directory: str | Path) -> Path:
    """Write a training checkpoint (weights in training dtype + config) into ``directory``."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_save(drafter.trainable_state_dict(), out / CHECKPOINT_WEIGHTS)
    write_json(out / CHECKPOINT_CONFIG, drafter.config.to_dict())
    return out


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; point at a drafter checkpoint or export directory")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; point at a drafter checkpoint or export directory")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


def load_drafter_weights(directory: str | Path) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """Read a training checkpoint written by ``save_drafter_weights``; keys and shapes checked."""
    src = Path(directory)
    cfg = DrafterConfig.from_dict(_read_json(src / CHECKPOINT_CONFIG))
    state = _load_tensors(src / CHECKPOINT_WEIGHTS)
    check_state(state, cfg, src / CHECKPOINT_WEIGHTS)
    return cfg, state


def export_config(cfg: DrafterConfig, engine: Engine) -> dict[str, Any]:
    """The ``config.json`` of an exported drafter (LlamaForCausalLMEagle3)."""
    ids = translate_aux_ids(cfg.aux_layers, cfg.target_model_type, engine)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
        "eagle3_ray": {
            "aux_hidden_state_indices": list(cfg.aux_layers),
            "target_model_type": cfg.target_model_type,
            "serving_engine": engine,
            "format_version": FORMAT_VERSION,
        },
    }
    if engine == "vllm":
        # vLLM reads the ids from the top level of the draft config, SGLang from eagle_config.
        config["eagle_aux_hidden_state_layer_ids"] = ids
    return config


def export_drafter(checkpoint_dir: str | Path, out_dir: str | Path, engine: Engine) -> Path:
    """Training checkpoint -> the directory ``engine`` serves unchanged; returns ``out_dir``."""
    cfg, state = load_drafter_weights(checkpoint_dir)
    config = export_config(cfg, engine)  # translates aux ids first: refuse before writing
    tensors = {
        k: v.to(torch.int64 if k == "d2t" else torch.bool if k == "t2d" else torch.bfloat16)
        for k, v in state.items()
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_save(tensors, out / EXPORT_WEIGHTS)
    write_json(out / EXPORT_CONFIG, config)
    return out


def _config_from_export(
    raw: dict[str, Any], source: Path, engine: Engine | None, target_model_type: str | None
) -> DrafterConfig:
    """DrafterConfig of an exported config.json (ours, or a foreign one given engine/model type)."""
    ours = raw.get("eagle3_ray") or {}
    model_type = ours.get("target_model_type", target_model_type)
    aux = ours.get("aux_hidden_state_indices")
    if aux is None:
        ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or raw.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        serving = ours.get("serving_engine", engine)
        if ids is None or serving is None or model_type is None:
            raise CheckpointError(
                f"{source} does not say which target hidden states it reads: it needs "
                "eagle3_ray.aux_hidden_state_indices, or eagle_aux_hidden_state_layer_ids plus the "
                "engine and target model type it was written for (load_drafter(..., engine=, "
                "target_model_type=))"
            )
        aux = aux_ids_to_hf_indices(ids, model_type, serving)
    try:
        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        cfg = DrafterConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or hidden,
            aux_layers=list(aux),
            target_model_type=model_type or "llama",
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            hidden_act=raw.get("hidden_act", "silu"),
        )
    except KeyError as e:
        raise CheckpointError(f"{source} lacks the field {e.args[0]!r} of an EAGLE-3 drafter config") from None
    cfg.validate()
    return cfg


def read_drafter_dir(
    path: str | Path, engine: Engine | None = None, target_model_type: str | None = None
) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """(config, checked state dict) of a training checkpoint dir or an exported dir."""
    src = Path(path)
    if (src / CHECKPOINT_CONFIG).is_file():
        return load_drafter_weights(src)
    if not (src / EXPORT_CONFIG).is_file():
        raise CheckpointError(
            f"{src} holds neither {CHECKPOINT_CONFIG} (training checkpoint) nor {EXPORT_CONFIG} "
            "(exported drafter); pass a drafter directory"
        )
    cfg = _config_from_export(_read_json(src / EXPORT_CONFIG), src / EXPORT_CONFIG, engine, target_model_type)
    state = _load_tensors(src / EXPORT_WEIGHTS)
    check_state(state, cfg, src / EXPORT_WEIGHTS)
    return cfg, state


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header, checking the file holds every byte it promises (reads
    only the header: cheap on the driver, whatever the drafter's size)."""
    if not path.is_file():
        raise CheckpointError(f"{path} does not exist; point at a drafter checkpoint or export directory")
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        shapes = {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: no valid header ({e})") from None
    size = path.stat().st_size
    if size != 8 + n + end:
        raise CheckpointError(f"{path} is not a readable safetensors file: truncated ({size} of {8 + n + end} bytes)")
    return shapes


class _Shape:
    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape


def check_drafter_dir(path: str | Path, what: str = "--drafter", foreign_ok: bool = False) -> DrafterConfig | None:
    """Everything ``load_drafter(path)`` needs, checked from the config and the weights' header only:
    the directory exists, is a training checkpoint or an exported drafter, and its tensors have the
    config's names and shapes. For the driver, before any actor is given the path.

    ``foreign_ok``: a drafter exported by another tool (no eagle3_ray section, so no known aux ids)
    passes with its weights' header checked only; SGLang serves such a directory as it is. Returns
    the drafter's config, or None for such a foreign one."""
    want = "pass the --out of `eagle3-ray export` (config.json + model.safetensors)"
    src = require_dir(path, what, want, CheckpointError)
    if (src / CHECKPOINT_CONFIG).is_file():
        cfg, weights = DrafterConfig.from_dict(_read_json(src / CHECKPOINT_CONFIG)), src / CHECKPOINT_WEIGHTS
    elif (src / EXPORT_CONFIG).is_file():
        raw = _read_json(src / EXPORT_CONFIG)
        archs = raw.get("architectures") or [] if isinstance(raw, dict) else []
        if not isinstance(raw, dict) or not (raw.get("eagle3_ray") or raw.get("eagle_config")
                                             or "eagle_aux_hidden_state_layer_ids" in raw
                                             or any("eagle" in str(a).lower() for a in archs)):
            raise CheckpointError(
                f"{what} {src}: its {EXPORT_CONFIG} is not an EAGLE-3 drafter's (no eagle_config or Eagle3 "
                f"architecture; a target model directory?); {want}"
            )
        weights = src / EXPORT_WEIGHTS
        if foreign_ok and not raw.get("eagle3_ray"):
            if weights.is_file() or not any(p.suffix in (".safetensors", ".bin") for p in src.iterdir()):
                _header_shapes(weights)  # other tools also write pytorch_model.bin, which SGLang reads
            return None
        cfg = _config_from_export(raw, src / EXPORT_CONFIG, None, None)
    else:
        raise CheckpointError(
            f"{what} {src} holds neither {CHECKPOINT_CONFIG} (training checkpoint) nor {EXPORT_CONFIG} "
            f"(exported drafter); {want}"
        )
    check_state({k: _Shape(v) for k, v in _header_shapes(weights).items()}, cfg, weights)  # type: ignore[misc]
    return cfg


def load_drafter(
    path: str | Path,
    embedding: torch.nn.Embedding | torch.Tensor | None = None,
    *,
    engine: Engine | None = None,
    target_model_type: str | None = None,
) -> Eagle3Drafter:
    """A ready drafter (fp32, eval mode) from an exported or a training checkpoint directory.

    ``embedding``: the target's input embedding to bind (else call ``bind_embedding`` later).
    ``engine``/``target_model_type`` are only needed for drafters exported by other tools.
    """
    cfg, state = read_drafter_dir(path, engine, target_model_type)
    drafter = Eagle3Drafter(cfg)
    result = drafter.load_state_dict(state, strict=False)
    assert list(result.missing_keys) == ["embed_tokens.weight"] and not result.unexpected_keys, result
    if embedding is not None:
        drafter.bind_embedding(embedding)
    return drafter.eval()


# Fields an init_from drafter must share with the run's config (anything else is free to differ).
INIT_MATCH_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "aux_layers",
)


def init_drafter_from(exported_dir: str | Path, config: DrafterConfig) -> dict[str, torch.Tensor]:
    """State dict to start training from (``train.init_from``), checked against ``config``.

    The returned dict includes the exported ``d2t``/``t2d``: the lm_head rows only mean
    something with the vocab map they were trained with.
    """
    theirs, state = read_drafter_dir(exported_dir)
    diffs = [
        f"{name}: drafter has {getattr(theirs, name)}, run config has {getattr(config, name)}"
        for name in INIT_MATCH_FIELDS
        if getattr(theirs, name) != getattr(config, name)
    ]
    if diffs:
        raise CheckpointError(
            f"train.init_from={exported_dir} was trained for another configuration ("
            + "; ".join(diffs)
            + "); match these in the config (target.aux_layers, vocab.draft_vocab_size, train.drafter.*) "
            "or start from scratch"
        )
    return state

