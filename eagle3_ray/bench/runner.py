"""The benchmark: one actor loads the target and the drafter once and decodes every prompt in every mode.

Per turn of every prompt, on the same prompt tokens and in the same process: plain target generation
(the baseline), each speculative mode of ``bench.modes`` (chain, tree), prompt lookup (a
drafter-free peer) and, on request, chain mode with an untrained drafter. Multi-turn prompts carry
the baseline's answer into the next turn (or the record's own replies: fixed ``answers``, a chat
record's assistant turns and tool results; the same for every bench run), so every mode sees exactly
the same prompts even when sampling. At temperature 0 every turn
that differs from the baseline is audited (``bench.audit``: first differing position, the
baseline's top-2 logit gap there, whether rounding explains it). ``docs/bench.md`` defines what is measured.

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
from eagle3_ray.bench.audit import audit_turn, bound_text, first_difference
from eagle3_ray.bench.prompts import Prompt, categories_by_set, load_prompt_sets
from eagle3_ray.bench.report import reference_sentence, write_report
from eagle3_ray.config import BenchConfig, PipelineConfig, TargetConfig, config_to_dict
from eagle3_ray.errors import engine_start
from eagle3_ray.progress import say

DEFAULT_PROMPTS = "builtin:demo_eval"
RESULTS_NAME = "results.json"
PARTIAL_DIR = "partial"
PARTIAL_FORMAT = 2  # 2: per-part timings and the divergence audit in the records
WARMUP_TOKENS = 16  # enough to run every code path (prefill, drafting, verify) once
UNTRAINED_SEED = 0
SAMPLING_SEED = 0
PROMPT_LOOKUP_TOKENS = 10  # transformers' usual prompt_lookup_num_tokens
SPEC_KINDS = ("chain", "tree", "untrained")  # decoded by decode.generate; counted in the summary's divergences
PARTS = ("prefill", "draft", "verify", "accept", "commit")  # decode.stats: SpecStats.parts

# Runner: (prompt ids [T], max_new_tokens) -> (new token ids, stats dict)
Runner = Callable[[list[int], int], tuple[list[int], dict[str, Any]]]


class BenchActor:
    """Target + drafter loaded once; decodes prompt sets in every benchmark mode. No Ray in here."""

    def __init__(self, target_cfg: TargetConfig, drafter_dir: str, compare_untrained: bool = False):
        from eagle3_ray.drafter import load_drafter
        from eagle3_ray.engines.targets import load_target
        from eagle3_ray.decode import prepare_drafter

        target_cfg = TargetConfig.model_validate(target_cfg)  # the section as is; a dict (notebooks) is validated
        # A failure here ends the benchmark at once (EngineStartError, not retried): see errors.engine_start.
        with engine_start(f"the benchmark's target (target.model={target_cfg.model!r}) and drafter {drafter_dir}"):
            self.target = load_target(target_cfg)
            model = self.target.model
            # On the target's device and dtype, sharing (not copying) its input embedding.
            self.drafter = prepare_drafter(load_drafter(drafter_dir), model)
            self.untrained = _untrained_like(self.drafter, model) if compare_untrained else None
        self.info: dict[str, Any] = {"device": _device_name(self.target.device), "target": target_cfg.model,
                                     "drafter": drafter_dir, "dtype": str(self.target.dtype).removeprefix("torch."),
                                     "graphed_baseline": False, "draft_graphs": False}
        self._static = None  # the StaticTarget (CUDA), built on first use

    def uses_static_target(self, b: BenchConfig) -> bool:
        """Whether the modes decode through a StaticTarget: with ``bench.cuda_graphs``, on CUDA (off
        CUDA it would run the same functions eagerly, with no graphs to gain)."""
        return b.cuda_graphs and self.target.device.type == "cuda"

    def _decoding_target(self, b: BenchConfig):
        """The model, or where ``uses_static_target`` one StaticTarget shared by every mode (drafting
        through its graphed StaticProposer when ``bench.draft_graphs``)."""
        if not self.uses_static_target(b):
            self.info.update(graphed_baseline=False, draft_graphs=False)
            return self.target.model
        if self._static is None or self._static.max_length != b.max_length:
            from eagle3_ray.decode import StaticTarget

            self._static = StaticTarget(self.target.model, self.drafter.config.aux_layers, max_length=b.max_length)
            self.info["static_target"] = (f"CUDA graphs {self._static.cuda_graphs}, max_length {b.max_length}, "
                                          f"attention spans {self._static.spans}")
        self._static.draft_graphs = b.draft_graphs
        graphs = self._static.cuda_graphs  # False off CUDA: the same functions run eagerly
        self.info.update(graphed_baseline=graphs, draft_graphs=graphs and b.draft_graphs)
        return self._static

    def describe(self) -> dict[str, Any]:
        return dict(self.info)

    def warmup(self, prompt: Prompt, bench: BenchConfig) -> None:
        """One short decode per mode: first-call costs (allocator, kernels, caches, graph captures)
        stay out of the timings."""
        bench = BenchConfig.model_validate(bench)
        ids = self._render([{"role": "user", "content": prompt.turns[0]}])
        for run in self._runners(bench).values():
            run(ids, min(WARMUP_TOKENS, bench.max_new_tokens))
        if self._static is not None:  # every attention span of every width met: no capture in a timed run
            self._static.capture_spans()
            self.info["target_graphs"] = len(self._static.graph_keys)

    def run_category(self, prompts: list[Prompt], bench: BenchConfig) -> dict[str, list[dict[str, Any]]]:
        """Raw per-turn records of every mode: ``{kind: [{prompt_id, turn, prompt_tokens, identical,
        divergence, stats}]}``; ``divergence`` is the audit of a differing greedy turn (else None)."""
        bench = BenchConfig.model_validate(bench)
        runners = self._runners(bench)
        records: dict[str, list[dict[str, Any]]] = {kind: [] for kind in runners}
        for prompt in prompts:
            replies: list[str] = []  # the baseline's answers: the history where the record gives none
            for turn in range(len(prompt.turns)):
                ids = self._render(prompt.conversation(turn, replies), prompt.tools)
                outputs: dict[str, list[int]] = {}
                for kind, run in runners.items():  # baseline first: its answer is the reference
                    tokens, stats = run(ids, bench.max_new_tokens)
                    outputs[kind] = tokens
                    records[kind].append(
                        {"prompt_id": prompt.id, "turn": turn, "prompt_tokens": len(ids),
                         "identical": tokens == outputs["baseline"], "divergence": None, "stats": stats}
                    )
                if bench.temperature == 0:
                    self._audit(ids, outputs, {kind: recs[-1] for kind, recs in records.items()}, bench)
                replies.append(self.target.tokenizer.decode(outputs["baseline"], skip_special_tokens=True))
        return records

    def _audit(self, ids: list[int], outputs: dict[str, list[int]], latest: dict[str, dict[str, Any]],
               bench: BenchConfig) -> None:
        """Audit this turn's greedy outputs that differ from the baseline's (after every timed run)."""
        if all(tokens == outputs["baseline"] for tokens in outputs.values()):
            return
        from eagle3_ray import decode

        baseline = outputs["baseline"]
        prompt = torch.tensor(ids, device=self.target.device)
        # Teacher-forced on the baseline's answer: the gaps are those of the baseline's own context
        # even where an untimed free replay would decode otherwise (then it is not identical). Only as
        # far as the last first difference: no audit reads a later position.
        upto = max(first_difference(baseline, t) for t in outputs.values() if t != baseline) + 1
        forced = baseline[:upto]
        replay, top2 = decode.target_top2(self._decoding_target(bench), prompt, bench.max_new_tokens, forced=forced)
        for kind, tokens in outputs.items():
            if tokens != baseline:
                audit = audit_turn(baseline, tokens, top2, self.target.dtype)
                audit["replay_identical"] = replay == forced  # the replay's argmax = the baseline (audited part)
                latest[kind]["divergence"] = audit

    def run(self, prompt_sets: dict[str, list[Prompt]], bench: BenchConfig,
            sglang_plain_tokens_per_s: float | None = None) -> dict[str, Any]:
        """Warm up, decode every category, aggregate (no files written)."""
        bench = BenchConfig.model_validate(bench)
        first = next(p for prompts in prompt_sets.values() for p in prompts)
        self.warmup(first, bench)
        records = {cat: self.run_category(prompts, bench) for cat, prompts in prompt_sets.items()}
        return results_body(records, bench, self.describe(), sglang_plain_tokens_per_s,
                            categories_by_set(prompt_sets))

    def _render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        from eagle3_ray.data.chat import render_generation_prompt

        return render_generation_prompt(self.target.tokenizer, messages, tools)

    def _runners(self, b: BenchConfig) -> dict[str, Runner]:
        """Every decoding to time, baseline first; all share temperature and seed."""
        from eagle3_ray import decode

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

        runners = {"baseline": bind(decode.target_generate, **sampling)}
        for mode in b.modes:
            runners[mode] = bind(decode.generate, self.drafter, **(chain if mode == "chain" else tree))
        if b.prompt_lookup:
            runners["prompt_lookup"] = bind(decode.prompt_lookup_generate, target=model, num_tokens=PROMPT_LOOKUP_TOKENS)
        if self.untrained is not None:
            runners["untrained"] = bind(decode.generate, self.untrained, **chain)
        return runners


def _untrained_like(drafter: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """Same config and vocab map as ``drafter``, seeded random weights: the floor a trained one must beat."""
    from eagle3_ray.drafter import Eagle3Drafter
    from eagle3_ray.decode import prepare_drafter

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
    count by their length rather than as one sample each. ``ms_per_cycle``: milliseconds per
    verify cycle of each part of ``SpecStats.parts`` (the prefill per turn instead).
    """
    stats = [r["stats"] for r in records]
    new_tokens = sum(s["new_tokens"] for s in stats)
    seconds = sum(s["seconds"] for s in stats)
    verified = [s for s in stats if s.get("tau") is not None and s.get("verify_steps")]
    steps = sum(s["verify_steps"] for s in verified)
    parts = {p: sum((s.get("parts") or {}).get(p, 0.0) for s in stats) for p in PARTS}
    parts = {p: v for p, v in parts.items() if any(p in (s.get("parts") or {}) for s in stats)}
    cycles = sum(s.get("verify_steps") or 0 for s in stats)
    ms_per_cycle = {p: 1000 * v / (len(stats) if p == "prefill" else cycles) for p, v in parts.items()
                    if (len(stats) if p == "prefill" else cycles)}
    divergent = [r for r in records if not r["identical"]]
    return {
        "tau": sum(s["tau"] * s["verify_steps"] for s in verified) / steps if steps else None,
        "accept_by_position": _mean_positions(verified),
        "tokens_per_s": new_tokens / seconds if seconds > 0 else None,
        "new_tokens": new_tokens,
        "verify_steps": steps if verified else None,
        "seconds": seconds,
        "turns": len(records),
        "identical_to_baseline": sum(r["identical"] for r in records) / len(records) if records else None,
        "parts_seconds": parts,
        "ms_per_cycle": ms_per_cycle,
        "divergent_turns": len(divergent),
        # audited and not explained by rounding, or not audited (sampling, or an older record)
        "unexplained_divergences": sum((r.get("divergence") or {}).get("explained") is not True for r in divergent),
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


def results_body(
    per_category: dict[str, dict[str, list[dict[str, Any]]]],
    bench: BenchConfig,
    info: dict[str, Any],
    sglang_plain_tokens_per_s: float | None = None,
    set_of: dict[str, str] | None = None,
) -> dict[str, Any]:
    """results.json's body: ``summarize`` + where it ran + the ``summary`` keys + the audit list.
    ``set_of``: ``{category: prompt set}`` (``prompts.categories_by_set``) for ``per_set``."""
    results = {**summarize(per_category, bench.modes, set_of), **info}
    results["divergences"] = [
        {"category": cat, "kind": kind, "prompt_id": r["prompt_id"], "turn": r["turn"], **(r["divergence"] or {})}
        for cat, kinds in per_category.items() for kind, recs in kinds.items() for r in recs if not r["identical"]
    ]
    results["summary"] = summary_keys(results, greedy=bench.temperature == 0,
                                      sglang_plain_tokens_per_s=sglang_plain_tokens_per_s)
    return results


def summary_keys(results: dict[str, Any], greedy: bool, sglang_plain_tokens_per_s: float | None) -> dict[str, Any]:
    """The headline figures. ``spec_vs_graphed_<mode>``: tokens/s over the CUDA-graphed plain
    decoding of the same turns (None when the baseline was not graphed, e.g. on CPU).
    ``spec_vs_sglang_plain``: {mode: tokens/s over the given SGLang plain tokens/s} or None.
    ``bf16_divergent_turns`` / ``bf16_unexplained_divergences``: turns of the speculative kinds
    (chain, tree, untrained) that differ from the baseline, and those whose baseline top-2 gap is
    over the rounding bound of the target dtype (``bench.audit``; None when sampling)."""
    graphed = bool(results.get("graphed_baseline"))
    kinds = {**(results.get("modes") or {}), "untrained": results.get("untrained")}
    entries = [kinds[k] for k in SPEC_KINDS if kinds.get(k)]
    dtype = getattr(torch, str(results.get("dtype") or "float32"))
    return {
        "spec_vs_graphed_chain": results["speedup"].get("chain") if graphed else None,
        "spec_vs_graphed_tree": results["speedup"].get("tree") if graphed else None,
        "spec_vs_sglang_plain": (
            {m: results["tokens_per_s"][m] / sglang_plain_tokens_per_s for m in results["tokens_per_s"]
             if results["tokens_per_s"][m]} if sglang_plain_tokens_per_s else None
        ),
        "sglang_plain_tokens_per_s": sglang_plain_tokens_per_s,
        "bf16_divergent_turns": sum(e["divergent_turns"] for e in entries) if greedy else None,
        "bf16_unexplained_divergences": sum(e["unexplained_divergences"] for e in entries) if greedy else None,
        "divergence_bound": bound_text(dtype),
        "draft_graphs": results.get("draft_graphs"),
        "graphed_baseline": graphed,
    }


def _pooled(per_category: dict[str, dict[str, list[dict[str, Any]]]], cats: list[str],
            turn: int | None = None) -> dict[str, dict[str, Any]]:
    """``{kind: aggregate with speedup}`` over the turns of ``cats`` pooled, the speedup over the
    baseline of the same turns: one category, a prompt set, or everything; with ``turn``, only the
    turns at that index of their conversation (0: the first user turn)."""
    pooled: dict[str, list[dict[str, Any]]] = {}
    for cat in cats:
        for kind, recs in per_category[cat].items():
            pooled.setdefault(kind, []).extend(r for r in recs if turn is None or r["turn"] == turn)
    base = aggregate(pooled["baseline"])["tokens_per_s"]
    return {kind: _with_speedup(aggregate(recs), base) for kind, recs in pooled.items()}


SINGLE_SET = "all"  # per_set's key when no category -> set mapping is given


def summarize(per_category: dict[str, dict[str, list[dict[str, Any]]]], modes: list[str],
              set_of: dict[str, str] | None = None) -> dict[str, Any]:
    """results.json body from raw records ``{category: {kind: [turn records]}}``.

    Speedups divide by the baseline measured on the same turns (per category, per prompt set, and
    over all). ``set_of``: ``{category: set name}``; ``per_set`` pools each set's categories the
    same way the overall figures pool all of them (one set ``"all"`` when not given).
    """
    categories = {cat: _pooled(per_category, [cat]) for cat in per_category}
    members: dict[str, list[str]] = {}
    for cat in per_category:
        members.setdefault((set_of or {}).get(cat) or SINGLE_SET, []).append(cat)
    per_set = {name: _pooled(per_category, cats) for name, cats in members.items()}
    # Each set with multi-turn prompts, by turn index ("1", "2", ...): MT-bench's second turns answer
    # after the target's own first answer, a context the training data may hold less of.
    per_turn = {}
    for name, cats in members.items():
        indices = sorted({r["turn"] for c in cats for r in per_category[c]["baseline"]})
        if len(indices) > 1:
            per_turn[name] = {str(t + 1): _pooled(per_category, cats, turn=t) for t in indices}
    overall = _pooled(per_category, list(per_category))
    return {
        "tau": {m: overall[m]["tau"] for m in modes},
        "tokens_per_s": {m: overall[m]["tokens_per_s"] for m in modes},
        "speedup": {m: overall[m]["speedup"] for m in modes},
        "accept_by_position": {m: overall[m]["accept_by_position"] for m in modes},
        "modes": {m: overall[m] for m in modes},
        "baseline": overall["baseline"],
        "prompt_lookup": overall.get("prompt_lookup"),
        "untrained": overall.get("untrained"),
        "per_set": per_set,
        "per_turn": per_turn,
        "per_category": categories,
        "num_prompts": len({(c, r["prompt_id"]) for c, k in per_category.items() for r in k["baseline"]}),
        "num_turns": overall["baseline"]["turns"],
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
    sglang_plain_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    """Benchmark ``drafter`` (an exported dir) on the target of ``cfg``; writes results.json + report.

    Prompts: ``prompts``, else ``cfg.bench.prompts`` (one set or several: ``prompts.load_prompt_sets``),
    else the shipped ``builtin:demo_eval``.
    ``train_metrics``: the training ``metrics.jsonl``, summarised and plotted in the report.
    ``sglang_plain_tokens_per_s``: SGLang's plain decoding on the same turns, measured elsewhere;
    the summary then states the modes' ratio to it.
    """
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.bench.reference is not None:  # a wrong record fails now, not after the measurements
        reference_sentence(config_to_dict(cfg)["bench"]["reference"], out_dir)
    source = prompts or cfg.bench.prompts or DEFAULT_PROMPTS
    sets = load_prompt_sets(source, cfg.bench.max_prompts)
    resolved = config_to_dict(cfg)
    if not prompts and cfg.bench.prompts:
        source = resolved["bench"]["prompts"]  # entries as plain JSON
    drafter_dir = str(Path(drafter).resolve())
    engine = cfg.bench.bench_engine(cfg.target.backend)
    if engine == "sglang":
        from eagle3_ray.bench.sglang_runner import sglang_only_results

        results = sglang_only_results(cfg, drafter_dir, sets, out_dir)
    else:
        results = _hf_results(cfg, drafter_dir, sets, out_dir, compare_untrained, sglang_plain_tokens_per_s)
        if engine == "both":
            from eagle3_ray.bench.sglang_runner import add_sglang

            add_sglang(results, cfg, drafter_dir, sets, out_dir)
    results["config"] = {"bench": resolved["bench"], "target": resolved["target"], "prompts": source}
    _write_json(out_dir / RESULTS_NAME, results)
    write_report(results, out_dir, train_metrics)
    return results


def _hf_results(
    cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]], out: Path, compare_untrained: bool,
    sglang_plain_tokens_per_s: float | None = None,
) -> dict[str, Any]:
    partial_dir = out / PARTIAL_DIR
    keys = {cat: _partial_key(cfg, drafter_dir, compare_untrained, prompts) for cat, prompts in sets.items()}
    done = {cat: p for cat in sets if (p := _read_partial(partial_dir, cat, keys[cat])) is not None}
    missing = [cat for cat in sets if cat not in done]
    if missing:
        say(f"[bench] {len(done)} categories already measured, {len(missing)} to run: {missing}")
        done.update(_measure(cfg, drafter_dir, sets, missing, compare_untrained, partial_dir, keys))
    info = next(iter(done.values()))["info"]
    return results_body({cat: done[cat]["records"] for cat in sets}, cfg.bench, info, sglang_plain_tokens_per_s,
                        categories_by_set(sets))


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

    ray = init_ray(cfg.ray)
    actor_cls = ray.remote(num_gpus=cfg.bench.num_gpus, num_cpus=cfg.bench.num_cpus)(BenchActor)
    actor = actor_cls.remote(cfg.target, drafter_dir, compare_untrained)  # typed sections pickle across Ray
    try:
        ray.get(actor.warmup.remote(sets[missing[0]][0], cfg.bench))
        info = ray.get(actor.describe.remote())  # after the warm-up: it names the decoding machinery
        done = {}
        for cat in missing:
            records = ray.get(actor.run_category.remote(sets[cat], cfg.bench))
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
    skip = ("prompts", "max_prompts", "num_gpus", "reference")  # reference: a sentence of the report
    bench = {k: v for k, v in config_to_dict(cfg)["bench"].items() if k not in skip}
    ident = {
        "bench": bench,
        "target": config_to_dict(cfg)["target"],
        "drafter": [drafter_dir, stamp],
        "untrained": compare_untrained,
        "prompts": [[p.id, p.turns] + ([p.answers] if p.answers is not None else [])
                    + ([p.messages, p.tools] if p.messages is not None else []) for p in prompts],
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
