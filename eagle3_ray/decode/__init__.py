"""EAGLE-3 speculative decoding on Hugging Face targets (batch size 1, KV caches), and the
drafter-free generators it is measured against. See docs/decode.md.

    tokens, stats = generate(target, drafter, prompt_ids, 128, mode="tree", topk=4, depth=5)
    stats.tau, stats.tokens_per_s

``drafter`` is what ``eagle3_ray.drafter.export.load_drafter`` returns, or any ``Proposer``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from eagle3_ray.drafter.model import Eagle3Drafter
from eagle3_ray.errors import ConfigError
from eagle3_ray.decode.chain import Eagle3Proposer, chain_generate
from eagle3_ray.decode.drafts import Draft, DraftTree, Proposer
from eagle3_ray.decode.plain import prompt_lookup_generate, target_generate, target_top2
from eagle3_ray.decode.sampling import make_sampling
from eagle3_ray.decode.static import StaticTarget
from eagle3_ray.decode.static_draft import StaticProposer
from eagle3_ray.decode.stats import SpecStats, Stopwatch, Tally
from eagle3_ray.decode.target import TargetRunner, check_max_new_tokens, eos_set, model_device, prompt_tensor
from eagle3_ray.decode.tree import tree_generate

__all__ = [
    "Draft",
    "DraftTree",
    "Eagle3Proposer",
    "Proposer",
    "SpecStats",
    "StaticProposer",
    "StaticTarget",
    "generate",
    "prepare_drafter",
    "prompt_lookup_generate",
    "target_generate",
    "target_top2",
]

Mode = Literal["chain", "tree"]
COMMON_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "eos_token_id": None}
MODE_DEFAULTS: dict[str, dict[str, int]] = {
    "chain": {"num_steps": 3},  # K drafts per verify
    "tree": {"topk": 4, "depth": 5, "total_tokens": 16},  # EAGLE-2 tree; total_tokens = drafts verified
}


def generate(
    target: torch.nn.Module | StaticTarget,
    drafter: Eagle3Drafter | Proposer,
    input_ids: torch.Tensor | Sequence[int],
    max_new_tokens: int,
    mode: Mode = "chain",
    **params: Any,
) -> tuple[list[int], SpecStats]:
    """Speculative decoding of one prompt: (new token ids, EOS kept, without the prompt; stats).

    ``target``: the model, or a ``StaticTarget`` built over it once (preallocated KV cache, one
    CUDA graph per verify width, reused by every call; with its ``draft_graphs`` an Eagle3Drafter
    drafts through its ``StaticProposer``: static drafter cache, graphed draft steps).
    Params: chain ``num_steps`` (3); tree ``topk`` (4), ``depth`` (5), ``total_tokens`` (16);
    both ``temperature`` (0 = greedy, token-for-token the target's greedy decoding), ``top_p``
    (1.0), ``seed`` (0), ``eos_token_id`` (None = target.generation_config's; [] = never stop).
    """
    opts = _options(mode, params)
    check_max_new_tokens(max_new_tokens)
    static = target if isinstance(target, StaticTarget) else None
    model = static.model if static is not None else target
    proposer = _as_proposer(drafter, model, opts)
    if static is not None and static.draft_graphs and isinstance(proposer, Eagle3Proposer):
        proposer = static.proposer(proposer.drafter)  # static drafter cache, graphed draft steps
    device = model_device(model)
    prompt = prompt_tensor(input_ids, device)
    s = make_sampling(opts["temperature"], opts["top_p"], opts["seed"], device)
    max_drafts = opts["num_steps"] if mode == "chain" else opts["depth"]
    tally = Tally(max_new_tokens, eos_set(model, opts["eos_token_id"]), max_drafts)
    with torch.inference_mode():
        runner = static.runner(proposer.aux_layers) if static is not None else TargetRunner(model, proposer.aux_layers)
        clock = Stopwatch(device)
        if mode == "chain":
            stats = chain_generate(runner, proposer, prompt, tally, s, clock, opts["num_steps"])
        else:
            stats = tree_generate(
                runner, proposer, prompt, tally, s, clock, opts["topk"], opts["depth"], opts["total_tokens"]
            )
    return tally.tokens, stats


def _options(mode: str, params: dict[str, Any]) -> dict[str, Any]:
    if mode not in MODE_DEFAULTS:
        raise ConfigError(f"mode={mode!r} is unknown; use 'chain' or 'tree'")
    defaults = {**COMMON_DEFAULTS, **MODE_DEFAULTS[mode]}
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown parameters {unknown} for mode={mode!r}; allowed: {sorted(defaults)}")
    opts = {**defaults, **params}
    for name in MODE_DEFAULTS[mode]:
        if not isinstance(opts[name], int) or opts[name] < 1:
            raise ConfigError(f"{name}={opts[name]!r}; it must be a positive integer")
    return opts


def _as_proposer(drafter: Eagle3Drafter | Proposer, target: torch.nn.Module, opts: dict[str, Any]) -> Proposer:
    if isinstance(drafter, Eagle3Drafter):
        prepare_drafter(drafter, target)
        if opts.get("topk", 1) > drafter.config.draft_vocab_size:
            raise ConfigError(
                f"topk={opts['topk']} exceeds the drafter's vocabulary ({drafter.config.draft_vocab_size}); lower it"
            )
        return Eagle3Proposer(drafter)
    if isinstance(drafter, Proposer):
        return drafter
    raise ConfigError(
        f"drafter is a {type(drafter).__name__}; pass what eagle3_ray.drafter.export.load_drafter returns "
        "(an Eagle3Drafter) or an eagle3_ray.decode.Proposer"
    )


def prepare_drafter(drafter: Eagle3Drafter, target: torch.nn.Module) -> Eagle3Drafter:
    """Check the drafter fits ``target``, move it (in place) to the target's device/dtype, put it
    in eval mode and bind the target's input embedding (shared, not copied)."""
    text = target.config.get_text_config()
    cfg = drafter.config
    if cfg.target_hidden_size != text.hidden_size:
        raise ConfigError(
            f"the drafter reads target states of width {cfg.target_hidden_size}, this target's are "
            f"{text.hidden_size}; use a drafter trained for this target"
        )
    if not cfg.aux_layers or max(cfg.aux_layers) > text.num_hidden_layers:
        raise ConfigError(
            f"the drafter reads target hidden_states {cfg.aux_layers}, this target has "
            f"{text.num_hidden_layers} layers (indices 0..{text.num_hidden_layers}); use a drafter trained "
            "for this target"
        )
    embedding = target.get_input_embeddings()
    weight = embedding.weight  # [V, H]
    if drafter.fc.weight.device != weight.device or drafter.fc.weight.dtype != weight.dtype:
        drafter.to(device=weight.device, dtype=weight.dtype)
    if drafter.embed_tokens.weight.data_ptr() != weight.data_ptr():
        drafter.bind_embedding(embedding)
    return drafter.eval()
