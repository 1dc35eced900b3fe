"""Pick the engine backend named by the config."""

from __future__ import annotations

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.base import TargetEngine


def build_engine(cfg: TargetConfig, batch_tokens: int = 8192, mode: str = "capture") -> TargetEngine:
    if cfg.backend == "hf":
        from eagle3_ray.engines.hf import HFEngine

        return HFEngine(cfg, batch_tokens=batch_tokens)
    from eagle3_ray.engines.sglang import SGLangEngine

    return SGLangEngine(cfg, mode=mode)
