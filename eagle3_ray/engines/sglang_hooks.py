"""The forward hook SGLang attaches to ``logits_processor`` to capture EAGLE-3 features.

SGLang imports this module inside every TP scheduler process (``ServerArgs.forward_hooks``,
registered by ``sglang/srt/model_executor/hook_manager.py:register_forward_hooks``), so it imports
only the standard library, torch and safetensors: no Ray, nothing heavy from ``eagle3_ray``.

What the hook sees (SGLang 0.5.23, verified in docs/sglang.md): ``LlamaForCausalLM.forward`` and
``DeepseekV2ForCausalLM.forward`` call ``self.logits_processor(input_ids, hidden_states, lm_head,
forward_batch, aux_hidden_states)`` positionally, with ``hidden_states`` [N, H] already through the
final norm (the lm_head input) and ``aux_hidden_states`` either a list of three [N, H] tensors or
one packed [N, 3H] tensor. N is the sum of the batch's extend lengths, requests in
``forward_batch.rids`` order.

Only TP rank 0 writes: every rank holds the same full rows, and one writer per request keeps
/dev/shm traffic at one copy. Each request becomes ``<dir>/<rid>.safetensors`` (written to a
temporary name, then renamed, so a reader never sees half a file) holding ``aux_hidden`` [T, 3H]
and ``last_hidden`` [T, H] in the model dtype, plus the request's cached prefix length as metadata.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

CAPTURE_SUFFIX = ".safetensors"
FACTORY_PATH = "eagle3_ray.engines.sglang_hooks:capture_hook_factory"

# Positions in LogitsProcessor.forward(input_ids, hidden_states, lm_head, logits_metadata,
# aux_hidden_states, ...) (sglang/srt/layers/logits_processor.py); pinned by the contract tests.
HIDDEN_ARG, BATCH_ARG, AUX_ARG = 1, 3, 4


def capture_path(directory: str | Path, rid: str) -> Path:
    return Path(directory) / f"{rid}{CAPTURE_SUFFIX}"


def _world_rank() -> int:
    # SGLang's WORLD rank is ep_join_rank_offset + tp_size * pp_rank + tp_rank
    # (sglang/srt/runtime_context.py:spawn_world_rank); the offset is 0 outside elastic EP.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def capture_hook_factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of a ``forward_hooks`` spec: config = {"dir": str, "tp_size": int}.

    Returns None on TP ranks other than 0; SGLang then registers nothing there.
    """
    directory = Path(config["dir"])
    if _world_rank() % int(config["tp_size"]) != 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        forward_batch = args[BATCH_ARG]
        mode = forward_batch.forward_mode
        # Decode steps and speculative verification carry no new prompt rows to capture.
        if not mode.is_extend() or mode.is_target_verify():
            return None
        aux = args[AUX_ARG] if len(args) > AUX_ARG else None
        if aux is None:
            return None  # capture not enabled: the engine reports the missing files with the cause
        write_batch(directory, forward_batch, args[HIDDEN_ARG], aux)
        return None

    return hook


def write_batch(
    directory: Path,
    forward_batch: Any,
    hidden: torch.Tensor,  # [N, H] post-final-norm
    aux: torch.Tensor | list[torch.Tensor],  # [N, 3H] packed, or three [N, H]
) -> None:
    """Split one extend batch into per-request files."""
    aux_packed = aux if isinstance(aux, torch.Tensor) else torch.cat(list(aux), dim=-1)  # [N, 3H]
    lens = forward_batch.extend_seq_lens_cpu
    if lens is None:
        lens = forward_batch.extend_seq_lens.tolist()
    prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(lens)
    start = 0
    # zip stops at the real requests: padded batch slots have no rid.
    for rid, n, cached in zip(forward_batch.rids, lens, prefix):
        rows = slice(start, start + int(n))
        _write_one(capture_path(directory, rid), aux_packed[rows], hidden[rows], int(cached))
        start += int(n)


def _write_one(path: Path, aux_hidden: torch.Tensor, last_hidden: torch.Tensor, cached: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tensors = {
        "aux_hidden": aux_hidden.detach().to("cpu").contiguous(),  # [T, 3H]
        "last_hidden": last_hidden.detach().to("cpu").contiguous(),  # [T, H]
    }
    save_file(tensors, str(tmp), metadata={"prefix_len": str(cached)})
    os.replace(tmp, path)
