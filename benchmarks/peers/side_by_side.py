"""The side-by-side figures of one `specforge.sh` run, from what its calls brought back.

    python benchmarks/peers/side_by_side.py --run RUN_DIR --tau TAU_DIR --out side_by_side.json

RUN_DIR: `specforge.sh STEP=collect`'s archive unpacked (the chain's markers, timings, logs, the
trainers' metrics and SpecForge's log); TAU_DIR: `sglang_tau.py`'s `<label>-<mode>.json` and turns.json.
Every figure is computed here from those files:
- training: each trainer's steady tokens/s from its own log (ours: `metrics.jsonl` lines past the
  first 100 steps of the 3-epoch run; SpecForge: `perf/global_samples_per_second` past step 200 of the
  1-epoch run, times the mean sample length), the wall seconds of each training command (startup
  included) and the GPU's peak memory sampled by `nvidia-smi` while it ran alone;
- held-out tau: ``1 + sum_k prod_{j<=k} acc_j`` over the 7 TTT steps on the same held-out samples
  (ours: the final `val_tau`; SpecForge: its last evaluation, ``eval/simulated_acc_len + 1``);
- SGLang tau: ``sglang_tau.py``'s per-turn records pooled, with paired bootstrap intervals.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sglang_tau import paired_interval, summarize, tau_of  # noqa: E402


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def ours_steady(metrics: Path, skip: int = 100) -> float:
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["tokens_per_s"] for r in rows if r.get("step", 0) >= skip and "tokens_per_s" in r)


def specforge_log(log: Path) -> tuple[list[tuple[int, dict]], dict]:
    steps = [(int(m.group(1)), ast.literal_eval(m.group(2)))
             for m in re.finditer(r"^step (\d+): (\{.*\})$", log.read_text(), re.M)]
    evals = [(s, d) for s, d in steps if "eval/simulated_acc_len" in d]
    return steps, (dict(evals[-1][1], step=evals[-1][0]) if evals else {})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True)
    ap.add_argument("--tau", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    run, tau_dir = Path(a.run), Path(a.tau)
    inputs = _json(run / "sf" / "inputs.json")
    tokens, samples = inputs["train"]["tokens"], inputs["train"]["samples"]
    steps, last_eval = specforge_log(run / "sf" / "aligned-1ep" / "train.log")
    sf_sps = statistics.median(d["train/perf/global_samples_per_second"] for s, d in steps
                               if s >= 200 and "train/perf/global_samples_per_second" in d)
    sf_tps = sf_sps * tokens / samples
    ours_tps = ours_steady(run / "ours3" / "train" / "metrics.jsonl")
    times = {n: _json(run / f"{n}.time.json") for n in ("ours1", "bf16", "ours3", "sf-aligned-1ep")}
    ours1_train_s = _json(run / "ours1" / "summary.json")["stage_seconds"]["train"]
    held = {"ours-1ep": _json(run / "ours1" / "train" / "summary.json")["metrics"]["val_tau"],
            "ours-3ep": _json(run / "ours3" / "train" / "summary.json")["metrics"]["val_tau"],
            "specforge-1ep": 1 + last_eval["eval/simulated_acc_len"]}
    turns = _json(tau_dir / "turns.json")
    results = {label: {m: _json(p) for m in ("chain", "tree") if (p := tau_dir / f"{label}-{m}.json").exists()}
               for label in ("ours1", "ours3", "sf-aligned-1ep")}
    sglang = summarize(turns, {k: v for k, v in results.items() if v})
    pairs = {}
    for mode in ("chain", "tree"):
        if all(mode in results[k] for k in ("sf-aligned-1ep", "ours1", "ours3")):
            sf = results["sf-aligned-1ep"][mode]["records"]
            for ours in ("ours1", "ours3"):
                mine = results[ours][mode]["records"]
                pairs[f"{ours}_minus_specforge_1ep_{mode}"] = {
                    "tau": tau_of(mine) - tau_of(sf), "ci95": paired_interval(mine, sf)}
    out = {
        "data": {"train_samples": samples, "train_tokens": tokens, "held_out_samples": inputs["eval"]["samples"],
                 "tokens_per_sample": tokens / samples},
        "bytes_per_token": {"specforge": inputs["specforge_bytes_per_token"], **{
            f"eagle3ray_{k}": v for k, v in inputs["eagle3ray_bytes_per_token"].items()}},
        "train_tokens_per_s_steady": {"eagle3ray": ours_tps, "specforge": sf_tps, "ratio": ours_tps / sf_tps},
        "train_wall_s_1ep": {"eagle3ray_train_stage": ours1_train_s, "specforge_command": times["sf-aligned-1ep"]["seconds"],
                             "ratio": times["sf-aligned-1ep"]["seconds"] / ours1_train_s},
        "train_wall_s_3ep_eagle3ray_command": times["ours3"]["seconds"],
        "train_gpu_peak_mib": {"eagle3ray": times["ours3"]["gpu_peak_mib"],
                               "specforge": times["sf-aligned-1ep"]["gpu_peak_mib"]},
        "capture": {"eagle3ray_fp8_run_s": times["ours1"]["seconds"], "eagle3ray_bf16_extract_s": times["bf16"]["seconds"],
                    "specforge": None},
        "held_out_tau": held, "specforge_last_eval_step": last_eval.get("step"),
        "sglang": sglang, "paired": pairs,
    }
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "sglang"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
