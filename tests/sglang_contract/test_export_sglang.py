"""Export vs the installed SGLang's source: its capture rule and its EAGLE-3 draft loader (one version per run).

Moved from tests/test_export.py, where they skipped without SGLang; here they run against every
supported version (tests/test_sglang_versions.py).
"""

from __future__ import annotations

import ast
from types import SimpleNamespace
from typing import Iterable, List, Optional, Tuple

import pytest
import torch
from safetensors.torch import load_file

from conftest import source_root
from eagle3_ray.drafter import DrafterConfig, Eagle3Drafter, export_drafter, save_drafter_weights
from eagle3_ray.engines.aux_layers import translate_aux_ids

H, HT, VOCAB, DRAFT = 32, 32, 96, 48


@pytest.fixture()
def trained(tmp_path):
    """A drafter with non-trivial weights and vocab map, saved as a training checkpoint."""
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        vocab_size=VOCAB, draft_vocab_size=DRAFT, target_hidden_size=HT, aux_layers=[2, 12, 21],
        target_model_type="llama", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512,
    )
    d = Eagle3Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.requires_grad:
                p.normal_(0, 0.3)
    ids = torch.randperm(VOCAB)[:DRAFT].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    d.set_vocab_map(ids - torch.arange(DRAFT), t2d)
    d.bind_embedding(torch.nn.Embedding(VOCAB, H))
    return d, None, save_drafter_weights(d, tmp_path / "ckpt")


def _sglang_capture_fn(file: str):
    """``set_eagle3_layers_to_capture`` compiled from the installed SGLang source file (not imported:
    SGLang's package import needs CUDA-only dependencies)."""
    path = source_root() / "srt" / "models" / file
    tree = ast.parse(path.read_text())
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "set_eagle3_layers_to_capture")
    namespace = {"Optional": Optional, "List": List}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["set_eagle3_layers_to_capture"]


class FakeSGLangTarget:
    """Stands in for an SGLang target model (needs CUDA to build) so its capture rule can run."""

    def __init__(self, num_layers: int):
        self.pp_group = SimpleNamespace(is_last_rank=True)
        self.config = SimpleNamespace(num_hidden_layers=num_layers)
        self.model = SimpleNamespace(layers_to_capture=None)


@pytest.mark.parametrize(
    "file, model_type, hf",
    [
        ("llama.py", "llama", [2, 12, 21]),
        ("llama.py", "llama", [1, 2, 3]),
        ("qwen2.py", "qwen2", [2, 14, 25]),
        ("qwen3.py", "qwen3", [4, 18, 33]),
        ("deepseek_v2.py", "deepseek_v3", [2, 30, 58]),
        ("deepseek_v2.py", "kimi_k2", [3, 30, 58]),
    ],
)
def test_real_sglang_capture_rule_reads_back_hf_indices(file, model_type, hf):
    """Layers SGLang captures = layers_to_capture = HF hidden_states indices (input of that layer)."""
    target = FakeSGLangTarget(num_layers=61)
    _sglang_capture_fn(file)(target, translate_aux_ids(hf, model_type, "sglang"))
    assert target.model.layers_to_capture == hf


def test_real_sglang_loader_consumes_every_exported_key(trained, tmp_path):
    """Run SGLang's LlamaForCausalLMEagle3.load_weights source over our file: no key is dropped."""
    path = source_root() / "srt" / "models" / "llama_eagle3.py"
    cls = next(
        n for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "LlamaForCausalLMEagle3"
    )
    fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    loaded: dict[str, list] = {}

    def default_weight_loader(param, weight, shard=None):
        loaded.setdefault(param, []).append((shard, tuple(weight.shape)))

    namespace = {"torch": torch, "Iterable": Iterable, "Tuple": Tuple, "default_weight_loader": default_weight_loader}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), namespace)

    class FakeSGLangEagle3:
        """SGLang's draft module names (model.layers.0.*, fused qkv/gate_up); building it needs CUDA."""

        def named_parameters(self):
            layer = "model.layers.0."
            names = ["model.fc.weight", "model.norm.weight", "lm_head.weight", "model.embed_tokens.weight"] + [
                layer + n for n in (
                    "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                    "mlp.down_proj.weight", "input_layernorm.weight", "hidden_norm.weight",
                    "post_attention_layernorm.weight",
                )
            ]
            return [(n, n) for n in names]  # the "parameter" is its name: the recorder keys on it

    out = export_drafter(trained[2], tmp_path / "export", "sglang")
    fake = FakeSGLangEagle3()
    namespace["load_weights"](fake, load_file(str(out / "model.safetensors")).items())
    shards = {k: sorted(str(s) for s, _ in v) for k, v in loaded.items()}
    assert shards == {
        "model.fc.weight": ["None"], "model.norm.weight": ["None"], "lm_head.weight": ["None"],
        "model.layers.0.self_attn.qkv_proj.weight": ["k", "q", "v"],
        "model.layers.0.self_attn.o_proj.weight": ["None"],
        "model.layers.0.mlp.gate_up_proj.weight": ["0", "1"],
        "model.layers.0.mlp.down_proj.weight": ["None"],
        "model.layers.0.input_layernorm.weight": ["None"],
        "model.layers.0.hidden_norm.weight": ["None"],
        "model.layers.0.post_attention_layernorm.weight": ["None"],
    }
    assert torch.equal(fake.hot_token_id, trained[0].draft_to_target(torch.arange(DRAFT)))
