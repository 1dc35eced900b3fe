"""Custom metrics on the Ray dashboard through `ray.util.metrics` (thin Ray layer).

Ray exports them in Prometheus form on every node's metrics port with a `ray_` prefix (counters
also get `_total`): e.g. `ray_eagle3_samples_total{stage="capture", run="ci-tiny"}`. Every series
carries the tags `run` (config `name`) and `stage`; a process that is not a Ray driver or worker
records nothing, so the compute core and plain scripts can call these freely.

    eagle3_samples        counter  samples through a stage (prepare, capture, store, online)
    eagle3_tokens         counter  tokens through a stage
    eagle3_bytes_written  counter  feature bytes committed to the store
    eagle3_rejects        counter  samples quarantined by a stage
    eagle3_extract_tokens_per_s  gauge  tokens/s of one engine actor's last batch
    eagle3_capture_agreement / eagle3_capture_nll / eagle3_capture_nll_excess  gauges, the capture
                          audit's figures of an engine actor's last shard (docs/feature-store.md)
    eagle3_train_loss / eagle3_train_tau(_served) / eagle3_train_acc{ttt_step}  gauges, last logged step
    eagle3_train_step     gauge    optimizer step
    eagle3_train_tokens_per_s / eagle3_train_input_wait  gauges, last logging window
    eagle3_train_val_tau / eagle3_train_val_loss     gauges, last held-out evaluation (train.val_share)
    eagle3_train_val_tau_walk3  gauge  chain(3) decoding replayed over the held-out answers, last evaluation
    eagle3_bench_tau{mode}  gauge  acceptance length of a benchmark mode
"""

from __future__ import annotations

from typing import Any

PREFIX = "eagle3_"

# name -> (kind, description, extra tag keys besides run/stage)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "samples": ("counter", "Samples through a pipeline stage.", ()),
    "tokens": ("counter", "Tokens through a pipeline stage.", ()),
    "bytes_written": ("counter", "Feature bytes committed to the feature store.", ()),
    "rejects": ("counter", "Samples quarantined by a stage (reasons in rejects.jsonl).", ()),
    "extract_tokens_per_s": ("gauge", "Tokens/s of one engine actor over its last batch.", ()),
    "capture_agreement": ("gauge", "Capture audit: share of greedy-answer rows whose lm_head argmax is the next "
                          "token, an engine actor's last shard.", ()),
    "capture_nll": ("gauge", "Capture audit: mean next-token NLL (nats) on assistant rows, last shard.", ()),
    "capture_nll_excess": ("gauge", "Capture audit: mean NLL less the target's own entropy (nats), last shard.", ()),
    "train_loss": ("gauge", "Drafter TTT loss at the last logged step.", ()),
    "train_tau": ("gauge", "Simulated acceptance length at the last logged step.", ()),
    "train_tau_served": ("gauge", "Simulated acceptance counting targets outside the draft vocab as misses.", ()),
    "train_acc": ("gauge", "Top-1 accuracy of one TTT step at the last logged step.", ("ttt_step",)),
    "train_step": ("gauge", "Optimizer steps taken.", ()),
    "train_tokens_per_s": ("gauge", "Training tokens/s over the last logging window, all workers.", ()),
    "train_input_wait": ("gauge", "Share of the last logging window the step loop waited for packs.", ()),
    "train_val_tau": ("gauge", "Simulated tau on the held-out samples (train.val_share), last evaluation.", ()),
    "train_val_loss": ("gauge", "TTT loss on the held-out samples (train.val_share), last evaluation.", ()),
    "train_val_tau_walk3": ("gauge", "Chain(3) decoding replayed over the held-out answers: tokens per verify "
                            "cycle, last evaluation (docs/pipeline.md).", ()),
    "bench_tau": ("gauge", "Measured acceptance length of one speculative-decoding mode.", ("mode",)),
}

_BASE_TAGS = ("run", "stage")
_cache: dict[str, Any] = {}  # per process: Ray registers each metric once per worker


def _in_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _metric(name: str):
    if name not in _cache:
        from ray.util import metrics

        kind, description, extra = METRICS[name]
        cls = metrics.Counter if kind == "counter" else metrics.Gauge
        _cache[name] = cls(PREFIX + name, description=description, tag_keys=_BASE_TAGS + extra)
    return _cache[name]


def _tags(run: str, stage: str, extra: dict[str, str]) -> dict[str, str]:
    return {"run": run or "", "stage": stage, **{k: str(v) for k, v in extra.items()}}


def inc(name: str, value: float, run: str, stage: str, **tags: str) -> None:
    """Add `value` to counter `name` (no-op outside Ray or for value 0)."""
    if value and _in_ray():
        _metric(name).inc(float(value), tags=_tags(run, stage, tags))


def set_gauge(name: str, value: float, run: str, stage: str, **tags: str) -> None:
    """Set gauge `name` (no-op outside Ray)."""
    if _in_ray():
        _metric(name).set(float(value), tags=_tags(run, stage, tags))


def record_train_step(metrics: dict[str, float], run: str, ttt_steps: int) -> None:
    """Loss, tau, per-step accuracy and step of a logged training step (rank 0 only)."""
    set_gauge("train_step", metrics["step"], run, "train")
    set_gauge("train_loss", metrics["loss"], run, "train")
    set_gauge("train_tau", metrics["tau"], run, "train")
    for key in ("tokens_per_s", "input_wait", "val_tau", "val_loss", "val_tau_walk3"):
        if key in metrics:
            set_gauge(f"train_{key}", metrics[key], run, "train")
    if "tau_served" in metrics:
        set_gauge("train_tau_served", metrics["tau_served"], run, "train")
    for i in range(ttt_steps):
        if f"acc_{i}" in metrics:
            set_gauge("train_acc", metrics[f"acc_{i}"], run, "train", ttt_step=str(i))


def record_bench(results: dict[str, Any], run: str) -> None:
    """Acceptance length per mode from a `run_bench` result."""
    for mode, tau in (results.get("tau") or {}).items():
        if tau is not None:
            set_gauge("bench_tau", tau, run, "bench", mode=mode)
