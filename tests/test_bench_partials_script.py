"""benchmarks/bench_partials.py: a bench stopped after some categories is pooled from its partial
files by the product's own results_body / write_report, and names what it lacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eagle3_ray.bench.runner import PARTIAL_DIR, PARTIAL_FORMAT, _partial_path
from eagle3_ray.config import BenchConfig, PipelineConfig, config_to_dict

ROOT = Path(__file__).resolve().parent.parent


def _rec(pid: str, tokens: int, seconds: float, tau: float | None = None, steps: int | None = None,
         turn: int = 0) -> dict:
    stats = {"new_tokens": tokens, "seconds": seconds, "tau": tau, "verify_steps": steps,
             "accept_by_position": [], "tokens_per_s": tokens / seconds, "parts": {}}
    return {"prompt_id": pid, "turn": turn, "prompt_tokens": 10, "identical": True, "divergence": None, "stats": stats}


def _pool(tmp_path: Path, cfg: PipelineConfig, records_by_category: dict) -> tuple[Path, dict]:
    """A run directory holding ``cfg`` resolved and one partial file per category, pooled by the script;
    returns (run, results.json)."""
    import yaml

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    info = {"device": "cpu", "dtype": "float32", "graphed_baseline": False, "draft_graphs": False}
    for cat, records in records_by_category.items():
        path = _partial_path(run / "bench" / PARTIAL_DIR, cat)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": PARTIAL_FORMAT, "key": "k", "category": cat, "info": info,
                                    "records": records}))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_partials.py"), "--run", str(run)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return run, json.loads((run / "bench" / "results.json").read_text())


def test_pools_the_finished_categories_and_names_the_missing_ones(tmp_path):
    prompts = tmp_path / "mt.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}"]}) + "\n"
                               for i, c in enumerate(["writing", "math", "coding"])))
    cfg = PipelineConfig(bench=BenchConfig(prompts=str(prompts), modes=["chain"], max_new_tokens=8))
    run, results = _pool(tmp_path, cfg, {
        cat: {"baseline": [_rec(pid, 8, 1.0)], "chain": [_rec(pid, 8, 0.5, tau=2.0, steps=4)]}
        for cat, pid in (("writing", "0"), ("math", "1"))})
    assert results["incomplete"]["missing_categories"] == ["coding"]
    assert sorted(results["per_category"]) == ["math", "writing"]
    assert results["tau"]["chain"] == 2.0 and results["speedup"]["chain"] == 2.0 and results["num_prompts"] == 2
    report = (run / "bench" / "report.md").read_text()
    assert report.startswith("> **Incomplete:** 2 of 3 categories measured; not measured: coding.")


def test_several_prompt_sets_pool_per_set_and_per_turn(tmp_path):
    """bench.prompts as a list of sets (as configs/smollm2-h200.yaml's runs pass it): the resolved config
    holds mappings, the categories are <set>/<category>, per_set and per_turn group them by set."""
    mt, gsm = tmp_path / "mt_bench.jsonl", tmp_path / "gsm8k_test.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [f"q{i}", f"f{i}"]}) + "\n"
                          for i, c in enumerate(["writing", "math"])))
    gsm.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    cfg = PipelineConfig(bench=BenchConfig(prompts=[{"path": str(mt), "max_prompts": 80}, {"path": str(gsm)}],
                                           modes=["chain"], max_new_tokens=8))
    _, results = _pool(tmp_path, cfg, {
        cat: {"baseline": [_rec(pid, 8, 1.0), _rec(pid, 8, 1.0, turn=1)],
              "chain": [_rec(pid, 8, 0.5, tau=2.0, steps=4), _rec(pid, 8, 0.5, tau=4.0, steps=2, turn=1)]}
        for cat, pid in (("mt_bench/writing", "0"), ("mt_bench/math", "1"))})
    assert results["incomplete"]["missing_categories"] == ["gsm8k_test/gsm8k_test"]
    assert list(results["per_set"]) == ["mt_bench"]
    assert results["per_turn"]["mt_bench"]["1"]["chain"]["tau"] == 2.0
    assert results["per_turn"]["mt_bench"]["2"]["chain"]["tau"] == 4.0
    assert results["config"]["prompts"][0]["max_prompts"] == 80
