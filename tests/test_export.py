"""Export: the exact SGLang/vLLM directory, aux-id translation, and loading back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_ray.drafter import (
    DrafterConfig,
    Eagle3Drafter,
    export_drafter,
    init_drafter_from,
    load_drafter,
    load_drafter_weights,
    save_drafter_weights,
)
from eagle3_ray.engines.aux_layers import aux_ids_to_hf_indices, translate_aux_ids
from eagle3_ray.errors import CheckpointError, ConfigError

# docs/contracts.md "Export directory", written out rather than imported so a drift fails here.
EXPORTED_KEYS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
}
H, HT, VOCAB, DRAFT = 32, 32, 96, 48


def _config(**changes) -> DrafterConfig:
    fields = dict(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=VOCAB, draft_vocab_size=DRAFT, target_hidden_size=HT, aux_layers=[2, 12, 21],
        target_model_type="llama", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512,
    )
    return DrafterConfig(**{**fields, **changes})


@pytest.fixture()
def trained(tmp_path):
    """A drafter with non-trivial weights and vocab map, saved as a training checkpoint."""
    torch.manual_seed(0)
    d = Eagle3Drafter(_config())
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    ids = torch.randperm(VOCAB)[:DRAFT].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DRAFT), t2d)
    embedding = torch.nn.Embedding(VOCAB, H)
    d.bind_embedding(embedding)
    ckpt = save_drafter_weights(d, tmp_path / "ckpt")
    return d, embedding, ckpt


def _outputs(d: Eagle3Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 7), generator=g)
    aux = torch.randn(2, 7, 3 * HT, generator=g)
    with torch.no_grad():
        h = d(ids, d.fuse(aux), torch.arange(7).expand(2, 7))
        return h, d.logits(h)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_exported_directory_is_exact(trained, tmp_path, engine):
    d, _, ckpt = trained
    out = export_drafter(ckpt, tmp_path / "export", engine)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == EXPORTED_KEYS
    for k, v in tensors.items():
        assert v.shape == d.state_dict()[k].shape, k
        assert v.dtype == {"d2t": torch.int64, "t2d": torch.bool}.get(k, torch.bfloat16), k
    assert torch.equal(tensors["d2t"], d.d2t) and torch.equal(tensors["t2d"], d.t2d)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["torch_dtype"] == "bfloat16" and cfg["hidden_act"] == "silu"
    expected = {
        "hidden_size": H, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "max_position_embeddings": 512, "rope_theta": 50000.0, "rope_scaling": None,
        "rms_norm_eps": 1e-5, "vocab_size": VOCAB, "draft_vocab_size": DRAFT, "target_hidden_size": HT,
    }
    assert {k: cfg[k] for k in expected} == expected
    ids = [1, 11, 20] if engine == "sglang" else [2, 12, 21]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
    assert cfg["eagle3_ray"] == {
        "aux_hidden_state_indices": [2, 12, 21], "target_model_type": "llama",
        "serving_engine": engine, "format_version": 1,
    }
    # vLLM reads the ids from the config's top level; SGLang from eagle_config.
    assert cfg.get("eagle_aux_hidden_state_layer_ids") == (ids if engine == "vllm" else None)


@pytest.mark.parametrize(
    "model_type, engine, hf, ids",
    [
        ("llama", "sglang", [2, 12, 21], [1, 11, 20]),
        ("llama", "sglang", [1, 5, 9], [0, 4, 8]),
        ("qwen2", "sglang", [2, 14, 25], [1, 13, 24]),
        ("qwen3", "sglang", [3, 18, 33], [2, 17, 32]),
        ("deepseek_v3", "sglang", [2, 30, 58], [2, 30, 58]),
        ("kimi_k25", "sglang", [2, 30, 58], [2, 30, 58]),
        ("llama", "vllm", [2, 12, 21], [2, 12, 21]),
        ("deepseek_v3", "vllm", [1, 30, 58], [1, 30, 58]),
    ],
)
def test_aux_id_translation_table(model_type, engine, hf, ids):
    assert translate_aux_ids(hf, model_type, engine) == ids
    assert aux_ids_to_hf_indices(ids, model_type, engine) == hf


def test_aux_ids_sglang_cannot_express_are_refused():
    with pytest.raises(ConfigError, match="first index >= 2"):
        translate_aux_ids([1, 30, 58], "deepseek_v3", "sglang")
    with pytest.raises(ConfigError, match="SGLANG_AUX_RULES"):
        translate_aux_ids([2, 3, 4], "some_new_arch", "sglang")
    assert translate_aux_ids([2, 3, 4], "some_new_arch", "vllm") == [2, 3, 4]


def test_checkpoint_round_trip_is_exact(trained):
    d, embedding, ckpt = trained
    cfg, state = load_drafter_weights(ckpt)
    assert cfg == d.config and set(state) == EXPORTED_KEYS
    loaded = load_drafter(ckpt, embedding)
    for a, b in zip(_outputs(d), _outputs(loaded)):
        assert torch.equal(a, b)


def test_export_round_trip_gives_identical_outputs(trained, tmp_path):
    d, embedding, ckpt = trained
    out = export_drafter(ckpt, tmp_path / "export", "sglang")
    loaded = load_drafter(out, embedding)
    assert loaded.config == d.config
    with torch.no_grad():  # the export stores bf16: compare with the bf16-rounded original
        for p in d.parameters():
            if p.requires_grad:
                p.copy_(p.bfloat16().float())
    for a, b in zip(_outputs(d), _outputs(loaded)):
        assert torch.equal(a, b)


def test_foreign_export_needs_engine_and_model_type(trained, tmp_path):
    out = export_drafter(trained[2], tmp_path / "export", "sglang")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["eagle3_ray"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="engine and target model type"):
        load_drafter(out)
    assert load_drafter(out, engine="sglang", target_model_type="llama").config.aux_layers == [2, 12, 21]


def test_refuses_missing_extra_and_misshapen_tensors(trained, tmp_path):
    out = export_drafter(trained[2], tmp_path / "export", "vllm")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    del tensors["midlayer.hidden_norm.weight"]
    tensors["fc.weight"] = torch.zeros(H, 2 * HT, dtype=torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        load_drafter(out)
    msg = str(err.value)
    assert "midlayer.extra.weight" in msg and "midlayer.hidden_norm.weight" in msg
    assert "fc.weight: (32, 64) != expected (32, 96)" in msg


def test_init_from_refuses_another_config_naming_fields(trained, tmp_path):
    out = export_drafter(trained[2], tmp_path / "export", "sglang")
    state = init_drafter_from(out, _config())
    assert set(state) == EXPORTED_KEYS
    Eagle3Drafter(_config()).load_state_dict(state, strict=False)
    with pytest.raises(CheckpointError) as err:
        init_drafter_from(out, _config(intermediate_size=128, aux_layers=[2, 12, 20]))
    msg = str(err.value)
    assert "intermediate_size: drafter has 64, run config has 128" in msg
    assert "aux_layers: drafter has [2, 12, 21], run config has [2, 12, 20]" in msg
    assert "num_attention_heads" not in msg


def test_refused_layer_set_writes_nothing(tmp_path):
    d = Eagle3Drafter(_config(target_model_type="deepseek_v3", aux_layers=[1, 30, 58]))
    ckpt = save_drafter_weights(d, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="deepseek_v3"):
        export_drafter(ckpt, tmp_path / "export", "sglang")
    assert not (tmp_path / "export").exists()
    assert (export_drafter(ckpt, tmp_path / "export", "vllm") / "model.safetensors").is_file()


def test_missing_directory_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="neither"):
        load_drafter(tmp_path)
