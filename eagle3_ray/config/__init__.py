"""One pydantic schema for the whole pipeline.

A YAML file validated here drives every stage. Unknown keys are rejected with their dotted path,
``section.field=value`` overrides apply on top, and the resolved config is written next to every
output (``save_resolved``). The sections live in config/sections.py and config/train.py;
``eagle3-ray config -c CFG --explain`` prints the resolved config with every field's description
and default (config/explain.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from eagle3_ray.atomic import write_text
from eagle3_ray.config.sections import (
    PROMPT_ENTRY_FORM, BenchConfig, DataConfig, ExtractConfig, GenerateConfig, PromptSetEntry, RayConfig, Section,
    SGLangConfig, TargetConfig, VocabConfig,
)
from eagle3_ray.config.train import TRACKERS, DrafterShape, TrackingConfig, TrainConfig
from eagle3_ray.errors import ConfigError

__all__ = [
    "PROMPT_ENTRY_FORM", "RESOLVED_CONFIG_NAME", "STAGE_SECTIONS", "TRACKERS", "BenchConfig", "DataConfig",
    "DrafterShape", "ExtractConfig", "GenerateConfig", "PipelineConfig", "PromptSetEntry", "RayConfig", "SGLangConfig",
    "Section", "TargetConfig", "TrackingConfig", "TrainConfig", "VocabConfig", "apply_overrides", "config_to_dict",
    "load_config", "save_resolved",
]

RESOLVED_CONFIG_NAME = "config.resolved.yaml"


class PipelineConfig(Section):
    name: str = Field("eagle3", description="The run's name: Ray Train's run dir (<name>-train), the `run` tag of the "
                      "dashboard metrics, the default MLflow experiment and W&B project.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="The target model whose drafter is "
                                 "trained, and the engine that runs it.")
    data: DataConfig = Field(default_factory=DataConfig, description="Input conversations or prompts.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig, description="Self-distillation: the target "
                                     "answers prompt-only samples.")
    extract: ExtractConfig = Field(default_factory=ExtractConfig, description="Hidden-state capture by the engine "
                                   "actor pool, and the feature store.")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="The draft vocabulary map (d2t/t2d).")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Drafter training on Ray Train + DeepSpeed.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="The speculative-decoding benchmark.")
    ray: RayConfig = Field(default_factory=RayConfig, description="The Ray cluster the stages run on.")


# The sections each command reads (`eagle3-ray <command> --help` names them). `export` takes no config.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "generate": ("target", "data", "generate", "extract", "ray"),
    "prepare": ("target", "data", "ray"),
    "extract": ("target", "data", "extract", "ray"),
    "vocab": ("extract", "vocab", "train", "ray"),
    "train": ("target", "extract", "train", "ray"),
    "bench": ("target", "generate", "bench", "ray"),
    "run": tuple(PipelineConfig.model_fields)[1:],
}


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key; remove it or fix its spelling")
        else:
            lines.append(f"  {path}: {e['msg']} (got {e.get('input')!r})")
    return f"invalid config {source}:\n" + "\n".join(lines)


def _parse_value(raw: str) -> Any:
    """Override values are YAML scalars/lists: `3`, `true`, `null`, `[2, 8, 12]`, `text`."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.field=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML config (None = all defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        p = Path(path)
        source = str(p)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a directory; pass -c with a YAML file (see configs/)")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist; pass -c with a YAML file (see configs/)")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must be a mapping of sections, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, overrides or [])
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def config_to_dict(cfg: PipelineConfig) -> dict[str, Any]:
    return json.loads(cfg.model_dump_json())


def save_resolved(cfg: PipelineConfig, out_dir: str | Path, name: str = RESOLVED_CONFIG_NAME) -> Path:
    """Write the resolved config next to a stage's outputs (atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / name
    write_text(target, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return target
