"""`eagle3-ray run`: the whole pipeline, resumable stage by stage.

    prompts -> generate (self-distillation) -> prepare -> extract -> vocab -> train -> export -> bench -> report

Each stage writes into its own directory under --out and leaves `_DONE.json` there, beside its output,
holding the hash of the config sections it depends on (extract: features/_DONE.json; export:
drafter/_DONE.json). A rerun skips stages whose marker matches and resumes the rest (extraction skips
committed samples, training restarts from its latest checkpoint). The benchmark stage writes the
run's report (bench/report.md, with the training curves).
With `train.mode=online|hybrid` the vocab map comes from the prepared tokens and features stream
from the engine actors into training (eagle3_ray/online.py) instead of an extract stage.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable

from eagle3_ray import metrics as dashboard
from eagle3_ray.atomic import write_json
from eagle3_ray.bench.report import REPORT_NAME, lead
from eagle3_ray.bench.runner import RESULTS_NAME, run_bench
from eagle3_ray.config import PipelineConfig, config_to_dict, save_resolved
from eagle3_ray.data.sources import Sample, input_paths, inputs_fingerprint, read_samples
from eagle3_ray.errors import ConfigError
from eagle3_ray.extract.generate_stage import run_generate
from eagle3_ray.extract.pipeline import run_extract
from eagle3_ray.extract.prepare_stage import run_prepare
from eagle3_ray.extract.vocab_stage import run_vocab
from eagle3_ray.online import run_online_training, run_online_vocab
from eagle3_ray.out_lock import out_lock
from eagle3_ray.progress import say
from eagle3_ray.train.checkpoint import export_from_training
from eagle3_ray.train.trainer import run_training

DONE = "_DONE.json"
# The run's input data (path, size, content hash) at the top of --out: the stages resume by sample id,
# so a rerun over other data would keep the old records' answers and features; it is refused.
INPUTS = "inputs.json"
# Stages whose output directory is not named after the stage (their marker sits there).
OUTPUT_DIRS = {"extract": "features", "export": "drafter"}

# Which config sections each stage's output depends on (a change there reruns the stage).
STAGE_DEPS = {
    "generate": ("target", "data", "generate"),
    "prepare": ("target", "data", "generate"),
    "extract": ("target", "data", "generate", "extract"),
    "vocab": ("target", "data", "generate", "vocab"),
    "train": ("target", "data", "generate", "vocab", "train"),
    "export": ("target", "data", "generate", "vocab", "train"),
    "bench": ("target", "data", "generate", "vocab", "train", "bench"),
}

# Options that change how a stage runs, never what it writes: out of the hashes, so that setting
# them (or their arrival in a new version) does not redo finished stages. Dotted: a nested section's key.
# The long-sample memory options too: the same loss and gradients, only what the backward recomputes;
# and the experiment trackers, which get the metrics that metrics.jsonl gets.
# generate.answers: answers taken from an earlier run only where its settings are this run's (the same text);
# bench.reference: a sentence of the report citing another record, not what the bench measures.
UNHASHED = {"train": ("val_cache_bytes", "loss_chunk_tokens", "recompute_ttt_steps", "trackers", "tracking"),
            "target": ("sglang.max_concurrent_calls",), "generate": ("answers",), "bench": ("reference",)}


# Options added after runs existed, hashed only when set off their default, so that a run made before
# an option came resumes with the hash it had: none (empty or unset), off, or the old behaviour.
# (train.context_parallel on gives other packs; train.keep_best none exports another checkpoint.)
HASHED_UNLESS_DEFAULT = {
    "generate": {"synthetic_prompts": 0, "after_tools": "keep"},
    "train": {"val_groups": {}, "eval_only": [], "context_parallel": 1, "warmup_ratio": None,
              "lm_head_init": "random", "keep_best": "held_out_tau"},
}


def _stage_hash(cfg: PipelineConfig, stage: str, data: str | None) -> str:
    full = config_to_dict(cfg)
    if full["generate"]["samples_per_prompt"] == 1:  # one answer per prompt: the hash of runs before copies
        full["generate"] = {k: v for k, v in full["generate"].items()
                            if k not in ("samples_per_prompt", "sample_temperature")}
    for section, defaults in HASHED_UNLESS_DEFAULT.items():
        for key, default in defaults.items():
            if full[section][key] == default:
                full[section].pop(key)
    # The bench's engine options, where they change nothing: the hash of runs before them.
    unused = {"engine"} if cfg.bench.engine == "auto" else set()
    if cfg.bench.bench_engine(cfg.target.backend) == "hf":
        unused.add("concurrency")
    full["bench"] = {k: v for k, v in full["bench"].items() if k not in unused}
    for section, keys in UNHASHED.items():
        for key in keys:
            *inner, last = key.split(".")
            d = full[section]
            for k in inner:
                d = d[k]
            d.pop(last, None)
    part = {k: full[k] for k in STAGE_DEPS[stage]}
    if stage == "vocab" and cfg.train.eval_only:  # the vocab stage leaves those groups' samples out
        part["_eval_only"] = {g: cfg.train.val_groups[g] for g in cfg.train.eval_only}
    part["_data"] = data
    return hashlib.sha256(json.dumps(part, sort_keys=True).encode()).hexdigest()[:16]


class StopAfter(Exception):
    """Raised by StageRunner once the stage named by `stop_after` is done."""


class StageRunner:
    def __init__(self, cfg: PipelineConfig, out: Path, data: str | None, stop_after: str | None = None):
        self.cfg, self.out, self.data, self.stop_after = cfg, out, data, stop_after
        self.timings: dict[str, float] = {}

    def dir(self, stage: str) -> Path:
        """Where `stage` writes: its own directory, except extract (features/) and export (drafter/)."""
        return self.out / OUTPUT_DIRS.get(stage, stage)

    def marker(self, stage: str) -> Path:
        """The stage's `_DONE.json`, beside its output; an out dir written before the markers moved
        keeps its marker in out/<stage>/, read as well so that it resumes."""
        marker = self.dir(stage) / DONE
        legacy = self.out / stage / DONE
        return legacy if not marker.is_file() and legacy.is_file() else marker

    def run(self, stage: str, fn: Callable[[Path], Any]) -> Any:
        d = self.dir(stage)
        marker = self.marker(stage)
        want = _stage_hash(self.cfg, stage, self.data)
        if marker.is_file():
            saved = json.loads(marker.read_text(encoding="utf-8"))
            if saved.get("hash") == want:
                say(f"[run] {stage}: done earlier, skipping ({d})")
                self._maybe_stop(stage)
                return self._relocated(saved, stage, d)
            say(f"[run] {stage}: config changed since the last run, redoing")
            marker.unlink()
        say(f"[run] {stage} ...")
        t0 = time.monotonic()
        result = fn(d)
        self.timings[stage] = round(time.monotonic() - t0, 1)
        d.mkdir(parents=True, exist_ok=True)
        write_json(d / DONE, {"hash": want, "result": result, "seconds": self.timings[stage]}, indent=None,
                   newline=False)
        self._maybe_stop(stage)
        return result

    def _relocated(self, saved: dict[str, Any], stage: str, d: Path) -> Any:
        """A finished stage's result, where it is now: a recorded path that no longer exists (the out
        dir renamed, or restored on another machine) is taken from the stage's directory of this out
        dir, as the part of the path after the stage's directory name."""
        result = saved.get("result")
        if not isinstance(result, str) or not Path(result).is_absolute() or Path(result).exists():
            return result
        parts = Path(result).parts
        if d.name in parts:
            moved = d.joinpath(*parts[len(parts) - parts[::-1].index(d.name):])
            if moved.exists():
                say(f"[run] {stage}: its output moved with the out dir: {result} is now {moved}")
                return str(moved)
        return result

    def _maybe_stop(self, stage: str) -> None:
        if stage == self.stop_after:
            raise StopAfter(stage)


def _needs_generation(cfg: PipelineConfig, data: str | None) -> bool:
    from eagle3_ray.data.distill import needs_answers

    regenerate = cfg.generate.after_tools == "regenerate"
    paths = input_paths(data, cfg.data)
    for item in read_samples(paths, cfg.data.format, cfg.data.max_samples, cfg.data.system_prompt):
        if isinstance(item, Sample) and needs_answers(item, regenerate):
            return True
    return False


def run_pipeline(cfg: PipelineConfig, data: str | None, out: str | Path,
                 stop_after: str | None = None) -> dict[str, Any]:
    """Run (or resume) every stage; `stop_after` ends the run after that stage (one of STAGE_DEPS)."""
    t0 = time.monotonic()
    out = Path(out).resolve()
    with out_lock(out, "run"):
        return _locked_run(cfg, data, out, stop_after, t0)


def check_inputs(cfg: PipelineConfig, data: str | None, out: Path) -> None:
    """``ConfigError`` when ``out`` was written from input data of other content (``INPUTS`` records
    it): every stage resumes by sample id, so records edited under the same ids (or another file
    whose records share ids, such as its line numbers) would keep the old answers and features.
    The same content at another path passes. An out dir without the record (written before it
    existed) is taken as written from this data."""
    now = inputs_fingerprint(input_paths(data, cfg.data))
    record = out / INPUTS
    if record.is_file():
        before = json.loads(record.read_text(encoding="utf-8"))
        if before.get("sha256") != now["sha256"]:
            raise ConfigError(
                f"{out} was written from other input data: {before.get('data')} ({before.get('bytes')} bytes, "
                f"sha256 {str(before.get('sha256'))[:12]}...) then, {now['data']} ({now['bytes']} bytes, sha256 "
                f"{now['sha256'][:12]}...) now. The stages resume by sample id and would keep the answers and "
                f"features of the old records: pass another --out for this data, or delete {out} to start over"
            )
    write_json(record, now)


def _locked_run(cfg: PipelineConfig, data: str | None, out: Path, stop_after: str | None, t0: float):
    check_inputs(cfg, data, out)  # out_lock made the directory
    save_resolved(cfg, out)
    stages = StageRunner(cfg, out, data, stop_after)
    try:
        return _run_stages(cfg, data, out, stages, t0)
    except StopAfter:
        summary = {"stopped_after": stop_after, "seconds": round(time.monotonic() - t0, 1),
                   "stage_seconds": stages.timings}
        write_json(out / "summary.json", summary, newline=False)
        say(f"[run] stopped after {stop_after} as asked ({out})")
        return summary


def _train_stages(cfg: PipelineConfig, stages: StageRunner, prepared: str) -> None:
    """offline: extract -> vocab (store) -> train; online/hybrid: vocab (prepared) -> streamed train."""
    features, vocab = stages.dir("extract"), stages.dir("vocab")
    if cfg.train.mode == "offline":
        stages.run("extract", lambda d: run_extract(cfg, prepared, d).store)
        stages.run("vocab", lambda d: str(run_vocab(cfg, features, d)))
        stages.run("train", lambda d: str(run_training(cfg, features, vocab, d)))
        return
    store = features if cfg.train.mode == "hybrid" else None
    stages.run("vocab", lambda d: str(run_online_vocab(cfg, prepared, d)))
    stages.run("train", lambda d: str(run_online_training(cfg, prepared, vocab, d, features=store)))


def _run_stages(cfg: PipelineConfig, data: str | None, out: Path, stages: StageRunner,
                t0: float) -> dict[str, Any]:
    source = data
    if _needs_generation(cfg, data):
        source = stages.run("generate", lambda d: str(run_generate(cfg, data, d)))
    prepared = stages.run("prepare", lambda d: run_prepare(cfg, source, d).prepared)
    _train_stages(cfg, stages, prepared)
    drafter = stages.dir("export")
    stages.run("export", lambda d: str(export_from_training(stages.dir("train"), d, engine="sglang")))
    metrics = stages.dir("train") / "metrics.jsonl"
    results = stages.run(
        "bench",
        lambda d: _bench_summary(
            run_bench(cfg, drafter=str(drafter), prompts=None, out=d, compare_untrained=cfg.bench.untrained,
                      train_metrics=str(metrics) if metrics.is_file() else None)
        ),
    )
    dashboard.record_bench(results, cfg.name)
    bench = stages.dir("bench")
    summary = {
        "drafter": str(drafter),
        "best_checkpoint": _best_checkpoint(stages.dir("train")),
        "report": str(bench / REPORT_NAME),
        "results": str(bench / RESULTS_NAME),
        **results,
        "seconds": round(time.monotonic() - t0, 1),
        "stage_seconds": stages.timings,
    }
    write_json(out / "summary.json", summary, newline=False)
    _print_summary(summary)
    return summary


def _best_checkpoint(train: Path) -> dict[str, Any] | None:
    """The training summary's best checkpoint (train.keep_best), which export took; None for none."""
    summary = train / "summary.json"
    return json.loads(summary.read_text(encoding="utf-8")).get("best") if summary.is_file() else None


def _bench_summary(results: dict[str, Any]) -> dict[str, Any]:
    untrained = results.get("untrained") or {}
    return {
        "lead": lead(results),  # the report's first words (markdown)
        "tau": results.get("tau", {}),
        "speedup": results.get("speedup", {}),
        "tokens_per_s": results.get("tokens_per_s", {}),
        "untrained_tau": untrained.get("tau"),
    }


def _print_summary(s: dict[str, Any]) -> None:
    tau = ", ".join(f"{m} {v:.2f}" for m, v in (s.get("tau") or {}).items())
    speed = ", ".join(f"{m} {v:.2f}x" for m, v in (s.get("speedup") or {}).items())
    say("\n=== eagle3-ray run: done in %.0fs ===" % s["seconds"])
    if s.get("lead"):
        say("  " + s["lead"].replace("**", "").replace("`", ""))
    untrained = s.get("untrained_tau")
    say(f"  acceptance length tau: {tau}" + (f"   (untrained drafter: {untrained})" if untrained is not None else ""))
    say(f"  speedup over plain generation: {speed}")
    say(f"  drafter (SGLang layout): {s['drafter']}")
    if s.get("best_checkpoint"):
        b = s["best_checkpoint"]
        say(f"    from the best checkpoint: step {b['step']}, held-out tau {b['val_tau']:.3f} ({b['margin']:+.3f} over "
            f"the last evaluation, step {b['last_eval_step']})")
    say(f"  report: {s['report']}")
