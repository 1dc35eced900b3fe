"""ray_session.init_ray on a fresh local Ray (a subprocess: the test session's own Ray is already up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, os, sys
from eagle3_ray.config import RayConfig
from eagle3_ray.ray_session import init_ray

ray = init_ray(RayConfig(num_cpus=1, env_vars={"E3_PROBE": "from-config", "TOKENIZERS_PARALLELISM": "true"}))
seen = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in
                                   ("E3_PROBE", "TOKENIZERS_PARALLELISM", "RAY_TRAIN_V2_ENABLED")}).remote())
# A worker logging the line Ray Train's PlacementGroupCleaner logs each second without a dashboard,
# then a line of its own: the driver forwards the second only.
def talk():
    import logging, time
    logging.getLogger("e3probe").warning("Failed to query Ray Train Controller actor state. State API may be "
                                         "temporarily unavailable. Continuing to monitor.")
    print("e3-probe-forwarded", flush=True)
ray.get(ray.remote(talk).remote())
import time
time.sleep(4)  # the driver's log forwarding polls the workers' log files
print(json.dumps({"task": seen, "job_runtime_env": ray.get_runtime_context().runtime_env}))
ray.shutdown()
"""


@pytest.mark.ray  # a fresh local Ray in a subprocess
def test_local_ray_workers_inherit_the_configured_env_vars_without_a_runtime_env(tmp_path):
    """... and the driver forwards the workers' lines but Ray Train's failing State API poll."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "E3_PROBE", "TOKENIZERS_PARALLELISM", "RAY_DEDUP_LOGS_SKIP_REGEX")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The config's values win over the defaults, and reach the workers by inheritance.
    assert got["task"] == {"E3_PROBE": "from-config", "TOKENIZERS_PARALLELISM": "true", "RAY_TRAIN_V2_ENABLED": "1"}
    assert not got["job_runtime_env"]  # no job runtime_env: Ray's prestarted workers serve the first tasks
    # Ray Train's State API poll, failing without a dashboard, is not forwarded; other worker lines are.
    assert "e3-probe-forwarded" in out.stdout + out.stderr
    assert "Failed to query Ray Train Controller" not in out.stdout + out.stderr
