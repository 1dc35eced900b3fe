"""What a long sample meets in SGLang's capture, against the real source of one version (conftest.py:
run once per version). docs/data.md, "Long samples", states these facts; an SGLang that changes one
fails here.

- The input limit: ``TokenizerManager._validate_one_request`` refuses an input of ``context_len``
  tokens or more (and an input + ``max_new_tokens`` over it: capture asks for 1 new token), and the
  scheduler aborts one of ``max_req_input_len`` = min(context_len - 1, KV pool tokens - 1) - 5 or
  more (``validate_input_length``, ``TpModelWorker.get_worker_info``): with a KV pool larger than the
  window, the longest sample captured is context_len - 7 tokens. Refused with a message, never cut,
  unless ``allow_auto_truncate`` (default False) is set: then SGLang cuts the input to the limit and
  the capture's row check fails on the missing rows.
- Without chunked prefill (capture forces ``chunked_prefill_size=-1``) a request longer than
  ``max_prefill_tokens`` still runs, alone, in one forward: the scheduler admits the first request of
  a prefill batch whatever its length (``PrefillAdder``).
- Its memory: with chunked prefill off SGLang sizes the activation reserve left outside
  ``mem_fraction_static`` for max(max_prefill_tokens, 2048) tokens (16,384 by default), not for the
  longest sample: a longer one runs past what the reserve assumed.

Modules that need CUDA builds to import are read from the source (test_contract.py's way).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
from types import SimpleNamespace

import sglang.srt.server_args as server_args

from eagle3_ray.engines.sglang_args import CAPTURE_FORCED, engine_kwargs, server_args_fields

from conftest import compile_sglang_def, source_root  # noqa: E402

SRT = source_root() / "srt"


def _tree(rel: str) -> ast.Module:
    return ast.parse((SRT / rel).read_text(encoding="utf-8"))


def _function(rel: str, name: str, cls: str | None = None) -> ast.FunctionDef:
    body = _tree(rel).body
    if cls is not None:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == cls]
        assert classes, f"class {cls} is gone from sglang/srt/{rel}"
        body = classes[0].body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{cls + '.' if cls else ''}{name} is gone from sglang/srt/{rel}"
    return found[0]




def _defaults() -> dict:
    cls = server_args.ServerArgs
    if hasattr(cls, "__struct_fields__"):  # 0.5.23: a msgspec Struct
        import msgspec

        return {f.name: f.default for f in msgspec.structs.fields(cls)}
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _ifs(fn: ast.AST) -> list[str]:
    return [ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, ast.If)]


def test_the_tokenizer_manager_refuses_an_input_of_the_context_length():
    fn = _function("managers/tokenizer_manager.py", "_validate_one_request", "TokenizerManager")
    (gate,) = [n for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "input_token_num >= self.context_len"]
    (choice,) = gate.body  # if self.allow_auto_truncate: cut, else: raise ValueError
    assert ast.unparse(choice.test) == "self.allow_auto_truncate"
    assert any(ast.unparse(n) == "del input_ids[_max_req_len:]" for n in choice.body)
    (refusal,) = choice.orelse
    assert isinstance(refusal, ast.Raise) and ast.unparse(refusal.exc.func) == "ValueError"
    assert "_max_req_len = self.context_len" in ast.unparse(fn)
    # capture's one new token: input + 1 <= context_len too (the check above already implies it)
    assert "self.validate_total_tokens and max_new_tokens is not None and (max_new_tokens + input_token_num > " \
           "_max_req_len)" in _ifs(fn)


def test_the_scheduler_refuses_from_the_context_length_less_6_and_cuts_only_when_told():
    worker = ast.unparse(_function("managers/tp_worker.py", "get_worker_info", "TpModelWorker"))
    assert "max_req_len = min(self.model_config.context_len - 1," in worker and "max_req_len - 5" in worker
    validate = compile_sglang_def(_function("managers/utils.py", "validate_input_length"),
                         {"logger": logging.getLogger("sglang-contract")})
    limit = 8192 - 1 - 5  # SmolLM2's window, a KV pool larger than it
    assert validate(SimpleNamespace(origin_input_ids=list(range(limit - 1))), limit, False) is None
    refused = SimpleNamespace(origin_input_ids=list(range(limit)))
    assert f"({limit} tokens) exceeds the maximum allowed length ({limit} tokens)" in validate(refused, limit, False)
    assert len(refused.origin_input_ids) == limit  # refused whole
    cut = SimpleNamespace(origin_input_ids=list(range(limit + 100)))
    assert validate(cut, limit, True) is None and len(cut.origin_input_ids) == limit  # allow_auto_truncate: cut
    calls = [c for c in ast.walk(_tree("managers/scheduler.py")) if isinstance(c, ast.Call)
             and ast.unparse(c.func) == "validate_input_length"]
    assert calls and all(ast.unparse(c.args[2]) == "get_serving().allow_auto_truncate" for c in calls)
    assert _defaults()["allow_auto_truncate"] is False


def test_without_chunked_prefill_the_first_request_runs_whatever_its_length():
    rel = "managers/schedule_policy.py"
    body = _tree(rel)
    gates = [t for t in _ifs(body) if "self.rem_chunk_tokens is None" in t and "rem_input_tokens" in t]
    # the cap on prefill tokens holds only once the batch has a request ("can_run_list" non-empty)
    assert gates and all("can_run_list" in t for t in gates), gates
    assert _defaults()["max_prefill_tokens"] == 16384


def test_with_chunked_prefill_off_the_activation_reserve_counts_max_prefill_tokens():
    rel = "arg_groups/memory_hook.py" if (SRT / "arg_groups/memory_hook.py").is_file() else "server_args.py"
    text = ast.unparse(_tree(rel))
    prefix = "cfg" if rel.startswith("arg_groups") else "self"
    assert f"activation_tokens = max({prefix}.max_prefill_tokens, 2048)" in text
    assert f"activation_tokens = max({prefix}.chunked_prefill_size, 2048)" in text
    assert "reserved_mem += activation_tokens * 1.5" in text


def test_capture_keeps_chunked_prefill_off_and_the_length_knobs_at_sglangs_own(target, tmp_path):
    """engine_kwargs leaves the window and the prefill budget to SGLang; a long-sample run passes them
    (as the long-capture run of record long_capture_32k did: context_length past max_position_embeddings needs
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, max_prefill_tokens sizes the activation reserve)."""
    kw = engine_kwargs(target, "capture", capture_dir=tmp_path)
    assert kw["chunked_prefill_size"] == -1 and CAPTURE_FORCED["chunked_prefill_size"][0] == -1
    knobs = {"context_length": 32775, "max_prefill_tokens": 32768}
    assert not set(knobs) & set(kw) and "allow_auto_truncate" not in kw
    long = target.model_copy(update={"sglang": target.sglang.model_copy(update={"extra_engine_kwargs": knobs})})
    kw = engine_kwargs(long, "capture", capture_dir=tmp_path)
    assert {k: kw[k] for k in knobs} == knobs and set(knobs) <= server_args_fields()


def test_the_engine_hands_the_schedulers_input_limit_to_the_tokenizer_manager():
    """SGLangEngine.capture reads ``engine.tokenizer_manager.max_req_input_len`` to refuse a too-long
    sample itself (tests/sglang_contract/test_restart.py); the engine sets it from the scheduler."""
    text = (SRT / "entrypoints" / "engine.py").read_text()
    assert "tokenizer_manager.max_req_input_len = " in text and '"max_req_input_len"' in text


def test_capture_refuses_auto_truncation(target, tmp_path):
    from eagle3_ray.errors import ConfigError

    cut = target.model_copy(update={"sglang": target.sglang.model_copy(
        update={"extra_engine_kwargs": {"allow_auto_truncate": True}})})
    import pytest

    with pytest.raises(ConfigError, match="allow_auto_truncate"):
        engine_kwargs(cut, "capture", capture_dir=tmp_path)
