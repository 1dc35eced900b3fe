"""The capture audit inside SGLang's processes (engines/sglang_hooks.py: audit_rows), against the real
source of one SGLang version: what the hook reads (the logits processor's lm_head argument, the forward
batch's input ids, a vocab-parallel lm_head's shard layout) and that its figures equal those of the
whole vocab, at TP 1 through SGLang's own hook manager and at TP 2 on two real gloo ranks whose
lm_head slices are laid out by SGLang's own ``VocabParallelEmbedding._get_indices``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from eagle3_ray.audit.rows import audit_positions, row_figures
from eagle3_ray.engines.sglang_args import AUX_FLAG, engine_kwargs
from eagle3_ray.engines.sglang_capture import read_capture
from eagle3_ray.engines.sglang_hooks import LM_HEAD_ARG, capture_path, flush

from conftest import compile_sglang_def  # noqa: E402
from test_contract import (  # noqa: E402,F401  (fixtures)
    REPO,
    SRT,
    TinyTargetWithLogitsProcessor,
    _class,
    _forward_batch,
    _method,
    _target,
    forward_batch_cls,
    forward_mode,
    target_dir,
)

VOCAB_FILE = "layers/vocab_parallel_embedding.py"


def test_the_hook_reads_the_lm_head_and_input_ids_where_sglang_passes_them(forward_batch_cls):
    args = [a.arg for a in _method("layers/logits_processor.py", "LogitsProcessor", "forward").args.args][1:]
    assert args[LM_HEAD_ARG] == "lm_head"
    for rel, cls in [("models/llama.py", "LlamaForCausalLM"), ("models/deepseek_v2.py", "DeepseekV2ForCausalLM")]:
        calls = [c for c in ast.walk(_method(rel, cls, "forward"))
                 if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.logits_processor"]
        assert all(ast.unparse(c.args[LM_HEAD_ARG]) == "self.lm_head" for c in calls), rel
    assert "input_ids" in {f.name for f in fields(forward_batch_cls)}


def test_a_vocab_parallel_lm_head_keeps_its_slice_of_the_vocab_first_where_the_hook_reads_it():
    init = ast.unparse(_method(VOCAB_FILE, "VocabParallelEmbedding", "__init__"))
    for attr in ("self.shard_indices = self._get_indices(", "self.tp_size = ", "self.use_attn_tp_group = "):
        assert attr in init, attr
    indices = _class(VOCAB_FILE, "VocabParallelEmbeddingShardIndices")
    assert "org_vocab_start_index" in ast.unparse(indices) and "def num_org_elements" in ast.unparse(indices)
    loader = ast.unparse(_method(VOCAB_FILE, "VocabParallelEmbedding", "weight_loader"))
    # rank r's rows 0 .. num_org_elements-1 hold ids org_vocab_start_index ..: the checkpoint's narrow copied first
    assert "start_idx = self.shard_indices.org_vocab_start_index" in loader
    assert "loaded_weight.narrow(output_dim, start_idx, shard_size)" in loader
    assert "param[:loaded_weight.shape[0]].data.copy_(loaded_weight)" in loader


def sglang_slices(vocab: int, tp: int) -> list[dict[str, int]]:
    """Each TP rank's (first id, ids, rows with padding) of SGLang's ParallelLMHead of ``vocab`` ids,
    computed by SGLang's own code (compiled from its source)."""
    tree = ast.parse((SRT / VOCAB_FILE).read_text(encoding="utf-8"))
    ns: dict = {"dataclass": dataclass, "Optional": Optional, "List": list, "Tuple": tuple}
    for node in ast.parse((SRT / "distributed/utils.py").read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef) and node.name in ("divide", "ensure_divisibility"):
            compile_sglang_def(node, ns)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in ("pad_vocab_size", "vocab_range_from_per_partition_vocab_size",
                                                                "vocab_range_from_global_vocab_size"):
            compile_sglang_def(node, ns)
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "DEFAULT_VOCAB_PADDING_SIZE":
            exec(ast.unparse(node), ns)
    compile_sglang_def(_class(VOCAB_FILE, "VocabParallelEmbeddingShardIndices"), ns)
    get_indices = compile_sglang_def(_method(VOCAB_FILE, "VocabParallelEmbedding", "_get_indices"), ns,
                                     keep_decorators=set())
    padding = ns["DEFAULT_VOCAB_PADDING_SIZE"]
    if ns["pad_vocab_size"](vocab, padding) % tp:  # as VocabParallelEmbedding.__init__ does
        padding *= tp
    padded = ns["pad_vocab_size"](vocab, padding)
    out = []
    for rank in range(tp):
        idx = get_indices(None, padded, padded, vocab, vocab, rank, tp)
        out.append({"start": idx.org_vocab_start_index, "count": idx.num_org_elements, "rows": padded // tp})
    return out


def _reference(hidden, weight, input_ids, lens, share):
    """Per request, the figures of its audit positions from the whole vocab (audit/rows.py's math,
    checked against the full logits in tests/test_capture_audit.py)."""
    out, start = [], 0
    for n in lens:
        pos = audit_positions(n, share)
        out.append(row_figures(hidden[start + pos], weight, input_ids[start + pos + 1], pos))
        start += n
    return out


def test_the_hook_computes_the_audit_figures_of_the_whole_vocab_at_tp_1(target_dir, tmp_path, forward_batch_cls,
                                                                        forward_mode):
    from sglang.srt.model_executor.hook_manager import register_forward_hooks

    hooks = engine_kwargs(_target(target_dir, tp_size=1), "capture", capture_dir=tmp_path,
                          fields=frozenset({AUX_FLAG}), audit_share=0.5)["forward_hooks"]
    assert hooks[-1]["config"]["audit_share"] == 0.5
    model = TinyTargetWithLogitsProcessor(hidden=64, vocab=512)
    register_forward_hooks(model, hooks)
    torch.manual_seed(0)
    lens, rids = [9, 5], ["q-a", "q-b"]
    ids, last, aux = torch.randint(0, 512, (14,)), torch.randn(14, 64), torch.randn(14, 192)
    batch = _forward_batch(forward_batch_cls, forward_mode.EXTEND, rids, lens)
    batch.input_ids = ids
    model(ids, last, batch, aux)
    flush(timeout=30)
    want = _reference(last, model.lm_head.weight.detach(), ids, lens, 0.5)
    for rid, n, ref in zip(rids, lens, want):
        got = read_capture(capture_path(tmp_path, rid), n, hidden_size=64).audit
        assert torch.equal(got.positions, ref.positions) and torch.equal(got.argmax, ref.argmax)
        assert torch.allclose(got.nll, ref.nll, atol=1e-4) and torch.allclose(got.entropy, ref.entropy, atol=1e-4)


_RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, types, torch, torch.distributed as dist
    rank, init, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    spec = json.load(open(out + "/spec.json"))
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
    from eagle3_ray.engines.sglang_capture import read_capture
    from eagle3_ray.engines.sglang_hooks import capture_hook_factory, capture_path, flush
    torch.manual_seed(0)  # the same weights and batch on both ranks
    full, hidden = torch.randn(spec["vocab"], 16), torch.randn(sum(spec["lens"]), 16)
    ids = torch.randint(0, spec["vocab"], (sum(spec["lens"]),))
    mine = spec["slices"][rank]
    lm_head = torch.nn.Module()  # SGLang's ParallelLMHead's layout: its slice, then padding rows
    pad = torch.full((mine["rows"] - mine["count"], 16), 1e4)  # never read: they would win every argmax
    lm_head.weight = torch.nn.Parameter(torch.cat([full[mine["start"]:mine["start"] + mine["count"]], pad]))
    lm_head.shard_indices = types.SimpleNamespace(org_vocab_start_index=mine["start"], num_org_elements=mine["count"])
    lm_head.tp_size, lm_head.use_attn_tp_group = 2, False
    mode = types.SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    batch = types.SimpleNamespace(forward_mode=mode, rids=spec["rids"], extend_seq_lens_cpu=spec["lens"],
                                  extend_prefix_lens_cpu=[0] * len(spec["lens"]), input_ids=ids)
    hook = capture_hook_factory({"dir": out + "/shm", "tp_size": 2, "audit_share": spec["share"]})
    hook(None, (ids, hidden, lm_head, batch, torch.zeros(len(ids), 48)), None)
    if rank == 0:
        flush(timeout=60)
        got = {rid: read_capture(capture_path(out + "/shm", rid), n, 16).audit for rid, n in zip(spec["rids"], spec["lens"])}
        json.dump({rid: [f.positions.tolist(), f.nll.tolist(), f.entropy.tolist(), f.argmax.tolist()]
                   for rid, f in got.items()}, open(out + "/got.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


def test_two_tp_ranks_gather_their_vocab_slices_to_the_figures_of_the_whole_vocab(tmp_path):
    vocab, lens, rids, share = 1000, [11, 7], ["r-a", "r-b"], 1.0
    slices = sglang_slices(vocab, 2)
    assert slices[1]["start"] == slices[0]["count"] and sum(s["count"] for s in slices) == vocab
    assert slices[1]["rows"] > slices[1]["count"]  # the last slice carries padding rows
    (tmp_path / "spec.json").write_text(json.dumps({"vocab": vocab, "lens": lens, "rids": rids, "share": share,
                                                    "slices": slices}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_SCRIPT, str(r), str(tmp_path / "init"), str(tmp_path)],
                              env=env) for r in (0, 1)]
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    got = json.loads((tmp_path / "got.json").read_text())
    torch.manual_seed(0)
    full, hidden = torch.randn(vocab, 16), torch.randn(sum(lens), 16)
    ids = torch.randint(0, vocab, (sum(lens),))
    for rid, ref in zip(rids, _reference(hidden, full, ids, lens, share)):
        positions, nll, entropy, argmax = got[rid]
        assert positions == ref.positions.tolist() and argmax == ref.argmax.tolist()
        assert torch.allclose(torch.tensor(nll), ref.nll, atol=1e-4)
        assert torch.allclose(torch.tensor(entropy), ref.entropy, atol=1e-4)
    # rank 1 computed its share and wrote nothing: rank 0's files were each read once and are gone
    assert sorted(p.name for p in (tmp_path / "shm").iterdir() if p.suffix == ".safetensors") == []
