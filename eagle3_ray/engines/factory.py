"""Pick the engine backend named by the config."""

from __future__ import annotations

from eagle3_ray.config import TargetConfig
from eagle3_ray.engines.base import TargetEngine
from eagle3_ray.errors import engine_start


def build_engine(cfg: TargetConfig, batch_tokens: int = 8192, mode: str = "capture",
                 max_batch: int | None = None, audit_share: float = 0.0) -> TargetEngine:
    """The engine of ``cfg.backend``. A failure to build it is an ``EngineStartError`` naming the
    cause (``errors.engine_start``): it would fail the same way again, so the stage stops.
    ``max_batch``: the most requests one generate call sends (SGLang sizes its CUDA graphs by it).
    ``audit_share``: the share of rows whose capture audit figures each capture carries."""
    what = f"the {'HF' if cfg.backend == 'hf' else 'SGLang'} engine of target.model={cfg.model!r}"
    with engine_start(what):
        if cfg.backend == "hf":
            from eagle3_ray.engines.hf import HFEngine

            return HFEngine(cfg, batch_tokens=batch_tokens, audit_share=audit_share)
        from eagle3_ray.engines.sglang import SGLangEngine

        return SGLangEngine(cfg, mode=mode, max_batch=max_batch, audit_share=audit_share)
