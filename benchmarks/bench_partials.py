"""results.json and report.md of a bench stage that did not finish, from the categories it did.

    python benchmarks/bench_partials.py --run <run out dir> [--sglang-plain-tps 438] [--out <dir>]

The product's bench writes each category's raw per-turn records to ``<run>/bench/partial/`` as it
completes (a rerun measures only the rest). When the machine is gone before the last category,
this script pools the finished ones through the product's own ``results_body`` and ``write_report``
(the same code a finished bench runs; nothing here decodes), with the run's resolved config
(``<run>/config.resolved.yaml``), and records which categories of the prompt set were not measured
under ``incomplete`` in results.json and in the report's first lines. Default ``--out``:
``<run>/bench``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_ray.bench.prompts import categories_by_set, load_prompt_sets  # noqa: E402
from eagle3_ray.bench.report import write_report  # noqa: E402
from eagle3_ray.bench.runner import PARTIAL_DIR, results_body  # noqa: E402
from eagle3_ray.config import config_to_dict, load_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="the run's --out directory")
    ap.add_argument("--prompts", help="the bench prompt file, if the config's path is not readable here")
    ap.add_argument("--sglang-plain-tps", type=float, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    cfg = load_config(a.run / "config.resolved.yaml")
    partial = sorted((a.run / "bench" / PARTIAL_DIR).glob("*.json"))
    if not partial:
        raise SystemExit(f"no partial results under {a.run / 'bench' / PARTIAL_DIR}")
    per_category, info = {}, None
    for path in partial:
        d = json.loads(path.read_text())
        per_category[d["category"]] = d["records"]
        info = d["info"]
    resolved = config_to_dict(cfg)
    prompts = a.prompts or resolved["bench"]["prompts"]  # plain data: several sets are a list of mappings
    sets = load_prompt_sets(prompts, cfg.bench.max_prompts) if prompts else {}
    missing = [c for c in sets if c not in per_category]
    # per_set / per_turn by the sets the bench was given, as a finished bench groups them
    set_of = {c: s for c, s in categories_by_set(sets).items() if c in per_category}
    results = results_body(per_category, cfg.bench, info, a.sglang_plain_tps, set_of or None)
    results["config"] = {"bench": resolved["bench"], "target": resolved["target"], "prompts": prompts}
    results["incomplete"] = {"measured_categories": sorted(per_category), "missing_categories": missing,
                             "note": "pooled from the bench stage's partial results by benchmarks/bench_partials.py"}
    out = a.out or a.run / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    metrics = a.run / "train" / "metrics.jsonl"
    report = write_report(results, out, metrics if metrics.is_file() else None)
    if missing:
        text = report.read_text()
        report.write_text(f"> **Incomplete:** {len(per_category)} of {len(sets)} categories measured; "
                          f"not measured: {', '.join(missing)}.\n\n" + text)
    s = results["summary"]
    print(json.dumps({"tau": results["tau"], "tokens_per_s": results["tokens_per_s"], "speedup": results["speedup"],
                      "num_prompts": results["num_prompts"], "missing": missing,
                      "bf16_divergent_turns": s["bf16_divergent_turns"],
                      "bf16_unexplained_divergences": s["bf16_unexplained_divergences"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
