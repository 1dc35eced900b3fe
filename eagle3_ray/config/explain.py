"""`eagle3-ray config`: the resolved config as YAML, and with ``--explain`` every field's description
and default from the schema, as comments (torchtitan's typed help, SpecForge's dry run).

Both outputs load again as they are (``-c``): the comments are YAML comments, the values those of
``config.resolved.yaml``.
"""

from __future__ import annotations

import textwrap
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from eagle3_ray.config import PipelineConfig, config_to_dict

WIDTH = 100  # of a comment line, indent included


def render(cfg: PipelineConfig, explain: bool = False) -> str:
    """The resolved config ``cfg`` as YAML; ``explain``: each field preceded by its description and default."""
    values = config_to_dict(cfg)
    if not explain:
        return yaml.safe_dump(values, sort_keys=False)
    lines = ["# The resolved config: every field with its description and [default]. It loads as it is (-c)."]
    _section(PipelineConfig, values, 0, lines)
    return "\n".join(lines) + "\n"


def _section(model: type[BaseModel], values: dict[str, Any], depth: int, lines: list[str]) -> None:
    indent = "  " * depth
    for name, info in model.model_fields.items():
        sub = _section_type(info)
        if sub is not None:
            lines.extend(_comment(info.description or "", indent))
            lines.append(f"{indent}{name}:")
            _section(sub, values[name], depth + 1, lines)
            continue
        default = _flow(info.get_default(call_default_factory=True, validated_data={}))
        lines.extend(_comment(f"{info.description or ''} [default: {default}]", indent))
        lines.append(f"{indent}{name}: {_flow(values[name])}")


def _section_type(info: FieldInfo) -> type[BaseModel] | None:
    """The section model a field holds (a nested mapping of fields), or None for a value."""
    ann = info.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _flow(value: Any) -> str:
    """``value`` as one line of YAML (flow style for lists and mappings)."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"), sort_keys=False).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width=WIDTH - len(indent) - 2)]
