"""The benchmark: one actor loads the target and the drafter once and decodes every prompt in every mode.

Per turn of every prompt, on the same prompt tokens and in the same process: plain target generation
(the baseline), each speculative mode of ``bench.modes`` (chain, tree), prompt lookup (a
drafter-free peer) and, on request, chain mode with an untrained drafter. Multi-turn prompts carry
the baseline's answer into the next turn, so every mode sees exactly the same prompts even when
sampling. ``docs/bench.md`` defines what is measured.

``BenchActor`` is a plain class (in-process in tests); ``run_bench`` runs it as a Ray actor, writes
each category's raw per-turn stats to ``<out>/partial/`` as it completes (a rerun computes only the
missing categories), then ``results.json`` and the report.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3_ray.atomic import write_json
from eagle3_ray.bench.prompts import Prompt, load_prompt_sets
from eagle3_ray.bench.report import write_report
from eagle3_ray.config import BenchConfig, PipelineConfig, TargetConfig, config_to_dict
from eagle3_ray.progress import say

DEFAULT_PROMPTS = "builtin:demo_eval"
RESULTS_NAME = "results.json"
PARTIAL_DIR = "partial"
PARTIAL_FORMAT = 1
WARMUP_TOKENS = 16  # enough to run every code path (prefill, drafting, verify) once
UNTRAINED_SEED = 0
SAMPLING_SEED = 0
PROMPT_LOOKUP_TOKENS = 10  # transformers' usual prompt_lookup_num_tokens

# Runner: (prompt ids [T], max_new_tokens) -> (new token ids, stats dict)
Runner = Callable[[list[int], int], tuple[list[int], dict[str, Any]]]


class BenchActor:
    """Target + drafter loaded once; decodes prompt sets in every benchmark mode. No Ray in here."""

    def __init__(self, target_cfg: dict[str, Any], drafter_dir: str, compare_untrained: bool = False):
        from eagle3_ray.drafter import load_drafter
        from eagle3_ray.engines.targets import load_target
        from eagle3_ray.spec import prepare_drafter

        self.target = load_target(TargetConfig.model_validate(target_cfg))
        model = self.target.model
        # On the target's device and dtype, sharing (not copying) its input embedding.
        self.drafter = prepare_drafter(load_drafter(drafter_dir), model)
        self.untrained = _untrained_like(self.drafter, model) if compare_untrained else None
        self.info = {"device": _device_name(self.target.device), "target": target_cfg["model"], "drafter": drafter_dir}
        self._static = None  # the StaticTarget (CUDA), built on first use

    def _decoding_target(self, b: BenchConfig):
        """The model, or on CUDA with ``bench.cuda_graphs`` one StaticTarget shared by every mode."""
        if not (b.cuda_graphs and self.target.device.type == "cuda"):
            return self.target.model
        if self._static is None or self._static.max_length != b.max_length:
            from eagle3_ray.spec import StaticTarget

            self._static = StaticTarget(self.target.model, self.drafter.config.aux_layers, max_length=b.max_length)
            self.info["static_target"] = f"CUDA graphs, max_length {b.max_length}"
        return self._static

    def describe(self) -> dict[str, str]:
        return dict(self.info)

    def warmup(self, prompt: Prompt, bench: dict[str, Any]) -> None:
        """One short decode per mode: first-call costs (allocator, kernels, caches) stay out of the timings."""
        b = BenchConfig.model_validate(bench)
        ids = self._render([{"role": "user", "content": prompt.turns[0]}])
        for run in self._runners(b).values():
            run(ids, min(WARMUP_TOKENS, b.max_new_tokens))

    def run_category(self, prompts: list[Prompt], bench: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """Raw per-turn records of every mode: ``{kind: [{prompt_id, turn, prompt_tokens, stats, ...}]}``."""
        b = BenchConfig.model_validate(bench)
        runners = self._runners(b)
        records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in runners}
        for prompt in prompts:
            messages: list[dict[str, str]] = []
            for turn, text in enumerate(prompt.turns):
                messages.append({"role": "user", "content": text})
                ids = self._render(messages)
                answer: list[int] = []
                for kind, run in runners.items():  # baseline first: its answer is the reference
                    tokens, stats = run(ids, b.max_new_tokens)
                    if kind == "baseline":
                        answer = tokens
                    records[kind].append(
                        {"prompt_id": prompt.id, "turn": turn, "prompt_tokens": len(ids),
                         "identical": tokens == answer, "stats": stats}
                    )
                reply = self.target.tokenizer.decode(answer, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": reply})
        return records

    def run(self, prompt_sets: dict[str, list[Prompt]], bench: dict[str, Any]) -> dict[str, Any]:
        """Warm up, decode every category, aggregate (no files written)."""
        first = next(p for prompts in prompt_sets.values() for p in prompts)
        self.warmup(first, bench)
        records = {cat: self.run_category(prompts, bench) for cat, prompts in prompt_sets.items()}
        return {**summarize(records, bench["modes"]), **self.describe()}

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        from eagle3_ray.data.chat import render_generation_prompt

        return render_generation_prompt(self.target.tokenizer, messages)

    def _runners(self, b: BenchConfig) -> dict[str, Runner]:
        """Every decoding to time, baseline first; all share temperature and seed."""
        from eagle3_ray import spec

        model = self.target.model
        decoding = self._decoding_target(b)  # every mode but prompt lookup (transformers' generate)
        sampling = {"temperature": b.temperature, "seed": SAMPLING_SEED}
        chain = {"mode": "chain", "num_steps": b.num_steps, **sampling}
        tree = {"mode": "tree", "topk": b.topk, "depth": b.depth, "total_tokens": b.total_tokens, **sampling}

        def bind(fn: Callable[..., tuple[list[int], Any]], *args: Any, target: Any = decoding, **kw: Any) -> Runner:
            def run(ids: list[int], n: int) -> tuple[list[int], dict[str, Any]]:
                tokens, stats = fn(target, *args, torch.tensor(ids, device=self.target.device), n, **kw)
                return list(tokens), stats.to_dict()

            return run

        runners = {"baseline": bind(spec.target_generate, **sampling)}
        for mode in b.modes:
            runners[mode] = bind(spec.generate, self.drafter, **(chain if mode == "chain" else tree))
        if b.prompt_lookup:
            runners["prompt_lookup"] = bind(spec.prompt_lookup_generate, target=model, num_tokens=PROMPT_LOOKUP_TOKENS)
        if self.untrained is not None:
            runners["untrained"] = bind(spec.generate, self.untrained, **chain)
        return runners


def _untrained_like(drafter: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """Same config and vocab map as ``drafter``, seeded random weights: the floor a trained one must beat."""
    from eagle3_ray.drafter import Eagle3Drafter
    from eagle3_ray.spec import prepare_drafter

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(UNTRAINED_SEED)
        untrained = Eagle3Drafter(drafter.config)
    untrained.set_vocab_map(drafter.d2t.cpu(), drafter.t2d.cpu())
    return prepare_drafter(untrained, model)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


# --- aggregation: plain dicts in, plain dicts out ---------------------------------------------------


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals of one mode over many turns.

    ``tau`` weights each turn by its verify steps (Σ τ·steps / Σ steps, i.e. tokens per target
    verify forward); ``tokens_per_s`` is total new tokens over total decode seconds, so long answers
    count by their length rather than as one sample each.
    """
    stats = [r["stats"] for r in records]
    new_tokens = sum(s["new_tokens"] for s in stats)
    seconds = sum(s["seconds"] for s in stats)
    verified = [s for s in stats if s.get("tau") is not None and s.get("verify_steps")]
    steps = sum(s["verify_steps"] for s in verified)
    return {
        "tau": sum(s["tau"] * s["verify_steps"] for s in verified) / steps if steps else None,
        "accept_by_position": _mean_positions(verified),
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "new_tokens": new_tokens,
        "verify_steps": steps if verified else None,
        "seconds": seconds,
        "turns": len(records),
        "identical_to_baseline": sum(r["identical"] for r in records) / len(records) if records else None,
    }


def _mean_positions(stats: list[dict[str, Any]]) -> list[float]:
    """Per draft position, the rate of verify steps accepting at least that many drafts (steps-weighted)."""
    width = max((len(s.get("accept_by_position") or []) for s in stats), default=0)
    total = [0.0] * width
    for s in stats:
        for i, rate in enumerate(s.get("accept_by_position") or []):
            total[i] += rate * s["verify_steps"]
    steps = sum(s["verify_steps"] for s in stats)
    return [t / steps for t in total]


def _with_speedup(agg: dict[str, Any], baseline_tps: float | None) -> dict[str, Any]:
    tps = agg["tokens_per_s"]
    agg["speedup"] = tps / baseline_tps if tps and baseline_tps else None
    return agg


def summarize(per_category: dict[str, dict[str, list[dict[str, Any]]]], modes: list[str]) -> dict[str, Any]:
    """results.json body from raw records ``{category: {kind: [turn records]}}``.

    Speedups divide by the baseline measured on the same turns (per category, and over all).
    """
    categories: dict[str, dict[str, Any]] = {}
    for cat, kinds in per_category.items():
        base = aggregate(kinds["baseline"])["tokens_per_s"]
        categories[cat] = {kind: _with_speedup(aggregate(recs), base) for kind, recs in kinds.items()}
    pooled: dict[str, list[dict[str, Any]]] = {}
    for kinds in per_category.values():
        for kind, recs in kinds.items():
            pooled.setdefault(kind, []).extend(recs)
    base = aggregate(pooled["baseline"])["tokens_per_s"]
    overall = {kind: _with_speedup(aggregate(recs), base) for kind, recs in pooled.items()}
    return {
        "tau": {m: overall[m]["tau"] for m in modes},
        "tokens_per_s": {m: overall[m]["tokens_per_s"] for m in modes},
        "speedup": {m: overall[m]["speedup"] for m in modes},
        "accept_by_position": {m: overall[m]["accept_by_position"] for m in modes},
        "modes": {m: overall[m] for m in modes},
        "baseline": overall["baseline"],
        "prompt_lookup": overall.get("prompt_lookup"),
        "untrained": overall.get("untrained"),
        "per_category": categories,
        "num_prompts": len({(c, r["prompt_id"]) for c, k in per_category.items() for r in k["baseline"]}),
        "num_turns": len(pooled["baseline"]),
    }


# --- the Ray layer: actor, resumable partial results, results.json -----------------------------------


def run_bench(
    cfg: PipelineConfig,
    drafter: str | Path,
    prompts: str | None = None,
    *,
    out: str | Path,
    compare_untrained: bool = False,
    train_metrics: str | Path | None = None,
) -> dict[str, Any]:
    """Benchmark ``drafter`` (an exported dir) on the target of ``cfg``; writes results.json + report.

    Prompts: ``prompts``, else ``cfg.bench.prompts``, else the shipped ``builtin:demo_eval``.
    ``train_metrics``: the training ``metrics.jsonl``, summarised and plotted in the report.
    """
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    source = prompts or cfg.bench.prompts or DEFAULT_PROMPTS
    sets = load_prompt_sets(source, cfg.bench.max_prompts)
    drafter_dir = str(Path(drafter).resolve())
    if cfg.target.backend == "sglang":
        results = _sglang_results(cfg, drafter_dir, sets)
    else:
        results = _hf_results(cfg, drafter_dir, sets, out_dir, compare_untrained)
    resolved = config_to_dict(cfg)
    results["config"] = {"bench": resolved["bench"], "target": resolved["target"], "prompts": source}
    _write_json(out_dir / RESULTS_NAME, results)
    write_report(results, out_dir, train_metrics)
    return results


def _hf_results(
    cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]], out: Path, compare_untrained: bool
) -> dict[str, Any]:
    bench = config_to_dict(cfg)["bench"]
    partial_dir = out / PARTIAL_DIR
    keys = {cat: _partial_key(cfg, drafter_dir, compare_untrained, prompts) for cat, prompts in sets.items()}
    done = {cat: p for cat in sets if (p := _read_partial(partial_dir, cat, keys[cat])) is not None}
    missing = [cat for cat in sets if cat not in done]
    if missing:
        say(f"[bench] {len(done)} categories already measured, {len(missing)} to run: {missing}")
        done.update(_measure(cfg, drafter_dir, sets, missing, compare_untrained, partial_dir, keys))
    info = next(iter(done.values()))["info"]
    return {**summarize({cat: done[cat]["records"] for cat in sets}, bench["modes"]), **info}


def _measure(
    cfg: PipelineConfig,
    drafter_dir: str,
    sets: dict[str, list[Prompt]],
    missing: list[str],
    compare_untrained: bool,
    partial_dir: Path,
    keys: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """Run the missing categories on one actor, saving each as soon as it completes."""
    from eagle3_ray.ray_session import init_ray

    bench = config_to_dict(cfg)["bench"]
    ray = init_ray(cfg.ray)
    actor_cls = ray.remote(num_gpus=cfg.bench.num_gpus, num_cpus=cfg.bench.num_cpus)(BenchActor)
    actor = actor_cls.remote(config_to_dict(cfg)["target"], drafter_dir, compare_untrained)
    try:
        info = ray.get(actor.describe.remote())
        ray.get(actor.warmup.remote(sets[missing[0]][0], bench))
        done = {}
        for cat in missing:
            records = ray.get(actor.run_category.remote(sets[cat], bench))
            done[cat] = {"format": PARTIAL_FORMAT, "key": keys[cat], "category": cat, "info": info, "records": records}
            _write_json(_partial_path(partial_dir, cat), done[cat])
            say(f"[bench] {cat}: {len(sets[cat])} prompts measured")
        return done
    finally:
        ray.kill(actor)


def _partial_key(cfg: PipelineConfig, drafter_dir: str, compare_untrained: bool, prompts: list[Prompt]) -> str:
    """Everything that changes a category's numbers: a partial with another key is measured again."""
    weights = Path(drafter_dir) / "model.safetensors"
    stamp = [weights.stat().st_size, weights.stat().st_mtime_ns] if weights.is_file() else None
    bench = {k: v for k, v in config_to_dict(cfg)["bench"].items() if k not in ("prompts", "max_prompts", "num_gpus")}
    ident = {
        "bench": bench,
        "target": config_to_dict(cfg)["target"],
        "drafter": [drafter_dir, stamp],
        "untrained": compare_untrained,
        "prompts": [[p.id, p.turns] for p in prompts],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _partial_path(partial_dir: Path, category: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", category)
    return partial_dir / f"{safe}-{hashlib.sha256(category.encode()).hexdigest()[:8]}.json"


def _read_partial(partial_dir: Path, category: str, key: str) -> dict[str, Any] | None:
    path = _partial_path(partial_dir, category)
    if not path.is_file():
        return None
    try:
        part = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None  # writes are atomic, so only a hand-edited file lands here: measure again
    return part if part.get("format") == PARTIAL_FORMAT and part.get("key") == key else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def _sglang_results(cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]]) -> dict[str, Any]:
    """SGLang targets: the engine benchmark in a Ray task owning the engine's GPUs, then reshaped."""
    from eagle3_ray.bench.sglang_bench import run_sglang_bench
    from eagle3_ray.ray_session import init_ray

    ray = init_ray(cfg.ray)
    task = ray.remote(num_gpus=max(cfg.target.tp_size, cfg.bench.num_gpus))(run_sglang_bench)
    raw = ray.get(task.remote(cfg, drafter_dir, {cat: [p.turns for p in ps] for cat, ps in sets.items()}))
    return {
        **sglang_to_results(raw),
        "num_prompts": sum(len(ps) for ps in sets.values()),
        "num_turns": sum(len(p.turns) for ps in sets.values() for p in ps),
        "target": cfg.target.model,
        "drafter": drafter_dir,
    }


def sglang_to_results(raw: dict[str, Any], mode: str = "eagle3") -> dict[str, Any]:
    """``run_sglang_bench``'s output in the results.json layout, as one mode named ``mode``."""

    def row(r: dict[str, Any] | None, speedup: float | None = None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {
            "tau": r.get("tau"),
            "accept_by_position": [],  # SGLang reports accept lengths, not per-position rates
            "tokens_per_s": r.get("tokens_per_s"),
            "speedup": r.get("speedup", speedup),
            "new_tokens": r.get("completion_tokens"),
            "verify_steps": r.get("spec_verify_ct"),
            "seconds": r.get("seconds"),
            "turns": r.get("turns"),
        }

    spec, base = raw["eagle3"], raw["baseline"]
    overall = row(spec)
    base_cats = base.get("per_category") or {}
    return {
        "tau": {mode: overall["tau"]},
        "tokens_per_s": {mode: overall["tokens_per_s"]},
        "speedup": {mode: overall["speedup"]},
        "accept_by_position": {mode: []},
        "modes": {mode: overall},
        "baseline": row(base, 1.0),
        "prompt_lookup": None,
        "untrained": None,
        "per_category": {
            cat: {"baseline": row(base_cats.get(cat), 1.0), mode: row(r)}
            for cat, r in (spec.get("per_category") or {}).items()
        },
        "device": raw.get("device", "cuda"),
        "engine": raw.get("engine"),
    }
