"""The Ray layer of the SGLang benchmark: each mode's engine in a Ray task of its own, one after
the other, each mode's measurement saved as soon as it ends (a rerun measures only the missing
modes), then results.json's ``sglang`` section.

A mode's task owns ``max(target.tp_size, bench.num_gpus)`` GPUs; Ray runs it again only when its
process died, never when it raised: an engine that fails to start fails the same way again
(``ray_session.fail_fast_remote``, docs/reliability.md). A spec mode that fails is recorded in
``sglang.errors`` and the other modes are still measured; the stage then ends with that error.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from eagle3_ray.bench import sglang_bench as sb
from eagle3_ray.bench.prompts import Prompt
from eagle3_ray.config import PipelineConfig, config_to_dict
from eagle3_ray.errors import EngineError
from eagle3_ray.progress import say

PARTIAL_DIR = "partial"
PARTIAL_FORMAT = 1


def measure_sglang(cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]], out: Path
                   ) -> dict[str, Any]:
    """Every mode measured (or read back from ``<out>/partial``), combined into the ``sglang`` section."""
    conversations = sb.conversations_of(sets)
    partial_dir = out / PARTIAL_DIR
    parts: dict[str, dict[str, Any]] = {}
    turns = None
    for mode in sb.modes_to_run(cfg.bench):
        key = _key(cfg, drafter_dir, conversations, mode, turns)
        path = partial_dir / f"sglang-{mode}.json"
        part = _read(path, key)
        if part is None:
            say(f"[bench] SGLang {mode}: starting its engine ({'no ' if not cfg.bench.cuda_graphs else ''}CUDA graphs, "
                f"concurrency {cfg.bench.concurrency})")
            try:
                part = _run_task(cfg, mode, drafter_dir, conversations if mode == "plain" else None, turns)
            except Exception as e:
                if mode == "plain":
                    raise
                part = {"mode": mode, "error": _one_line(e)}
                say(f"[bench] SGLang {mode} failed: {part['error']}")
            if "error" not in part:
                _write(path, {**part, "format": PARTIAL_FORMAT, "key": key})
                say(f"[bench] SGLang {mode}: " + ", ".join(
                    f"c{c} {row['tokens_per_s']:.1f} tok/s" + (f" tau {row['tau']:.2f}" if row.get("tau") else "")
                    for c, row in part["by_concurrency"].items()))
        parts[mode] = part
        if mode == "plain":
            turns = [sb.TurnPrompt(**t) for t in part["turns"]]
    return sb.combine(parts, cfg.bench.concurrency)


def _run_task(cfg: PipelineConfig, mode: str, drafter_dir: str, conversations: Any, turns: Any) -> dict[str, Any]:
    from eagle3_ray.ray_session import fail_fast_remote, init_ray

    ray = init_ray(cfg.ray)
    task = fail_fast_remote(sb.run_mode, num_gpus=max(cfg.target.tp_size, cfg.bench.num_gpus))
    return ray.get(task.remote(cfg, mode, drafter_dir, conversations, turns))


def sglang_only_results(cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]], out: Path
                        ) -> dict[str, Any]:
    """results.json of a bench on SGLang alone: the concurrency-1 figures in the layout the report
    and the HF bench share (baseline = plain decoding), and the whole ``sglang`` section."""
    section = measure_sglang(cfg, drafter_dir, sets, out)
    results = _layout(section)
    results.update(sglang=section, target=cfg.target.model, drafter=drafter_dir, device=section["device"],
                   graphed_baseline=cfg.bench.cuda_graphs, draft_graphs=cfg.bench.cuda_graphs, dtype="bfloat16")
    results["summary"] = {**sb.summary_keys(section), "engine": "sglang"}
    _raise_errors(section)
    return results


def add_sglang(results: dict[str, Any], cfg: PipelineConfig, drafter_dir: str, sets: dict[str, list[Prompt]],
               out: Path) -> None:
    """``bench.engine=both``: the SGLang section beside the HF bench's results, and SGLang's tau
    against the project's own on the same prompts."""
    section = measure_sglang(cfg, drafter_dir, sets, out)
    results["sglang"] = section
    own = {m: (results.get("tau") or {}).get(m) for m in sb.SPEC_MODES}
    results.setdefault("summary", {}).update(sb.summary_keys(section, own))
    _raise_errors(section)


def _layout(section: dict[str, Any]) -> dict[str, Any]:
    """The rows of the lowest concurrency measured (1 unless ``bench.concurrency`` lacks it) as
    results.json's common layout (modes, baseline, per category/turn: those only at concurrency 1,
    the only one whose requests are timed one by one)."""
    low = str(min(section["concurrency"]))
    at_low = {m: by_c.get(low) for m, by_c in section["modes"].items()}
    spec = [m for m in at_low if m != "plain" and at_low[m]]

    def row(m: str, r: dict[str, Any] | None, speedup: float | None) -> dict[str, Any] | None:
        if r is None:
            return None
        kept = {k: v for k, v in r.items() if k != "ms_per_cycle"}  # the sglang section has it (one number)
        return {**kept, "speedup": speedup, "new_tokens": r.get("completion_tokens"), "turns": r.get("requests"),
                "identical_to_baseline": section["identical_to_plain"].get(m)}

    modes = {m: row(m, at_low[m], (section["speedup"].get(m) or {}).get(low)) for m in spec}

    def groups(grouped: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not any(m != "plain" for rows in grouped.values() for m in rows):
            return {}  # plain's turns alone (no spec mode ran at concurrency 1): nothing to compare
        return {name: {("baseline" if m == "plain" else m): r for m, r in rows.items()} for name, rows in grouped.items()}

    per_turn = groups(section["per_turn"])

    return {
        "tau": {m: modes[m]["tau"] for m in spec},
        "tokens_per_s": {m: modes[m]["tokens_per_s"] for m in spec},
        "speedup": {m: modes[m]["speedup"] for m in spec},
        "accept_by_position": {m: modes[m]["accept_by_position"] for m in spec},
        "modes": modes,
        "baseline": row("plain", at_low.get("plain"), 1.0),
        "prompt_lookup": None,
        "untrained": None,
        "per_set": {},
        "per_turn": {"all": per_turn} if len(per_turn) > 1 else {},
        "per_category": groups(section["per_category"]),
        "summary_concurrency": int(low),
        "num_prompts": section["num_prompts"],
        "num_turns": section["num_turns"],
    }


def _raise_errors(section: dict[str, Any]) -> None:
    if section["errors"]:
        raise EngineError("the SGLang bench could not measure " + "; ".join(
            f"{mode}: {why}" for mode, why in section["errors"].items()) + " (results.json has the other modes)")


def _key(cfg: PipelineConfig, drafter_dir: str, conversations: Any, mode: str, turns: Any) -> str:
    """Everything that changes one mode's numbers; the spec modes also depend on plain's turns."""
    weights = Path(drafter_dir) / "model.safetensors"
    stamp = [weights.stat().st_size, weights.stat().st_mtime_ns] if weights.is_file() else None
    resolved = config_to_dict(cfg)
    bench = {k: v for k, v in resolved["bench"].items() if k not in ("prompts", "max_prompts", "engine")}
    ident = {"mode": mode, "bench": bench, "target": resolved["target"],
             "drafter": [drafter_dir, stamp] if mode != "plain" else None, "prompts": conversations,
             "turns": [t.ids for t in turns] if turns else None}
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read(path: Path, key: str) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        part = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    return part if part.get("format") == PARTIAL_FORMAT and part.get("key") == key else None


def _write(path: Path, data: dict[str, Any]) -> None:
    from eagle3_ray.atomic import write_json

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[-1] if lines else type(e).__name__
