"""CPU smoke tests of the peer-comparison scripts (benchmarks/peers/): SpecForge's trainer inputs written
from a real store of this project, the split they follow, and the SGLang tau bench's fixed turns and
arithmetic. SpecForge itself is a benchmark dependency only and is not installed here; the layout its
reader expects (``scripts/prepare_hidden_states.py`` and ``OfflineManifestReader`` of SpecForge 0.2.0:
``rows_<g>-<g+2000>/data_<i>.ckpt`` holding input_ids and loss_mask [T], hidden_state [1, T, H] and
aux_hidden_state [1, T, 3H]) is pinned here instead."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "peers" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_specforge_inputs_are_the_store_rows_in_its_layout(ci_tiny_inputs, tmp_path):
    """Every training sample of the store, split as training splits it (train.val_share, by prompt),
    lands in SpecForge's per-sample file with the same rows; the held-out ones in eval/; bytes per
    token of both formats are reported. A rerun writes nothing new."""
    from eagle3_ray.config import load_config, save_resolved
    from eagle3_ray.features import open_store
    from eagle3_ray.train.packing import split_store

    sfi = _load("specforge_inputs")
    cfg = load_config("configs/ci-tiny.yaml", ["train.val_share=0.25"])
    cfg_file = save_resolved(cfg, tmp_path)
    store = open_store(ci_tiny_inputs / "features")
    keep, held, _, _ = split_store(store.sample_ids, 0.25, cfg.train.seed, {}, [])
    assert len(held) > 0 and len(keep) + len(held) == len(store)
    out = tmp_path / "sf"
    assert sfi.main(["--features", str(ci_tiny_inputs / "features"), "--config", str(cfg_file),
                     "--out", str(out)]) == 0
    summary = json.loads((out / "inputs.json").read_text())
    assert summary["train"]["samples"] == len(keep) and summary["eval"]["samples"] == len(held)
    for split, indices in (("train", keep), ("eval", held)):
        for k, i in enumerate(indices):
            rec = torch.load(out / split / "rows_0-2000" / f"data_{k}.ckpt", weights_only=True)
            ref = store[int(i)]
            assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
            assert rec["input_ids"].dtype == torch.int64 and rec["hidden_state"].dtype == torch.bfloat16
            assert torch.equal(rec["input_ids"], torch.as_tensor(ref["input_ids"]).long())
            assert torch.equal(rec["loss_mask"], torch.as_tensor(ref["loss_mask"]).long())
            assert torch.equal(rec["hidden_state"][0], ref["last_hidden"])
            assert torch.equal(rec["aux_hidden_state"][0], ref["aux_hidden"])
    # a copy of the sample, not a view of the shard (torch.save of a view writes the whole storage)
    biggest = max(p.stat().st_size for p in (out / "train").rglob("*.ckpt"))
    assert biggest < 2 * max(store.lengths) * store.meta.hidden_size * 4 * 2 + 8192
    per_token = summary["eagle3ray_bytes_per_token"]["none"]
    assert per_token == pytest.approx(store.meta.hidden_size * 4 * 2 + 5, rel=0.05)
    assert summary["specforge_bytes_per_token"] > per_token
    again = sfi.main(["--features", str(ci_tiny_inputs / "features"), "--config", str(cfg_file), "--out", str(out)])
    assert again == 0 and json.loads((out / "inputs.json").read_text())["train"]["written"] == 0


def test_the_sglang_tau_bench_decodes_fixed_turns(smollm2_dir, tmp_path):
    """The turns come from the fixed answers (a second turn's prompt holds the first answer), a prompt
    without them is refused, and tau and its paired interval follow the project's definition."""
    from eagle3_ray.config import load_config
    from eagle3_ray.errors import DataError

    st = _load("sglang_tau")
    cfg = load_config("configs/smollm2-h200.yaml", [f"target.model={smollm2_dir}"])
    fixed = tmp_path / "fixed.jsonl"
    fixed.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "Shorter."],
                                 "answers": ["Hello there, friend."]}) + "\n")
    turns = st.fixed_turns(cfg, str(fixed))
    assert [t["turn"] for t in turns] == [0, 1]
    tok = __import__("transformers").AutoTokenizer.from_pretrained(smollm2_dir)
    assert "Hello there, friend." in tok.decode(turns[1]["ids"])
    assert "Hello there" not in tok.decode(turns[0]["ids"])
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi.", "Shorter."]}) + "\n")
    with pytest.raises(DataError, match="history"):
        st.fixed_turns(cfg, str(bare))
    a = [{"completion_tokens": 9, "spec_verify_ct": 4}, {"completion_tokens": 7, "spec_verify_ct": 2}]
    b = [{"completion_tokens": 9, "spec_verify_ct": 8}, {"completion_tokens": 7, "spec_verify_ct": 6}]
    assert st.tau_of(a) == pytest.approx((8 + 6) / 6)
    lo, hi = st.paired_interval(a, b)
    assert 0 < lo <= st.tau_of(a) - st.tau_of(b) <= hi
    assert np.isclose(st.paired_interval(a, a), 0).all()
