"""What the product's own run (`eagle3-ray run`) reached: tau against training tokens, held-out
simulated tau against the tau the benchmark measured, and the side script's curve at equal tokens.

    python benchmarks/product_report.py --run <run out dir> [--log <run log>...] \
        [--side benchmarks/results/quality_smollm2_67k_train_lr1e-3.json] [--json out.json]

Reads only what the run wrote: ``train/metrics.jsonl`` (every logged step; held-out rows carry
``val_tau``, ``val_tau_chain3``, ``val_tau_walk3`` and, with ``train.val_groups``, each group's
``val_tau/<name>``, ``val_tau_chain3/<name>`` and ``val_tau_walk3/<name>``, all kept in the curve; every row carries ``train_tokens``, the tokens the optimizer has seen, all workers) and
``bench/results.json``. Metrics written before the trainer logged ``train_tokens`` (e.g. the committed
product_smollm2_h200 run) get the tokens from the trainer's plan line in the run's log instead
("N samples, T tokens -> P packs over E epoch(s) ...; S optimizer steps": T x E / S per optimizer
step, an estimate). Nothing here trains or decodes.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

PLAN = re.compile(r"\[train\] ([\d,]+) samples, ([\d,]+) tokens -> ([\d,]+) packs over (\d+) epoch\(s\).*?; "
                  r"([\d,]+) optimizer steps")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


def tokens_per_step(logs: list[Path]) -> float | None:
    """Training tokens per optimizer step from the newest plan line of the run's logs."""
    found = None
    for log in logs:
        for m in PLAN.finditer(log.read_text(encoding="utf-8", errors="replace")):
            found = _int(m.group(2)) * int(m.group(4)) / max(_int(m.group(5)), 1)
    return found


def read_metrics(path: Path) -> list[dict]:
    rows: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["step"])] = row  # a resumed run logs a step again: keep the last
    return [rows[s] for s in sorted(rows)]


def train_tokens(row: dict, per_step: float | None) -> float | None:
    """Training tokens up to a metrics row: as logged (``train_tokens``), else step x the plan's
    tokens per step (older metrics), else None."""
    if row.get("train_tokens") is not None:
        return row["train_tokens"]
    return row["step"] * per_step if per_step else None


def side_curve(path: Path) -> list[tuple[float, float]]:
    """(training tokens, held-out tau) of the side script's run."""
    d = json.loads(path.read_text(encoding="utf-8"))
    t = d["train"]
    per_step = t["train_tokens"] * t["epochs_seen"] / max(t["steps"], 1)
    pts = [(h["step"] * per_step, h["val_tau"]) for h in d["history"] if "val_tau" in h]
    pts.append((t["steps"] * per_step, t["held_out"]["val_tau"]))
    return pts


def interpolate(curve: list[tuple[float, float]], x: float) -> float | None:
    if not curve or x < curve[0][0] or x > curve[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="the run's --out directory")
    ap.add_argument("--log", type=Path, nargs="*", default=[], help="the run's console logs (for the plan line)")
    ap.add_argument("--side", type=Path, help="the side script's training JSON, compared at equal tokens")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args(argv)

    metrics = read_metrics(next(a.run.rglob("metrics.jsonl")))
    logged = bool(metrics) and all("train_tokens" in r for r in metrics)
    per_step = None if logged else tokens_per_step(a.log)
    side = side_curve(a.side) if a.side else []
    curve = []
    for r in metrics:
        tokens = train_tokens(r, per_step)
        point = {"step": r["step"], "train_tokens": tokens, "tau": r.get("tau"), "val_tau": r.get("val_tau"),
                 **{k: v for k, v in r.items() if k.startswith(("val_tau_chain3", "val_tau_walk3", "val_tau/",
                                                                "val_acc_0"))}}
        if side and tokens is not None and r.get("val_tau") is not None:
            point["side_val_tau"] = interpolate(side, tokens)
        curve.append(point)
    results_file = a.run / "bench" / "results.json"
    bench = json.loads(results_file.read_text(encoding="utf-8")) if results_file.is_file() else {}
    last_val = next((p["val_tau"] for p in reversed(curve) if p["val_tau"] is not None), None)
    final_tokens = curve[-1]["train_tokens"] if curve else None
    out = {
        "tokens_per_step": (final_tokens / max(metrics[-1]["step"], 1) if logged else per_step),
        "tokens_from": "metrics" if logged else ("plan line" if per_step else None),
        "steps": metrics[-1]["step"] if metrics else 0,
        "train_tokens": final_tokens,
        "held_out_tau_final": last_val,
        "held_out_final_by_group": next(({k: v for k, v in p.items() if "/" in k} for p in reversed(curve)
                                         if any("/" in k for k in p)), {}),
        "measured_tau": (bench.get("tau") or {}),
        "curve": curve,
    }
    # chain(3) per group: walked (val_tau_walk3) where the run logged it, else the per-position mean
    chain = "val_tau_walk3" if any("val_tau_walk3" in p for p in curve) else "val_tau_chain3"
    groups = sorted({k.split("/", 1)[1] for p in curve for k in p if k.startswith(chain + "/")})
    label = "walk3" if chain == "val_tau_walk3" else "chain3"
    print(f"{'step':>6} {'tokens':>12} {'train tau':>9} {'held-out tau':>12} {'side script':>11}"
          + "".join(f" {g + ' ' + label:>16}" for g in groups))
    for p in curve:
        if p["val_tau"] is None and p is not curve[-1]:
            continue
        tok = f"{p['train_tokens']:,.0f}" if p["train_tokens"] is not None else "?"
        side_tau = p.get("side_val_tau")
        print(f"{p['step']:>6} {tok:>12} {p['tau'] or 0:>9.2f} {p['val_tau'] or float('nan'):>12.2f} "
              f"{side_tau if side_tau is not None else float('nan'):>11.2f}"
              + "".join(f" {p.get(chain + '/' + g, float('nan')):>16.2f}" for g in groups))
    print(f"training tokens from {out['tokens_from']}; held-out simulated tau (final) {last_val}; "
          f"measured by bench: {out['measured_tau']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
