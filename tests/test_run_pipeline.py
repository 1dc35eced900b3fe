"""`eagle3-ray run` end to end on ci-tiny (real Ray, real DeepSpeed), and a rerun skips every stage.

The run is the session's one whole CLI run (conftest.py's ``ci_tiny_run``: stopped hard
mid-training and rerun to the end; test_fault_injection.py checks the resume)."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.config import load_config

STAGES = ("prepare", "extract", "vocab", "train", "export", "bench")


def test_run_writes_drafter_results_and_report_then_resumes(ci_tiny_run, ray_local, capsys):
    from eagle3_ray.drafter import load_drafter
    from eagle3_ray.pipeline import run_pipeline

    out = ci_tiny_run["out"]
    cfg = load_config("configs/ci-tiny.yaml", list(ci_tiny_run["overrides"]))
    drafter = load_drafter(out / "drafter")
    assert drafter.config.draft_vocab_size == cfg.vocab.draft_vocab_size
    results = json.loads((out / "bench" / "results.json").read_text())
    untrained = results["untrained"]
    assert untrained is not None  # seeded random weights: the floor
    for kind in ("chain", "tree", "untrained"):
        run = untrained if kind == "untrained" else results["modes"][kind]
        # fp32 on the CPU: speculative decoding is lossless, every turn equals greedy decoding
        assert run["identical_to_baseline"] == 1.0, (kind, run["identical_to_baseline"])
    # 12 steps do not make ci-tiny's random target predictable (tau stays near 1), but they must
    # lower the TTT loss, and tau is bounded by the drafted tokens plus the bonus token.
    losses = [json.loads(line)["loss"] for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0], losses
    assert 1.0 <= results["tau"]["chain"] <= 1 + cfg.bench.num_steps
    assert 1.0 <= results["tau"]["tree"] <= 1 + cfg.bench.depth
    for mode in ("chain", "tree"):
        assert results["speedup"][mode] == pytest.approx(
            results["modes"][mode]["tokens_per_s"] / results["baseline"]["tokens_per_s"])
    assert "tau" in (out / "report.md").read_text().lower()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tau"] == results["tau"]
    assert (out / "config.resolved.yaml").is_file()
    for stage in STAGES:
        assert (out / stage / "_DONE.json").is_file(), stage

    capsys.readouterr()
    run_pipeline(cfg, data=None, out=out)
    printed = capsys.readouterr().out
    for stage in STAGES:
        assert f"[run] {stage}: done earlier, skipping" in printed
