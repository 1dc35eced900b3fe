"""Contract tests against the real source of one SGLang version (see conftest.py: run once per version).

SGLang's engine needs CUDA, so nothing here serves a model. What runs for real: ``ServerArgs`` (a
msgspec Struct in 0.5.23, a dataclass in 0.5.17) and, where the version has it, its aux-capture
validation; ``hook_manager.register_forward_hooks``; ``SamplingParams``. Modules that need CUDA
builds to import (forward_batch_info, logits_processor, models/*) are read from their installed
source instead: the needed class or method is compiled from SGLang's own text (``_sglang_def``)
and exercised, so a change upstream changes what these tests run. Where versions differ, a test
checks the path the engine takes on the installed version (feature-detected, as the engine does).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import MISSING, dataclass, field, fields
from enum import IntEnum, auto
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional

import pytest
import torch

import sglang.srt.server_args as server_args

from eagle3_ray.config import BenchConfig, TargetConfig, load_config  # noqa: E402
from eagle3_ray.engines.base import default_aux_layers  # noqa: E402
from eagle3_ray.engines.sglang import SGLangEngine  # noqa: E402
from eagle3_ray.engines.sglang_args import (  # noqa: E402
    AUX_FLAG,
    CAPTURE_SAMPLING,
    GRAPH_MAX_BS,
    MODES,
    check_extra_kwargs,
    check_server_args,
    engine_kwargs,
    generate_sampling,
    server_args_fields,
    sglang_aux_ids,
)
from eagle3_ray.engines.sglang_capture import read_capture  # noqa: E402
from eagle3_ray.engines.sglang_hooks import (  # noqa: E402
    AUX_ARG, BATCH_ARG, HIDDEN_ARG, LAYER_BATCH_ARG, STATS_FILE, capture_path, flush, writer,
)
from eagle3_ray.errors import ConfigError, EngineError  # noqa: E402

from conftest import compile_sglang_def, source_root  # noqa: E402

SRT = source_root() / "srt"
REPO = Path(__file__).resolve().parents[2]
FIELDS = server_args_fields()
HAS_AUX_FLAG = AUX_FLAG in FIELDS
IS_STRUCT = hasattr(server_args.ServerArgs, "__struct_fields__")


# --- reading SGLang's source ----------------------------------------------------------------------


def _tree(rel: str) -> ast.Module:
    return ast.parse((SRT / rel).read_text(encoding="utf-8"))


def _class(rel: str, name: str) -> ast.ClassDef:
    found = [n for n in _tree(rel).body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"class {name} is gone from sglang/srt/{rel}"
    return found[0]


def _method(rel: str, cls: str, name: str) -> ast.FunctionDef:
    found = [n for n in _class(rel, cls).body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls}.{name} is gone from sglang/srt/{rel}"
    return found[0]




@pytest.fixture(scope="module")
def forward_mode():
    return compile_sglang_def(_class("model_executor/forward_batch_info.py", "ForwardMode"), {"IntEnum": IntEnum, "auto": auto})


@pytest.fixture(scope="module")
def forward_batch_cls():
    ns = {"dataclass": dataclass, "field": field, "Optional": Optional, "List": List, "torch": torch}
    return compile_sglang_def(_class("model_executor/forward_batch_info.py", "ForwardBatch"), ns, base="_NoMixin")


def _forward_batch(cls, mode, rids: list[str], lens: list[int], prefix: list[int] | None = None):
    """A real-source ForwardBatch: required fields filled, the extend fields the scheduler sets."""
    n = sum(lens)
    required = {
        f.name: torch.zeros(n, dtype=torch.long)
        for f in fields(cls)
        if f.default is MISSING and f.default_factory is MISSING
    }
    required.update(forward_mode=mode, batch_size=len(rids))
    return cls(
        **required,
        rids=rids,
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_seq_lens_cpu=list(lens),
        extend_prefix_lens_cpu=prefix or [0] * len(lens),
    )


# --- engine kwargs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_llama_config):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama_config.save_pretrained(d)
    return d


def _target(target_dir, **changes) -> TargetConfig:
    # The 6-layer tiny target's default [2, 3, 3] repeats a layer: name three distinct ones.
    return TargetConfig(**{"model": str(target_dir), "backend": "sglang", "tp_size": 2, "aux_layers": [2, 3, 4],
                           **changes})


def _kwargs(target_dir, mode, tmp_path, target=None):
    target = target or _target(target_dir, sglang={"nnodes": 2, "dist_init_addr": "10.0.0.1:5000",
                                                   "mem_fraction_static": 0.8})
    return engine_kwargs(target, mode, capture_dir=tmp_path, drafter_dir=tmp_path, bench=BenchConfig(), node_rank=1)


def test_server_args_fields_are_read_the_way_the_version_defines_them():
    """0.5.23: a msgspec Struct (``dataclasses.fields`` raises); 0.5.17: a dataclass."""
    import dataclasses

    if IS_STRUCT:
        assert FIELDS == set(server_args.ServerArgs.__struct_fields__)
        with pytest.raises(TypeError):
            dataclasses.fields(server_args.ServerArgs)
    else:
        assert FIELDS == {f.name for f in dataclasses.fields(server_args.ServerArgs)}
    assert {"forward_hooks", "disable_radix_cache", "chunked_prefill_size", "disable_cuda_graph",
            "sampling_defaults", "skip_tokenizer_init", "speculative_algorithm"} <= FIELDS


@pytest.mark.parametrize("mode", MODES)
def test_every_engine_kwarg_is_a_server_args_field(target_dir, tmp_path, mode):
    kw = _kwargs(target_dir, mode, tmp_path)
    assert set(kw) <= FIELDS, set(kw) - FIELDS
    check_server_args(kw)
    if IS_STRUCT:  # a Struct is built without resolving; the 0.5.17 dataclass resolves in __post_init__ (CUDA)
        args = server_args.ServerArgs(**kw)
        assert args.tp_size == 2 and args.nnodes == 2 and args.node_rank == 1


def test_capture_kwargs_take_the_installed_versions_aux_path(target_dir, tmp_path):
    kw = _kwargs(target_dir, "capture", tmp_path)
    assert kw["disable_radix_cache"] and kw["chunked_prefill_size"] == -1 and kw["disable_cuda_graph"]
    hooks = kw["forward_hooks"]
    if HAS_AUX_FLAG:
        from sglang.srt.arg_groups.model_override_base import resolving_view
        from sglang.srt.arg_groups.validation_hook import handle_aux_hidden_state_capture

        args = server_args.ServerArgs(**kw)
        handle_aux_hidden_state_capture(args)  # raises ValueError on a settings combination it refuses
        view = resolving_view(args)
        assert view.aux_hidden_state_capture == "eagle3" and view.speculative_algorithm is None  # no draft loaded
        assert kw["return_aux_hidden_state_layer_ids"] == [1, 2, 3]  # llama: HF index k -> k - 1
        assert [h["target_modules"] for h in hooks] == [["logits_processor"]]
    else:
        # Without the flag, speculative_algorithm="EAGLE3" would want a draft model: capture uses layer hooks.
        assert "speculative_algorithm" not in kw and "return_aux_hidden_state_layer_ids" not in kw
        assert [h["target_modules"] for h in hooks] == [["model.layers.1"], ["model.layers.2"], ["model.layers.3"],
                                                        ["logits_processor"]]
        source = (SRT / "model_executor/model_runner_components/spec_aux_hidden_state.py").read_text()
        assert "speculative_draft_model_path" in source  # aux capture is tied to loading a draft here


def test_layer_hook_capture_is_refused_for_models_without_the_layer_convention(target_dir, tmp_path):
    from eagle3_ray.engines.base import EngineInfo

    info = EngineInfo(model_type="glm4_moe", num_layers=32, hidden_size=64, vocab_size=512, aux_layers=[2, 16, 29],
                      dtype="bfloat16", fingerprint="x")
    with pytest.raises(ConfigError, match="enable_return_aux_hidden_states"):
        engine_kwargs(_target(target_dir), "capture", info=info, capture_dir=tmp_path, fields=frozenset())
    deepseek = EngineInfo(model_type="deepseek_v3", num_layers=32, hidden_size=64, vocab_size=512,
                          aux_layers=[2, 16, 29], dtype="bfloat16", fingerprint="x")
    # tp_size 1: at TP the layer hooks are guarded per installed SGLang (test_tp_reduced.py).
    hooks = engine_kwargs(_target(target_dir, tp_size=1), "capture", info=deepseek, capture_dir=tmp_path,
                          fields=frozenset())["forward_hooks"]
    assert [h["target_modules"] for h in hooks] == [["model.layers.1"], ["model.layers.15"], ["model.layers.28"],
                                                    ["logits_processor"]]


def test_generate_and_spec_kwargs(target_dir, tmp_path):
    gen = _kwargs(target_dir, "generate", tmp_path)
    assert "forward_hooks" not in gen and "disable_radix_cache" not in gen and gen["skip_tokenizer_init"]
    spec = _kwargs(target_dir, "spec", tmp_path)
    b = BenchConfig()
    assert spec["speculative_algorithm"] == "EAGLE3" and spec["speculative_draft_model_path"] == str(tmp_path)
    assert (spec["speculative_num_steps"], spec["speculative_eagle_topk"], spec["speculative_num_draft_tokens"]) == (
        b.depth, b.topk, b.total_tokens)
    chain = engine_kwargs(_target(target_dir), "spec", drafter_dir=tmp_path, bench=BenchConfig(modes=["chain"]))
    assert (chain["speculative_eagle_topk"], chain["speculative_num_draft_tokens"]) == (1, b.num_steps + 1)


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"disable_radix_cache": False}, "prefix-cache"),
        ({"chunked_prefill_size": 8192}, "chunked prefill"),
        ({"disable_cuda_graph": False}, "graph replay"),
        ({"cuda_graph_backend_prefill": "full"}, "graph replay"),
        ({"pp_size": 2}, "pp_size"),
        ({"enable_dp_attention": True}, "attention DP"),
        ({"return_aux_hidden_state_layer_ids": [1, 2, 3]}, "target.aux_layers"),
        ({"model_path": "/x"}, "target.model"),
        ({"tp_size": 4}, "target.tp_size"),
    ],
)
def test_capture_breaking_extra_kwargs_are_refused(target_dir, tmp_path, extra, words):
    with pytest.raises(ConfigError, match=words):
        engine_kwargs(_target(target_dir, sglang={"extra_engine_kwargs": extra}), "capture", capture_dir=tmp_path)


def test_extra_kwargs_pass_through_where_harmless(target_dir, tmp_path):
    prefix_cache = _target(target_dir, sglang={"extra_engine_kwargs": {"disable_radix_cache": False}})
    assert engine_kwargs(prefix_cache, "generate")["disable_radix_cache"] is False  # decode may cache
    same = _target(target_dir, sglang={"extra_engine_kwargs": {"chunked_prefill_size": -1, "max_running_requests": 8}})
    assert engine_kwargs(same, "capture", capture_dir=tmp_path)["max_running_requests"] == 8
    with pytest.raises(ConfigError, match="not ServerArgs fields"):
        check_server_args({**engine_kwargs(_target(target_dir), "generate"), "max_runing_requests": 8})


def test_multinode_needs_dist_init_addr(target_dir):
    with pytest.raises(ConfigError, match="dist_init_addr"):
        engine_kwargs(_target(target_dir, sglang={"nnodes": 2}), "generate")


def test_sampling_params_are_sglang_fields():
    from sglang.srt.sampling.sampling_params import SamplingParams

    for params in (CAPTURE_SAMPLING, generate_sampling(32, 0.0, 1.0, 0), generate_sampling(32, 0.7, 0.9, 3)):
        assert set(params) <= set(SamplingParams.__struct_fields__)
        assert SamplingParams(**params).max_new_tokens == params["max_new_tokens"]


# --- the hook -------------------------------------------------------------------------------------


def test_logits_processor_call_matches_hook_positions():
    """The hook indexes forward's positional args; pin the signature and the models' calls."""
    args = [a.arg for a in _method("layers/logits_processor.py", "LogitsProcessor", "forward").args.args][1:]
    assert args[HIDDEN_ARG] == "hidden_states" and args[BATCH_ARG] == "logits_metadata"
    assert args[AUX_ARG] == "aux_hidden_states"
    for rel, cls in [("models/llama.py", "LlamaForCausalLM"), ("models/qwen2.py", "Qwen2ForCausalLM"),
                     ("models/qwen3.py", "Qwen3ForCausalLM"), ("models/deepseek_v2.py", "DeepseekV2ForCausalLM")]:
        calls = [
            c for c in ast.walk(_method(rel, cls, "forward"))
            if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.logits_processor"
        ]
        assert calls, f"{cls}.forward no longer calls self.logits_processor"
        for c in calls:
            assert len(c.args) > AUX_ARG and ast.unparse(c.args[AUX_ARG]) == "aux_hidden_states", (rel, ast.unparse(c))


def test_hook_reads_only_forward_batch_fields_that_exist(forward_batch_cls, forward_mode):
    names = {f.name for f in fields(forward_batch_cls)}
    assert {"forward_mode", "rids", "extend_seq_lens", "extend_seq_lens_cpu", "extend_prefix_lens_cpu"} <= names
    assert forward_mode.EXTEND.is_extend() and not forward_mode.EXTEND.is_target_verify()
    assert forward_mode.TARGET_VERIFY.is_extend() and not forward_mode.DECODE.is_extend()


class TinyTargetWithLogitsProcessor(torch.nn.Module):
    """A real module tree with a ``logits_processor`` child called the way llama.py:625 calls it."""

    class LogitsProcessor(torch.nn.Module):
        def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
            return hidden_states @ lm_head.weight.T  # [N, vocab]

    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.logits_processor = self.LogitsProcessor()

    def forward(self, input_ids, hidden_states, forward_batch, aux_hidden_states):
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, aux_hidden_states)


@pytest.fixture(scope="module")
def hf_rows(tiny_llama_config):
    """Two sequences through a seeded HF Llama: per-request (aux [T,3H], last [T,H]) and packed rows."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config).eval()
    aux_ids = [2, 3, 4]
    seqs = [torch.randint(3, 500, (n,)) for n in (7, 4)]
    per_request = []
    with torch.no_grad():
        for s in seqs:
            out = model.model(input_ids=s[None], output_hidden_states=True)
            per_request.append((torch.cat([out.hidden_states[k][0] for k in aux_ids], -1), out.last_hidden_state[0]))
    return seqs, per_request


@pytest.mark.parametrize("packed", [True, False], ids=["packed-aux", "aux-list"])
def test_sglang_registers_our_hook_which_writes_each_request(
    target_dir, tmp_path, forward_batch_cls, forward_mode, hf_rows, packed
):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    seqs, per_request = hf_rows
    # The hook of the enable_return_aux_hidden_states path (0.5.23); the layer-hook path: further down.
    hooks = engine_kwargs(_target(target_dir, tp_size=1), "capture", capture_dir=tmp_path,
                          fields=frozenset({AUX_FLAG}))["forward_hooks"]
    model = TinyTargetWithLogitsProcessor(hidden=64, vocab=512)
    register_forward_hooks(model, hooks)
    assert len(model.logits_processor._forward_hooks) == 1

    aux = torch.cat([a for a, _ in per_request])  # [N, 3H]
    last = torch.cat([h for _, h in per_request])  # [N, H]
    aux_arg = aux if packed else list(aux.split(64, dim=-1))  # DeepSeek packs, Llama passes a list
    rids = ["req-a", "req-b"]
    batch = _forward_batch(forward_batch_cls, forward_mode.EXTEND, rids, [len(s) for s in seqs])
    before = writer().stats()  # the process's writer's account since its start
    rows_before, bytes_before = before["rows"], before["bytes"]
    logits = model(torch.cat(seqs), last, batch, aux_arg)
    assert logits.shape == (aux.shape[0], 512)  # the hook leaves the output alone
    flush(timeout=30)  # the hook's writer thread writes the files

    for rid, seq, (want_aux, want_last) in zip(rids, seqs, per_request):
        cap = read_capture(capture_path(tmp_path, rid), len(seq), hidden_size=64)
        assert torch.equal(cap.aux_hidden, want_aux) and torch.equal(cap.last_hidden, want_last)
        assert not capture_path(tmp_path, rid).exists()  # read_capture deletes
    assert _left(tmp_path) == []  # no temporary files left behind
    stats = json.loads((tmp_path / STATS_FILE).read_text())  # the writer's account, next to the captures
    assert stats["rows"] - rows_before == aux.shape[0]
    assert stats["bytes"] - bytes_before == aux.numel() * aux.element_size() + last.numel() * last.element_size()

    decode = _forward_batch(forward_batch_cls, forward_mode.DECODE, rids, [1, 1])
    verify = _forward_batch(forward_batch_cls, forward_mode.TARGET_VERIFY, rids, [1, 1])
    model(torch.cat(seqs)[:2], last[:2], decode, aux_arg)
    model(torch.cat(seqs)[:2], last[:2], verify, aux_arg)
    flush(timeout=30)
    assert _left(tmp_path) == []


def _left(directory: Path) -> list[Path]:
    """What the hook left in a capture directory besides its writer's stats file."""
    return [p for p in directory.iterdir() if p.name != STATS_FILE]


class FakeSGLangLlamaWithLayers(torch.nn.Module):
    """FAKE SGLang Llama (the real one needs CUDA to build): SGLang's module names and calling
    convention (models/llama.py, pinned by the source test below), replaying HF's hidden states.

    Decoder layer i returns ``(hidden_states, residual)`` whose sum is HF ``hidden_states[i + 1]``,
    split unevenly as SGLang's fused add-norm leaves it; the model calls each layer positionally,
    then ``logits_processor(input_ids, final_hidden, lm_head, forward_batch, aux_hidden_states)``
    with ``aux_hidden_states=None`` (capture_aux_hidden_states off: no draft loaded).
    """

    class Layer(torch.nn.Module):
        def __init__(self, out: torch.Tensor, deepseek: bool):
            super().__init__()
            self.out = out  # [N, H] HF hidden_states[i + 1] of the packed batch
            self.deepseek = deepseek

        def forward(self, positions, hidden_states, forward_batch, residual, *more):
            residual = hidden_states if residual is None else hidden_states + residual
            if self.deepseek:  # DeepseekV2DecoderLayer: (hidden_states, residual, topk_indices)
                return self.out - 0.25 * residual, 0.25 * residual, None
            return self.out - 0.25 * residual, 0.25 * residual

    def __init__(self, states: list[torch.Tensor], last: torch.Tensor, vocab: int, deepseek: bool = False):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList(self.Layer(h, deepseek) for h in states[1:])
        self.lm_head = torch.nn.Linear(last.shape[-1], vocab, bias=False)
        self.logits_processor = TinyTargetWithLogitsProcessor.LogitsProcessor()
        self.embeds, self.last = states[0], last

    def forward(self, input_ids, positions, forward_batch):
        hidden_states, residual = self.embeds, None
        for layer in self.model.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)[:2]
        return self.logits_processor(input_ids, self.last, self.lm_head, forward_batch, None)


@pytest.mark.parametrize("deepseek", [False, True], ids=["llama-layers", "deepseek-layers"])
def test_layer_hook_capture_writes_the_hf_states(target_dir, tmp_path, forward_batch_cls, forward_mode,
                                                 tiny_llama_config, deepseek):
    """The capture path of SGLang without enable_return_aux_hidden_states (0.5.17), through SGLang's
    real register_forward_hooks: every request's file holds HF hidden_states[k] exactly."""
    from transformers import LlamaForCausalLM
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config).eval()
    seqs = [torch.randint(3, 500, (n,)) for n in (7, 4)]
    with torch.no_grad():
        outs = [hf.model(input_ids=q[None], output_hidden_states=True) for q in seqs]
    layers = tiny_llama_config.num_hidden_layers
    states = [torch.cat([o.hidden_states[i][0] for o in outs]) for i in range(layers + 1)]  # [N, H] each
    last = torch.cat([o.last_hidden_state[0] for o in outs])
    kw = engine_kwargs(_target(target_dir, tp_size=1), "capture", capture_dir=tmp_path, fields=frozenset())
    model = FakeSGLangLlamaWithLayers(states, last, vocab=512, deepseek=deepseek)
    register_forward_hooks(model, kw["forward_hooks"])
    assert [len(model.model.layers[i]._forward_hooks) for i in range(layers)] == [int(i in (1, 2, 3)) for i in range(layers)]

    rids = ["req-a", "req-b"]
    batch = _forward_batch(forward_batch_cls, forward_mode.EXTEND, rids, [len(q) for q in seqs])
    model(torch.cat(seqs), None, batch)
    flush(timeout=30)
    for rid, q, o in zip(rids, seqs, outs):
        cap = read_capture(capture_path(tmp_path, rid), len(q), hidden_size=64)
        assert torch.allclose(cap.aux_hidden, torch.cat([o.hidden_states[k][0] for k in (2, 3, 4)], -1), atol=1e-6)
        assert torch.equal(cap.last_hidden, o.last_hidden_state[0])
    model(torch.cat(seqs)[:2], None, _forward_batch(forward_batch_cls, forward_mode.DECODE, rids, [1, 1]))
    flush(timeout=30)
    assert _left(tmp_path) == []  # decode steps write nothing


def _layer_calls(fn: ast.FunctionDef) -> list[ast.Call]:
    return [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == "layer"]


def test_installed_models_fit_the_capture_path_the_engine_takes():
    """With enable_return_aux_hidden_states the hook reads logits_processor's aux argument (pinned
    above). Without it (0.5.17) the layer hooks rely on models/llama.py and qwen2.py (Qwen3Model is a
    Qwen2Model) calling ``layer(positions, hidden_states, forward_batch, residual)`` and each decoder
    layer returning ``hidden_states, residual``, summed by SGLang's own capture the same way."""
    if HAS_AUX_FLAG:
        assert {"enable_return_aux_hidden_states", "return_aux_hidden_state_layer_ids"} <= FIELDS
        return
    _deepseek_layers_fit_the_layer_hooks()
    for rel, model_cls, layer_cls in [("models/llama.py", "LlamaModel", "LlamaDecoderLayer"),
                                      ("models/qwen2.py", "Qwen2Model", "Qwen2DecoderLayer"),
                                      ("models/qwen3.py", "Qwen3Model", "Qwen3DecoderLayer")]:
        cls = _class(rel, model_cls)
        if not any(isinstance(n, ast.FunctionDef) and n.name == "forward" for n in cls.body):
            assert [ast.unparse(b) for b in cls.bases] == ["Qwen2Model"], f"{model_cls} has no forward of its own"
        else:
            forward = _method(rel, model_cls, "forward")
            calls = _layer_calls(forward)
            assert calls, f"{model_cls}.forward no longer calls its layers"
            for c in calls:
                assert ast.unparse(c.args[LAYER_BATCH_ARG]) == "forward_batch" and len(c.args) == 4, ast.unparse(c)
            appended = [ast.unparse(c.args[0]) for c in ast.walk(forward) if isinstance(c, ast.Call)
                        and ast.unparse(c.func) == "aux_hidden_states.append"]
            assert appended and all(a.startswith("hidden_states + residual") for a in appended), appended
        returns = [n for n in ast.walk(_method(rel, layer_cls, "forward")) if isinstance(n, ast.Return)]
        assert [ast.unparse(r.value) for r in returns][-1] == "(hidden_states, residual)", layer_cls


def _deepseek_layers_fit_the_layer_hooks():
    """DeepseekV2Model.forward calls ``layer(positions, hidden_states, forward_batch, residual, ...)``;
    each DeepseekV2DecoderLayer returns ``hidden_states, residual, topk_indices``; SGLang's own capture
    (``prepare_attn_and_capture_last_layer_outputs``) takes the next layer's ``residual`` after its
    fused add-norm, i.e. the same sum ``hidden_states + residual`` the layer hook takes."""
    calls = _layer_calls(_method("models/deepseek_v2.py", "DeepseekV2Model", "forward"))
    assert calls, "DeepseekV2Model.forward no longer calls its layers"
    for c in calls:
        assert [ast.unparse(a) for a in c.args[:4]] == ["positions", "hidden_states", "forward_batch", "residual"]
    returns = [n for n in ast.walk(_method("models/deepseek_v2.py", "DeepseekV2DecoderLayer", "forward"))
               if isinstance(n, ast.Return)]
    assert ast.unparse(returns[-1].value) == "(hidden_states, residual, topk_indices)"
    capture = ast.unparse(_method("layers/communicator.py", "LayerCommunicator",
                                  "prepare_attn_and_capture_last_layer_outputs"))
    assert capture.index("self.prepare_attn(") < capture.index("hidden_states=residual"), capture


def test_reader_refuses_partial_captures(tmp_path, forward_batch_cls, forward_mode, hf_rows):
    from eagle3_ray.engines.sglang_hooks import write_batch

    seqs, per_request = hf_rows
    aux, last = per_request[0]
    cached = _forward_batch(forward_batch_cls, forward_mode.EXTEND, ["r"], [len(seqs[0]) - 2], prefix=[2])
    write_batch(tmp_path, cached, last[2:], aux[2:])
    flush(timeout=30)
    with pytest.raises(EngineError, match="prefix cache hit: 2"):
        read_capture(capture_path(tmp_path, "r"), len(seqs[0]), hidden_size=64)
    write_batch(tmp_path, _forward_batch(forward_batch_cls, forward_mode.EXTEND, ["s"], [len(seqs[0])]), last, aux)
    flush(timeout=30)
    with pytest.raises(EngineError, match="hidden size"):
        read_capture(capture_path(tmp_path, "s"), len(seqs[0]), hidden_size=32)


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch.distributed as dist
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
    from eagle3_ray.engines.sglang_hooks import capture_hook_factory
    hook = capture_hook_factory({"dir": out + "/shm", "tp_size": 2})
    heavy = sorted(m for m in sys.modules if m == "ray" or m.startswith(("ray.", "sglang", "transformers")))
    json.dump({"hook": hook is not None, "heavy": heavy}, open(f"{out}/rank{rank}.json", "w"))
    dist.barrier()  # a rank leaving while its peer still connects fails the peer ("closed by peer")
    dist.destroy_process_group()
    """
)


def test_only_tp_rank_zero_gets_a_hook(tmp_path):
    """Two real gloo ranks, as SGLang's TP workers: rank 0 registers the hook, rank 1 nothing."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), str(tmp_path / "init"), str(tmp_path)], env=env)
        for r in (0, 1)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["hook"] for g in got] == [True, False]
    assert got[0]["heavy"] == []  # SGLang imports the hook module in every TP worker: keep it light


# --- aux layer ids --------------------------------------------------------------------------------

_SHIFT_MODELS = [
    ("models/llama.py", "LlamaForCausalLM", "llama"),
    ("models/qwen2.py", "Qwen2ForCausalLM", "qwen2"),
    ("models/qwen3.py", "Qwen3ForCausalLM", "qwen3"),
    ("models/deepseek_v2.py", "DeepseekV2ForCausalLM", "deepseek_v2"),
    ("models/deepseek_v2.py", "DeepseekV2ForCausalLM", "deepseek_v3"),
]


def _layers_captured(rel: str, cls: str, ids: list[int] | None, num_layers: int) -> list[int]:
    """Run the model's real set_eagle3_layers_to_capture on a minimal object."""
    method = compile_sglang_def(_method(rel, cls, "set_eagle3_layers_to_capture"), {"Optional": Optional, "List": List})
    obj = SimpleNamespace(
        pp_group=SimpleNamespace(is_last_rank=True),
        config=SimpleNamespace(num_hidden_layers=num_layers),
        model=SimpleNamespace(layers_to_capture=[]),
    )
    method(obj, ids)
    assert obj.capture_aux_hidden_states
    return obj.model.layers_to_capture


@pytest.mark.parametrize("rel, cls, model_type", _SHIFT_MODELS, ids=[m[2] for m in _SHIFT_MODELS])
@pytest.mark.parametrize("hf", [[2, 16, 29], [3, 10, 20], [2, 3, 30], [1, 8, 16]])
def test_translated_ids_capture_the_config_states(rel, cls, model_type, hf):
    """layers_to_capture c captures the input of layer c = HF hidden_states[c] (docs/sglang.md)."""
    num_layers = 32
    if model_type.startswith("deepseek") and hf[0] == 1:
        with pytest.raises(ConfigError, match="first index"):
            sglang_aux_ids(hf, model_type, num_layers)
        return
    ids = sglang_aux_ids(hf, model_type, num_layers)
    assert _layers_captured(rel, cls, ids, num_layers) == hf
    if HAS_AUX_FLAG:  # capture-only ids (0.5.23) pass SGLang's range check; 0.5.17 has no such ids
        check_range = compile_sglang_def(
            [n for n in _tree("model_executor/model_runner_components/spec_aux_hidden_state.py").body
             if isinstance(n, ast.FunctionDef) and n.name == "_check_capture_layer_ids_in_range"][0], {}
        )
        check_range(ids, SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=num_layers)))


@pytest.mark.parametrize("rel, cls, model_type", _SHIFT_MODELS, ids=[m[2] for m in _SHIFT_MODELS])
def test_default_ids_mean_the_same_states_everywhere(rel, cls, model_type):
    assert _layers_captured(rel, cls, None, 61) == default_aux_layers(61)


def test_last_layer_output_cannot_be_captured():
    with pytest.raises(ConfigError, match="last layer's output"):
        sglang_aux_ids([2, 16, 32], "llama", 32)


# --- exported drafter vs llama_eagle3.py -----------------------------------------------------------

# Parameters of LlamaForCausalLMEagle3 with one layer and untied lm_head, by module attribute
# (pinned to the source below). embed_tokens comes from the target and is never exported.
_EAGLE3_PARAMS = [
    "model.embed_tokens.weight", "model.fc.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.hidden_norm.weight",
]


def _assigned_attrs(rel: str, cls: str) -> set[str]:
    return {
        t.attr for n in ast.walk(_method(rel, cls, "__init__")) if isinstance(n, ast.Assign)
        for t in n.targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }


def test_eagle3_param_list_matches_sglang_modules():
    assert {"qkv_proj", "o_proj"} <= _assigned_attrs("models/llama.py", "LlamaAttention")
    assert {"gate_up_proj", "down_proj"} <= _assigned_attrs("models/llama.py", "LlamaMLP")
    assert {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"} <= _assigned_attrs(
        "models/llama.py", "LlamaDecoderLayer")
    assert {"hidden_norm", "mlp"} <= _assigned_attrs("models/llama_eagle3.py", "LlamaDecoderLayer")
    assert {"embed_tokens", "fc", "layers", "norm"} <= _assigned_attrs("models/llama_eagle3.py", "LlamaModel")
    assert {"model", "lm_head"} <= _assigned_attrs("models/llama_eagle3.py", "LlamaForCausalLMEagle3")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from eagle3_ray.drafter.export import export_drafter, save_drafter_weights
    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter

    vocab, draft = 96, 48
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, vocab_size=vocab, draft_vocab_size=draft, target_hidden_size=32,
                        aux_layers=[2, 12, 21], target_model_type="llama", rms_norm_eps=1e-5)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    ids = torch.randperm(vocab)[:draft].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab_map(ids - torch.arange(draft), t2d)
    root = tmp_path_factory.mktemp("drafter")
    out = export_drafter(save_drafter_weights(drafter, root / "ckpt"), root / "export", engine="sglang")
    return out, ids


def test_exported_keys_are_exactly_what_llama_eagle3_loads(exported):
    """Run SGLang's real load_weights: every key lands in a parameter, every parameter is filled."""
    from safetensors.torch import load_file

    out, target_ids = exported
    loaded: list[tuple[str, Any]] = []

    class Param:
        def __init__(self, name):
            self.name = name

        def weight_loader(self, param, weight, shard_id=None):
            loaded.append((param.name, shard_id))

    load_weights = compile_sglang_def(_method("models/llama_eagle3.py", "LlamaForCausalLMEagle3", "load_weights"),
                               {"torch": torch, "default_weight_loader": None})
    host = SimpleNamespace(hot_token_id=None, named_parameters=lambda: [(n, Param(n)) for n in _EAGLE3_PARAMS])
    tensors = load_file(str(out / "model.safetensors"))
    for name, tensor in tensors.items():
        before = len(loaded) + (host.hot_token_id is not None)
        load_weights(host, [(name, tensor)])
        assert name == "t2d" or len(loaded) + (host.hot_token_id is not None) > before, f"{name} silently skipped"
    assert sorted(loaded, key=str) == sorted(
        [(p, None) for p in _EAGLE3_PARAMS if "qkv" not in p and "gate_up" not in p and "embed" not in p]
        + [("model.layers.0.self_attn.qkv_proj.weight", s) for s in "qkv"]
        + [("model.layers.0.mlp.gate_up_proj.weight", s) for s in (0, 1)], key=str)
    assert torch.equal(host.hot_token_id, target_ids)  # d2t + arange = the draft tokens' target ids


def _config_reads(rel: str, cls: str) -> set[str]:
    """Config attributes a class reads without a fallback (``getattr(config, name, default)`` has one)."""
    nodes = list(ast.walk(_class(rel, cls)))
    direct = {n.attr for n in nodes if isinstance(n, ast.Attribute) and ast.unparse(n.value) in ("config", "self.config")}
    guarded = {
        n.args[1].value for n in nodes
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "getattr" and len(n.args) == 3
        and isinstance(n.args[1], ast.Constant)
    }
    return direct - guarded


def test_exported_config_carries_every_field_sglang_reads(exported):
    from transformers import LlamaConfig

    out, _ = exported
    raw = json.loads((out / "config.json").read_text())
    hf = LlamaConfig(**raw)  # SGLang reads the draft config through transformers
    reads = (
        _config_reads("models/llama_eagle3.py", "LlamaDecoderLayer") | _config_reads("models/llama_eagle3.py", "LlamaModel")
        | _config_reads("models/llama_eagle3.py", "LlamaForCausalLMEagle3")
        | _config_reads("models/llama.py", "LlamaDecoderLayer") | _config_reads("models/llama.py", "LlamaMLP")
    )
    assert {"draft_vocab_size", "hidden_size", "rms_norm_eps", "tie_word_embeddings"} <= reads
    missing = sorted(r for r in reads if not hasattr(hf, r) and r != "intermediate_size_mlp")  # llama4 only
    assert not missing, missing
    assert raw["draft_vocab_size"] == 48 and raw["target_hidden_size"] == 32 and raw["tie_word_embeddings"] is False
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 11, 20]  # llama: HF k -> k - 1


# --- presets and benchmark arithmetic ---------------------------------------------------------------

NCCL = {"NCCL_PROTO": "LL", "NCCL_ALGO": "Ring", "NCCL_P2P_LEVEL": "SYS", "NCCL_MAX_NCHANNELS": "16",
        "NCCL_BUFFSIZE": "16777216", "NCCL_NTHREADS": "512"}


@pytest.mark.parametrize("name, model_type, layers, tp", [
    ("llama3.1-8b", "llama", 32, 1), ("deepseek-v3", "deepseek_v3", 61, 8), ("kimi-k2.5", "kimi_k2", 61, 8)])
def test_presets_load_and_translate(name, model_type, layers, tp):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.target.backend == "sglang" and cfg.target.tp_size == tp and cfg.vocab.draft_vocab_size == 32000
    assert cfg.target.aux_layers == default_aux_layers(layers)
    sglang_aux_ids(cfg.target.aux_layers, model_type, layers)
    extra = cfg.target.sglang.extra_engine_kwargs
    check_extra_kwargs(extra, "capture")
    assert set(extra) <= FIELDS, set(extra) - FIELDS
    if tp == 8:
        assert cfg.ray.env_vars == NCCL


def test_benchmark_reads_the_counters_sglang_fills():
    """bench/sglang_bench.py reads tau and the histogram from meta_info keys this SGLang fills, and
    sizes the CUDA graphs through a ServerArgs field it has; the bench's kwargs are all fields."""
    source = (SRT / "managers/tokenizer_manager.py").read_text()
    assert '"completion_tokens"' in source and 'meta_info["spec_verify_ct"]' in source
    assert 'meta_info["spec_correct_drafts_histogram"]' in source
    # the histogram counts verify steps by drafts accepted, bonus token not counted
    assert "update_spec_correct_drafts_histogram(num_correct_drafts)" in (
        SRT / "managers/scheduler_components/batch_result_processor.py").read_text()
    from eagle3_ray.bench import sglang_bench as sb

    assert GRAPH_MAX_BS in FIELDS
    cfg = load_config(REPO / "configs" / "smollm2-h200.yaml")
    for mode in ("plain", "chain", "tree"):
        kw = sb.mode_kwargs(cfg, mode, "/drafter", FIELDS)
        check_server_args(kw)
        assert kw[GRAPH_MAX_BS] == max(cfg.bench.concurrency) and "disable_cuda_graph" not in kw
    record = sb.request_record({"output_ids": [1, 2], "meta_info": {"completion_tokens": 9, "spec_verify_ct": 3,
                                                                    "spec_correct_drafts_histogram": [0, 1, 2]}}, 1.0)
    row = sb.summarize([record])
    assert row["tau"] == pytest.approx(8 / 3) and row["accept_length"] == 3.0 and row["accept_histogram"] == [0, 1, 2]


def _async_method(rel: str, cls: str, name: str) -> ast.AsyncFunctionDef:
    found = [n for n in _class(rel, cls).body if isinstance(n, ast.AsyncFunctionDef) and n.name == name]
    assert found, f"async {cls}.{name} is gone from sglang/srt/{rel}"
    return found[0]


def test_engine_answers_calls_as_coroutines_of_its_own_loop():
    """SGLangEngine runs ``Engine.loop`` in a thread of its own and awaits ``Engine.async_generate``
    there: pin that the engine keeps its loop in ``self.loop``, that ``async_generate`` takes the
    arguments we pass, and that it answers a batch as ``generate`` does (the generator's first item)."""
    init = _method("entrypoints/engine.py", "Engine", "__init__")
    assert any(isinstance(n, ast.Assign) and any(ast.unparse(t) == "self.loop" for t in n.targets)
               for n in ast.walk(init)), "Engine.__init__ no longer sets self.loop"
    agen = _async_method("entrypoints/engine.py", "Engine", "async_generate")
    params = {a.arg for a in agen.args.args + agen.args.kwonlyargs}
    assert {"input_ids", "sampling_params", "rid"} <= params
    body = ast.unparse(agen)
    assert "self.tokenizer_manager.generate_request(obj, None)" in body
    assert "return await generator.__anext__()" in body  # not streaming: the batch's answers at once
    gen = ast.unparse(_method("entrypoints/engine.py", "Engine", "generate"))
    assert "self.loop.run_until_complete(generator.__anext__())" in gen  # the same answer, on the same loop
    # Stopping an engine cancels what is left on its loop, the tokenizer manager's handle_loop among
    # them: its wrapper kills this whole process tree on an Exception, which CancelledError is not.
    wrapper = [n for n in _tree("managers/tokenizer_manager.py").body
               if isinstance(n, ast.AsyncFunctionDef) and n.name == "print_exception_wrapper"]
    assert wrapper, "print_exception_wrapper is gone from managers/tokenizer_manager.py"
    handlers = [h for h in ast.walk(wrapper[0]) if isinstance(h, ast.ExceptHandler)]
    assert handlers and all(h.type is not None and ast.unparse(h.type) == "Exception" for h in handlers)


class FakeSGLangEngineOnALoop:
    """FAKE ``sglang.Engine`` (the real one needs CUDA): as the real one, it answers on its asyncio
    loop (``engine.loop``); its blocking ``generate`` runs that loop and fails when it is already
    running ("this event loop is already running"), which is what a second thread meets."""

    def __init__(self):
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.calls = self.in_flight = self.max_in_flight = 0

    def shutdown(self):
        pass

    def generate(self, input_ids, sampling_params, rid=None):
        return self.loop.run_until_complete(self.async_generate(input_ids, sampling_params, rid))

    async def async_generate(self, input_ids, sampling_params, rid=None):
        import asyncio

        assert asyncio.get_running_loop() is self.loop
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.05)
        self.in_flight -= 1
        self.calls += 1
        return [{"output_ids": [7, len(s)], "meta_info": {"id": r}} for s, r in zip(input_ids, rid or [None] * len(input_ids))]


def test_generate_calls_from_threads_share_the_engines_loop(target_dir):
    """The generate stage calls from threads: each call is a coroutine on the engine's own loop (run by
    one thread of SGLangEngine), so they are inside SGLang together and each gets its own answers."""
    from concurrent.futures import ThreadPoolExecutor

    engine = SGLangEngine(_target(target_dir, tp_size=1), mode="generate",
                          engine_factory=lambda **kw: FakeSGLangEngineOnALoop())
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda n: engine.generate([[1] * n], max_new_tokens=1), range(1, 9)))
        assert outs == [[[7, n]] for n in range(1, 9)] and engine._engine.calls == 8
        assert engine._engine.max_in_flight > 1
    finally:
        engine.close()


def test_a_generate_engine_captures_graphs_up_to_the_batch_it_is_sent(target_dir):
    """The generate stage sends generate.batch_size requests per call (512 in the H200 preset), above
    SGLang's default graph bound on an H100 or H200 (256): the engine is built with graphs up to that
    batch and runs at most that many requests at once (real ServerArgs fields); the user's own graph
    settings win, and graphs off stay off."""
    def built_with(**changes):
        seen = []

        def factory(**kw):
            seen.append(kw)
            return FakeSGLangEngineOnALoop()

        engine = SGLangEngine(_target(target_dir, tp_size=1, **changes), mode="generate", engine_factory=factory,
                              max_batch=512)
        engine.close()
        check_server_args(seen[0])
        return seen[0]

    kw = built_with()
    assert kw[GRAPH_MAX_BS] == 512 and kw["max_running_requests"] == 512 and not kw.get("disable_cuda_graph")
    assert "max_running_requests" in FIELDS  # a real field: check_server_args above would refuse it otherwise
    # SGLangEngine keeps several calls queued; SGLang runs one batch of them, each step on a graph
    assert SGLangEngine.calls_in_flight > 1
    own = built_with(sglang={"extra_engine_kwargs": {GRAPH_MAX_BS: 64}})
    assert own[GRAPH_MAX_BS] == 64 and "max_running_requests" not in own
    assert built_with(sglang={"extra_engine_kwargs": {"max_running_requests": 2048}})["max_running_requests"] == 2048
    off = built_with(sglang={"extra_engine_kwargs": {"disable_cuda_graph": True}})
    assert GRAPH_MAX_BS not in off and "max_running_requests" not in off
    # prefill graphs off (benchmarks/device/serving.sh generate, sglang-noprefill): decode graphs still sized
    if "cuda_graph_backend_prefill" in FIELDS:
        no_prefill = built_with(sglang={"extra_engine_kwargs": {"cuda_graph_backend_prefill": "disabled"}})
        assert no_prefill[GRAPH_MAX_BS] == 512 and no_prefill["max_running_requests"] == 512
    # capture never sizes graphs (they are off there), and without max_batch SGLang's default stands
    assert GRAPH_MAX_BS not in engine_kwargs(_target(target_dir, tp_size=1), "generate")


def test_an_engine_without_a_loop_is_refused(target_dir):
    class NoLoop:
        def shutdown(self):
            pass

    with pytest.raises(EngineError, match="no asyncio loop"):
        SGLangEngine(_target(target_dir, tp_size=1), mode="generate", engine_factory=lambda **kw: NoLoop())


def test_a_capture_dir_without_hard_links_is_refused_before_sglang_starts(target_dir, tmp_path, monkeypatch):
    """The hook links each batch's file once per request; a filesystem without hard links (os.link
    made to fail here, as such a filesystem's does) stops the engine before SGLang is built."""
    import errno

    def no_links(src, dst, *a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")

    built = []
    monkeypatch.setattr(os, "link", no_links)
    cfg = _target(target_dir, tp_size=1, sglang={"capture_dir": str(tmp_path / "cap")})
    with pytest.raises(ConfigError, match="does not support hard links.*/dev/shm"):
        SGLangEngine(cfg, mode="capture", engine_factory=lambda **kw: built.append(kw))
    assert built == [] and list((tmp_path / "cap").iterdir()) == []  # nothing started, nothing left


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hook_files_are_safetensors_both_ways(tmp_path, dtype):
    """The hook writes one safetensors file per batch by hand (no extra copies), linked once per
    request, and the engine maps it (no copy) and takes the request's rows: safetensors' own reader
    reads the hook's files, and the engine reads safetensors' own files."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3_ray.engines.sglang_hooks import write_linked

    aux, last = torch.randn(5, 12).to(dtype), torch.randn(5, 4).to(dtype)
    write_linked(tmp_path, [("a", 2, 0), ("b", 3, 0)], aux, last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.safetensors"]  # no temporary left
    assert capture_path(tmp_path, "a").stat().st_nlink == 2  # one file, two links
    with safe_open(str(capture_path(tmp_path, "b")), "pt") as f:
        assert torch.equal(f.get_tensor("aux_hidden"), aux) and torch.equal(f.get_tensor("last_hidden"), last)
        assert json.loads(f.metadata()["requests"]) == {"a": [0, 2, 0], "b": [2, 3, 0]}
    cap = read_capture(capture_path(tmp_path, "b"), 3, hidden_size=4)
    assert torch.equal(cap.aux_hidden, aux[2:]) and torch.equal(cap.last_hidden, last[2:])
    cap = read_capture(capture_path(tmp_path, "a"), 2, hidden_size=4)
    assert torch.equal(cap.aux_hidden, aux[:2]) and torch.equal(cap.last_hidden, last[:2])
    assert list(tmp_path.iterdir()) == []
    save_file({"aux_hidden": aux, "last_hidden": last}, str(tmp_path / "c.safetensors"),
              metadata={"requests": json.dumps({"c": [0, 5, 0]})})
    cap = read_capture(tmp_path / "c.safetensors", 5, hidden_size=4)
    assert torch.equal(cap.aux_hidden, aux) and torch.equal(cap.last_hidden, last)
    assert not list(tmp_path.glob("c*"))


def test_a_capture_file_without_the_request_is_refused(tmp_path):
    from eagle3_ray.engines.sglang_hooks import write_linked

    write_linked(tmp_path, [("a", 2, 0)], torch.randn(2, 12), torch.randn(2, 4))
    capture_path(tmp_path, "a").rename(capture_path(tmp_path, "z"))  # a link whose name is not in the file
    with pytest.raises(EngineError, match="holds no rows of request z"):
        read_capture(capture_path(tmp_path, "z"), 2, hidden_size=4)


def test_several_writer_threads_write_every_request_and_flush_waits_for_all(tmp_path):
    """_Writer(3): batches handed over back to back are written by whichever thread is free; flush
    returns only when all of them are on disk; the stats add up over the threads."""
    from eagle3_ray.engines.sglang_hooks import _Writer

    w = _Writer(3)
    want = {}
    for b in range(7):
        n = [3, 5]
        aux, last = torch.randn(sum(n), 12), torch.randn(sum(n), 4)
        reqs = [(f"b{b}-{i}", k, 0) for i, k in enumerate(n)]
        w.put(tmp_path, reqs, aux, last, None)
        want[f"b{b}-0"], want[f"b{b}-1"] = (aux[:3], last[:3]), (aux[3:], last[3:])
    w.flush(timeout=30)
    for rid, (a, h) in want.items():
        cap = read_capture(capture_path(tmp_path, rid), a.shape[0], hidden_size=4)
        assert torch.equal(cap.aux_hidden, a) and torch.equal(cap.last_hidden, h)
    st = w.stats()
    assert st["writers"] == 3 and st["batches"] == 7 and st["rows"] == 56 and st["bytes"] == 56 * 16 * 4
    assert _left(tmp_path) == []


def test_the_writer_count_comes_from_the_environment_and_a_bad_value_falls_back(monkeypatch, caplog):
    from eagle3_ray.engines.sglang_hooks import DEFAULT_WRITERS, WRITERS_ENV, _writer_count

    monkeypatch.setenv(WRITERS_ENV, "3")
    assert _writer_count() == 3
    monkeypatch.delenv(WRITERS_ENV)
    assert _writer_count() == DEFAULT_WRITERS
    monkeypatch.setenv(WRITERS_ENV, "two")
    with caplog.at_level("ERROR"):
        assert _writer_count() == DEFAULT_WRITERS
    assert "EAGLE3_RAY_CAPTURE_WRITERS='two' is not a positive integer" in caplog.text
