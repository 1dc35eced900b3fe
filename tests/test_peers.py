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


def test_speculators_inputs_are_the_store_rows_in_its_layout(ci_tiny_inputs, tmp_path):
    """speculators 0.9.0's offline files (benchmarks/peers/speculators_inputs.py) from a real store: the
    training rows, then the held-out ones (its --train-data-ratio cuts exactly there), in the datasets
    ``save_to_disk`` layout it loads; hs_<row>.safetensors with the three aux states and a last state that
    its verifier_norm (RMSNorm, the target's gain) maps back onto the store's last_hidden; the training
    rows' loss-token counts; a rerun writes nothing. Its EAGLE-3 checkpoint (the layout of a CPU
    ``speculators train --dry-run``) exports to SGLang's, and what SGLang cannot serve is refused.
    speculators itself is not installed here (its own loader was checked with `speculators_inputs.py check`)."""
    from collections import Counter

    import pyarrow as pa
    from safetensors.torch import load_file, save_file

    from eagle3_ray.config import load_config, save_resolved
    from eagle3_ray.features import open_store
    from eagle3_ray.train.packing import split_store

    spi = _load("speculators_inputs")
    cfg_file = save_resolved(load_config("configs/ci-tiny.yaml", ["train.val_share=0.25"]), tmp_path)
    store = open_store(ci_tiny_inputs / "features")
    keep, held, _, _ = split_store(store.sample_ids, 0.25, 0, {}, [])
    out, H = tmp_path / "spec", store.meta.hidden_size
    args = ["inputs", "--features", str(ci_tiny_inputs / "features"), "--config", str(cfg_file), "--out", str(out)]
    assert spi.main(args) == 0
    summary = json.loads((out / "inputs.json").read_text())
    order = [*map(int, keep), *map(int, held)]
    assert summary["train_samples"] == len(keep) and summary["eval_samples"] == len(held) > 0
    assert int(len(order) * summary["train_data_ratio"]) == len(keep)
    assert summary["target_layer_ids"] == list(store.meta.aux_layers)
    data = out / "data"
    state = json.loads((data / "state.json").read_text())
    assert state["_format_type"] == "torch" and (data / "dataset_info.json").is_file()
    with pa.memory_map(str(data / state["_data_files"][0]["filename"])) as f:
        table = pa.ipc.open_stream(f).read_all()  # datasets' shard: an Arrow IPC stream
    assert table.num_rows == len(order) and table.schema.field("input_ids").type == pa.list_(pa.int64())
    target = load_file(out / "target" / "model.safetensors")  # the seeded random target, saved as its verifier
    w, eps = target["model.norm.weight"].float(), json.loads((out / "target" / "config.json").read_text())["rms_norm_eps"]
    freq: Counter = Counter()
    for k, i in enumerate(order):
        ref = store[i]
        ids, mask = torch.as_tensor(ref["input_ids"]).long(), torch.as_tensor(ref["loss_mask"]).long()
        T = len(ids)
        assert table["input_ids"][k].as_py() == ids.tolist() and table["loss_mask"][k].as_py() == mask.tolist()
        assert table["seq_len"][k].as_py() == T
        hs = load_file(data / "hidden_states" / f"hs_{k}.safetensors")
        assert torch.equal(hs["token_ids"], ids)
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (T, 4, H)
        assert torch.equal(hs["hidden_states"][:, :3].reshape(T, 3 * H), ref["aux_hidden"])
        y = ref["last_hidden"].float()
        assert (spi.rms_norm(hs["hidden_states"][:, 3], w, eps) - y).abs().max() <= 2**-7 * y.abs().max()
        if k < len(keep):
            freq.update(ids[mask.bool()].tolist())
    assert torch.load(data / "token_freq.pt", weights_only=True) == dict(freq)
    # a random target's gain is all ones; the inversion against a real-looking gain, on made-up states
    g = torch.Generator().manual_seed(0)
    gain = torch.rand(H, generator=g) * 3 + 0.05
    y = spi.rms_norm(torch.randn(16, H, generator=g).to(torch.bfloat16), gain, 1e-5)
    assert (spi.rms_norm(spi.pre_norm_state(y, gain), gain, 1e-5) - y).abs().max() <= 2**-7 * y.abs().max()
    assert spi.main(args) == 0 and json.loads((out / "inputs.json").read_text())["hs_written"] == 0

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tlc = {"model_type": "llama", "hidden_size": H, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": H // 2, "intermediate_size": 2 * H, "vocab_size": 300,
           "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           "layer_types": ["full_attention"], "sliding_window": 2048, "use_sliding_window": False}
    raw = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size": 8,
           "eagle_aux_hidden_state_layer_ids": list(store.meta.aux_layers), "norm_before_fc": True,
           "norm_before_residual": False, "norm_output": True, "fc_norm": False, "transformer_layer_config": tlc,
           "speculators_config": {"verifier": {"name_or_path": str(out / "target")}}}
    (ckpt / "config.json").write_text(json.dumps(raw))
    save_file({"d2t": torch.arange(8), "t2d": torch.zeros(300, dtype=torch.bool), "fc.weight": torch.zeros(H, 3 * H),
               "input_norm.weight": torch.ones(3 * H), "lm_head.weight": torch.zeros(8, H), "norm.weight": torch.ones(H),
               "layers.0.hidden_norm.weight": torch.ones(H), "embed_tokens.weight": torch.zeros(300, H),
               "verifier_lm_head.weight": torch.zeros(8, H)}, str(ckpt / "model.safetensors"))
    assert spi.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "sgl")]) == 0
    config = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 8
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [k - 1 for k in store.meta.aux_layers]
    assert config["norm_before_fc"] and config["norm_output"] and "layer_types" not in config
    weights = load_file(tmp_path / "sgl" / "model.safetensors")
    assert "embed_tokens.weight" not in weights and "verifier_lm_head.weight" not in weights  # SGLang shares the target's
    assert weights["d2t"].dtype == torch.int64 and weights["fc.weight"].dtype == torch.bfloat16
    for change, word in (({"norm_before_residual": True}, "norm-before-residual"),
                         ({"transformer_layer_config": {**tlc, "layer_types": ["sliding_attention"]}}, "full-attention")):
        (ckpt / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(SystemExit, match=word):
            spi.main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "refused")])
