"""Custom dashboard metrics: a tiny extraction on a real local head, scraped from its Prometheus port."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SCRAPE_TIMEOUT_S = 90
RUN = "ci-metrics"  # the config `name`, i.e. the `run` tag of this test's series
SERIES = re.compile(r'^(?P<name>ray_eagle3_\w+)\{(?P<tags>[^}]*)\} (?P<value>\S+)$', re.M)


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return [
        (m["name"], dict(re.findall(r'(\w+)="([^"]*)"', m["tags"])), float(m["value"]))
        for m in SERIES.finditer(text)
    ]


def total(series, name: str, **tags: str) -> float:
    """Sum over processes (each Ray worker exports its own series, tagged WorkerId)."""
    return sum(v for n, t, v in series if n == name and all(t.get(k) == w for k, w in tags.items()))


def test_metrics_record_in_ray_only():
    """Outside Ray the calls are no-ops: checked in a fresh interpreter (this one may hold a session)."""
    code = (
        "from eagle3_ray import metrics\n"
        "metrics.inc('samples', 3, 'r', 'prepare')\n"
        "metrics.set_gauge('train_loss', 1.0, 'r', 'train')\n"
        "assert not metrics._cache\n"
        "import sys; assert 'ray' not in sys.modules or not __import__('ray').is_initialized()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_extraction_metrics_reach_the_prometheus_endpoint(local_head, tmp_path):
    env = local_head  # shared with test_jobs.py: this run's own `run` tag keeps its series apart
    out = tmp_path / "features"
    proc = subprocess.run(
        ["python", "jobs/extract.py", "-c", "configs/ci-tiny.yaml", "--out", str(out), f"name={RUN}"],
        cwd=ROOT, env={**env, "RAY_ADDRESS": env["RAY_GCS"]}, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    port = int(env["RAY_METRICS_PORT"])
    run = {"run": RUN}
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        series = scrape(port)
        if total(series, "ray_eagle3_samples_total", stage="store", **run) >= summary["samples"]:
            break
        assert time.monotonic() < deadline, f"metrics never showed up: {sorted({s[0] for s in series})}"
        time.sleep(0.5)  # a gauge of an ended actor ages out of the endpoint ~20 s after its last export
    assert total(series, "ray_eagle3_samples_total", stage="prepare", **run) == 12
    assert total(series, "ray_eagle3_samples_total", stage="capture", **run) == 12
    assert total(series, "ray_eagle3_samples_total", stage="store", **run) == summary["samples"] == 12
    assert total(series, "ray_eagle3_tokens_total", stage="store", **run) == summary["tokens"]
    assert total(series, "ray_eagle3_bytes_written_total", stage="store", **run) == summary["bytes_written"]
    assert total(series, "ray_eagle3_rejects_total", **run) == 0
    rates = [v for n, t, v in series if n == "ray_eagle3_extract_tokens_per_s" and t.get("run") == RUN]
    assert rates and all(v > 0 for v in rates)



def test_a_logged_training_step_sets_its_gauges(ray_local):
    """Throughput and input wait go to Prometheus with loss, tau and accuracies (an operator's
    dashboard shows whether training is compute- or input-bound)."""
    from eagle3_ray import metrics

    m = {"step": 10, "loss": 3.0, "tau": 1.5, "tau_served": 1.4, "acc_0": 0.5, "acc_1": 0.3,
         "tokens_per_s": 1234.0, "input_wait": 0.02, "val_tau": 1.3, "val_loss": 3.2}
    metrics.record_train_step(m, "gauges-test", ttt_steps=2)
    for name in ("train_step", "train_loss", "train_tau", "train_tau_served", "train_acc",
                 "train_tokens_per_s", "train_input_wait", "train_val_tau", "train_val_loss"):
        assert name in metrics._cache, name
