"""The report's training part: tau against training tokens (table and plot), measured tau beside the
final held-out simulated tau; benchmarks/product_report.py on metrics with and without the token count."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from eagle3_ray.bench.plots import TRAINING_PLOT
from eagle3_ray.bench.report import CURVE_ROWS, write_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))
import product_report  # noqa: E402


def _rows(n: int, tokens_per_step: int | None = 1000, val_every: int = 5) -> list[dict]:
    rows = []
    for s in range(1, n + 1):
        r = {"step": s, "loss": 9.0 / s, "tau": 1 + 0.05 * s, "acc_0": 0.02 * s}
        if tokens_per_step:
            r["train_tokens"] = tokens_per_step * s
        if s % val_every == 0:
            r.update(val_tau=1 + 0.04 * s, val_loss=8.0 / s, val_acc_0=0.015 * s)
        rows.append(r)
    return rows


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n#", start + len(title))
    return text[start:] if end < 0 else text[start:end]


@pytest.fixture
def bench_results() -> dict:
    """The committed product run's bench results (chain and tree measured on an H200)."""
    return json.loads((RESULTS / "product_smollm2_h200_bench.json").read_text())


def test_the_report_tabulates_tau_against_training_tokens_and_measured_beside_simulated(tmp_path, bench_results):
    metrics = _write(tmp_path / "metrics.jsonl", _rows(12))
    text = write_report(bench_results, tmp_path / "out", metrics).read_text()
    curve = _section(text, "### Tau against training tokens")
    assert "| step | training tokens | train simulated tau | held-out simulated tau |" in curve
    # The held-out evaluations (steps 5 and 10) and the last row, with their logged token counts.
    assert "| 5 | 5,000 | 1.25 | 1.20 |" in curve and "| 10 | 10,000 | 1.50 | 1.40 |" in curve
    assert "| 12 | 12,000 | 1.60 | – |" in curve and "| 3 | 3,000 " not in curve
    measured = _section(text, "### Measured against simulated tau")
    # measured tau per mode beside the final held-out simulated tau (step 10) and the final train tau
    chain = f"{bench_results['tau']['chain']:.2f}"
    assert f"| chain (K=3) | {chain} | 1.40 | 1.60 |" in measured
    assert f"| tree (top-8, depth 6, 48 tokens) | {bench_results['tau']['tree']:.2f} | 1.40 | 1.60 |" in measured
    assert "held-out at step 10, 10,000 training tokens" in measured
    assert "| 12 | 12,000 | 0.750 |" in _section(text, "## Training")
    assert (tmp_path / "out" / TRAINING_PLOT).stat().st_size > 0


def test_the_curve_gets_chain3_columns_for_the_held_out_set_and_each_group(tmp_path, bench_results):
    rows = _rows(12)
    for r in rows:
        if "val_tau" in r:
            r.update({"val_tau_chain3": 1.1 + 0.01 * r["step"], "val_tau_chain3/mt_bench": 1.0 + 0.02 * r["step"],
                      "val_tau/mt_bench": 1.3})
    text = write_report(bench_results, tmp_path / "out", _write(tmp_path / "metrics.jsonl", rows)).read_text()
    curve = _section(text, "### Tau against training tokens")
    assert "| step | training tokens | train simulated tau | held-out simulated tau | held-out chain(3) | mt_bench chain(3) |" in curve
    assert "| 10 | 10,000 | 1.50 | 1.40 | 1.20 | 1.20 |" in curve and "| 5 | 5,000 | 1.25 | 1.20 | 1.15 | 1.10 |" in curve
    assert "| 12 | 12,000 | 1.60 | – | – | – |" in curve


def test_the_walked_chain_takes_the_chain3_columns_where_the_run_logged_it(tmp_path, bench_results):
    rows = _rows(12)
    for r in rows:
        if "val_tau" in r:
            r.update({"val_tau_chain3": 1.9, "val_tau_walk3": 1.1 + 0.01 * r["step"], "val_tau/mt_bench": 1.3,
                      "val_tau_chain3/mt_bench": 1.9, "val_tau_walk3/mt_bench": 1.0 + 0.02 * r["step"]})
    text = write_report(bench_results, tmp_path / "out", _write(tmp_path / "metrics.jsonl", rows)).read_text()
    curve = _section(text, "### Tau against training tokens")
    assert "| 10 | 10,000 | 1.50 | 1.40 | 1.20 | 1.20 |" in curve and "1.90" not in curve
    assert "`val_tau_walk3`" in curve
    measured = _section(text, "### Measured against simulated tau")
    assert "held-out chain(3) walked (final)" in measured
    assert f"| chain (K=3) | {bench_results['tau']['chain']:.2f} | 1.40 | 1.60 | 1.20 |" in measured


def test_a_long_run_is_thinned_to_the_table_size_keeping_the_last_row(tmp_path, bench_results):
    metrics = _write(tmp_path / "metrics.jsonl", _rows(300, val_every=2))
    curve = _section(write_report(bench_results, tmp_path / "out", metrics).read_text(), "### Tau against")
    lines = [ln for ln in curve.splitlines() if ln.startswith("| ") and ln[2].isdigit()]
    assert len(lines) == CURVE_ROWS and lines[0].startswith("| 2 | 2,000 ") and lines[-1].startswith("| 300 | 300,000 ")


def test_metrics_without_the_token_count_still_report(tmp_path, bench_results):
    """Metrics written before the trainer logged train_tokens, and a run without held-out samples."""
    rows = [{k: v for k, v in r.items() if not k.startswith("val_")} for r in _rows(4, tokens_per_step=None)]
    metrics = _write(tmp_path / "metrics.jsonl", rows)
    text = write_report(bench_results, tmp_path / "out", metrics).read_text()
    assert "| 4 | – | 1.20 | – |" in _section(text, "### Tau against training tokens")
    assert "no held-out evaluation in this run" in text
    assert (tmp_path / "out" / TRAINING_PLOT).stat().st_size > 0
    # No bench tau (nothing decoded): no measured table, the rest stays.
    text = write_report({"device": "cpu"}, tmp_path / "none", metrics).read_text()
    assert "### Tau against training tokens" in text and "### Measured against simulated tau" not in text


def _committed_product() -> dict:
    return json.loads((RESULTS / "product_smollm2_h200.json").read_text())


def _run_dir(tmp_path: Path, rows: list[dict]) -> Path:
    run = tmp_path / "run"
    (run / "train").mkdir(parents=True)
    _write(run / "train" / "metrics.jsonl", rows)
    (run / "bench").mkdir()
    (run / "bench" / "results.json").write_text((RESULTS / "product_smollm2_h200_bench.json").read_text())
    return run


def test_product_report_reads_old_metrics_through_the_plan_line(tmp_path):
    """The committed product run (metrics without train_tokens): the tokens come from the plan line of
    its committed log, as the committed figures were made."""
    committed = _committed_product()
    rows = [{"step": p["step"], "loss": 1.0, "tau": p["tau"], **({"val_tau": p["val_tau"]} if p["val_tau"] else {})}
            for p in committed["curve"]]
    out = tmp_path / "out.json"
    product_report.main(["--run", str(_run_dir(tmp_path, rows)), "--log", str(RESULTS / "product_smollm2_h200.log"),
                         "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["tokens_from"] == "plan line"
    assert got["tokens_per_step"] == pytest.approx(committed["tokens_per_step"])
    assert got["train_tokens"] == pytest.approx(committed["train_tokens"])
    assert [p["train_tokens"] for p in got["curve"]] == pytest.approx([p["train_tokens"] for p in committed["curve"]])
    assert got["held_out_tau_final"] == committed["held_out_tau_final"]
    assert got["measured_tau"] == committed["measured_tau"]


def test_product_report_takes_the_logged_training_tokens(tmp_path):
    rows = _rows(10, tokens_per_step=1234)
    out = tmp_path / "out.json"
    # A plan line that disagrees is ignored: the logged count is the exact one.
    product_report.main(["--run", str(_run_dir(tmp_path, rows)), "--log", str(RESULTS / "product_smollm2_h200.log"),
                         "--json", str(out)])
    got = json.loads(out.read_text())
    assert got["tokens_from"] == "metrics" and got["train_tokens"] == 12340 and got["tokens_per_step"] == 1234
    assert [p["train_tokens"] for p in got["curve"]] == [1234 * s for s in range(1, 11)]


def test_product_report_keeps_each_groups_held_out_curve(tmp_path):
    """train.val_groups rows: each group's val_tau/<g> and val_tau_chain3/<g> stay in the curve, and the
    last evaluation's are the final figures by group."""
    rows = _rows(10, tokens_per_step=100)
    for r in rows:
        if "val_tau" in r:
            r.update({"val_tau_chain3": 1.5, "val_tau/mt_bench": 1.4 + 0.01 * r["step"],
                      "val_tau_chain3/mt_bench": 1.3 + 0.01 * r["step"]})
    out = tmp_path / "out.json"
    product_report.main(["--run", str(_run_dir(tmp_path, rows)), "--json", str(out)])
    got = json.loads(out.read_text())
    evaluated = [p for p in got["curve"] if p.get("val_tau") is not None]
    assert evaluated and all(p["val_tau_chain3/mt_bench"] == pytest.approx(1.3 + 0.01 * p["step"]) for p in evaluated)
    last = evaluated[-1]["step"]
    assert got["held_out_final_by_group"] == {"val_tau/mt_bench": pytest.approx(1.4 + 0.01 * last),
                                              "val_tau_chain3/mt_bench": pytest.approx(1.3 + 0.01 * last)}
