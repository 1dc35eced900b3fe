"""Several drafters' tau in SGLang's own EAGLE-3 decoding, on exactly the same turns (a fixed history).

    python benchmarks/peers/sglang_tau.py -c configs/smollm2-h200.yaml --prompts mt_fixed.jsonl \\
        --drafter ours-1ep=RUN/ours1/drafter --drafter specforge-1ep=RUN/sf/aligned-1ep/sglang \\
        --out RUN/tau target.model=<HF dir> bench.max_new_tokens=1024 "bench.concurrency=[8]" ...

Every record of ``--prompts`` must carry its ``answers`` (``long_eval_set.py history`` writes them):
the turns' prompt ids are then fixed before any engine starts, and each drafter decodes the same
prompts. For each mode of ``bench.modes`` the drafters' engines run at once, one process each on the
one GPU (``target.sglang.mem_fraction_static`` each; a 135M target needs little): tau is counted from
SGLang's own per-request counters and does not depend on what else runs, the speeds printed beside
it do, so they are not figures. The engines are the product's bench engines (``bench.sglang_bench``:
``mode_kwargs``, ``Served``; CUDA graphs on, the preset's chain and tree shapes), at the one
``bench.concurrency`` given, every request's counters kept.
Output: ``<out>/<label>-<mode>.json`` (the records) and ``<out>/tau.json``: tau per drafter
and mode, by turn and category, and each drafter's per-turn difference from the first one with a
seeded bootstrap interval.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eagle3_ray.config import load_config  # noqa: E402
from eagle3_ray.errors import DataError  # noqa: E402


def fixed_turns(cfg, prompts: str) -> list[dict]:
    """Every turn of ``prompts`` as the bench's ``TurnPrompt`` (a dict), after the fixed answers."""
    from dataclasses import asdict

    from eagle3_ray.bench.prompts import load_prompt_sets
    from eagle3_ray.bench.sglang_bench import TurnPrompt
    from eagle3_ray.data.chat import render_generation_prompt
    from eagle3_ray.engines.describe import load_tokenizer

    tok = load_tokenizer(cfg.target)
    turns = []
    for category, items in load_prompt_sets(prompts, cfg.bench.max_prompts).items():
        for p in items:
            if p.answers is None or len(p.answers) < len(p.turns) - 1:
                raise DataError(f"{prompts}: prompt {p.id} has no fixed answers for its turns; write them with "
                                "`benchmarks/long_eval_set.py history` first")
            messages: list[dict] = []
            for t, text in enumerate(p.turns):
                messages.append({"role": "user", "content": text})
                turns.append(asdict(TurnPrompt(category, p.id, t, render_generation_prompt(tok, messages))))
                if t < len(p.answers):
                    messages.append({"role": "assistant", "content": p.answers[t]})
    return turns


def child(a) -> int:
    """One engine (the product's bench engine for ``--mode``): the fixed turns at the one concurrency,
    every request's record kept (``run_mode`` keeps them at concurrency 1 only)."""
    from eagle3_ray.bench import sglang_bench as sb
    from eagle3_ray.engines.sglang_args import check_server_args, generate_sampling, import_sglang
    from eagle3_ray.engines.sglang_process import EngineLoop, launch_sglang

    cfg = load_config(a.config, a.overrides)
    b, (c,) = cfg.bench, cfg.bench.concurrency
    ids = [t["ids"] for t in json.loads(Path(a.turns).read_text())]
    kwargs = sb.mode_kwargs(cfg, a.mode, a.drafter_dir)
    check_server_args(kwargs)
    sampling = generate_sampling(b.max_new_tokens, b.temperature, 1.0, cfg.generate.seed)
    what = f"the SGLang {a.mode} engine of {a.drafter_dir}"
    engine, procs = launch_sglang(kwargs, import_sglang().Engine, what=what)
    served = sb.Served(EngineLoop(engine, procs, what), a.mode)
    try:
        warm = dict(sampling, max_new_tokens=min(sb.WARMUP_TOKENS, b.max_new_tokens))
        served.serve(ids[:c], warm, c, "warm-up")
        records, wall = served.serve(ids, sampling, c, f"c{c}")
    finally:
        served.loop.close()
    for r in records:
        r.pop("output_ids")
    result = {"mode": a.mode, "drafter": a.drafter_dir, "concurrency": c, "wall_s": wall,
              "server_args": {k: v for k, v in kwargs.items() if k.startswith(("speculative_", "cuda_graph"))},
              "summary": sb.summarize(records, wall), "records": records}
    Path(a.result).write_text(json.dumps(result))
    return 0


def tau_of(records: list[dict]) -> float | None:
    """The project's tau (docs/bench.md): tokens appended by verify steps / verify steps."""
    steps = sum(r["spec_verify_ct"] or 0 for r in records)
    return sum(r["completion_tokens"] - 1 for r in records) / steps if steps else None


def paired_interval(a: list[dict], b: list[dict], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of tau(a) - tau(b) over the same turns, resampling turns (seeded bootstrap)."""
    rng = np.random.default_rng(seed)
    ca, cb = (np.array([[r["completion_tokens"] - 1, r["spec_verify_ct"] or 0] for r in x], dtype=float)
              for x in (a, b))
    idx = rng.integers(0, len(a), size=(n, len(a)))
    diffs = [ca[i, 0].sum() / ca[i, 1].sum() - cb[i, 0].sum() / cb[i, 1].sum() for i in idx]
    return float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))


def summarize(turns: list[dict], results: dict[str, dict[str, dict]]) -> dict:
    out: dict = {"turns": len(turns), "drafters": {}}
    first = None
    for label, by_mode in results.items():
        row = out["drafters"][label] = {}
        for mode, res in by_mode.items():
            records = res["records"]
            row[mode] = {"tau": tau_of(records), "concurrency": res["concurrency"],
                         "accept_length": res["summary"].get("accept_length"),
                         "tokens_per_s_shared_gpu": res["summary"].get("tokens_per_s"),
                         "by_turn": {str(t): tau_of([r for r, tp in zip(records, turns) if tp["turn"] == t])
                                     for t in sorted({tp["turn"] for tp in turns})},
                         "by_category": {cat: tau_of([r for r, tp in zip(records, turns) if tp["category"] == cat])
                                         for cat in sorted({tp["category"] for tp in turns})}}
            if first is None:
                first = label
            elif mode in results[first]:
                base = results[first][mode]["records"]
                row[mode][f"minus_{first}"] = {"tau": row[mode]["tau"] - out["drafters"][first][mode]["tau"],
                                               "ci95": paired_interval(records, base)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-c", "--config", required=True)
    ap.add_argument("--prompts", help="a prompt set whose records carry their fixed answers")
    ap.add_argument("--drafter", action="append", default=[], help="label=exported drafter directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--modes-at-once", action="store_true", help="start every mode's engines together")
    ap.add_argument("--mem-step", type=float, default=0.0, help="the k-th engine of a wave gets "
                    "target.sglang.mem_fraction_static + k x this: SGLang sizes an engine's pool as the total x its "
                    "fraction less what the GPU already holds, so engines that start after others need a higher one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--drafter-dir", help=argparse.SUPPRESS)
    ap.add_argument("--turns", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args(argv)
    if a.child:
        return child(a)
    cfg = load_config(a.config, a.overrides)
    if a.mem_step and cfg.target.sglang.mem_fraction_static is None:
        raise SystemExit("--mem-step needs target.sglang.mem_fraction_static (the first engine's fraction)")
    if len(cfg.bench.concurrency) != 1:
        raise SystemExit("give one bench.concurrency: every drafter is measured at the same one")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    turns = fixed_turns(cfg, a.prompts)
    (out / "turns.json").write_text(json.dumps(turns))
    drafters = dict(d.split("=", 1) for d in a.drafter)
    results: dict[str, dict[str, dict]] = {label: {} for label in drafters}
    # Each mode's engines at once; with --modes-at-once every mode's too (tau does not depend on what else runs)
    waves = [list(cfg.bench.modes)] if a.modes_at_once else [[m] for m in cfg.bench.modes]
    for wave in waves:
        procs = {}
        k = 0
        for mode in wave:
            for label, d in drafters.items():
                result = out / f"{label}-{mode}.json"
                if result.exists():
                    continue
                cmd = [sys.executable, __file__, "--child", "-c", a.config, "--out", str(out), "--mode", mode,
                       "--drafter-dir", d, "--turns", str(out / "turns.json"), "--result", str(result),
                       *a.overrides]
                if a.mem_step:
                    frac = cfg.target.sglang.mem_fraction_static + k * a.mem_step
                    cmd.append(f"target.sglang.mem_fraction_static={frac:.3f}")
                k += 1
                log = open(out / f"{label}-{mode}.log", "w")
                procs[f"{label}-{mode}"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        failed = [name for name, p in procs.items() if p.wait() != 0]
        if failed:
            print(f"[sglang_tau] failed: {failed} (see {out}/<name>.log)", flush=True)
    for label in drafters:
        for mode in cfg.bench.modes:
            f = out / f"{label}-{mode}.json"
            if f.exists():
                results[label][mode] = json.loads(f.read_text())
    summary = summarize(turns, {k: v for k, v in results.items() if v})
    (out / "tau.json").write_text(json.dumps(summary, indent=1))
    for label, row in summary["drafters"].items():
        print(label, {m: round(r["tau"], 3) if r["tau"] else None for m, r in row.items()}, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
