"""Custom dashboard metrics: the extraction of the pipeline job that test_jobs.py submits to a real
local head (conftest.py's ``submitted_pipeline_job``), scraped from the head's Prometheus port."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SCRAPE_TIMEOUT_S = 90
RUN = "ci-tiny"  # the config `name` of the submitted job, i.e. the `run` tag of its series
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


class SeriesWatch:
    """Scrapes a head's endpoint every ``every_s`` in a thread while a run goes on, keeping every
    series seen (its last value). A gauge of an ended actor ages out of the endpoint ~20 s after its
    last export, and the submitted pipeline trains for longer than that after extracting."""

    def __init__(self, port: int, every_s: float = 1.0):
        self.port, self.every_s = port, every_s
        self._seen: dict[tuple[str, frozenset], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                series = scrape(self.port)
            except OSError:  # the head's agent not up yet, or busy: the next scrape catches up
                continue
            for name, tags, value in series:
                self._seen[(name, frozenset(tags.items()))] = value

    def __enter__(self) -> SeriesWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def seen(self) -> list[tuple[str, dict[str, str], float]]:
        return [(name, dict(tags), value) for (name, tags), value in self._seen.items()]


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


def test_extraction_metrics_reach_the_prometheus_endpoint(submitted_pipeline_job):
    job = submitted_pipeline_job  # its own `run` tag keeps its series apart from any other run's
    assert job["status"] == "SUCCEEDED", job["logs"][-3000:]
    summary = json.loads((job["out"] / "features" / "summary.json").read_text())
    port = int(job["env"]["RAY_METRICS_PORT"])
    run = {"run": RUN}
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while True:
        series = scrape(port)
        if total(series, "ray_eagle3_samples_total", stage="store", **run) >= summary["samples"]:
            break
        assert time.monotonic() < deadline, f"metrics never showed up: {sorted({s[0] for s in series})}"
        time.sleep(0.5)
    assert total(series, "ray_eagle3_samples_total", stage="prepare", **run) == 12
    assert total(series, "ray_eagle3_samples_total", stage="capture", **run) == 12
    assert total(series, "ray_eagle3_samples_total", stage="store", **run) == summary["samples"] == 12
    assert total(series, "ray_eagle3_tokens_total", stage="store", **run) == summary["tokens"]
    assert total(series, "ray_eagle3_bytes_written_total", stage="store", **run) == summary["bytes_written"]
    assert total(series, "ray_eagle3_rejects_total", **run) == 0
    # The engine actors' gauges, seen while the job ran (conftest.py's SeriesWatch around the job).
    rates = [v for n, t, v in job["series_seen"] if n == "ray_eagle3_extract_tokens_per_s" and t.get("run") == RUN]
    assert rates and all(v > 0 for v in rates)


def test_a_logged_training_step_sets_its_gauges(ray_local):
    """Throughput and input wait go to Prometheus with loss, tau and accuracies (an operator's
    dashboard shows whether training is compute- or input-bound)."""
    from eagle3_ray import metrics

    m = {"step": 10, "loss": 3.0, "tau": 1.5, "tau_served": 1.4, "acc_0": 0.5, "acc_1": 0.3,
         "tokens_per_s": 1234.0, "input_wait": 0.02, "val_tau": 1.3, "val_loss": 3.2, "val_tau_walk3": 1.2}
    metrics.record_train_step(m, "gauges-test", ttt_steps=2)
    for name in ("train_step", "train_loss", "train_tau", "train_tau_served", "train_acc",
                 "train_tokens_per_s", "train_input_wait", "train_val_tau", "train_val_loss", "train_val_tau_walk3"):
        assert name in metrics._cache, name
