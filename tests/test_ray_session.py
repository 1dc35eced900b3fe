"""ray_session.init_ray on a fresh local Ray (a subprocess: the test session's own Ray is already up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, os, sys
from eagle3_ray.config import RayConfig
from eagle3_ray.ray_session import init_ray

ray = init_ray(RayConfig(num_cpus=1, env_vars={"E3_PROBE": "from-config", "TOKENIZERS_PARALLELISM": "true"}))
seen = ray.get(ray.remote(lambda: {k: os.environ.get(k) for k in
                                   ("E3_PROBE", "TOKENIZERS_PARALLELISM", "RAY_TRAIN_V2_ENABLED")}).remote())
print(json.dumps({"task": seen, "job_runtime_env": ray.get_runtime_context().runtime_env}))
ray.shutdown()
"""


def test_local_ray_workers_inherit_the_configured_env_vars_without_a_runtime_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "E3_PROBE", "TOKENIZERS_PARALLELISM")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # The config's values win over the defaults, and reach the workers by inheritance.
    assert got["task"] == {"E3_PROBE": "from-config", "TOKENIZERS_PARALLELISM": "true", "RAY_TRAIN_V2_ENABLED": "1"}
    assert not got["job_runtime_env"]  # no job runtime_env: Ray's prestarted workers serve the first tasks
