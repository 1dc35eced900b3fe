"""The drafter: exact layout, sizing from the target, SGLang math, and the KV-cache API."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from eagle3_ray.drafter import DrafterConfig, DrafterKVCache, Eagle3Drafter
from eagle3_ray.errors import ConfigError

LAYOUT = {
    "fc.weight": (64, 192),
    "norm.weight": (64,),
    "lm_head.weight": (100, 64),
    "d2t": (100,),
    "t2d": (512,),
    "midlayer.self_attn.q_proj.weight": (64, 128),
    "midlayer.self_attn.k_proj.weight": (32, 128),
    "midlayer.self_attn.v_proj.weight": (32, 128),
    "midlayer.self_attn.o_proj.weight": (64, 64),
    "midlayer.mlp.gate_proj.weight": (128, 64),
    "midlayer.mlp.up_proj.weight": (128, 64),
    "midlayer.mlp.down_proj.weight": (64, 128),
    "midlayer.input_layernorm.weight": (64,),
    "midlayer.hidden_norm.weight": (64,),
    "midlayer.post_attention_layernorm.weight": (64,),
}


@pytest.fixture()
def drafter(tiny_llama_config):
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(tiny_llama_config, draft_vocab_size=100, aux_layers=[2, 4, 5])
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:  # norms: move away from 1 so a swapped norm shows up
                p.uniform_(0.5, 1.5)
    d.bind_embedding(torch.nn.Embedding(512, 64))
    return d


def _inputs(b=2, t=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (b, t), generator=g)
    hidden = torch.randn(b, t, 64, generator=g)
    pos = torch.arange(t).expand(b, t)
    return ids, hidden, pos


def test_layout_is_exactly_design(drafter):
    state = drafter.state_dict()
    assert {k: tuple(v.shape) for k, v in drafter.trainable_state_dict().items()} == LAYOUT
    assert tuple(state["embed_tokens.weight"].shape) == (512, 64)
    assert state["d2t"].dtype == torch.int64 and state["t2d"].dtype == torch.bool
    assert not drafter.embed_tokens.weight.requires_grad
    assert drafter.fc.bias is None and drafter.lm_head.bias is None


def test_from_target_sizes_like_target_and_applies_overrides(tiny_llama_config):
    cfg = DrafterConfig.from_target(tiny_llama_config, 100, [2, 3, 3])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.target_hidden_size) == (128, 512, 64)
    assert cfg.rms_norm_eps == 1e-5 and cfg.target_model_type == "llama" and cfg.rope_scaling is None

    cfg = DrafterConfig.from_target(
        tiny_llama_config, 100, [2, 3, 3], {"num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 96}
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size) == (8, 4, 8, 96)
    assert DrafterConfig.from_dict(cfg.to_dict()) == cfg


def test_from_target_refuses_impossible_shapes(tiny_llama_config):
    with pytest.raises(ConfigError, match="hidden_size=128"):
        DrafterConfig.from_target(tiny_llama_config, 100, [2, 3, 3], {"hidden_size": 128})
    with pytest.raises(ConfigError, match="multiple of"):
        DrafterConfig.from_target(tiny_llama_config, 100, [2, 3, 3], {"num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="unknown fields"):
        DrafterConfig.from_target(tiny_llama_config, 100, [2, 3, 3], {"num_layers": 2})


def test_rope_scaling_is_read_from_transformers_config():
    target = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=1024, rope_theta=5e5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
    )
    cfg = DrafterConfig.from_target(target, 100, [2, 3, 4])
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"
    d = Eagle3Drafter(cfg)
    pos = torch.arange(600)[None]
    cos_ref, sin_ref = LlamaRotaryEmbedding(target)(torch.zeros(1), pos)
    cos, sin = d.rotary(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref)
    torch.testing.assert_close(sin, sin_ref)


@pytest.mark.parametrize("theta, head_dim", [(10000.0, 16), (100000.0, 64), (5e5, 128)])
def test_default_rope_is_transformers_own_bit_for_bit(theta, head_dim):
    """The default RoPE is computed without importing transformers: the same tables and the same
    rotation as its Llama, to the bit (theta 1e5, head 64: SmolLM2; 5e5, 128: the Llama-3 family)."""
    from eagle3_ray.drafter.model import apply_rotary_pos_emb as ours

    target = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, rope_theta=theta)
    d = Eagle3Drafter(DrafterConfig.from_target(target, 100, [2, 3, 4]))
    assert d.config.rope_scaling is None
    pos = torch.arange(4096)[None]
    cos_ref, sin_ref = LlamaRotaryEmbedding(target)(torch.zeros(1), pos)
    cos, sin = d.rotary(pos, torch.float32)
    assert torch.equal(cos, cos_ref) and torch.equal(sin, sin_ref)
    q, k = torch.randn(1, 4, 4096, head_dim), torch.randn(1, 2, 4096, head_dim)
    for got, want in zip(ours(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos_ref, sin_ref)):
        assert torch.equal(got, want)


def test_the_training_modules_do_not_import_transformers():
    """Every Ray Train worker imports the training loop: transformers' Llama costs it ~3 s of CPU."""
    import subprocess
    import sys

    code = "import sys, eagle3_ray.train.loop; print(sorted(m for m in sys.modules if m.startswith('transformers')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _reference_forward(d: Eagle3Drafter, ids, hidden, pos):
    """SGLang llama_eagle3 math written out plainly: causal attention, explicit softmax."""
    cfg = d.config

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    m, a = d.midlayer, d.midlayer.self_attn
    x = torch.cat([rms(d.embed_tokens.weight[ids], m.input_layernorm.weight), rms(hidden, m.hidden_norm.weight)], -1)
    b, t, _ = x.shape
    q = (x @ a.q_proj.weight.T).view(b, t, 4, 16).transpose(1, 2)
    k = (x @ a.k_proj.weight.T).view(b, t, 2, 16).transpose(1, 2)
    v = (x @ a.v_proj.weight.T).view(b, t, 2, 16).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16))(x, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(16)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, 64) @ a.o_proj.weight.T
    h = hidden + attn
    z = rms(h, m.post_attention_layernorm.weight)
    mlp = (F.silu(z @ m.mlp.gate_proj.weight.T) * (z @ m.mlp.up_proj.weight.T)) @ m.mlp.down_proj.weight.T
    return h + mlp


def test_forward_matches_sglang_math(drafter):
    ids, hidden, pos = _inputs()
    with torch.no_grad():
        out = drafter(ids, hidden, pos)
        torch.testing.assert_close(out, _reference_forward(drafter, ids, hidden, pos), atol=1e-5, rtol=1e-5)
        logits = drafter.logits(out)
        expected = (out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-5) * drafter.norm.weight)
        torch.testing.assert_close(logits, expected @ drafter.lm_head.weight.T, atol=1e-5, rtol=1e-5)
    assert logits.shape == (2, 6, 100)


def test_fuse_is_fc(drafter):
    aux = torch.randn(2, 3, 192)
    torch.testing.assert_close(drafter.fuse(aux), aux @ drafter.fc.weight.T)


def test_cache_incremental_equals_full_forward(drafter):
    ids, hidden, pos = _inputs(t=7)
    with torch.no_grad():
        full = drafter(ids, hidden, pos)
        cache = DrafterKVCache()
        parts = [drafter(ids[:, :4], hidden[:, :4], pos[:, :4], cache=cache)]
        for j in range(4, 7):
            parts.append(drafter(ids[:, j : j + 1], hidden[:, j : j + 1], pos[:, j : j + 1], cache=cache))
    assert cache.length == 7 and cache.k.shape == (2, 2, 7, 16)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_cache_crop_discards_rejected_drafts(drafter):
    ids, hidden, pos = _inputs(t=6)
    other_ids, other_hidden, _ = _inputs(t=6, seed=7)
    with torch.no_grad():
        cache = DrafterKVCache()
        drafter(ids[:, :4], hidden[:, :4], pos[:, :4], cache=cache)
        drafter(other_ids[:, 4:], other_hidden[:, 4:], pos[:, 4:], cache=cache)  # drafts, then rejected
        cache.crop(4)
        assert cache.length == 4
        tail = drafter(ids[:, 4:], hidden[:, 4:], pos[:, 4:], cache=cache)
        full = drafter(ids, hidden, pos)
    torch.testing.assert_close(tail, full[:, 4:], atol=1e-5, rtol=1e-5)


def test_cache_select_keeps_an_accepted_tree_path(drafter):
    """A tree of drafts at positions 3,3,4 (two siblings, then a child of the second): keep 0-2 + path."""
    ids, hidden, pos = _inputs(b=1, t=3)
    tree_ids, tree_hidden, _ = _inputs(b=1, t=3, seed=3)
    tree_pos = torch.tensor([[3, 3, 4]])
    # Row j of the tree sees the prefix, itself and its ancestors: node 2 is a child of node 1.
    tree_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    with torch.no_grad():
        cache = DrafterKVCache()
        drafter(ids, hidden, pos, cache=cache)
        tree_out = drafter(tree_ids, tree_hidden, tree_pos, attention_mask=tree_mask[None, None], cache=cache)
        cache.select(torch.tensor([0, 1, 2, 4, 5]))
        nxt = drafter(ids[:, :1], hidden[:, :1], torch.tensor([[5]]), cache=cache)

        chain_ids = torch.cat([ids, tree_ids[:, 1:], ids[:, :1]], 1)
        chain_hidden = torch.cat([hidden, tree_hidden[:, 1:], hidden[:, :1]], 1)
        chain = drafter(chain_ids, chain_hidden, torch.arange(6)[None])
    torch.testing.assert_close(tree_out[:, 1:], chain[:, 3:5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nxt, chain[:, 5:], atol=1e-5, rtol=1e-5)

    per_row = DrafterKVCache()
    per_row.append(torch.arange(12.0).view(2, 1, 6, 1), torch.arange(12.0).view(2, 1, 6, 1))
    per_row.select(torch.tensor([[0, 2], [1, 5]]))
    assert per_row.k.flatten().tolist() == [0.0, 2.0, 7.0, 11.0]


def test_bind_embedding_shares_frozen_weight(drafter):
    emb = torch.nn.Embedding(512, 64)
    drafter.bind_embedding(emb)
    assert drafter.embed_tokens.weight.data_ptr() == emb.weight.data_ptr()
    ids, hidden, pos = _inputs()
    drafter.logits(drafter(ids, hidden, pos)).sum().backward()
    assert drafter.embed_tokens.weight.grad is None and drafter.fc.weight.grad is None
    assert drafter.midlayer.self_attn.q_proj.weight.grad is not None
    with pytest.raises(ConfigError, match=r"\(512, 64\)"):
        drafter.bind_embedding(torch.zeros(500, 64))


def test_vocab_map_and_draft_to_target(drafter):
    target_ids = torch.tensor(sorted(torch.randperm(512)[:100].tolist()))
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[target_ids] = True
    drafter.set_vocab_map(target_ids - torch.arange(100), t2d)
    draft = torch.tensor([[0, 5, 99]])
    assert drafter.draft_to_target(draft).tolist() == [target_ids[[0, 5, 99]].tolist()]
    with pytest.raises(ConfigError, match="draft_vocab_size=100"):
        drafter.set_vocab_map(torch.zeros(90, dtype=torch.int64), t2d)


def test_lm_head_init_from_target_reads_a_state_as_the_target_does(drafter):
    """train.lm_head_init=target: row i is the target's row of token i + d2t[i], so over the draft
    vocabulary the drafter's head ranks a (normed) state's tokens exactly as the target's head does."""
    target_ids = torch.tensor(sorted(torch.randperm(512, generator=torch.Generator().manual_seed(3))[:100].tolist()))
    t2d = torch.zeros(512, dtype=torch.bool)
    t2d[target_ids] = True
    drafter.set_vocab_map(target_ids - torch.arange(100), t2d)
    head = torch.randn(512, 64, generator=torch.Generator().manual_seed(4))
    drafter.init_lm_head_from_target(head)
    assert torch.equal(drafter.lm_head.weight, head[target_ids])
    with torch.no_grad():
        drafter.norm.weight.fill_(1.0)
    h = torch.randn(7, 64)
    draft_best = drafter.draft_to_target(drafter.logits(h).argmax(-1))
    target_logits = h @ head.T
    target_logits[:, ~t2d] = float("-inf")
    assert torch.equal(draft_best, target_logits.argmax(-1))
    with pytest.raises(ConfigError, match="lm_head_init=random"):
        drafter.init_lm_head_from_target(torch.randn(512, 32))


def test_bf16_cast_keeps_buffers_and_rope_exact(drafter):
    d = drafter.to(torch.bfloat16)
    assert d.d2t.dtype == torch.int64 and d.t2d.dtype == torch.bool and d.rotary.inv_freq.dtype == torch.float32
    ids, hidden, pos = _inputs()
    assert d(ids, hidden.bfloat16(), pos).dtype == torch.bfloat16


def test_only_decoding_caches_run_attention_without_cudnn(drafter):
    """cuDNN re-plans per shape, so decoding (key length grows every call) runs without it; the TTT
    unroll's cache sees the same shapes every step and keeps torch's choice: without cuDNN its masked
    GQA attention fell back to the math kernel (8B-shaped step 18.9K -> 7.2K tokens/s on an H200).
    The backend flags are process-wide, so a CUDA device object shows the choice on any build."""
    from eagle3_ray.drafter.model import attention_backends
    from eagle3_ray.decode.chain import Eagle3Proposer

    cuda = torch.device("cuda")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(DrafterKVCache(growing=True), cuda):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    for cache in (DrafterKVCache(), None):  # the TTT unroll's cache; an uncached forward
        with attention_backends(cache, cuda):
            assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(DrafterKVCache(growing=True), torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()  # nothing to change off CUDA
    assert Eagle3Proposer(drafter).cache.growing  # speculative decoding's drafter cache
