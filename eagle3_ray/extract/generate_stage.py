"""Self-distillation on Ray: engine actors write the assistant turns for prompt-only data.

The prompts are split over `extract.num_actors` engine actors; each writes its own resumable part
file (see data/distill.py) and the driver joins the parts into one conversations.jsonl, in the
order of the input.

Each actor answers its prompts in ``generation_order``: by number of user turns, then by prompt
length. A batched decoder pads every row of a batch to its longest prompt, and a multi-turn batch
generates each turn in its own call: batches of similar prompts with the same number of turns keep
the padding, the calls' shapes (KV storages, CUDA graphs) and the work per row alike. Prompts that
alone fill ``data.max_length`` are rejected up front: no answer token of theirs could be trained on.

``generate.samples_per_prompt`` = n > 1 answers every prompt-only sample n times: copy 0 as with n = 1
(``generate.temperature``, the sample's own id), copies 1..n-1 sampled at
``generate.sample_temperature`` under the ids ``<id>#s<copy>`` (``copy_id``), more trajectories of
the same target from the same prompts. Each actor writes its copies, in the same generation order,
into its one part file after copy 0 (resume skips the ids already written); the join puts each
prompt's copies together, copy 0 first. Training holds a prompt's copies out together
(``data/groups.py: base_id``).

``generate.synthetic_prompts`` = m > 0: the actors first write m user requests of the target's own
(data/synthetic.py), actor i its share into ``synthetic.part-<i>.jsonl``, and answer them with their
input prompts; the join puts them after the input's records, each with its copies.

A rerun resumes the part files (``answers_meta.json`` beside them records what decides an answer's
text: ``answer_settings``, and the input file's sha256). When those settings or the input's content
changed since the parts were written (another target, temperature, answer length, seed, a prompt
edited under its id, ...) the stage refuses with a ``ConfigError`` instead of
mixing old answers into the new run; other changes (batch size, more copies, more requests) resume.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_ray.atomic import write_json, write_stream
from eagle3_ray.config import GenerateConfig, PipelineConfig, TargetConfig, save_resolved
from eagle3_ray.data.groups import copy_id
from eagle3_ray.data.sources import Sample
from eagle3_ray.data.synthetic import SYNTHETIC_ID, read_synthetic
from eagle3_ray.errors import ConfigError, DataError
from eagle3_ray.extract.stage import write_summary
from eagle3_ray.progress import say
from eagle3_ray.rejects import REJECTS_FILE, append_rejects

CONVERSATIONS_FILE = "conversations.jsonl"
ANSWERS_META = "answers_meta.json"  # answer_settings of the part files beside it
PART_GLOBS = ("conversations.part-*.jsonl", "synthetic.part-*.jsonl")


@dataclass(frozen=True)
class SyntheticShare:
    """An actor's share of ``generate.synthetic_prompts``: ``count`` requests of the target's own,
    written to ``path`` by actor number ``actor``."""

    count: int
    path: str
    actor: int


class DistillActor:
    """Holds one target engine; `run` self-distills a list of samples into a part file."""

    def __init__(self, target: TargetConfig, batch_tokens: int, batch_size: int | None = None):
        """``batch_size``: generate.batch_size, the most requests one engine call sends."""
        from eagle3_ray.engines.describe import describe_target, load_tokenizer
        from eagle3_ray.engines.factory import build_engine

        self.engine = build_engine(target, batch_tokens=batch_tokens, mode="generate", max_batch=batch_size)
        self.tokenizer = load_tokenizer(target)
        self.fingerprint = describe_target(target).fingerprint  # the feature store's target_fingerprint

    def run(self, samples: list[Sample], part_path: str, gen: GenerateConfig, max_length: int | None = None,
            synthetic: SyntheticShare | None = None) -> dict:
        """Answers ``samples`` into ``part_path`` (resumable), ``gen.samples_per_prompt`` times (see
        the module doc); the summary's ``rejected`` lists the prompts too long for ``max_length``
        (None: none rejected), which are not answered, and ``per_copy`` the summary of each copy (its
        ``total``: the records of that copy in the part file). ``synthetic``: first write that many
        requests of the target's own and answer them too (``synthetic`` in the summary: how many)."""
        from eagle3_ray.data.distill import needs_answers, self_distill
        from eagle3_ray.data.synthetic import synthetic_prompts

        written = []
        if synthetic and synthetic.count > 0:
            written = synthetic_prompts(self.engine, self.tokenizer, synthetic.count, synthetic.path,
                                        actor=synthetic.actor, batch_size=gen.batch_size,
                                        seed=synthetic_seed(gen.seed, synthetic.actor))
        regenerate = gen.after_tools == "regenerate"
        ordered, too_long = generation_order(list(samples) + written, self.tokenizer, max_length, regenerate)
        per_copy = []
        for copy in range(gen.samples_per_prompt):
            if copy == 0:
                todo, temperature = ordered, gen.temperature
            else:  # samples with nothing to write would only be repeated: those with answers to write are copied
                todo = [dataclasses.replace(s, sample_id=copy_id(s.sample_id, copy))
                        for s in ordered if needs_answers(s, regenerate)]
                temperature = gen.sample_temperature
            summary = self_distill(
                self.engine,
                self.tokenizer,
                todo,
                part_path,
                max_new_tokens=gen.max_new_tokens,
                temperature=temperature,
                top_p=gen.top_p,
                batch_size=gen.batch_size,
                seed=copy_seed(gen.seed, copy),
                regenerate_after_tools=regenerate,
                answered_by=self.fingerprint,
            )
            per_copy.append(dict(vars(summary)) if hasattr(summary, "__dict__") else dict(summary))
        out = {k: sum(c[k] for c in per_copy) for k in per_copy[0]}
        out["seconds"] = round(out["seconds"], 3)
        return {**out, "per_copy": per_copy, "rejected": too_long, "synthetic": len(written)}

    def close(self) -> None:
        self.engine.close()


# Copy c's engine calls are seeded copy_seed(seed, c) + call (self_distill counts its calls): a stride
# far beyond any call count, so that no two copies share a seed. With `seed + c` copy c's second call
# reused copy c+1's first call's seed, on another batch of prompts.
COPY_SEED_STRIDE = 1_000_003


def copy_seed(seed: int, copy: int) -> int:
    """The first seed of copy ``copy``'s engine calls (copy 0: ``seed`` itself)."""
    return seed + copy * COPY_SEED_STRIDE


SYNTHETIC_SEED_OFFSET = 999_999_937  # past every copy's seeds (copies x COPY_SEED_STRIDE) for any sane copy count


def synthetic_seed(seed: int, actor: int) -> int:
    """The first seed of actor ``actor``'s engine calls writing synthetic requests."""
    return seed + SYNTHETIC_SEED_OFFSET + actor * COPY_SEED_STRIDE


def generation_order(samples: list, tokenizer: Any, max_length: int | None = None,
                     regenerate_after_tools: bool = False) -> tuple[list, list[dict]]:
    """(samples in the order to answer them, reject records of the prompts too long to answer).

    Order: samples with nothing to write first, then the others by the number of answers to write and
    by the token length of their first generation prompt (stable, so the order is the same on a rerun
    and resume skips what was written). A sample whose first generation prompt has ``max_length``
    tokens or more is rejected: every token of its answer would lie past ``data.max_length``, where
    preparation cuts or rejects the conversation.
    """
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.data.messages import answer_script

    keyed, rejects = [], []
    for pos, s in enumerate(samples):
        script = answer_script(s.messages, regenerate_after_tools)
        if None not in script:
            keyed.append(((0, 0, pos), s))
            continue
        n = len(render_generation_prompt(tokenizer, script[: script.index(None)], s.tools))
        if max_length is not None and n >= max_length:
            rejects.append({"sample_id": s.sample_id, "source": s.source, "stage": "generate",
                            "reason": f"the prompt has {n} tokens, data.max_length={max_length} leaves no room "
                                      "for an answer; raise data.max_length"})
            continue
        keyed.append(((script.count(None), n, pos), s))
    keyed.sort(key=lambda kv: kv[0])
    return [s for _, s in keyed], rejects


def joined_order(prompt_ids: list[str], copies: int) -> list[str]:
    """The ids of conversations.jsonl in order: the input's prompts, then the target's own requests,
    each prompt's copies together, copy 0 first."""
    return [copy_id(sid, c) for sid in prompt_ids for c in range(copies)]


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


def check_copy_ids(samples: list, copies: int, regenerate_after_tools: bool = False) -> None:
    """DataError if a sampled copy's id ``<id>#s<copy>`` (copies 1..``copies``-1 of the ``samples`` with
    answers to write) is the id of an input sample: the two records would share an id."""
    from eagle3_ray.data.distill import needs_answers

    if copies <= 1:
        return
    given = {s.sample_id: s.source for s in samples}
    for s in samples:
        if not needs_answers(s, regenerate_after_tools):
            continue
        for copy in range(1, copies):
            cid = copy_id(s.sample_id, copy)
            if cid in given:
                raise DataError(
                    f"the record {given[cid]} has the id {cid!r}, which generate.samples_per_prompt={copies} "
                    f"gives the sampled copy {copy} of {s.sample_id!r} ({s.source}); rename that record's id "
                    "or set generate.samples_per_prompt=1"
                )


def answer_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The settings that decide what an answer (or a request the target writes) says. The sampled
    copies' temperature counts only with copies (``generate.samples_per_prompt`` > 1)."""
    t, d, g = cfg.target, cfg.data, cfg.generate
    settings = {"target.model": t.model, "target.dtype": t.dtype, "target.seed": t.seed,
                "data.system_prompt": d.system_prompt, "generate.max_new_tokens": g.max_new_tokens,
                "generate.temperature": g.temperature, "generate.top_p": g.top_p, "generate.seed": g.seed}
    if g.samples_per_prompt > 1:
        settings["generate.sample_temperature"] = g.sample_temperature
    settings["generate.after_tools"] = g.after_tools
    return settings


def check_answer_settings(out: Path, settings: dict[str, Any]) -> None:
    """Before answering into ``out``: ``ConfigError`` when its part files were written under other
    ``answer_settings`` (a rerun resumes them, so it would mix old answers with new ones); then
    records ``settings`` beside them. Parts without a record (written before it existed) resume."""
    meta = out / ANSWERS_META
    parts = [p for pattern in PART_GLOBS for p in sorted(out.glob(pattern))]
    if parts and meta.is_file():
        # Parts recorded before generate.after_tools existed kept every given answer.
        before = {"generate.after_tools": "keep", **json.loads(meta.read_text(encoding="utf-8"))}
        changed = [f"{k}={before[k]!r} then, {v!r} now" for k, v in settings.items() if k in before and before[k] != v]
        if changed:
            raise ConfigError(
                f"{out} holds answers written under other settings ({'; '.join(changed)}), and a rerun resumes "
                f"them: delete {' and '.join(str(out / g) for g in PART_GLOBS)} (or the directory) to answer "
                "again, use another --out, or set those options back"
            )
    write_json(meta, settings, sort_keys=True)


def run_generate(cfg: PipelineConfig, data: str | None, out: str | Path) -> Path:
    import ray

    from eagle3_ray.data.sources import inputs_fingerprint, read_input

    t0 = time.monotonic()
    out = Path(out)
    save_resolved(cfg, out)
    sources, samples, rejected = read_input(data, cfg.data)
    rejects = [{**dataclasses.asdict(r), "stage": "generate"} for r in rejected]
    copies = cfg.generate.samples_per_prompt
    check_copy_ids(samples, copies, cfg.generate.after_tools == "regenerate")
    n_synthetic = cfg.generate.synthetic_prompts
    taken = [s.sample_id for s in samples if s.sample_id.startswith(SYNTHETIC_ID)] if n_synthetic else []
    if taken:
        raise DataError(f"the input has ids starting {SYNTHETIC_ID!r} ({taken[0]!r}, ...), which "
                        f"generate.synthetic_prompts={n_synthetic} gives the target's own requests; rename those "
                        "records or set generate.synthetic_prompts=0")
    # The input's content too: the parts resume by id, and a record edited under its id would keep
    # its old answer (`eagle3-ray run` refuses other data for its --out before this stage).
    check_answer_settings(out, {**answer_settings(cfg), "input.sha256": inputs_fingerprint(sources)["sha256"]})
    (out / REJECTS_FILE).unlink(missing_ok=True)
    append_rejects(out, rejects)

    n = max(1, min(cfg.extract.num_actors, len(samples)))
    actor_cls = ray.remote(
        num_gpus=cfg.extract.num_gpus_per_actor or 0, num_cpus=cfg.extract.num_cpus_per_actor, max_restarts=2
    )(DistillActor)
    actors = [actor_cls.remote(cfg.target, cfg.extract.batch_tokens, cfg.generate.batch_size) for _ in range(n)]
    parts = [out / f"conversations.part-{i:03d}.jsonl" for i in range(n)]
    say(f"[generate] {len(samples)} samples on {n} engine actor(s), {len(rejects)} rejected"
        + (f" + {n_synthetic} requests the target writes itself" if n_synthetic else "")
        + (f"; {copies} answers per prompt (copies 1-{copies - 1} sampled at temperature "
           f"{cfg.generate.sample_temperature})" if copies > 1 else ""))
    shares = [n_synthetic // n + (i < n_synthetic % n) for i in range(n)]
    synthetic_parts = [out / f"synthetic.part-{i:03d}.jsonl" for i in range(n)]
    results = ray.get(
        [a.run.remote(samples[i::n], str(parts[i]), cfg.generate, cfg.data.max_length,
                      SyntheticShare(shares[i], str(synthetic_parts[i]), i))
         for i, a in enumerate(actors)]
    )
    for a in actors:
        ray.kill(a)
    too_long = [r for res in results for r in res.pop("rejected", [])]
    if too_long:
        append_rejects(out, too_long)
        say(f"[generate] {len(too_long)} prompts rejected: too long for data.max_length={cfg.data.max_length}")

    joined = out / CONVERSATIONS_FILE
    synthetic_ids = [s.sample_id for p in synthetic_parts if p.exists() for s in read_synthetic(p)]
    ids = joined_order([s.sample_id for s in samples] + synthetic_ids, copies)
    count = write_stream(joined, lambda dst: join_in_order(parts, ids, dst))
    per_copy = [sum(res["per_copy"][c]["total"] for res in results) for c in range(copies)]
    synthetic = sum(res.pop("synthetic", 0) for res in results)
    if n_synthetic:
        say(f"[generate] {synthetic} of {n_synthetic} requests written by the target"
            + (" (it left the rest unfinished or repeated)" if synthetic < n_synthetic else ""))
    write_summary(
        out,
        {"conversations": count, "samples_per_prompt": copies, "conversations_per_copy": per_copy,
         "synthetic_prompts": synthetic,
         "rejected": len(rejects) + len(too_long), "parts": results,
         "seconds": round(time.monotonic() - t0, 2), "output": str(joined)},
    )
    say(f"[generate] wrote {count} conversations -> {joined}")
    return joined
