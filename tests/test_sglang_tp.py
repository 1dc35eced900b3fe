"""The tensor-parallel guard of the SGLang layer-hook capture (eagle3_ray/engines/sglang_tp.py), on CPU.

SGLang is not installed in this environment: the ServerArgs field sets are given as the engine's
``fields`` argument, and the one SGLang source tree below is a FAKE (named as such) holding only the
file the guard probes. tests/sglang_contract/test_tp_reduced.py runs the guard against the real
source of each supported version.
"""

from __future__ import annotations

import importlib

import pytest

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.sglang_args import AUX_FLAG, engine_kwargs
from eagle3_ray.engines.base import EngineInfo
from eagle3_ray.engines.sglang_tp import TP_REFUSED, layer_hook_tp_kwargs, sglang_defers_layer_sums
from eagle3_ray.errors import ConfigError

# The 0.5.17-like fields the guard reads: FlashInfer fusion and its off switch.
FIELDS = frozenset({"flashinfer_allreduce_fusion_backend", "enforce_disable_flashinfer_allreduce_fusion",
                    "moe_a2a_backend", "enable_attn_tp_input_scattered"})
DEEPSEEK = EngineInfo(model_type="deepseek_v3", num_layers=61, hidden_size=7168, vocab_size=163840,
                      aux_layers=[2, 30, 58], dtype="bfloat16", fingerprint="x")


@pytest.fixture(autouse=True)
def _no_mega_moe(monkeypatch):
    monkeypatch.delenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", raising=False)


def test_tp_1_needs_nothing():
    assert layer_hook_tp_kwargs(1, {"moe_a2a_backend": "deepep"}, FIELDS) == {}


def test_tp_forces_the_fusion_off_switch_where_sglang_has_it():
    assert not sglang_defers_layer_sums()  # no SGLang installed here
    assert layer_hook_tp_kwargs(8, {}, FIELDS) == {"enforce_disable_flashinfer_allreduce_fusion": True}
    assert layer_hook_tp_kwargs(8, {}, frozenset()) == {}  # an SGLang without the fusion
    assert layer_hook_tp_kwargs(8, {"moe_a2a_backend": "none", "max_running_requests": 8}, FIELDS) == {
        "enforce_disable_flashinfer_allreduce_fusion": True}


def test_a_fusion_that_cannot_be_switched_off_is_refused():
    with pytest.raises(ConfigError, match="no enforce_disable_flashinfer_allreduce_fusion.*target.tp_size=1"):
        layer_hook_tp_kwargs(2, {}, frozenset({"enable_flashinfer_allreduce_fusion"}))


@pytest.mark.parametrize("key, value, words", [
    ("moe_a2a_backend", "deepep", "own slice of the rows"),
    ("enable_attn_tp_input_scattered", True, "unreduced partial sum"),
    ("flashinfer_allreduce_fusion_backend", "trtllm", "unreduced partial sum"),
    ("enforce_disable_flashinfer_allreduce_fusion", False, "FlashInfer all-reduce fusion by itself"),
    ("enable_prefill_cp", True, "context parallelism"),
])
def test_a_setting_that_breaks_the_hooked_rows_is_refused_with_the_fix(key, value, words):
    with pytest.raises(ConfigError) as e:
        layer_hook_tp_kwargs(8, {key: value}, FIELDS)
    msg = str(e.value)
    want = TP_REFUSED[key][0] if key in TP_REFUSED else True
    assert f"extra_engine_kwargs.{key}={value!r}" in msg and "target.tp_size=8" in msg and words in msg
    assert msg.endswith(f"remove it or set {key}={want!r}"), msg


def test_the_environment_switch_to_all_to_all_moe_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", "True")
    with pytest.raises(ConfigError, match="SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE='True'.*megamoe.*unset it"):
        layer_hook_tp_kwargs(8, {}, FIELDS)
    monkeypatch.setenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", "0")
    assert layer_hook_tp_kwargs(8, {}, FIELDS)


def test_sglang_whose_layers_owe_their_sums_is_refused(tmp_path, monkeypatch):
    """A FAKE SGLang tree: only the file (layer_boundary/output.py) the guard looks for."""
    owed = tmp_path / "sglang" / "srt" / "layers" / "layer_boundary"
    owed.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (owed / "output.py").write_text("class UnreducedOutput:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert sglang_defers_layer_sums()
    with pytest.raises(ConfigError, match="partial sums.*sglang==0.5.23.*target.tp_size=1"):
        layer_hook_tp_kwargs(2, {}, FIELDS)
    assert layer_hook_tp_kwargs(1, {}, FIELDS) == {}


def test_engine_kwargs_apply_the_guard_on_the_layer_hook_path_only(tmp_path, tiny_llama_config):
    tiny_llama_config.save_pretrained(tmp_path / "m")

    def kwargs(fields, **sglang):
        target = TargetConfig(model=str(tmp_path / "m"), backend="sglang", tp_size=8, aux_layers=[2, 30, 58],
                              sglang=sglang)
        return engine_kwargs(target, "capture", info=DEEPSEEK, capture_dir=tmp_path, fields=fields)

    assert kwargs(FIELDS)["enforce_disable_flashinfer_allreduce_fusion"] is True
    aux = kwargs(FIELDS | {AUX_FLAG})  # SGLang's own aux capture completes each sum first
    assert "enforce_disable_flashinfer_allreduce_fusion" not in aux and aux[AUX_FLAG] is True
    with pytest.raises(ConfigError, match="extra_engine_kwargs.moe_a2a_backend='deepep'"):
        kwargs(FIELDS, extra_engine_kwargs={"moe_a2a_backend": "deepep"})
