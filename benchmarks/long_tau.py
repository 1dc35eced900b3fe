"""tau by context length: a bench stage's per-turn records (<bench out>/partial/*.json) pooled by each
turn's prompt tokens into buckets, per decoding mode (eagle3_ray.bench.runner's own aggregate), and two
benches of the same evaluation set compared turn by turn with a bootstrap interval. The `tau` command of
benchmarks/long_eval_set.py (docs/data.md, "Long samples"; record long_context_tau).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any


def bucket_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def bucket_names(edges: list[int]) -> list[str]:
    return [f"<{bucket_label(edges[0])}", *[f"{bucket_label(a)}-{bucket_label(b)}" for a, b in zip(edges, edges[1:])],
            f">={bucket_label(edges[-1])}"]


def bucket_of(prompt_tokens: int, edges: list[int]) -> int:
    """The index in `bucket_names` of a turn with that many prompt tokens."""
    return sum(prompt_tokens >= e for e in edges)


def tau_by_length(bench_dir: Path, edges: list[int]) -> dict[str, dict[str, Any]]:
    """{kind: {bucket: aggregate}} over every turn of the bench's partial records, by prompt tokens."""
    from eagle3_ray.bench.runner import aggregate

    files = sorted((bench_dir / "partial").glob("*.json"))
    if not files:
        raise SystemExit(f"{bench_dir}/partial holds no per-turn records: pass a bench stage's --out")
    names = bucket_names(edges)
    pooled: dict[str, dict[str, list]] = {}
    for f in files:
        for kind, recs in json.loads(f.read_text())["records"].items():
            for r in recs:
                pooled.setdefault(kind, {}).setdefault(names[bucket_of(r["prompt_tokens"], edges)], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for kind, by in pooled.items():
        out[kind] = {}
        for name in names:
            if name in by:
                agg = aggregate(by[name])
                out[kind][name] = {k: agg[k] for k in ("tau", "turns", "verify_steps", "new_tokens", "tokens_per_s",
                                                       "accept_by_position")}
                out[kind][name]["prompt_tokens_mean"] = sum(r["prompt_tokens"] for r in by[name]) / len(by[name])
    return out


def _turns(bench_dir: Path, kind: str) -> dict[tuple[str, int], dict]:
    """{(prompt id, turn): record} of one mode's per-turn records in a bench's partial/."""
    return {(r["prompt_id"], int(r["turn"])): r for f in sorted((bench_dir / "partial").glob("*.json"))
            for r in json.loads(f.read_text())["records"].get(kind, [])}


def paired(first: Path, second: Path, edges: list[int], kind: str = "chain", draws: int = 2000,
           seed: int = 0) -> dict[str, Any]:
    """Two benches of the same evaluation set, turn by turn: the pooled tau of the turns both measured
    (the bench's own pooling, `bench.runner.aggregate`), first minus second, overall and per bucket of the
    first's prompt tokens, with a 95% bootstrap interval over the turns (``draws`` resamples, seeded);
    ``same_prompt``: the turns whose prompts have the same length in both (a bench without fixed answers
    answers the history with its own greedy baseline, and bf16 decoding can part at a near-tie, so later
    turns may differ in text)."""
    a, b = _turns(first, kind), _turns(second, kind)
    keys = sorted(set(a) & set(b))
    if not keys:
        raise SystemExit(f"{first} and {second} share no {kind} turn to compare")
    names = bucket_names(edges)

    from eagle3_ray.bench.runner import aggregate

    def pooled(recs: dict, ks: list) -> float:
        return aggregate([recs[k] for k in ks])["tau"]

    rng = random.Random(seed)

    def compare(ks: list) -> dict[str, Any]:
        diffs = sorted(pooled(a, d) - pooled(b, d) for d in ([rng.choice(ks) for _ in ks] for _ in range(draws)))
        first, second = pooled(a, ks), pooled(b, ks)
        return {"turns": len(ks), "first": first, "second": second, "diff": first - second,
                "ci95": [diffs[int(0.025 * draws)], diffs[int(0.975 * draws) - 1]],
                "max_prompt_tokens": max(a[k]["prompt_tokens"] for k in ks)}

    out: dict[str, Any] = {"mode": kind, "all": compare(keys), "by_bucket": {},
                           "same_prompt": sum(a[k]["prompt_tokens"] == b[k]["prompt_tokens"] for k in keys)}
    for i, name in enumerate(names):
        ks = [k for k in keys if bucket_of(a[k]["prompt_tokens"], edges) == i]
        if ks:
            out["by_bucket"][name] = compare(ks)
    return out


def _table(results: dict[str, dict], kinds: list[str], names: list[str]) -> str:
    """Markdown: tau (turns) per run and mode, one column per context-length bucket."""
    used = [b for b in names if any(b in r.get(k, {}) for r in results.values() for k in kinds)]
    rows = ["| run | mode | " + " | ".join(used) + " |", "|" + "---|" * (len(used) + 2)]
    for label, r in results.items():
        for kind in kinds:
            if kind in r:
                cells = [f"{r[kind][b]['tau']:.3f} ({r[kind][b]['turns']})" if r[kind].get(b, {}).get("tau")
                         else "" for b in used]
                rows.append(f"| {label} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def tau_report(benches: list[Path], labels: list[str], edges: list[int], out: str | None) -> None:
    """Print tau per bench, mode and bucket (and, for two benches, the paired chain difference); write the
    figures to ``out`` (JSON) if given."""
    results = {name: tau_by_length(d, edges) for name, d in zip(labels, benches)}
    kinds = sorted({k for r in results.values() for k in r}, key=lambda k: (k != "baseline", k))
    print(_table(results, [k for k in kinds if k != "baseline"], bucket_names(edges)))
    pair = None
    if len(benches) == 2 and "chain" in kinds:
        pair = paired(benches[0], benches[1], edges)
        print(f"\n{labels[0]} - {labels[1]}, the same turns paired (chain tau, 95% bootstrap interval over turns; "
              f"{pair['same_prompt']} of {pair['all']['turns']} turns with prompts of the same length):\n")
        print("| turns | n | " + " | ".join(labels) + " | difference | 95% interval |\n|---|---|---|---|---|---|")
        for name, c in [("all", pair["all"]), *pair["by_bucket"].items()]:
            print(f"| {name} | {c['turns']} | {c['first']:.3f} | {c['second']:.3f} | {c['diff']:+.3f} | "
                  f"{c['ci95'][0]:+.3f} .. {c['ci95'][1]:+.3f} |")
    if out:
        Path(out).write_text(json.dumps({"edges": edges, "runs": dict(zip(labels, map(str, benches))),
                                         "tau_by_prompt_tokens": results, "paired": pair}, indent=1))
