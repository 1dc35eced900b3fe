"""The two target tensors training needs: the input embedding and the lm_head, saved once; and the
lm_head with the final norm's weight, the two the capture audit needs (``read_lm_head_and_norm``).

Training workers bind the frozen embedding into the drafter and compute target logits from the
frozen lm_head; they never load the target itself. From an HF directory with safetensors the
tensors are read by name (a 1T-parameter target is never materialised); random targets are built.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_ray.atomic import write_file
from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.targets import ResolvedTarget, load_target
from eagle3_ray.errors import TargetLoadError

HEADS_FILE = "target_heads.safetensors"
EMBED, LM_HEAD = "embed_tokens", "lm_head"


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {k: model_dir / v for k, v in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        return {}
    with safe_open(str(single), framework="pt") as f:
        return {k: single for k in f.keys()}


def _pick(names: dict[str, Path], suffix: str) -> str | None:
    hits = sorted((k for k in names if k.endswith(suffix)), key=len)
    return hits[0] if hits else None


def _read(names: dict[str, Path], key: str) -> torch.Tensor:
    with safe_open(str(names[key]), framework="pt") as f:
        return f.get_tensor(key)


def _from_files(model_dir: Path) -> dict[str, torch.Tensor] | None:
    names = _weight_files(model_dir)
    embed_key = _pick(names, "embed_tokens.weight")
    if embed_key is None:
        return None
    embed = _read(names, embed_key)
    head_key = _pick(names, "lm_head.weight")
    head = _read(names, head_key) if head_key else embed  # tied word embeddings
    return {EMBED: embed, LM_HEAD: head}


def _final_norm_key(names: dict[str, Path], anchor: str) -> str | None:
    """The text model's final norm weight: ``<prefix>model.norm.weight`` next to the lm_head (or the
    embedding) key ``anchor``, else the shortest ``norm.weight`` outside the decoder layers."""
    prefix = anchor[: anchor.index("lm_head.weight")] if anchor.endswith("lm_head.weight") else \
        anchor[: anchor.index("model.embed_tokens.weight")] if anchor.endswith("model.embed_tokens.weight") else None
    if prefix is not None and f"{prefix}model.norm.weight" in names:
        return f"{prefix}model.norm.weight"
    hits = sorted((k for k in names if (k == "norm.weight" or k.endswith(".norm.weight")) and "layers." not in k),
                  key=len)
    return hits[0] if hits else None


def read_lm_head_and_norm(model_dir: str | Path, with_head: bool = True) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """(lm_head [V, H], final norm weight [H]) of the checkpoint in ``model_dir``, read by name from
    its safetensors (through the index when sharded: only the files holding them are opened); the
    embedding when the word embeddings are tied; ``with_head=False``: (None, norm). None when the
    directory has no such tensors."""
    names = _weight_files(Path(model_dir))
    head_key = _pick(names, "lm_head.weight") or _pick(names, "embed_tokens.weight")
    if head_key is None:
        return None
    norm_key = _final_norm_key(names, head_key)
    if norm_key is None:
        return None
    return (_read(names, head_key) if with_head else None), _read(names, norm_key)


def save_target_heads(cfg: TargetConfig, resolved: ResolvedTarget, out_dir: str | Path) -> Path:
    """Write `target_heads.safetensors` (embed_tokens [V, H], lm_head [V, H]) into `out_dir`, read
    from the files ``cfg.model`` resolved to (``describe``'s ``resolved``)."""
    path = Path(out_dir) / HEADS_FILE
    if path.is_file():
        return path
    heads = _from_files(Path(resolved.model_path)) if resolved.model_path is not None else None
    if heads is None:
        model = load_target(cfg.model_copy(update={"device": "cpu"}), device="cpu", resolved=resolved).model
        out_emb = model.get_output_embeddings()
        if out_emb is None:
            raise TargetLoadError(f"target.model={cfg.model!r} has no lm_head; EAGLE-3 needs a causal LM")
        heads = {EMBED: model.get_input_embeddings().weight, LM_HEAD: out_emb.weight}
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().clone() for k, v in heads.items()}
    write_file(path, lambda tmp: save_file(tensors, str(tmp)))
    return path


def load_target_heads(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    t = load_file(str(path))
    return t[EMBED], t[LM_HEAD]
