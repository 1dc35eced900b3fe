"""The forward hook SGLang attaches to ``logits_processor`` to capture EAGLE-3 features.

SGLang imports this module inside every TP scheduler process (``ServerArgs.forward_hooks``,
registered by ``sglang/srt/model_executor/hook_manager.py:register_forward_hooks``), so it imports
only the standard library, torch and safetensors: no Ray, nothing heavy from ``eagle3_ray``.

What the hook sees (SGLang 0.5.17 and 0.5.23, verified in docs/sglang.md): ``LlamaForCausalLM.forward``
and ``DeepseekV2ForCausalLM.forward`` call ``self.logits_processor(input_ids, hidden_states, lm_head,
forward_batch, aux_hidden_states)`` positionally, with ``hidden_states`` [N, H] already through the
final norm (the lm_head input). N is the sum of the batch's extend lengths, requests in
``forward_batch.rids`` order. The aux states arrive one of two ways:

- SGLang with ``enable_return_aux_hidden_states`` (0.5.23): the model hands them to
  ``logits_processor`` as a list of three [N, H] tensors or one packed [N, 3H] tensor.
- SGLang without it (0.5.17): aux capture is tied to loading an EAGLE-3 draft, so
  ``aux_hidden_states`` is None. Instead one more hook per aux layer sits on decoder layer ``c``
  (``model.layers.<c>``), whose output ``(hidden_states, residual)`` sums to the residual stream
  after ``c + 1`` layers, HF ``hidden_states[c + 1]``: the same sum SGLang's own capture takes at
  the next layer's input (``hidden_states + residual``, models/llama.py). The layer hooks park
  their rows here, in this process, and the ``logits_processor`` hook of the same forward takes them.

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
LAYER_FACTORY_PATH = "eagle3_ray.engines.sglang_hooks:layer_hook_factory"

# Positions in LogitsProcessor.forward(input_ids, hidden_states, lm_head, logits_metadata,
# aux_hidden_states, ...) (sglang/srt/layers/logits_processor.py); pinned by the contract tests.
HIDDEN_ARG, BATCH_ARG, AUX_ARG = 1, 3, 4
# Position of forward_batch in a decoder layer's forward(positions, hidden_states, forward_batch,
# residual) (models/llama.py, qwen2.py, qwen3.py); pinned by the contract tests.
LAYER_BATCH_ARG = 2


def capture_path(directory: str | Path, rid: str) -> Path:
    return Path(directory) / f"{rid}{CAPTURE_SUFFIX}"


def _world_rank() -> int:
    # SGLang's WORLD rank is ep_join_rank_offset + tp_size * pp_rank + tp_rank
    # (sglang/srt/runtime_context.py:spawn_world_rank); the offset is 0 outside elastic EP.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _is_prefill(forward_batch: Any) -> bool:
    # Decode steps and speculative verification carry no new prompt rows to capture.
    mode = forward_batch.forward_mode
    return mode.is_extend() and not mode.is_target_verify()


# Rows parked by the layer hooks of the forward in progress, per capture dir: {slot: [N, H]}.
_LAYER_ROWS: dict[str, dict[int, torch.Tensor]] = {}


def capture_hook_factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of the ``logits_processor`` spec.

    config = {"dir": str, "tp_size": int, "layer_slots": int}; ``layer_slots`` > 0 means the aux
    states come from that many layer hooks (``layer_hook_factory``) rather than from SGLang.
    Returns None on TP ranks other than 0; SGLang then registers nothing there.
    """
    directory = Path(config["dir"])
    if _world_rank() % int(config["tp_size"]) != 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    slots = int(config.get("layer_slots", 0))
    key = str(directory)

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        forward_batch = args[BATCH_ARG]
        if not _is_prefill(forward_batch):
            return None
        if slots:
            parked = _LAYER_ROWS.pop(key, {})
            aux = [parked[j] for j in range(slots)] if len(parked) == slots else None
        else:
            aux = args[AUX_ARG] if len(args) > AUX_ARG else None
        if aux is None:
            return None  # capture not enabled: the engine reports the missing files with the cause
        write_batch(directory, forward_batch, args[HIDDEN_ARG], aux)
        return None

    return hook


def layer_hook_factory(config: dict[str, Any]) -> Callable | None:
    """``hook_factory`` of one aux layer's spec: config = {"dir", "tp_size", "slot": int}.

    The hook sits on a decoder layer whose forward is ``(positions, hidden_states, forward_batch,
    residual) -> (hidden_states, residual)`` and parks ``hidden_states + residual`` [N, H].
    """
    if _world_rank() % int(config["tp_size"]) != 0:
        return None
    key, slot = str(Path(config["dir"])), int(config["slot"])

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if not _is_prefill(args[LAYER_BATCH_ARG]):
            return None
        hidden, residual = output
        _LAYER_ROWS.setdefault(key, {})[slot] = hidden + residual  # [N, H]
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
