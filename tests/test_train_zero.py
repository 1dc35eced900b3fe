"""The ZeRO stage of the Kimi-K2.5 preset through the real Ray Train + DeepSpeed loop on CPU (gloo)."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_ray.config import load_config

CI_CONFIG = "configs/ci-tiny.yaml"


def _preset_stage() -> int:
    return load_config("configs/kimi-k2.5.yaml").train.zero_stage


def test_kimi_preset_zero_stage_trains_on_two_workers(ci_tiny_inputs, tmp_path):
    from safetensors.torch import load_file

    from eagle3_ray.drafter.model import DrafterConfig, Eagle3Drafter
    from eagle3_ray.train.checkpoint import read_train_state
    from eagle3_ray.train.trainer import run_training

    stage = _preset_stage()
    assert stage >= 2, "the preset's stage partitions gradients; ZeRO-1 is covered by test_train.py"
    # Two ranks: with one, ZeRO's gradient and optimizer-state partitions are the whole model.
    cfg = load_config(CI_CONFIG, [f"train.zero_stage={stage}", "train.num_workers=2", "train.max_steps=2",
                                  "train.log_every=1", "train.checkpoint_every=2"])
    out = tmp_path / "train"
    ckpt = run_training(cfg, ci_tiny_inputs / "features", ci_tiny_inputs / "vocab", out)

    state = read_train_state(ckpt)
    assert state["step"] == 2 and state["zero_stage"] == stage and state["world_size"] == 2
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    assert all(m["loss"] == m["loss"] and m["loss"] > 0 for m in lines)
    # Each rank saved its own partition of the optimizer state.
    assert len(list((ckpt / "ds").rglob("*optim_states*"))) == 2

    # The gathered weights moved from their seeded initialisation, by optimizer-sized steps.
    trained = load_file(str(ckpt / "drafter.safetensors"))
    dcfg = DrafterConfig.from_dict(json.loads((ckpt / "drafter_config.json").read_text()))
    torch.manual_seed(cfg.train.seed)
    init = Eagle3Drafter(dcfg).state_dict()
    moved = (trained["fc.weight"].float() - init["fc.weight"].float()).abs().max().item()
    assert 0 < moved < 100 * cfg.train.lr, moved
