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

``generate.answers`` names answers this target wrote earlier (an earlier run's conversations.jsonl
with its answers_meta.json, or a shipped ``builtin:<name>`` with ``<name>.meta.json``): where that
meta equals this run's ``answer_settings``, each record whose messages before its answers are an
input sample's is written into that sample's actor's part file before the actors start, so they
resume past it (``reuse_answers``); an actor with nothing left to write is not started.

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
from eagle3_ray.data.sources import BUILTIN_PREFIX, Sample, resolve_data_path
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


def loaded_dtype(cfg: PipelineConfig) -> str:
    """The dtype the engine actors load the target in: ``target.dtype``, with auto resolved as on
    their device (a GPU when they are given one or target.device names one)."""
    if cfg.target.dtype != "auto":
        return cfg.target.dtype
    gpu = cfg.extract.num_gpus_per_actor > 0 or cfg.target.device.startswith("cuda")
    return "bfloat16" if gpu else "float32"


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


def answers_files(source: str) -> tuple[Path, Path]:
    """``generate.answers`` -> (its conversations file, the meta that says how they were written):
    ``builtin:<name>`` -> ``<name>.jsonl`` and ``<name>.meta.json`` shipped beside it; a generate
    stage's output directory or its conversations.jsonl -> that file and the answers_meta.json beside it."""
    if source.startswith(BUILTIN_PREFIX):
        file = resolve_data_path(source)
        return file, file.with_suffix(".meta.json")
    path = Path(source).expanduser()
    file = path / CONVERSATIONS_FILE if path.is_dir() else path
    if not file.is_file():
        raise DataError(f"generate.answers={source!r}: {file} does not exist; pass the conversations.jsonl of an "
                        "earlier `eagle3-ray generate` (or its --out directory), or generate.answers=null")
    return file, file.parent / ANSWERS_META


def reuse_answers(source: str, settings: dict[str, Any], samples: list[Sample], copies: int,
                  regenerate_after_tools: bool, parts: list[Path]) -> int:
    """Writes the earlier answers of ``source`` (``generate.answers``) that this run would write into
    the part file of the actor that would write them (``samples[i]`` -> ``parts[i % len(parts)]``),
    unless it holds them already; returns how many it wrote. It writes nothing when ``source`` was
    written under other ``answer_settings`` than ``settings`` (the stage says which differ), and
    raises ``ConfigError`` when no meta says how it was written."""
    from eagle3_ray.data.distill import append_records, needs_answers, written_ids
    from eagle3_ray.data.sources import read_samples

    file, meta_file = answers_files(source)
    if not meta_file.is_file():
        raise ConfigError(
            f"generate.answers={source!r}: {meta_file} is missing, so nothing says which target and settings "
            f"wrote {file}; pass the output of `eagle3-ray generate` (answers_meta.json beside conversations.jsonl), "
            "or give the conversations as --data to train on them as they are"
        )
    # Answers recorded before generate.after_tools existed kept every given answer.
    before = {"generate.after_tools": "keep", **json.loads(meta_file.read_text(encoding="utf-8"))}
    if before.get("target.dtype") == "auto":  # an earlier run of this machine's: as this run resolves it
        before["target.dtype"] = settings.get("target.dtype")
    changed = [f"{k}={before.get(k)!r} then, {v!r} now" for k, v in settings.items() if before.get(k) != v]
    if changed:
        say(f"[generate] generate.answers={source}: written under other settings ({'; '.join(changed)}); "
            "every answer is generated here")
        return 0
    lines = {str(json.loads(line).get("id")): line
             for line in file.read_text(encoding="utf-8").splitlines() if line.strip()}
    earlier = {s.sample_id: s for s in read_samples(str(file)) if isinstance(s, Sample)}
    taken = 0
    for i, part in enumerate(parts):
        have = written_ids(part)
        records = []
        for sample in samples[i :: len(parts)]:
            if not needs_answers(sample, regenerate_after_tools):
                continue
            for copy in range(copies):
                sid = copy_id(sample.sample_id, copy)
                if sid not in have and sid in earlier and answers_of(sample, earlier[sid], regenerate_after_tools):
                    records.append(lines[sid])
        append_records(part, records)
        taken += len(records)
    return taken


def answers_of(sample: Sample, earlier: Sample, regenerate_after_tools: bool = False) -> bool:
    """``earlier`` holds answers to ``sample``: its messages are the sample's, with an assistant
    turn wherever the target writes one (``answer_script``), and its tools are the sample's."""
    from eagle3_ray.data.messages import answer_script

    script = answer_script(sample.messages, regenerate_after_tools)
    return (len(earlier.messages) == len(script) and earlier.tools == sample.tools
            and all(m["role"] == "assistant" if want is None else m == want
                    for m, want in zip(earlier.messages, script)))


def _nothing_to_write(samples: list[Sample], part: Path, copies: int, regenerate_after_tools: bool) -> bool:
    """Every record an actor would write for ``samples`` is in its part file already."""
    from eagle3_ray.data.distill import needs_answers, written_ids

    have = written_ids(part)
    return all(copy_id(s.sample_id, c) in have
               for s in samples for c in range(copies if needs_answers(s, regenerate_after_tools) else 1))


def _written_earlier(samples: list[Sample], copies: int, regenerate_after_tools: bool) -> dict[str, Any]:
    """The summary of an actor that was not started: each of its records was in its part file."""
    from eagle3_ray.data.distill import needs_answers

    answered = sum(needs_answers(s, regenerate_after_tools) for s in samples)
    per_copy = [{"total": len(samples) if c == 0 else answered, "skipped": len(samples) if c == 0 else answered,
                 "generated": 0, "passed_through": 0, "empty_answers": 0, "new_tokens": 0, "seconds": 0.0}
                for c in range(copies)]
    out = {k: sum(c[k] for c in per_copy) for k in per_copy[0]}
    return {**out, "per_copy": per_copy, "rejected": [], "synthetic": 0}


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
    parts = [out / f"conversations.part-{i:03d}.jsonl" for i in range(n)]
    regenerate = cfg.generate.after_tools == "regenerate"
    taken = 0
    if cfg.generate.answers:
        # The dtype the answers are written in, not the word: "auto" is bf16 on a GPU, fp32 on a CPU.
        settings = {**answer_settings(cfg), "target.dtype": loaded_dtype(cfg)}
        taken = reuse_answers(cfg.generate.answers, settings, samples, copies, regenerate, parts)
        if taken:
            say(f"[generate] {taken} answers taken from {cfg.generate.answers}, written earlier by this target "
                "under these settings (generate.answers=null writes them here)")
    shares = [n_synthetic // n + (i < n_synthetic % n) for i in range(n)]
    synthetic_parts = [out / f"synthetic.part-{i:03d}.jsonl" for i in range(n)]
    # An actor whose part file holds every record it would write has nothing to do: not started.
    busy = [i for i in range(n) if shares[i] or not _nothing_to_write(samples[i::n], parts[i], copies, regenerate)]
    say(f"[generate] {len(samples)} samples " + (f"on {len(busy)} engine actor(s)" if busy else "answered already")
        + f", {len(rejects)} rejected"
        + (f" + {n_synthetic} requests the target writes itself" if n_synthetic else "")
        + (f"; {copies} answers per prompt (copies 1-{copies - 1} sampled at temperature "
           f"{cfg.generate.sample_temperature})" if copies > 1 else ""))
    actor_cls = ray.remote(
        num_gpus=cfg.extract.num_gpus_per_actor or 0, num_cpus=cfg.extract.num_cpus_per_actor, max_restarts=2
    )(DistillActor)
    actors = {i: actor_cls.remote(cfg.target, cfg.extract.batch_tokens, cfg.generate.batch_size) for i in busy}
    running = {i: a.run.remote(samples[i::n], str(parts[i]), cfg.generate, cfg.data.max_length,
                               SyntheticShare(shares[i], str(synthetic_parts[i]), i))
               for i, a in actors.items()}
    done = dict(zip(running, ray.get(list(running.values()))))
    results = [done[i] if i in done else _written_earlier(samples[i::n], copies, regenerate) for i in range(n)]
    for a in actors.values():
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
         "synthetic_prompts": synthetic, "answers_taken": taken,
         "rejected": len(rejects) + len(too_long), "parts": results,
         "seconds": round(time.monotonic() - t0, 2), "output": str(joined)},
    )
    say(f"[generate] wrote {count} conversations -> {joined}")
    return joined
