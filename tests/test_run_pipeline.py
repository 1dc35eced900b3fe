"""`eagle3-ray run` end to end on ci-tiny (real Ray, real DeepSpeed), and the rerun skips every stage."""

from __future__ import annotations

import json

from eagle3_ray.config import load_config


def test_run_writes_drafter_results_and_report_then_resumes(ray_local, tmp_path, capsys):
    from eagle3_ray.drafter import load_drafter
    from eagle3_ray.pipeline import run_pipeline

    cfg = load_config("configs/ci-tiny.yaml", ["train.max_steps=4", "bench.max_prompts=1"])
    out = tmp_path / "run"
    summary = run_pipeline(cfg, data=None, out=out)

    drafter = load_drafter(out / "drafter")
    assert drafter.config.draft_vocab_size == cfg.vocab.draft_vocab_size
    results = json.loads((out / "bench" / "results.json").read_text())
    for mode in ("chain", "tree"):
        assert results["tau"][mode] >= 1.0 and results["speedup"][mode] > 0
    assert results["untrained"] is not None
    report = (out / "report.md").read_text()
    assert "tau" in report.lower()
    assert summary["tau"] == results["tau"]
    assert (out / "config.resolved.yaml").is_file()
    for stage in ("prepare", "extract", "vocab", "train", "export", "bench"):
        assert (out / stage / "_DONE.json").is_file(), stage

    capsys.readouterr()
    run_pipeline(cfg, data=None, out=out)
    printed = capsys.readouterr().out
    for stage in ("prepare", "extract", "vocab", "train", "export", "bench"):
        assert f"[run] {stage}: done earlier, skipping" in printed
