"""What the Ray stages of extract/ (and online training) share: the summary file beside a stage's
outputs, and the engine actor pool's ``map_batches`` arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_ray.atomic import write_json
from eagle3_ray.config import ExtractConfig

SUMMARY_FILE = "summary.json"
# Ray Data restarts a dead engine actor and retries its batches without limit by default
# (max_restarts=-1, max_task_retries=-1): a batch that kills its actor every time (host OOM, a
# driver crash on one input) would loop forever. Bounded, such a run fails and a rerun resumes.
ENGINE_ACTOR_RESTARTS = 4


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """The stage's ``summary.json`` in ``out`` (keys sorted, one line), written atomically."""
    write_json(out / SUMMARY_FILE, summary, sort_keys=True, newline=False)


def engine_pool(extract: ExtractConfig, **strategy: Any) -> dict[str, Any]:
    """``map_batches`` arguments of a pool of engine actors: ``extract.num_actors`` up to
    ``extract.max_actors``, each with its GPUs and CPUs, restarts bounded; ``strategy``: more
    ``ActorPoolStrategy`` arguments (concurrent calls per actor)."""
    import ray

    return dict(
        compute=ray.data.ActorPoolStrategy(min_size=extract.num_actors,
                                           max_size=extract.max_actors or extract.num_actors, **strategy),
        num_gpus=extract.num_gpus_per_actor or None,
        num_cpus=extract.num_cpus_per_actor,
        max_restarts=ENGINE_ACTOR_RESTARTS,
        max_task_retries=ENGINE_ACTOR_RESTARTS,
    )
