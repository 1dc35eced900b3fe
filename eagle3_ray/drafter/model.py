"""The EAGLE-3 drafter: one Llama decoder layer over (target embedding, fused target hidden state).

Parameter names are exactly the ``LlamaForCausalLMEagle3`` layout SGLang and vLLM load (docs/contracts.md
"Drafter"), so export is a dtype cast and a key filter. The math follows SGLang's
``srt/models/llama_eagle3.py``: residual from ``h``, q/k/v over
``cat(input_layernorm(embed), hidden_norm(h))``, fused residual adds, neox RoPE on positions.

API used by training (``drafter/ttt.py``) and by speculative decoding (``decode/``)::

    drafter.bind_embedding(target.get_input_embeddings())
    h = drafter.fuse(aux_hidden)                       # [B, T, 3Ht] -> [B, T, H]
    cache = DrafterKVCache()
    h_out = drafter(input_ids, h, position_ids, cache=cache)   # [B, T, H], pre-norm
    logits = drafter.logits(h_out)                     # [B, T, draft_vocab]
    target_ids = drafter.draft_to_target(logits.argmax(-1))
    next_h = h_out                                     # fed back as `hidden` at the next step
"""

from __future__ import annotations

import contextlib

import functools
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3_ray.drafter.ttt_attention import TTTCache, ttt_attention
from eagle3_ray.errors import CheckpointError, ConfigError

# train.drafter.* fields a user may override; everything else is sized from the target.
SHAPE_OVERRIDES = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")


@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter; saved as ``drafter_config.json`` with checkpoints."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # target vocabulary (rows of the bound embedding, length of t2d)
    draft_vocab_size: int  # lm_head rows, length of d2t
    target_hidden_size: int  # Ht; fc reads 3 * Ht
    aux_layers: list[int] = field(default_factory=list)  # HF hidden_states indices (docs/contracts.md "Aux layer ids")
    target_model_type: str = "llama"  # HF model_type of the target, decides SGLang's aux-id rule
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_scaling without rope_theta; None = default
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise CheckpointError(f"drafter config has unknown fields {unknown}; it was written by another version")
        missing = sorted(
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in data
        )
        if missing:
            raise CheckpointError(f"drafter config lacks fields {missing}")
        cfg = cls(**data)
        cfg.validate()
        return cfg

    @classmethod
    def from_target(
        cls,
        target_hf_config: Any,
        draft_vocab_size: int,
        aux_layers: list[int],
        overrides: dict[str, int | None] | None = None,
    ) -> DrafterConfig:
        """Size the drafter like one target decoder layer; ``overrides`` = ``train.drafter.*``.

        ``target_hf_config`` is the target's ``transformers`` config (multimodal configs are read
        through their text config). ``None`` overrides keep the target's value.
        """
        text = target_hf_config.get_text_config() if hasattr(target_hf_config, "get_text_config") else target_hf_config
        given = {k: v for k, v in (overrides or {}).items() if v is not None}
        unknown = sorted(set(given) - set(SHAPE_OVERRIDES))
        if unknown:
            raise ConfigError(f"train.drafter has unknown fields {unknown}; allowed: {list(SHAPE_OVERRIDES)}")
        heads = given.get("num_attention_heads", text.num_attention_heads)
        hidden = given.get("hidden_size", text.hidden_size)
        target_head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        # A new width or head count invalidates the target's head_dim unless one is given.
        reshaped = "hidden_size" in given or "num_attention_heads" in given
        head_dim = given.get("head_dim", hidden // heads if reshaped else target_head_dim)
        kv_default = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        rope_theta, rope_scaling = _rope_from_hf(text)
        cfg = cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=given.get("num_key_value_heads", min(kv_default, heads)),
            head_dim=head_dim,
            intermediate_size=given.get("intermediate_size", text.intermediate_size),
            vocab_size=text.vocab_size,
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=text.hidden_size,
            aux_layers=list(aux_layers),
            target_model_type=getattr(target_hf_config, "model_type", "llama"),
            rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(getattr(text, "max_position_embeddings", 2048)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.hidden_size != self.target_hidden_size:
            raise ConfigError(
                f"train.drafter.hidden_size={self.hidden_size} differs from the target hidden size "
                f"{self.target_hidden_size}: the drafter reuses the target's input embedding, so leave "
                "hidden_size unset"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"train.drafter: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; pick a divisor"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"vocab.draft_vocab_size={self.draft_vocab_size} exceeds the target vocabulary "
                f"{self.vocab_size}; lower it"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"drafter hidden_act={self.hidden_act!r}: only 'silu' (SwiGLU) is served by SGLang/vLLM")


def _rope_from_hf(text_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (rope_scaling) or 5.x (rope_parameters) config."""
    params = dict(getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {})
    theta = float(params.pop("rope_theta", getattr(text_config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (params if kind != "default" else None)


class RMSNorm(nn.Module):
    """SGLang/HF RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DrafterKVCache:
    """Keys/values of the drafter's one attention layer, RoPE already applied.

    ``k``/``v``: [B, kv_heads, S, head_dim]. ``forward(..., cache=c)`` appends the new T keys at
    the end, so position j of a call lands at cache index ``c.length + j``. Speculative decoding
    rolls back with ``crop(n)`` (reject drafts) or ``select(index)`` (keep a tree's accepted path).
    """

    def __init__(self, growing: bool = False) -> None:
        # growing: a decoding cache, one call per draft step, so its key length differs on every call;
        # attention then runs without cuDNN (sdpa_for_growing_keys). The TTT unroll's cache (False)
        # sees the same shapes every training step and keeps torch's choice: cuDNN's plans are reused
        # there, and without cuDNN the masked GQA attention falls back to the slow math kernel.
        self.growing = growing
        self.k: torch.Tensor | None = None  # [B, kv, S, D]
        self.v: torch.Tensor | None = None  # [B, kv, S, D]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add [B, kv, T, D] keys/values; returns the whole [B, kv, S + T, D] cache."""
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat([self.k, k], dim=2)
            self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Drop every position >= n (e.g. drafts the target rejected)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def select(self, index: torch.Tensor) -> None:
        """Keep only the positions in ``index`` ([N] for every row, or [B, N] per row), in that order."""
        if self.k is None:
            return
        if index.dim() == 1:
            self.k, self.v = self.k[:, :, index], self.v[:, :, index]
            return
        b, h, _, d = self.k.shape
        gather = index.to(self.k.device)[:, None, :, None].expand(b, h, index.shape[1], d)
        self.k, self.v = self.k.gather(2, gather), self.v.gather(2, gather)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        in_dim = 2 * cfg.hidden_size  # cat(embed, hidden)
        self.q_proj = nn.Linear(in_dim, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, 2H]
        cos: torch.Tensor,  # [B, T, D]
        sin: torch.Tensor,  # [B, T, D]
        mask: torch.Tensor | Any | None,  # [B, 1, T, S] bool (True = attend), a flex BlockMask, or Segments
        cache: DrafterKVCache | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, T, D]
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if isinstance(cache, TTTCache):  # the TTT unroll, `mask` its Segments
            cache.append(k, v)
            out = ttt_attention(q, cache, mask)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a flex BlockMask (training)
            out = _flex_attention(q.device)(q, k, v, block_mask=mask, enable_gqa=self.heads != self.kv_heads)
            return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
        causal = mask is None and past == 0
        if mask is None and past > 0:
            # New query j sits at cache index past + j and sees every key up to it.
            keys = torch.arange(past + t, device=x.device)
            mask = (keys[None, :] <= past + torch.arange(t, device=x.device)[:, None])[None, None]
        with attention_backends(cache, q.device):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.heads != self.kv_heads
            )  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


def attention_backends(cache: "DrafterKVCache | None", device: torch.device):
    """The sdpa backends of one drafter attention call: without cuDNN for a decoding cache
    (``growing``), torch's choice otherwise (the TTT unroll, uncached calls)."""
    return sdpa_for_growing_keys(device) if cache is not None and cache.growing else contextlib.nullcontext()


def sdpa_for_growing_keys(device: torch.device):
    """sdpa without the cuDNN backend on CUDA (a no-op elsewhere), for decoding whose key length
    grows every call: cuDNN builds an execution plan per new shape, milliseconds of host time per
    drafter attention (benchmarks/results/README.md, quality section). CUDA-graph replays (fixed
    shapes) do not pay it and keep torch's choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _flex_attention(device: torch.device):
    """flex_attention, compiled on CUDA (its fused kernel only exists compiled); eager elsewhere,
    where it runs a reference implementation (tests on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex() if device.type == "cuda" else flex_attention


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """``midlayer``: SGLang's EAGLE-3 input decoder layer."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DrafterMLP(cfg)

    def forward(self, embeds, hidden, cos, sin, mask, cache) -> torch.Tensor:
        # The residual stream starts at the hidden state, not at the token embedding.
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        h = hidden + self.self_attn(x, cos, sin, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE, as transformers' Llama: q, k [B, h, T, D]; cos, sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class RotaryEmbedding:
    """Neox-style RoPE tables computed in fp32 (SGLang keeps its cos/sin cache in fp32 too).

    A plain object, not a module, so ``drafter.to(torch.bfloat16)`` cannot round ``inv_freq``.
    """

    def __init__(self, cfg: DrafterConfig):
        rope = {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta}
        if rope["rope_type"] == "default":  # transformers' default rule, without importing it (~3 s per process)
            d = cfg.head_dim
            self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
            self.scaling = 1.0
        else:  # scaled RoPE (llama3, yarn, ...): transformers' own init functions
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            hf = LlamaConfig(
                hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads,
                head_dim=cfg.head_dim,
                max_position_embeddings=cfg.max_position_embeddings,
                rope_parameters=rope,
            )
            self.inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf)  # [D/2] fp32
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}  # one copy per device, not one per call

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] positions -> (cos, sin), each [B, T, D] in ``dtype``."""
        inv_freq = self._inv_freq_on.get(position_ids.device)
        if inv_freq is None:
            inv_freq = self._inv_freq_on[position_ids.device] = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter in the exact ``LlamaForCausalLMEagle3`` layout (docs/contracts.md "Drafter").

    ``embed_tokens`` is the target's input embedding, frozen and never exported: call
    ``bind_embedding`` before ``forward``. ``d2t``/``t2d`` default to the identity map of the
    first ``draft_vocab_size`` target ids until ``set_vocab_map`` installs the real one.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        # A zero placeholder until bind_embedding: no random init of a table that is replaced anyway
        # (128K x 4096 at the 8B shape, 164K x 7168 at Kimi-K2.5: seconds of serial CPU RNG per worker).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.zeros(config.vocab_size, config.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = DrafterLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))  # [Vd]
        self.register_buffer("t2d", t2d)  # [V]
        self.rotary = RotaryEmbedding(config)

    def set_vocab_map(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the vocab map (docs/contracts.md "Vocab map"): target_id = draft_id + d2t[draft_id]."""
        vd, v = self.config.draft_vocab_size, self.config.vocab_size
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise ConfigError(
                f"vocab map shapes d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match the drafter "
                f"({vd},) / ({v},); rebuild the vocab map with vocab.draft_vocab_size={vd}"
            )
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))

    def init_lm_head_from_target(self, target_lm_head: torch.Tensor) -> None:
        """``lm_head`` <- the target's lm_head rows ([V, Ht]) of the draft vocabulary, in draft order (row i
        is target token ``i + d2t[i]``): call after ``set_vocab_map`` (train.lm_head_init=target)."""
        v, h = self.config.vocab_size, self.config.hidden_size
        if tuple(target_lm_head.shape) != (v, h):
            raise ConfigError(
                f"train.lm_head_init=target: the target's lm_head is {tuple(target_lm_head.shape)}, the drafter's "
                f"rows are ({self.config.draft_vocab_size}, {h}) of a {v}-token vocabulary; it needs the drafter's "
                "hidden size to be the target's (unset train.drafter.hidden_size) or train.lm_head_init=random"
            )
        rows = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        with torch.no_grad():
            self.lm_head.weight.copy_(target_lm_head[rows.to(target_lm_head.device)].to(self.lm_head.weight))

    def bind_embedding(self, embedding: nn.Embedding | torch.Tensor) -> None:
        """Share the target's input embedding ([V, H]) without copying; it stays frozen."""
        weight = embedding.weight if isinstance(embedding, nn.Embedding) else embedding
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ConfigError(
                f"target embedding has shape {tuple(weight.shape)}, the drafter expects {expected}; "
                "train the drafter for this target"
            )
        self.embed_tokens.weight = nn.Parameter(weight.detach(), requires_grad=False)

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, 3Ht] concatenated aux states (id order) -> [B, T, H] step-0 hidden (``fc``)."""
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        hidden: torch.Tensor,  # [B, T, H]
        position_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor | None = None,  # [B, 1, T, S] bool, True = attend
        cache: DrafterKVCache | None = None,
    ) -> torch.Tensor:
        """One drafter pass; returns the pre-``norm`` hidden state [B, T, H].

        Token j pairs ``input_ids[:, j]`` (the *next* token) with ``hidden[:, j]`` (the state that
        predicted it). ``attention_mask`` covers S = ``cache.length`` + T keys (new keys last);
        None means causal over the cache plus the new tokens. The output is both the input of
        ``logits`` and the ``hidden`` of the next drafting step.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # [B, T, H]
        cos, sin = self.rotary(position_ids, hidden.dtype)  # [B, T, D]
        return self.midlayer(embeds, hidden, cos, sin, attention_mask, cache)

    def logits(self, hidden_out: torch.Tensor) -> torch.Tensor:
        """[B, T, H] -> [B, T, draft_vocab] (``norm`` then ``lm_head``)."""
        return self.lm_head(self.norm(hidden_out))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft vocab ids -> target vocab ids (same shape)."""
        return ids + self.d2t[ids]

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor that belongs to the drafter: all but the borrowed ``embed_tokens``."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

