"""The ``sglang.Engine`` kwargs of each mode, and the checks they pass before SGLang starts.

``engine_kwargs`` returns the exact kwargs of capture (the forward hooks of
``engines/sglang_hooks.py`` and the settings they need), generation and EAGLE-3 speculative decoding,
so they can be read and are tested against SGLang's own ``ServerArgs``. SGLang is imported lazily:
``eagle3_ray`` imports without it. Versions differ (0.5.17 and 0.5.23 are tested): the kwargs follow
the installed ``ServerArgs`` fields, never a version string. Facts behind each setting: docs/sglang.md.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Sequence

from eagle3_ray.config import BenchConfig, TargetConfig
from eagle3_ray.engines.aux_layers import translate_aux_ids
from eagle3_ray.engines.base import EngineInfo
from eagle3_ray.engines.sglang_hooks import FACTORY_PATH, LAYER_FACTORY_PATH
from eagle3_ray.engines.sglang_modules import sglang_module_paths
from eagle3_ray.engines.sglang_tp import layer_hook_tp_kwargs
from eagle3_ray.errors import ConfigError, EngineError

Mode = Literal["capture", "generate", "spec"]
MODES: tuple[str, ...] = ("capture", "generate", "spec")
TESTED_VERSIONS = ("0.5.17", "0.5.23")  # the range the `sglang` extra allows; contract-tested
INSTALL_HINT = "pip install 'eagle3-ray[sglang]' (sglang 0.5.17 to 0.5.23, needs CUDA GPUs)"
HOOK_NAME = "eagle3_ray_capture"
# In SGLang 0.5.23 (not 0.5.17): hands aux states to logits_processor without loading a draft.
AUX_FLAG = "enable_return_aux_hidden_states"
# Models whose decoder layers return (hidden_states, residual[, ...]) with forward_batch as the
# third positional argument: the layer-hook capture (SGLang without AUX_FLAG) works on these.
# DeepSeek-V2/V3 (and Kimi-K2, which ships DeepseekV3ForCausalLM) return a third item, topk_indices.
LAYER_HOOK_MODELS = ("llama", "qwen2", "qwen3", "deepseek_v2", "deepseek_v3", "kimi_k2")

# The largest decode batch SGLang captures a CUDA graph for (a ServerArgs field in 0.5.17 and 0.5.23).
# Its default is 256 on an 80-GB or 141-GB GPU with tp_size < 4: a decode batch above it runs eagerly.
GRAPH_MAX_BS = "cuda_graph_max_bs_decode"

# One forward per request, nothing decoded: max_new_tokens=0 returns no output at all.
CAPTURE_SAMPLING = {"max_new_tokens": 1, "temperature": 0.0}

# Settings the capture mode forces, each with what breaks without it.
CAPTURE_FORCED: dict[str, tuple[Any, str]] = {
    "disable_radix_cache": (True, "a prefix-cache hit skips the cached rows, so a sample loses tokens"),
    "chunked_prefill_size": (-1, "chunked prefill splits one sample over several forwards"),
    "disable_cuda_graph": (True, "CUDA graph replay never runs Python forward hooks"),
}
# Forced in addition where the installed ServerArgs has AUX_FLAG.
CAPTURE_FORCED_AUX_FLAG: dict[str, tuple[Any, str]] = {
    AUX_FLAG: (True, "the model only hands aux states to logits_processor with it"),
    "speculative_algorithm": ("EAGLE3", "it names the aux capture convention (no draft is loaded)"),
}

# Server settings that capture cannot work with, whatever their value elsewhere.
_CAPTURE_REFUSED: dict[str, tuple[Any, str]] = {
    "pp_size": (1, "aux capture needs pp_size == 1 (SGLang refuses it otherwise)"),
    "dp_size": (1, "TP rank 0 of one engine writes the features; scale with more engine actors"),
    "attn_dp_size": (1, "with attention DP, TP rank 0 does not see every request"),
    "enable_dp_attention": (False, "with attention DP, TP rank 0 does not see every request"),
    "enable_layernorm_sp": (False, "the hook would see sequence-sharded hidden states"),
    "enable_mixed_chunk": (False, "mixed batches interleave decode rows with prompt rows"),
    "cuda_graph_config": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "cuda_graph_backend_prefill": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "cuda_graph_backend_decode": (None, "it overrides disable_cuda_graph, and graph replay skips the hook"),
    "forward_hooks": (None, "the capture hook is set by eagle3_ray"),
    "return_aux_hidden_state_layer_ids": (None, "set target.aux_layers instead (HF hidden_states indices)"),
    "speculative_draft_model_path": (None, "capture runs the target alone"),
    "allow_auto_truncate": (False, "SGLang would cut a sample over its input limit; capture needs every row"),
}

# Keys owned by TargetConfig fields in every mode.
_MANAGED = {
    "model_path": "target.model",
    "tp_size": "target.tp_size",
    "dtype": "target.dtype",
    "nnodes": "target.sglang.nnodes",
    "dist_init_addr": "target.sglang.dist_init_addr",
    "node_rank": "the engine actor's node (one engine per node)",
    "mem_fraction_static": "target.sglang.mem_fraction_static",
    "skip_tokenizer_init": "nothing (the engine takes and returns token ids)",
    "sampling_defaults": "nothing (unset sampling knobs stay neutral)",
    "load_format": "target.model ('random:<config>' loads dummy weights)",
}


def import_sglang():
    try:
        import sglang
    except ImportError as e:
        raise EngineError(f"target.backend='sglang' needs SGLang: {INSTALL_HINT} ({e})") from e
    return sglang


def sglang_aux_ids(aux_layers: Sequence[int], model_type: str, num_layers: int) -> list[int]:
    """HF hidden_states indices -> the ids SGLang's ``set_eagle3_layers_to_capture`` expects.

    The per-architecture rules live in ``eagle3_ray.engines.aux_layers.translate_aux_ids`` (shared with
    export). SGLang captures the *input* of a decoder layer, so index ``num_layers`` (the output of
    the last layer, before the final norm) has no layer to capture it at.
    """
    ks = list(aux_layers)
    if max(ks) >= num_layers:
        raise ConfigError(
            f"target.aux_layers={ks}: SGLang captures the input of a decoder layer, so HF index "
            f"{num_layers} (the last layer's output) cannot be captured for a {num_layers}-layer target; "
            f"use indices <= {num_layers - 1} (default [2, L//2, L-3])"
        )
    return translate_aux_ids(ks, model_type, "sglang")


def _dtype(target: TargetConfig) -> str:
    # "auto" matches the HF backend on GPU (bf16); SGLang's own "auto" would follow the checkpoint.
    return "bfloat16" if target.dtype == "auto" else target.dtype


def _model_source(target: TargetConfig) -> dict[str, Any]:
    from eagle3_ray.engines.targets import resolve_target

    resolved = resolve_target(target.model, target.cache_dir)
    if resolved.model_path is None:  # random:<config>: SGLang builds it with dummy weights
        return {"model_path": str(Path(resolved.config_source).parent), "load_format": "dummy"}
    return {"model_path": str(resolved.model_path)}


def _base_kwargs(target: TargetConfig, node_rank: int) -> dict[str, Any]:
    sg = target.sglang
    kw: dict[str, Any] = {
        **_model_source(target),
        "tp_size": target.tp_size,
        "dtype": _dtype(target),
        "skip_tokenizer_init": True,
        # Unset sampling knobs stay neutral instead of following generation_config.json
        # (top_k, repetition_penalty, ...), which would skew self-distilled answers.
        "sampling_defaults": "openai",
    }
    if sg.nnodes > 1:
        if not sg.dist_init_addr:
            raise ConfigError(
                f"target.sglang.nnodes={sg.nnodes} needs target.sglang.dist_init_addr (host:port of node 0, "
                "shared by every node of the engine)"
            )
        if not 0 <= node_rank < sg.nnodes:
            raise ConfigError(f"node_rank={node_rank} must lie in [0, target.sglang.nnodes={sg.nnodes})")
        kw.update(nnodes=sg.nnodes, node_rank=node_rank, dist_init_addr=sg.dist_init_addr)
    if sg.mem_fraction_static is not None:
        kw["mem_fraction_static"] = sg.mem_fraction_static
    return kw


def server_args_fields() -> frozenset[str]:
    """Field names of the installed SGLang's ``ServerArgs``: a msgspec Struct (0.5.23) or a dataclass (0.5.17)."""
    from sglang.srt.server_args import ServerArgs

    struct_fields = getattr(ServerArgs, "__struct_fields__", None)
    if struct_fields is not None:
        return frozenset(struct_fields)
    return frozenset(f.name for f in dataclasses.fields(ServerArgs))


def check_extra_kwargs(extra: dict[str, Any], mode: Mode) -> None:
    """Refuse ``target.sglang.extra_engine_kwargs`` that another field owns or that break ``mode``."""
    for key in extra:
        if key in _MANAGED:
            raise ConfigError(f"target.sglang.extra_engine_kwargs.{key}: set it through {_MANAGED[key]}")
    if mode != "capture":
        return
    forced = {**CAPTURE_FORCED, **CAPTURE_FORCED_AUX_FLAG}
    for key, value in extra.items():
        if key in forced and value != forced[key][0]:
            want, why = forced[key]
            raise ConfigError(
                f"target.sglang.extra_engine_kwargs.{key}={value!r} breaks hidden-state capture ({why}); "
                f"capture forces {key}={want!r}: remove it"
            )
        if key in _CAPTURE_REFUSED and value != _CAPTURE_REFUSED[key][0]:
            want, why = _CAPTURE_REFUSED[key]
            raise ConfigError(
                f"target.sglang.extra_engine_kwargs.{key}={value!r} breaks hidden-state capture ({why}); "
                f"remove it or set {key}={want!r}"
            )


def _spec_kwargs(drafter_dir: str | Path | None, bench: BenchConfig | None,
                 shape: Literal["chain", "tree"] | None = None) -> dict[str, Any]:
    """EAGLE-3 with the drafter in ``drafter_dir``: a ``chain`` (top-1, ``bench.num_steps`` drafts) or a
    ``tree`` (``bench.topk`` x ``bench.depth``, ``bench.total_tokens`` verified); default: the tree
    when ``bench.modes`` lists it."""
    if drafter_dir is None or bench is None:
        raise ConfigError("mode='spec' needs drafter_dir (an exported drafter) and the bench config")
    if shape not in (None, "chain", "tree"):
        raise ConfigError(f"spec_shape={shape!r}: use 'chain' or 'tree'")
    if shape == "tree" or (shape is None and "tree" in bench.modes):
        steps, topk, tokens = bench.depth, bench.topk, bench.total_tokens
    else:  # a chain verifies its K drafts plus the bonus token
        steps, topk, tokens = bench.num_steps, 1, bench.num_steps + 1
    return {
        "speculative_algorithm": "EAGLE3",
        "speculative_draft_model_path": str(drafter_dir),
        "speculative_num_steps": steps,
        "speculative_eagle_topk": topk,
        "speculative_num_draft_tokens": tokens,
    }


def _capture_kwargs(
    target: TargetConfig, info: EngineInfo, capture_dir: str | Path | None, fields: frozenset[str],
    audit_share: float = 0.0,
) -> dict[str, Any]:
    if capture_dir is None:
        raise ConfigError("mode='capture' needs capture_dir (where the hook writes features)")
    ids = sglang_aux_ids(info.aux_layers, info.model_type, info.num_layers)  # also refuses index L
    hook_config = {"dir": str(capture_dir), "tp_size": target.tp_size}
    audit = {"audit_share": audit_share} if audit_share > 0 else {}  # the logits_processor hook's capture audit
    forced = {k: v for k, (v, _) in CAPTURE_FORCED.items()}
    # Exact module names of the class SGLang builds (a wrapper such as Kimi-K2.5 nests its text model).
    paths = sglang_module_paths(info.architectures, target.sglang.extra_engine_kwargs)
    if AUX_FLAG in fields:
        if not paths.aux_states:
            raise ConfigError(
                f"SGLang's {info.architectures[0]} does not hand set_eagle3_layers_to_capture to its language model, "
                f"so SGLang refuses {AUX_FLAG} for it and no aux states reach {paths.logits_processor}: capture this "
                "target with target.backend=hf, or with an SGLang without that flag (sglang 0.5.17: layer hooks)"
            )
        lp_hook = {"name": HOOK_NAME, "target_modules": [paths.logits_processor], "hook_factory": FACTORY_PATH,
                   "config": {**hook_config, **audit}}
        return {**forced, **{k: v for k, (v, _) in CAPTURE_FORCED_AUX_FLAG.items()},
                "return_aux_hidden_state_layer_ids": ids, "forward_hooks": [lp_hook]}
    if info.model_type not in LAYER_HOOK_MODELS:
        raise ConfigError(
            f"capturing a {info.model_type!r} target needs SGLang's {AUX_FLAG} (sglang 0.5.23); the installed "
            f"SGLang lacks it, and the layer-hook capture covers only {LAYER_HOOK_MODELS}: install sglang==0.5.23"
        )
    # Under TP a hooked layer must return reduced, whole rows: force off or refuse what breaks that.
    forced.update(layer_hook_tp_kwargs(target.tp_size, target.sglang.extra_engine_kwargs, fields))
    # HF hidden_states[k] is the summed output of decoder layer k - 1 (layer 0's output is k = 1).
    layer_hooks = [
        {"name": f"{HOOK_NAME}_aux{slot}", "target_modules": [paths.decoder_layer(k - 1)],
         "hook_factory": LAYER_FACTORY_PATH, "config": {**hook_config, "slot": slot}}
        for slot, k in enumerate(info.aux_layers)
    ]
    lp_hook = {"name": HOOK_NAME, "target_modules": [paths.logits_processor], "hook_factory": FACTORY_PATH,
               "config": {**hook_config, "layer_slots": len(info.aux_layers), **audit}}
    return {**forced, "forward_hooks": [*layer_hooks, lp_hook]}


def engine_kwargs(
    config: TargetConfig,
    mode: Mode = "capture",
    *,
    info: EngineInfo | None = None,
    capture_dir: str | Path | None = None,
    drafter_dir: str | Path | None = None,
    bench: BenchConfig | None = None,
    node_rank: int = 0,
    fields: frozenset[str] | None = None,
    spec_shape: Literal["chain", "tree"] | None = None,
    max_batch: int | None = None,
    audit_share: float = 0.0,
) -> dict[str, Any]:
    """The exact kwargs given to ``sglang.Engine`` for ``mode``.

    capture: target only, hooks + forced settings; generate: plain decoding (prefix cache on);
    spec: EAGLE-3 speculative decoding with ``drafter_dir`` (``spec_shape`` chain or tree, sized by
    ``bench``).
    ``info`` (aux layers, model type, depth) is read from the target config when not given;
    ``fields`` (the ServerArgs field names, which pick the capture path) from the installed SGLang.
    ``max_batch`` (generate): the requests of one call (``generate.batch_size``): the decode batch CUDA
    graphs are captured up to (``graph_max_bs``) and the most requests SGLang runs at once.
    ``audit_share`` (capture): the capture audit's share of rows, computed by the hook on every TP rank.
    """
    if mode not in MODES:
        raise ConfigError(f"engine mode {mode!r} is unknown; use one of {MODES}")
    extra = dict(config.sglang.extra_engine_kwargs)
    check_extra_kwargs(extra, mode)
    kw = _base_kwargs(config, node_rank)
    if mode == "capture":
        if info is None:
            from eagle3_ray.engines.describe import describe_target

            info = describe_target(config)
        kw.update(_capture_kwargs(config, info, capture_dir, server_args_fields() if fields is None else fields,
                                  audit_share))
    elif mode == "spec":
        kw.update(_spec_kwargs(drafter_dir, bench, spec_shape))
    kw = {**kw, **extra}
    if mode == "generate" and max_batch is not None:
        graphs = graph_max_bs(kw, max_batch, server_args_fields() if fields is None else fields)
        if graphs and "max_running_requests" not in kw:
            # The caller keeps more requests queued than it decodes at once (SGLangEngine.calls_in_flight
            # calls of max_batch each), so that a call's last long answers never decode alone; SGLang
            # admits a queued request as a running one finishes, and every decode step replays a graph.
            graphs["max_running_requests"] = max_batch
        kw.update(graphs)
    return kw


def graph_max_bs(kw: dict[str, Any], max_bs: int, fields: frozenset[str]) -> dict[str, Any]:
    """``{GRAPH_MAX_BS: max_bs}``: CUDA graphs captured up to the largest decode batch this engine gets,
    so that every decode step replays one (SGLang's default, 256 on an H100 or H200, leaves a larger
    batch eager; a smaller bound captures fewer graphs). Nothing where the user's kwargs
    ``kw`` size the graphs themselves, where graphs are off, or where the installed ServerArgs lacks the field."""
    if (GRAPH_MAX_BS in kw or "cuda_graph_config" in kw or kw.get("disable_cuda_graph")
            or GRAPH_MAX_BS not in fields):
        return {}
    return {GRAPH_MAX_BS: max_bs}


def check_server_args(kwargs: dict[str, Any]) -> None:
    """Refuse kwargs that are not fields of the installed SGLang's ServerArgs."""
    unknown = sorted(set(kwargs) - server_args_fields())
    if unknown:
        raise ConfigError(
            f"sglang.Engine kwargs {unknown} are not ServerArgs fields of the installed SGLang; "
            f"fix target.sglang.extra_engine_kwargs (eagle3_ray is tested with sglang {' and '.join(TESTED_VERSIONS)})"
        )


def generate_sampling(max_new_tokens: int, temperature: float, top_p: float, seed: int) -> dict[str, Any]:
    """Per-request SamplingParams; ``sampling_seed`` is honoured under enable_deterministic_inference."""
    if temperature == 0:
        return {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    return {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "sampling_seed": seed}
