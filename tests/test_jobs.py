"""`ray job submit` of jobs/pipeline.py to a real local head started by cluster/local-head.sh.

The cluster is the tests' own (free ports, its own temp dir, its own auth token), not the shared
`ray_local`; it is stopped by the pid of its `ray start --block`, never by `ray stop`. The job runs
once (conftest.py's `submitted_pipeline_job`): test_metrics.py scrapes the same head afterwards.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 480


def require_ray_dashboard() -> None:
    """The job server lives in the dashboard, which needs `ray[default]`'s extra packages."""
    for mod in ("aiohttp_cors", "prometheus_client", "grpc", "opentelemetry.sdk"):
        pytest.importorskip(mod, reason="the Ray dashboard/job server needs `pip install 'ray[default]'`")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_local_head(num_cpus: int = 2) -> dict:
    """cluster/local-head.sh start with free ports; returns the env (ports, token) its clients need."""
    require_ray_dashboard()
    gcs, dash, metrics, client, agent = free_ports(5)
    env = {
        **os.environ,
        "RAY_HEAD_PORT": str(gcs), "RAY_DASHBOARD_PORT": str(dash), "RAY_METRICS_PORT": str(metrics),
        "RAY_CLIENT_PORT": str(client), "RAY_AGENT_PORT": str(agent), "RAY_NUM_CPUS": str(num_cpus),
        # Short: Ray's unix socket paths under the temp dir must stay below ~107 bytes.
        "RAY_HEAD_DIR": tempfile.mkdtemp(prefix="e3h", dir="/tmp"),
        "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "2",  # nothing to drain once the test is done
    }
    env.pop("RAY_ADDRESS", None)
    subprocess.run(["bash", str(ROOT / "cluster/local-head.sh"), "start"], env=env, check=True, timeout=200)
    env["RAY_JOB_API"] = f"http://127.0.0.1:{dash}"
    env["RAY_GCS"] = f"127.0.0.1:{gcs}"
    return env


def stop_local_head(env: dict) -> None:
    subprocess.run(["bash", str(ROOT / "cluster/local-head.sh"), "stop"], env=env, check=False, timeout=120)


def ray_cli(env: dict, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(["ray", *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"ray {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


def job_status(env: dict, job_id: str) -> str:
    """The job's status from the job server's REST API (authenticated with the cluster token)."""
    req = urllib.request.Request(f"{env['RAY_JOB_API']}/api/jobs/{job_id}",
                                 headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["status"]


def wait_for_job(env: dict, job_id: str, timeout: float = JOB_TIMEOUT_S) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = job_status(env, job_id)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(0.5)  # a REST call to the local head: cheap
    ray_cli(env, "job", "stop", "--address", env["RAY_JOB_API"], job_id)
    return "TIMEOUT"


def submit_pipeline_job(env: dict, out: Path, stop_after: str = "train",
                        overrides: tuple[str, ...] = ("train.max_steps=2", "train.checkpoint_every=2")) -> dict:
    """`ray job submit` ci-tiny's pipeline up to ``stop_after`` (training); waits. What the tests check:
    status, logs, out. test_multinode.py submits it to a two-node cluster."""
    job_id = f"eagle3-ci-{secrets.token_hex(4)}"
    ray_cli(
        env, "job", "submit", "--address", env["RAY_JOB_API"], "--submission-id", job_id, "--no-wait",
        "--working-dir", str(ROOT), "--runtime-env", str(ROOT / "cluster/runtime_env.yaml"), "--",
        "python", "jobs/pipeline.py", "-c", "configs/ci-tiny.yaml", "--out", str(out), "--stop-after", stop_after,
        *overrides,
    )
    final = wait_for_job(env, job_id)
    logs = ray_cli(env, "job", "logs", "--address", env["RAY_JOB_API"], job_id)
    return {"env": env, "job_id": job_id, "status": final, "logs": logs, "out": out}


def test_submitted_pipeline_job_prepares_extracts_and_trains(submitted_pipeline_job):
    out, final, logs = (submitted_pipeline_job[k] for k in ("out", "status", "logs"))
    assert final == "SUCCEEDED", logs[-4000:]

    for stage in ("prepare", "extract", "vocab", "train"):
        assert f"[run] {stage} ..." in logs
    assert "stopped after train" in logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_after"] == "train"
    assert json.loads((out / "features" / "summary.json").read_text())["samples"] == 12
    assert (out / "vocab" / "vocab_map.safetensors").is_file()
    from eagle3_ray.train.checkpoint import latest_checkpoint, read_train_state

    assert read_train_state(latest_checkpoint(out / "train"))["step"] == 2
    assert not (out / "bench").exists()
