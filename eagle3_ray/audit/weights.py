"""The two target tensors the capture audit needs: the lm_head [V, H] and the final norm's weight [H].

Read by name from the target's safetensors (through the index of a sharded checkpoint: a 1T target's
store is checked on one node without loading the model; ``engines/heads.py``). The embedded SmolLM2
and other GGUF targets resolve to their safetensors conversion (``engines/targets.py``, converted
once and cached); targets with random weights, which have no files, are built on the CPU from their
seed. With tied word embeddings the lm_head is the embedding. No Ray in here.
"""

from __future__ import annotations

import torch

from eagle3_ray.config import TargetConfig
from eagle3_ray.errors import TargetLoadError


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The final norm of a transformers causal LM (``model.model.norm`` in Llama, Qwen, DeepSeek-V3,
    ...), or None where it has none there."""
    base = getattr(model, "model", None)
    norm = getattr(base, "norm", None)
    return norm if isinstance(norm, torch.nn.Module) and isinstance(getattr(norm, "weight", None), torch.Tensor) \
        else None


def model_head_and_norm(model: torch.nn.Module, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head weight, final norm weight) of a loaded model."""
    head, norm = model.get_output_embeddings(), final_norm(model)
    if head is None or norm is None:
        raise TargetLoadError(f"target.model={spec!r} ({type(model).__name__}) has no lm_head or no final norm at "
                              "model.norm; the capture audit needs both: set extract.audit_rows=0 and "
                              "extract.audit_max_unnormed=1 to extract without it")
    return head.weight, norm.weight


def lm_head_and_norm(target: TargetConfig, with_head: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(lm_head [V, H], final norm weight [H]) of ``target`` on the CPU, as stored (or built);
    ``with_head=False``: (None, norm), reading no lm_head (2.3 GB at the Kimi-K2.5 shape)."""
    from eagle3_ray.engines.heads import read_lm_head_and_norm
    from eagle3_ray.engines.targets import load_target, resolve_target

    resolved = resolve_target(target.model, target.cache_dir)
    if resolved.model_path is not None:
        found = read_lm_head_and_norm(resolved.model_path, with_head=with_head)
        if found is not None:
            return found
    model = load_target(target.model_copy(update={"device": "cpu"}), device="cpu", resolved=resolved).model
    head, norm = model_head_and_norm(model, target.model)
    return (head.detach() if with_head else None), norm.detach()
