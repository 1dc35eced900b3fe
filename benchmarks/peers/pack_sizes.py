"""Why SpecForge won the 1-epoch row, answered: the pack size (issue 59, third run), from the files the runs left.

    python benchmarks/peers/pack_sizes.py --run RUN3 --before-run RUN1 --before-tau TAU1 --out pack_sizes.json

RUN3: the third run's `specforge.sh STEP=collect` archive unpacked (NO_SF: ours1 at the preset's former packs
of 16,384 tokens, the recipe variants b4k and b2k, b2k's 3-epoch run, their SGLang tau under tau/);
RUN1 and TAU1: the first run's archives (record specforge_side_by_side, the same GPU kind), which hold
SpecForge's training logs and the SGLang records of ours1, ours3 and SpecForge's 1-epoch drafter on the
same 160 turns (checked here: the turns' token ids must be equal). Every figure is computed here:
- held-out tau: ours: the trainer's final `val_tau` (and the best one, which the export took); SpecForge:
  ``1 + eval/simulated_acc_len`` of each evaluation, on the same 80 held-out samples;
- training tokens/s: the median of the trainer's logged `tokens_per_s` after its first logged row (start-up);
  wall seconds and GPU peak of each training command (`specforge.sh`'s `timed`);
- SGLang tau: ``sglang_tau.py``'s per-turn records, and paired bootstrap intervals over the same turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import specforge_log  # noqa: E402
from sglang_tau import paired_interval, tau_of  # noqa: E402

VARIANTS = {"packs_16384": "ours1", "packs_4096": "recipe/b4k", "packs_2048": "recipe/b2k",
            "packs_2048_3ep": "recipe/b2k-3ep"}


def _json(path: Path):
    return json.loads(path.read_text())


def steady_tokens_per_s(metrics: Path) -> float:
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in r]
    return statistics.median(r["tokens_per_s"] for r in rows[1:] or rows)


def variant(run: Path, rel: str) -> dict:
    train = run / rel / "train"
    summary = _json(train / "summary.json")
    name = "ours1" if rel == "ours1" else "recipe-" + rel.split("/", 1)[1]
    timing = _json(run / f"{name}.time.json")
    packs = yaml.safe_load((train / "config.resolved.yaml").read_text())["train"]["batch_tokens"]
    return {"held_out_tau_final": summary["metrics"]["val_tau"], "held_out_tau_best": summary["best"]["val_tau"],
            "best_step": summary["best"]["step"], "optimizer_steps": summary["metrics"]["step"],
            "train_tokens": summary["metrics"]["train_tokens"], "tokens_per_s": steady_tokens_per_s(train / "metrics.jsonl"),
            "command_wall_s": timing["seconds"], "gpu_peak_mib": timing["gpu_peak_mib"], "batch_tokens": packs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="the third run, unpacked")
    ap.add_argument("--before-run", required=True, help="the first run's specforge_smollm2_run_h100.tgz, unpacked")
    ap.add_argument("--before-tau", required=True, help="the first run's specforge_smollm2_tau_h100.tgz, unpacked")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    run, before, before_tau = Path(a.run), Path(a.before_run), Path(a.before_tau)
    turns = _json(run / "tau" / "turns.json")
    if [t["ids"] for t in turns] != [t["ids"] for t in _json(before_tau / "turns.json")]:
        raise SystemExit("the two runs' SGLang turns differ: their tau cannot be paired")
    ours = {k: variant(run, rel) for k, rel in VARIANTS.items()}
    sf = {}
    for name in ("aligned-1ep", "default-1ep", "aligned-3ep"):
        steps, _ = specforge_log(before / "sf" / name / "train.log")
        sf[name] = {"evaluations": [[s, 1 + d["eval/simulated_acc_len"]] for s, d in steps
                                    if "eval/simulated_acc_len" in d],
                    "last_logged_step": max(s for s, _ in steps)}
    records = {label: {m: _json(p)["records"] for m in ("chain", "tree")
                       if (p := run / "tau" / f"recipe-{label}-{m}.json").exists()} for label in ("b2k", "b2k-3ep")}
    records.update({label: {"chain": _json(before_tau / f"{label}-chain.json")["records"]}
                    for label in ("ours1", "ours3", "sf-aligned-1ep")})
    sglang = {label: {m: tau_of(r) for m, r in by_mode.items()} for label, by_mode in records.items()}
    pairs = {}
    for mine, other in (("b2k", "sf-aligned-1ep"), ("b2k", "ours1"), ("b2k-3ep", "ours3"), ("b2k-3ep", "sf-aligned-1ep")):
        x, y = records[mine]["chain"], records[other]["chain"]
        pairs[f"{mine}_minus_{other}_chain"] = {"tau": tau_of(x) - tau_of(y), "ci95": paired_interval(x, y)}
    out = {"turns": len(turns), "ours": ours, "specforge": sf, "sglang_tau": sglang, "paired": pairs}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
