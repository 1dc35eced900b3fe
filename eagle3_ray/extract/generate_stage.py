"""Self-distillation on Ray: engine actors write the assistant turns for prompt-only data.

The prompts are split over `extract.num_actors` engine actors; each writes its own resumable part
file (see data/distill.py) and the driver joins the parts into one conversations.jsonl, in the
order of the input.

Each actor answers its prompts in ``generation_order``: by number of user turns, then by prompt
length. A batched decoder pads every row of a batch to its longest prompt, and a multi-turn batch
generates each turn in its own call: batches of similar prompts with the same number of turns keep
the padding, the calls' shapes (KV storages, CUDA graphs) and the work per row alike. Prompts that
alone fill ``data.max_length`` are rejected up front: no answer token of theirs could be trained on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

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

    def run(self, samples: list[dict], part_path: str, gen: dict, max_length: int | None = None) -> dict:
        """Answers ``samples`` into ``part_path`` (resumable); the summary's ``rejected`` lists the
        prompts too long for ``max_length`` (None: none rejected), which are not answered."""
        from eagle3_ray.data.distill import self_distill
        from eagle3_ray.data.sources import Sample

        ordered, too_long = generation_order([Sample(**s) for s in samples], self.tokenizer, max_length)
        summary = self_distill(
            self.engine,
            self.tokenizer,
            ordered,
            part_path,
            max_new_tokens=gen["max_new_tokens"],
            temperature=gen["temperature"],
            top_p=gen["top_p"],
            batch_size=gen["batch_size"],
            seed=gen["seed"],
        )
        out = dict(vars(summary)) if hasattr(summary, "__dict__") else dict(summary)
        return {**out, "rejected": too_long}

    def close(self) -> None:
        self.engine.close()


def generation_order(samples: list, tokenizer: Any, max_length: int | None = None) -> tuple[list, list[dict]]:
    """(samples in the order to answer them, reject records of the prompts too long to answer).

    Order: samples that need no generation first, then prompt-only ones by number of user turns and
    by the token length of their first generation prompt (stable, so the order is the same on a
    rerun and resume skips what was written). A prompt-only sample whose first generation prompt has
    ``max_length`` tokens or more is rejected: every token of its answer would lie past
    ``data.max_length``, where preparation cuts or rejects the conversation.
    """
    from eagle3_ray.data.chat import render_generation_prompt

    keyed, rejects = [], []
    for pos, s in enumerate(samples):
        if not s.needs_generation:
            keyed.append(((0, 0, pos), s))
            continue
        msgs = s.messages
        first_user = next((i for i, m in enumerate(msgs) if m["role"] == "user"), len(msgs) - 1)
        n = len(render_generation_prompt(tokenizer, msgs[: first_user + 1]))
        if max_length is not None and n >= max_length:
            rejects.append({"sample_id": s.sample_id, "source": s.source, "stage": "generate",
                            "reason": f"the prompt has {n} tokens, data.max_length={max_length} leaves no room "
                                      "for an answer; raise data.max_length"})
            continue
        turns = sum(m["role"] == "user" for m in msgs)
        keyed.append(((turns, n, pos), s))
    keyed.sort(key=lambda kv: kv[0])
    return [s for _, s in keyed], rejects


def join_in_order(parts: list[Path], ids: list[str], dst) -> int:
    """Writes the records of the part files to ``dst`` (binary) in the order of ``ids`` (records of
    other ids last, in file order); returns the number of records."""
    rank: dict[str, int] = {}
    for i, sid in enumerate(ids):
        rank.setdefault(str(sid), i)
    lines = []
    for p in parts:
        for line in p.read_text(encoding="utf-8").split("\n"):
            if line.strip():
                lines.append((rank.get(str(json.loads(line).get("id")), len(ids)), len(lines), line))
    lines.sort()
    for _, _, line in lines:
        dst.write((line + "\n").encode("utf-8"))
    return len(lines)


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
        [a.run.remote(samples[i::n], str(parts[i]), gen, cfg.data.max_length) for i, a in enumerate(actors)]
    )
    for a in actors:
        ray.kill(a)
    too_long = [r for res in results for r in res.pop("rejected", [])]
    if too_long:
        append_rejects(out / REJECTS_FILE, too_long)
        say(f"[generate] {len(too_long)} prompts rejected: too long for data.max_length={cfg.data.max_length}")

    joined = out / CONVERSATIONS_FILE
    ids = [s["sample_id"] for s in samples]
    count = write_stream(joined, lambda dst: join_in_order(parts, ids, dst))
    write_json_atomic(
        out / "summary.json",
        {"conversations": count, "rejected": len(rejects) + len(too_long), "parts": results,
         "seconds": round(time.monotonic() - t0, 2), "output": str(joined)},
    )
    say(f"[generate] wrote {count} conversations -> {joined}")
    return joined
