"""Connect to the Ray cluster named by the config, or start a local one (thin Ray layer)."""

from __future__ import annotations

import os

from eagle3_ray.config import RayConfig

# Ray hides GPUs from tasks that ask for none, which breaks CPU-only local runs on GPU laptops less
# than it helps; TOKENIZERS_PARALLELISM=false avoids fork warnings in Ray Data workers.
_DEFAULT_ENV = {"TOKENIZERS_PARALLELISM": "false", "RAY_TRAIN_V2_ENABLED": "1"}


def init_ray(cfg: RayConfig):
    """Return the initialized `ray` module: an existing session, cfg.address, $RAY_ADDRESS, or local."""
    import ray

    for k, v in _DEFAULT_ENV.items():
        os.environ.setdefault(k, v)
    if ray.is_initialized():
        return ray
    env_vars = {**_DEFAULT_ENV, **cfg.env_vars}
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(runtime_env={"env_vars": env_vars}, log_to_driver=True, configure_logging=False)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=cfg.num_cpus, include_dashboard=False, **kwargs)
    ray.data.DataContext.get_current().enable_progress_bars = True
    return ray
