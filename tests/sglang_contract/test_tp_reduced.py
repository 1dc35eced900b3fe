"""Under tensor parallelism every captured aux state is the reduced, whole residual stream (see conftest.py:
run once per version).

SGLang 0.5.17 (no ``enable_return_aux_hidden_states``): the engine hooks decoder layers and reads what
they return. A layer returns a TP partial sum when its MLP all-reduce is fused into the next layer or
reduce-scattered there, and a slice of the rows under all-to-all MoE, data-parallel dense layers or
prefill context parallelism (``eagle3_ray/engines/sglang_tp.py``). These tests pin each of those
conditions in the installed source (the names every deciding function reads: a new condition changes
them and fails here), every place SGLang turns one on by itself, and that the kwargs of a TP-8
Kimi-K2.5 capture (configs/kimi-k2.5.yaml) exclude each one; the FlashInfer fusion SGLang enables for
Kimi on Hopper is run through SGLang's own resolution passes and fusion gate, compiled from its source.

SGLang 0.5.23: every layer's output owes its all-reduce by construction under TP
(``layers/layer_boundary``), so the layer hooks cannot serve it and the engine refuses them there; the
engine reads SGLang's own aux states instead, which are captured only after the sum is completed
(pinned below). What runs needs no GPU: the hardware probes that would need one are set by hand and
named where they are.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
from enum import Enum, auto
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import sglang.srt.server_args as server_args

from eagle3_ray.config import load_config
from eagle3_ray.engines.sglang_args import AUX_FLAG, check_server_args, engine_kwargs, server_args_fields
from eagle3_ray.engines import sglang_tp as tp
from eagle3_ray.engines.base import EngineInfo
from eagle3_ray.errors import ConfigError

from conftest import compile_sglang_def, source_root

SRT = source_root() / "srt"
REPO = Path(__file__).resolve().parents[2]
FIELDS = server_args_fields()
HAS_AUX_FLAG = AUX_FLAG in FIELDS
# SGLang whose layers hand their output on with the TP sum owed (0.5.23) vs LayerCommunicator (0.5.17).
LAYER_BOUNDARY = (SRT / "layers/layer_boundary/output.py").is_file()
ACCESSORS = {"get_exec", "get_parallel", "get_flags", "get_spec", "get_forward", "get_server_args"}


# --- reading SGLang's source ----------------------------------------------------------------------


def _def(rel: str, qualname: str) -> ast.FunctionDef | ast.ClassDef:
    node: Any = ast.parse((SRT / rel).read_text(encoding="utf-8"))
    for part in qualname.split("."):
        found = [n for n in node.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part]
        assert found, f"{qualname} is gone from sglang/srt/{rel}"
        node = found[0]
    return node


def _reads(fn: ast.FunctionDef) -> set[str]:
    """What a function's body decides on: the globals it reads, and the attribute chains it reads
    off ``self`` or a runtime-config accessor (``get_exec().comm.x``)."""
    local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    nodes = [n for stmt in fn.body for n in ast.walk(stmt)]
    local |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    inner = {id(n.value) for n in nodes if isinstance(n, ast.Attribute)}
    out = set()
    for n in nodes:
        if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local
                and n.id not in ACCESSORS and not hasattr(builtins, n.id)):
            out.add(n.id)
        if isinstance(n, ast.Attribute) and id(n) not in inner:
            root = n
            while isinstance(root, ast.Attribute):
                root = root.value
            if (isinstance(root, ast.Name) and root.id == "self") or (
                    isinstance(root, ast.Call) and ast.unparse(root.func) in ACCESSORS):
                out.add(ast.unparse(n))
    return out


def _calls(fn: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == name]


def _compile(node: ast.AST, namespace: dict[str, Any]):
    """One of SGLang's definitions compiled into ``namespace``, decorators other than staticmethod dropped."""
    return compile_sglang_def(node, namespace, keep_decorators={"staticmethod"})


# --- the Kimi-K2.5 preset -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi(tmp_path_factory, tiny_llama_config):
    """configs/kimi-k2.5.yaml's target (TP 8) on a local config directory (the preset's /models path is
    not here), and the EngineInfo describe_target gives a Kimi-K2.5 checkpoint: transformers' text
    config of KimiK25 is a DeepSeek-V3 one, 61 layers, H 7168."""
    d = tmp_path_factory.mktemp("kimi-config")
    tiny_llama_config.save_pretrained(d)
    cfg = load_config(REPO / "configs" / "kimi-k2.5.yaml")
    assert cfg.target.tp_size == 8
    target = cfg.target.model_copy(update={"model": str(d)})
    info = EngineInfo(model_type="deepseek_v3", num_layers=61, hidden_size=7168, vocab_size=163840,
                      aux_layers=list(cfg.target.aux_layers), dtype="bfloat16", fingerprint="kimi",
                      architectures=("KimiK25ForConditionalGeneration",))
    return target, info


def _kimi_kwargs(kimi, tmp_path, fields=FIELDS, **extra):
    target, info = kimi
    if extra:
        sglang = target.sglang.model_copy(update={"extra_engine_kwargs": {**target.sglang.extra_engine_kwargs,
                                                                          **extra}})
        target = target.model_copy(update={"sglang": sglang})
    return engine_kwargs(target, "capture", info=info, capture_dir=tmp_path, fields=fields)


def _defaults() -> dict[str, Any]:
    if hasattr(server_args.ServerArgs, "__struct_fields__"):  # 0.5.23: built without resolving
        args = server_args.ServerArgs(model_path="x")
        return {f: getattr(args, f) for f in server_args.ServerArgs.__struct_fields__}
    out = {}
    for f in dataclasses.fields(server_args.ServerArgs):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


# --- 0.5.17: the conditions, pinned ---------------------------------------------------------------

# Each function that decides whether a layer of LAYER_HOOK_MODELS returns a partial sum or a slice of
# the rows, with everything it reads. What each read turns on (sglang_tp.py): the FlashInfer fusion
# (flashinfer_allreduce_fusion_backend), aiter's (enable_aiter_allreduce_fusion, ROCm),
# input-scattered attention (enable_attn_tp_input_scattered), an all-to-all MoE backend
# (moe_a2a_backend), DWDP (dwdp_size), data-parallel dense layers (moe_dense_tp_size=1), prefill CP
# (the *_prefill_cp / attn_cp_size), attention DP (refused for every capture).
COMMUNICATOR_READS_0517 = {
    ("layers/communicator.py", "LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer"): {
        "ScatterMode", "_use_aiter", "apply_flashinfer_allreduce_fusion", "get_attn_tp_context",
        "get_exec().comm.enable_aiter_allreduce_fusion", "get_moe_a2a_backend", "get_parallel().tp_size",
        "is_dp_attention_enabled", "is_enable_moe_cp_allgather", "self._context.tp_size", "self._speculative_algo",
        "self._speculative_algo.is_eagle", "self.is_last_layer", "self.layer_scatter_modes.mlp_mode"},
    ("layers/communicator.py", "apply_flashinfer_allreduce_fusion"): {
        "FUSE_ALLREDUCE_MAX_BATCH_SIZE", "_is_flashinfer_available", "_is_sm100_supported", "_is_sm90_supported",
        "get_exec().comm.flashinfer_allreduce_fusion_backend", "is_dp_attention_enabled",
        "is_flashinfer_allreduce_unavailable"},
    ("layers/communicator.py", "LayerCommunicator.should_use_reduce_scatter"): {
        "CommunicateSummableTensorPairFn", "dsa_use_prefill_cp", "get_attn_tp_context", "mla_use_prefill_cp",
        "self._communicate_summable_tensor_pair_fn", "self.allow_reduce_scatter", "self.is_last_layer",
        "should_use_dp_reduce_scatterv"},
    ("layers/communicator.py", "LayerScatterModes._compute_mlp_mode"): {
        "ScatterMode", "enable_dwdp", "enable_moe_dense_fully_dp", "get_moe_a2a_backend", "is_dsa_enable_prefill_cp",
        "is_enable_moe_cp_allgather", "is_mla_prefill_cp_enabled", "should_use_flashinfer_cutlass_moe_fp4_allgather"},
    ("layers/communicator.py", "ScatterMode.model_input_output"): {
        "ScatterMode", "is_dsa_enable_prefill_cp", "is_mla_prefill_cp_enabled"},
    ("layers/communicator.py", "AttnTpContext.init_context"): {
        "Backend", "Phase", "_is_cuda", "_is_npu", "check_cuda_graph_backend", "enable_moe_dense_fully_dp",
        "get_moe_a2a_backend", "get_parallel().enable_attn_tp_input_scattered", "get_parallel().tp_size",
        "get_spec().speculative_algorithm", "is_dp_attention_enabled", "logging", "self.allow_input_scattered",
        "self.is_dsa"},
    ("layers/moe/utils.py", "should_skip_post_experts_all_reduce"): {
        "get_moe_a2a_backend", "get_parallel().dwdp_size", "should_skip_mlp_all_reduce",
        "should_use_dp_reduce_scatterv", "should_use_flashinfer_cutlass_moe_fp4_allgather"},
    # Llama's and Qwen2's all-reduces: skipped only on skip_all_reduce or the published flags.
    ("layers/linear.py", "RowParallelLinear.forward"): {
        "get_exec().comm.enable_quant_communications", "get_parallel().attn_tp_group",
        "get_parallel().attn_tp_group.all_reduce", "get_tp_group", "is_allocation_symmetric", "self.bias",
        "self.input_is_parallel", "self.quant_method", "self.quant_method.apply", "self.reduce_results",
        "self.skip_bias_add", "self.tp_rank", "self.tp_size", "self.use_decode_attn_tp", "self.use_dp_attention_reduce",
        "should_skip_mlp_all_reduce", "split_tensor_along_last_dim", "tensor_model_parallel_all_reduce",
        "tensor_model_parallel_quant_all_reduce", "use_symmetric_memory"},
}

# 0.5.23: what decides that a layer's FFN output leaves its all-reduce to the next layer.
DEFERRAL_READS_0523 = {
    ("layers/layer_boundary/exit.py", "exit_facts"): {
        "BatchVariant", "ExitFacts", "StageKind", "SumGroup", "_fused_consumer_sum", "_sum_deferral_allowed",
        "get_parallel().tp_size", "is_dp_attention_enabled", "post_experts_sum_is_one_all_reduce",
        "should_use_dp_reduce_scatterv"},
    ("layers/layer_boundary/exit.py", "_batch_allows_deferred_sum"): {
        "_ffn_has_tokens", "aiter_ar_fusion_applies", "flashinfer_ar_fusion_applies"},
    ("layers/layer_boundary/exit.py", "_sum_deferral_allowed"): {
        "can_merge_post_experts_all_reduce", "is_dp_attention_enabled", "is_enable_moe_cp_allgather"},
    ("layers/moe/utils.py", "post_experts_sum_is_one_all_reduce"): {
        "envs", "get_exec().comm.enable_quant_communications", "get_lora", "get_moe_a2a_backend",
        "post_experts_output_is_complete", "post_experts_reduction_group"},
}

LAYER_FILES = {"llama": "models/llama.py", "qwen2": "models/qwen2.py", "qwen3": "models/qwen3.py",
               "deepseek_v2": "models/deepseek_v2.py"}  # deepseek_v3 and kimi_k2 run deepseek_v2.py's layers


def test_every_condition_for_a_partial_or_sliced_layer_output_is_pinned():
    """A changed condition (a new switch read, a new model publishing the skip flags) fails here:
    review what it turns on, then extend sglang_tp.py and these lists together."""
    if LAYER_BOUNDARY:
        for (rel, name), want in DEFERRAL_READS_0523.items():
            assert _reads(_def(rel, name)) == want, (rel, name, _reads(_def(rel, name)) ^ want)
        # Under TP an output whose sum is one all-reduce defers it whatever the fusion settings:
        # _batch_allows_deferred_sum admits it before asking any fused kernel.
        body = _def("layers/layer_boundary/exit.py", "_batch_allows_deferred_sum").body
        ifs = [s for s in body if isinstance(s, ast.If)]
        assert [ast.unparse(s) for s in ifs[:2]] == ["if not _ffn_has_tokens(forward_batch):\n    return False",
                                                   "if facts.single_sum:\n    return True"], [ast.unparse(s) for s in ifs]
        decide = ast.unparse(_def("layers/layer_boundary/exit.py", "ExitPolicy._decide"))
        assert "partial(UnreducedOutput" in decide and "_defers_sum(" in decide
        # ... and the decoder layers hand that owed output on instead of (hidden_states, residual).
        for rel, layer, ret in [("models/llama.py", "LlamaDecoderLayer", "self.ffn_boundary.finish(hidden_states, forward_batch)"),
                                ("models/deepseek_v2.py", "DeepseekV2DecoderLayer", "(hidden_states, topk_indices)")]:
            returns = [n for n in ast.walk(_def(rel, f"{layer}.forward")) if isinstance(n, ast.Return)]
            assert ast.unparse(returns[-1].value) == ret, layer
        return
    for (rel, name), want in COMMUNICATOR_READS_0517.items():
        got = _reads(_def(rel, name))
        assert got == want, (rel, name, got ^ want)
    skip_flags = ast.unparse(_def("layers/moe/utils.py", "should_skip_mlp_all_reduce"))
    assert "return f.fuse_mlp_allreduce or f.mlp_reduce_scatter" in skip_flags
    # Which layers publish those flags or mark their output for the next layer's fused all-reduce:
    # DeepSeek's alone among LAYER_HOOK_MODELS (Qwen3's LayerCommunicator neither fuses nor scatters).
    markers = ("_sglang_needs_allreduce_fusion", "fuse_mlp_allreduce", "mlp_reduce_scatter",
               "should_fuse_mlp_allreduce_with_next_layer", "should_use_reduce_scatter", "allow_reduce_scatter",
               "skip_all_reduce=True")
    used = {m: sorted(k for k, rel in LAYER_FILES.items() if m in (SRT / rel).read_text(encoding="utf-8"))
            for m in markers}
    assert used == {m: ["deepseek_v2"] for m in markers[:-1]} | {"skip_all_reduce=True": []}, used
    # In DeepSeek's layer: a fused layer marks its MLP output and skips postprocess_layer (the reduce);
    # the flags the MLP skips its own all-reduce on are the same two decisions.
    forward = _def("models/deepseek_v2.py", "DeepseekV2DecoderLayer.forward")
    assigns = {ast.unparse(s.targets[0]): ast.unparse(s.value) for s in ast.walk(forward) if isinstance(s, ast.Assign)}
    assert assigns["fuse_mlp_allreduce"] == "self.layer_communicator.should_fuse_mlp_allreduce_with_next_layer(forward_batch)"
    assert assigns["mlp_reduce_scatter"] == "self.layer_communicator.should_use_reduce_scatter(forward_batch)"
    assert assigns["hidden_states._sglang_needs_allreduce_fusion"] == "True"
    scoped = _calls(forward, "get_forward().scoped")
    assert [sorted(k.arg for k in c.keywords) for c in scoped] == [["fuse_mlp_allreduce", "mlp_reduce_scatter"]]
    guarded = [s for s in ast.walk(forward) if isinstance(s, ast.If) and _calls(s, "self.layer_communicator.postprocess_layer")]
    assert [ast.unparse(s.test) for s in guarded] == ["not fuse_mlp_allreduce"], [ast.unparse(s.test) for s in guarded]


# Every writer of a guarded setting in 0.5.17's ServerArgs resolution that can set an unsafe value,
# with what triggers it: SGLang's own FlashInfer auto-enable (forced off by the last writer,
# _enforce_disable_allreduce_fusion), else a setting or variable sglang_tp refuses.
WRITERS_0517 = {
    ("arg_groups/overrides.py", "_flashinfer_allreduce_fusion_auto_enable", "flashinfer_allreduce_fusion_backend"):
        "enforce_disable_flashinfer_allreduce_fusion",
    ("server_args.py", "_handle_deprecated_args", "flashinfer_allreduce_fusion_backend"):
        "enable_flashinfer_allreduce_fusion",
    ("arg_groups/overrides.py", "_a2a_backend_overrides", "moe_a2a_backend"): "enable_waterfill",
    ("arg_groups/overrides.py", "_deepseek_family_overrides", "moe_a2a_backend"): "enable_prefill_cp",
    ("arg_groups/overrides.py", "_deepseek_family_overrides", "moe_dense_tp_size"): "enable_prefill_cp",
    ("arg_groups/overrides.py", "_deepseek_family_overrides", "attn_cp_size"): "enable_prefill_cp",
    ("arg_groups/deepseek_v4_hook.py", "validate_deepseek_v4_cp", "moe_dense_tp_size"): "enable_prefill_cp",
    ("arg_groups/deepseek_v4_hook.py", "validate_deepseek_v4_cp", "attn_cp_size"): "enable_prefill_cp",
    ("arg_groups/deepseek_v4_hook.py", "validate_deepseek_v4_cp", "enable_dsa_prefill_context_parallel"):
        "enable_prefill_cp",
    ("server_args.py", "_handle_legacy_cp_arguments", "enable_prefill_cp"): "enable_prefill_context_parallel",
    ("server_args.py", "_handle_legacy_cp_arguments", "enable_prefill_context_parallel"): "enable_prefill_cp",
    ("server_args.py", "_handle_legacy_cp_arguments", "enable_dsa_prefill_context_parallel"): "enable_prefill_cp",
    ("server_args.py", "_handle_dwdp", "moe_dense_tp_size"): "dwdp_size",
    # Attention DP (refused for every capture) is also turned on only by these:
    ("arg_groups/overrides.py", "_deepseek_family_overrides", "enable_dp_attention"): "enable_prefill_cp",
    ("arg_groups/deepseek_v4_hook.py", "validate_deepseek_v4_cp", "enable_dp_attention"): "enable_prefill_cp",
    ("server_args.py", "_handle_dwdp", "enable_dp_attention"): "dwdp_size",
}


def _unsafe_writers(root: Path, safe: dict[str, Any]) -> dict[tuple[str, str, str], str]:
    """(file, function, field) -> value, for every assignment, dict entry or keyword inside a function
    of ServerArgs' resolution (server_args.py, arg_groups/) that may set a guarded field to other than
    its safe value."""
    out = {}
    for path in [root / "server_args.py", *sorted((root / "arg_groups").rglob("*.py"))]:
        rel = str(path.relative_to(root))

        def visit(node, fn):
            for child in ast.iter_child_nodes(node):
                name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
                found = []
                if name and isinstance(child, (ast.Assign, ast.AnnAssign)) and child.value is not None:
                    for t in child.targets if isinstance(child, ast.Assign) else [child.target]:
                        key = t.attr if isinstance(t, ast.Attribute) else (
                            t.slice.value if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) else None)
                        found.append((key, child.value))
                if name and isinstance(child, ast.Dict):
                    found += [(k.value, v) for k, v in zip(child.keys, child.values) if isinstance(k, ast.Constant)]
                if name and isinstance(child, ast.Call):
                    found += [(k.arg, k.value) for k in child.keywords]
                for key, value in found:
                    if key in safe and not (isinstance(value, ast.Constant) and value.value == safe[key]):
                        out[(rel, name, key)] = ast.unparse(value)
                visit(child, name)

        visit(ast.parse(path.read_text(encoding="utf-8")), None)
    return out


def test_sglang_turns_on_a_guarded_setting_only_where_the_guard_covers_it():
    if HAS_AUX_FLAG:
        # The aux path reads no layer output; the layer hooks are refused at TP here (next test).
        assert LAYER_BOUNDARY and tp.sglang_defers_layer_sums()
        return
    assert not LAYER_BOUNDARY and not tp.sglang_defers_layer_sums()
    safe = {k: v for k, (v, _) in {**tp.TP_FORCED, **tp.TP_REFUSED}.items()}
    safe.update(enable_dp_attention=False)  # refused for every capture (sglang_args._CAPTURE_REFUSED)
    writers = _unsafe_writers(SRT, safe)
    assert set(writers) == set(WRITERS_0517), {k: writers.get(k) for k in set(writers) ^ set(WRITERS_0517)}
    guarded = {**tp.TP_FORCED, **tp.TP_REFUSED}
    assert {trigger for trigger in WRITERS_0517.values()} <= set(guarded)
    # The writers' triggers, read off their source: the user's settings (refused) or an environment
    # variable (refused), except the hardware auto-enable, which the forced switch overrides last.
    source = {fn: ast.unparse(_def(rel, fn)) if rel != "server_args.py" else ast.unparse(_def(rel, f"ServerArgs.{fn}"))
              for rel, fn, _ in WRITERS_0517}
    assert "SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE" in source["_a2a_backend_overrides"]
    assert set(tp.TP_REFUSED_ENV) == {"SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE"}
    for (rel, fn, field), trigger in WRITERS_0517.items():
        if fn != "_flashinfer_allreduce_fusion_auto_enable":
            assert trigger in source[fn], (fn, trigger)
    adjust = ast.unparse(_def("server_args.py", "ServerArgs._handle_model_specific_adjustments"))
    assert adjust.index("run_post_process_pass(self, _flashinfer_allreduce_fusion_auto_enable)") < adjust.index(
        "run_post_process_pass(self, _enforce_disable_allreduce_fusion)")
    # Every guarded setting defaults to its safe value.
    defaults = _defaults()
    assert {k: defaults[k] for k in safe if k in defaults and defaults[k] != safe[k] and k not in tp.TP_FORCED} == {}


# --- the Kimi-K2.5 TP-8 capture excludes every condition ------------------------------------------


def test_kimi_tp8_capture_kwargs_exclude_every_condition(kimi, tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", raising=False)
    kw = _kimi_kwargs(kimi, tmp_path)
    assert kw["tp_size"] == 8
    targets = [m for h in kw["forward_hooks"] for m in h["target_modules"]]
    if HAS_AUX_FLAG:
        # SGLang's own aux states (captured after the sum completes, below); no decoder layer is hooked.
        assert targets == ["language_model.logits_processor"] and kw[AUX_FLAG] is True
        assert not set(tp.TP_FORCED) & set(kw)  # nothing of the layer-hook guard is needed here
        # Were the layer hooks taken here, every layer output would owe its sum: refused, saying why.
        with pytest.raises(ConfigError, match="partial sums.*sglang==0.5.23"):
            _kimi_kwargs(kimi, tmp_path, fields=FIELDS - {AUX_FLAG})
        return
    assert targets == ["language_model.model.layers.1", "language_model.model.layers.29",  # HF [2, 30, 58]
                       "language_model.model.layers.57", "language_model.logits_processor"]
    # The off switch of the fusion SGLang enables by itself; every other condition left at its default,
    # which SGLang changes only on a refused setting (previous test).
    assert {k: kw[k] for k in tp.TP_FORCED} == {"enforce_disable_flashinfer_allreduce_fusion": True}
    assert not (set(tp.TP_REFUSED) | set(tp.TP_REFUSED_ENV)) & set(kw), set(tp.TP_REFUSED) & set(kw)
    assert not {"enable_dp_attention", "dp_size", "attn_dp_size", "enable_layernorm_sp"} & set(kw)
    defaults = _defaults()
    for key, (safe, _) in tp.TP_REFUSED.items():
        if key in FIELDS:
            assert defaults[key] == safe, key
    assert set(kw) <= FIELDS, set(kw) - FIELDS
    check_server_args(kw)


UNSAFE = {
    "flashinfer_allreduce_fusion_backend": "trtllm", "enable_flashinfer_allreduce_fusion": True,
    "enable_aiter_allreduce_fusion": True, "enable_attn_tp_input_scattered": True, "moe_a2a_backend": "deepep",
    "enable_waterfill": True, "moe_dense_tp_size": 1, "dwdp_size": 8, "attn_cp_size": 8, "enable_prefill_cp": True,
    "enable_prefill_context_parallel": True, "enable_dsa_prefill_context_parallel": True,
    "enable_two_batch_overlap": True, "enforce_disable_flashinfer_allreduce_fusion": False,
}


@pytest.mark.parametrize("key", sorted(UNSAFE))
def test_a_setting_that_leaves_layer_outputs_unreduced_is_refused(kimi, tmp_path, monkeypatch, key):
    monkeypatch.delenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", raising=False)
    assert set(UNSAFE) == set(tp.TP_FORCED) | set(tp.TP_REFUSED)
    if HAS_AUX_FLAG:  # layer hooks here read owed sums whatever the setting: refused at TP as such
        with pytest.raises(ConfigError, match="partial sums"):
            _kimi_kwargs(kimi, tmp_path, fields=FIELDS - {AUX_FLAG}, **({key: UNSAFE[key]} if key in FIELDS else {}))
        return
    assert key in FIELDS, key  # every one is a setting of the SGLang whose layers the engine hooks
    with pytest.raises(ConfigError, match=f"extra_engine_kwargs.{key}=.*tp_size=8.*remove it or set {key}="):
        _kimi_kwargs(kimi, tmp_path, **{key: UNSAFE[key]})


def test_the_environment_that_switches_moe_to_all_to_all_is_refused(kimi, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", "1")
    if HAS_AUX_FLAG:
        assert _kimi_kwargs(kimi, tmp_path)[AUX_FLAG]
        return
    with pytest.raises(ConfigError, match="SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE.*megamoe"):
        _kimi_kwargs(kimi, tmp_path)
    monkeypatch.setenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", "false")
    assert _kimi_kwargs(kimi, tmp_path)["enforce_disable_flashinfer_allreduce_fusion"] is True


# --- SGLang's own resolution and fusion gate, run on the Kimi kwargs ------------------------------


def _resolved_comm(kw: dict[str, Any], arch: str, monkeypatch) -> Any:
    """0.5.17's ServerArgs for ``kw`` through SGLang's own FlashInfer passes, in the order
    _handle_model_specific_adjustments runs them, on a simulated Hopper (``is_sm90_supported``, set
    by hand: no GPU here); the rest of __post_init__ (which needs CUDA) does not run."""
    import sglang.srt.arg_groups.overrides as overrides

    monkeypatch.setattr(overrides, "is_sm90_supported", lambda: True)  # by hand: an H100/H200
    args = object.__new__(server_args.ServerArgs)
    for name, value in {**_defaults(), **kw}.items():
        object.__setattr__(args, name, value)
    hf = SimpleNamespace(architectures=[arch])
    object.__setattr__(args, "get_model_config", lambda: SimpleNamespace(hf_config=hf))
    object.__setattr__(args, "_resolved_overrides", [])
    overrides.run_post_process_pass(args, overrides._flashinfer_allreduce_fusion_auto_enable)
    overrides.run_post_process_pass(args, overrides._enforce_disable_allreduce_fusion)
    overrides.materialize_declarations(args)
    return args


def _fusion_gate(resolved: Any):
    """LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer and apply_flashinfer_allreduce_fusion,
    compiled from the installed source, on the runtime config ``resolved`` describes: one Hopper rank
    of a TP group, FlashInfer installed (set by hand), a non-last dense or MoE layer."""
    rel = "layers/communicator.py"
    tree = ast.parse((SRT / rel).read_text(encoding="utf-8"))
    max_batch = next(ast.literal_eval(s.value) for s in tree.body if isinstance(s, ast.Assign)
                     and ast.unparse(s.targets[0]) == "FUSE_ALLREDUCE_MAX_BATCH_SIZE")
    scatter_mode = _compile(_def(rel, "ScatterMode"), {"Enum": Enum, "auto": auto})
    comm = SimpleNamespace(flashinfer_allreduce_fusion_backend=resolved.flashinfer_allreduce_fusion_backend,
                           enable_aiter_allreduce_fusion=resolved.enable_aiter_allreduce_fusion)
    ns = {
        "FUSE_ALLREDUCE_MAX_BATCH_SIZE": max_batch, "ScatterMode": scatter_mode,
        "_is_sm90_supported": True, "_is_sm100_supported": False, "_is_flashinfer_available": True,  # by hand
        "_use_aiter": False,  # CUDA, not ROCm
        "is_flashinfer_allreduce_unavailable": lambda: False,
        "is_dp_attention_enabled": lambda: resolved.enable_dp_attention,
        "is_enable_moe_cp_allgather": lambda: resolved.attn_cp_size > resolved.moe_dp_size,
        "get_attn_tp_context": lambda: SimpleNamespace(input_scattered=resolved.enable_attn_tp_input_scattered),
        "get_exec": lambda: SimpleNamespace(comm=comm),
        "get_parallel": lambda: SimpleNamespace(tp_size=resolved.tp_size),
        "get_moe_a2a_backend": lambda: SimpleNamespace(is_none=lambda: resolved.moe_a2a_backend == "none"),
    }
    _compile(_def(rel, "apply_flashinfer_allreduce_fusion"), ns)
    gate = _compile(_def(rel, "LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer"), ns)
    layer = SimpleNamespace(_speculative_algo=None, is_last_layer=False, _context=SimpleNamespace(tp_size=resolved.tp_size),
                            layer_scatter_modes=SimpleNamespace(mlp_mode=scatter_mode.FULL))
    return lambda tokens: gate(layer, SimpleNamespace(input_ids=torch.zeros(tokens)))


def test_the_fusion_sglang_enables_for_kimi_on_hopper_stays_off(kimi, tmp_path, monkeypatch):
    """Without the guard SGLang fuses every Kimi layer's MLP all-reduce into the next layer for
    prefill batches of up to 2048 tokens (the hooked outputs would be partial sums); with the
    capture kwargs it fuses none."""
    monkeypatch.delenv("SGLANG_OPT_USE_DEEPGEMM_MEGA_MOE", raising=False)
    if HAS_AUX_FLAG:
        # 0.5.23 resolves the same auto-enable (model_hook.py runs both passes); the aux capture
        # completes the fused sum before it captures (next test), so the aux path keeps the fusion.
        adjust = ast.unparse(_def("arg_groups/model_hook.py", "handle_model_specific_adjustments"))
        assert adjust.index("_flashinfer_allreduce_fusion_auto_enable)") < adjust.index(
            "_enforce_disable_allreduce_fusion)")
        return
    arch = "KimiK25ForConditionalGeneration"  # configs/kimi-k2.5.yaml's checkpoint
    kw = _kimi_kwargs(kimi, tmp_path)
    plain = {k: v for k, v in kw.items() if k not in tp.TP_FORCED}
    unguarded = _fusion_gate(_resolved_comm(plain, arch, monkeypatch))
    assert unguarded(1024) and unguarded(2048) and not unguarded(2049)
    guarded_args = _resolved_comm(kw, arch, monkeypatch)
    assert guarded_args.flashinfer_allreduce_fusion_backend is None
    guarded = _fusion_gate(guarded_args)
    assert not any(guarded(n) for n in (1, 512, 2048, 16384))
    # A user's explicit backend would be overridden by the forced switch too, but is refused outright.
    with pytest.raises(ConfigError, match="flashinfer_allreduce_fusion_backend"):
        _kimi_kwargs(kimi, tmp_path, flashinfer_allreduce_fusion_backend="trtllm")


# --- where the aux states SGLang captures are reduced ----------------------------------------------


def _line(fn: ast.AST, call: str) -> list[int]:
    return [c.lineno for c in _calls(fn, call)]


def test_sglang_captures_aux_states_only_after_the_sum_completes():
    """0.5.23 (the engine's path there): StageBoundary._prepare_attention (layers/layer_boundary/stage.py)
    takes a ``capture`` only after ``stream.complete`` (ResidualStream.complete ->
    Contribution.complete: the owed all-reduce) and a ``capture_gathered`` (DeepSeek, Kimi) only from
    ``stream.residual`` after ``self._prepare`` ran the entry that completes the sum and wrote it into
    the residual. 0.5.17's own capture (with a draft; not the engine's path) is likewise taken after
    ``prepare_attn`` completed the previous layer's fused all-reduce."""
    if LAYER_BOUNDARY:
        prep = _def("layers/layer_boundary/stage.py", "StageBoundary._prepare_attention")
        complete, prepare = _line(prep, "stream.complete"), _line(prep, "self._prepare")
        assert len(complete) == 1 and len(prepare) == 1
        captures = _line(prep, "capture")
        gathered = _line(prep, "capture_gathered.capture")
        assert captures and gathered and min(captures) > complete[0] and min(gathered) > prepare[0]
        # A capture before the read takes the completed value; one after it, the residual written after completion.
        before = [c for c in _calls(prep, "capture") if c.lineno < prepare[0]]
        assert all(ast.unparse(c.args[0]) in ("value", "value + previous") for c in before)
        assert "value, previous = stream.export(hidden_states)" in ast.unparse(prep)
        staged = _def("layers/layer_boundary/stage.py", "StageBoundary._prepare")
        assert _line(staged, "stream.write")[0] > _line(staged, "entry.prepare")[0]
        stream_complete = ast.unparse(_def("layers/layer_boundary/residual/stream.py", "ResidualStream.complete"))
        assert "self.pending.complete()" in stream_complete
        contribution = ast.unparse(_def("layers/layer_boundary/residual/stream.py", "Contribution.complete"))
        assert "self.owed.complete(self.value)" in contribution and "self.owed.complete()" in contribution
        owed = ast.unparse(_def("layers/layer_boundary/output.py", "UnreducedOutput.complete"))
        assert "self.group.all_reduce(self.partial)" in owed
        # The models hand their capture to that boundary: Llama-style (capture=) and DeepSeek/Kimi-style.
        llama = _def("models/llama.py", "LlamaDecoderLayer.forward")
        assert [ast.unparse(k) for c in _calls(llama, "self.attn_boundary.prepare") for k in c.keywords] == [
            "capture=capture_output"]
        deepseek = _def("models/deepseek_v2.py", "DeepseekV2DecoderLayer.forward")
        kws = [ast.unparse(k) for c in _calls(deepseek, "self.attn_boundary.prepare") for k in c.keywords]
        assert "capture_gathered=captured_last_layer_outputs" in kws
        return
    own = _def("layers/communicator.py", "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs")
    assert _line(own, "captured_last_layer_outputs.append")[0] > _line(own, "self.prepare_attn")[0]
    prepare_attn = ast.unparse(_def("layers/communicator.py", "LayerCommunicator.prepare_attn"))
    assert "hidden_states._sglang_needs_allreduce_fusion" in prepare_attn
    assert "forward_with_allreduce_fusion(" in prepare_attn and "moe_tensor_model_parallel_all_reduce(" in prepare_attn
