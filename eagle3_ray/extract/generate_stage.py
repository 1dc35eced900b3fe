"""Self-distillation on Ray: engine actors write the assistant turns for prompt-only data.

The prompts are split over `extract.num_actors` engine actors; each writes its own resumable part
file (see data/distill.py) and the driver joins the parts into one conversations.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path

from eagle3_ray.atomic import write_stream
from eagle3_ray.config import PipelineConfig, save_resolved
from eagle3_ray.progress import say

CONVERSATIONS_FILE = "conversations.jsonl"


class DistillActor:
    """Holds one target engine; `run` self-distills a list of samples into a part file."""

    def __init__(self, target_cfg: dict, batch_tokens: int):
        from eagle3_ray.config import TargetConfig
        from eagle3_ray.engines.factory import build_engine
        from eagle3_ray.engines.describe import load_tokenizer

        cfg = TargetConfig.model_validate(target_cfg)
        self.engine = build_engine(cfg, batch_tokens=batch_tokens, mode="generate")
        self.tokenizer = load_tokenizer(cfg)

    def run(self, samples: list[dict], part_path: str, gen: dict) -> dict:
        from eagle3_ray.data.distill import self_distill
        from eagle3_ray.data.sources import Sample

        summary = self_distill(
            self.engine,
            self.tokenizer,
            [Sample(**s) for s in samples],
            part_path,
            max_new_tokens=gen["max_new_tokens"],
            temperature=gen["temperature"],
            top_p=gen["top_p"],
            batch_size=gen["batch_size"],
            seed=gen["seed"],
        )
        return dict(vars(summary)) if hasattr(summary, "__dict__") else dict(summary)

    def close(self) -> None:
        self.engine.close()


def run_generate(cfg: PipelineConfig, data: str | None, out: str | Path) -> Path:
    import ray

    from eagle3_ray.data.sources import Reject, read_samples, resolve_data_path
    from eagle3_ray.extract.pipeline import REJECTS_FILE, append_rejects, write_json_atomic

    t0 = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_resolved(cfg, out)
    source = resolve_data_path(data or cfg.data.path or "builtin:demo_prompts")
    samples, rejects = [], []
    for item in read_samples(source, cfg.data.format, cfg.data.max_samples, cfg.data.system_prompt):
        if isinstance(item, Reject):
            rejects.append({**vars(item), "stage": "generate"})
        else:
            samples.append(
                {"sample_id": item.sample_id, "messages": item.messages, "source": item.source}
            )
    (out / REJECTS_FILE).unlink(missing_ok=True)
    append_rejects(out / REJECTS_FILE, rejects)

    n = max(1, min(cfg.extract.num_actors, len(samples)))
    actor_cls = ray.remote(
        num_gpus=cfg.extract.num_gpus_per_actor or 0, num_cpus=cfg.extract.num_cpus_per_actor, max_restarts=2
    )(DistillActor)
    actors = [actor_cls.remote(cfg.target.model_dump(), cfg.extract.batch_tokens) for _ in range(n)]
    parts = [out / f"conversations.part-{i:03d}.jsonl" for i in range(n)]
    gen = cfg.generate.model_dump()
    say(f"[generate] {len(samples)} samples on {n} engine actor(s), {len(rejects)} rejected")
    results = ray.get(
        [a.run.remote(samples[i::n], str(parts[i]), gen) for i, a in enumerate(actors)]
    )
    for a in actors:
        ray.kill(a)

    joined = out / CONVERSATIONS_FILE

    def join(dst) -> int:
        count = 0
        for p in parts:
            for line in p.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    dst.write((line + "\n").encode("utf-8"))
                    count += 1
        return count

    count = write_stream(joined, join)
    write_json_atomic(
        out / "summary.json",
        {"conversations": count, "rejected": len(rejects), "parts": results,
         "seconds": round(time.monotonic() - t0, 2), "output": str(joined)},
    )
    say(f"[generate] wrote {count} conversations -> {joined}")
    return joined
