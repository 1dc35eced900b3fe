"""Connect to the Ray cluster named by the config, or start a local one (thin Ray layer)."""

from __future__ import annotations

import json
import os

from eagle3_ray.config import RayConfig

# Ray hides GPUs from tasks that ask for none, which breaks CPU-only local runs on GPU laptops less
# than it helps; TOKENIZERS_PARALLELISM=false avoids fork warnings in Ray Data workers.
_DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_V2_ENABLED": "1"}


def _job_env_vars() -> dict[str, str]:
    """env_vars of the runtime_env given to `ray job submit` ({} outside a submitted job).

    Inside a submitted job Ray merges ray.init's runtime_env into the job's and refuses (ValueError)
    when both set the same env var key, so the driver must leave those keys to the job.
    """
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return {}
    return dict((json.loads(raw).get("runtime_env") or {}).get("env_vars") or {})


def init_ray(cfg: RayConfig):
    """Return the initialized `ray` module: an existing session, cfg.address, $RAY_ADDRESS, or local."""
    import ray

    for k, v in _DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return ray
    job_env = _job_env_vars()
    env_vars = {k: v for k, v in {**_DEFAULT_ENV, **cfg.env_vars}.items() if k not in job_env}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(runtime_env={"env_vars": env_vars} if env_vars else None, log_to_driver=True,
                  configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, **kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = True
    return ray
