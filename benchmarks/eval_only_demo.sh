#!/usr/bin/env bash
# The CPU demo (configs/demo-smollm2.yaml, the real SmolLM2-135M-Instruct) with 16 MT-bench questions
# (two per category, both turns) added to its data as an evaluation-only group (train.eval_only): the
# target answers them with the demo prompts, training never sees them, and every held-out evaluation
# reports the drafter's simulated chain(3) tau on them (val_tau_chain3/mt_bench). The bench stage then
# decodes the same 16 questions for real (chain(3), 128 new tokens as generate), so the two figures
# are of one drafter on the same text.
#
#   bash benchmarks/eval_only_demo.sh <out dir> [<shared data dir, default ../shared/data>]
#
# Writes <out>/inputs/{data.jsonl,mt_bench_16.jsonl}, the run under <out>/run, and prints
# benchmarks/product_report.py's curve (held-out groups by training tokens) and the bench's tau.
set -euo pipefail
out=${1:?usage: eval_only_demo.sh <out dir> [<shared data dir>]}
data=${2:-../shared/data}
PY=${PYTHON:-python}
mkdir -p "$out/inputs"
"$PY" - "$data/mt_bench.jsonl" "$out/inputs" <<'PYEOF'
import json, sys
from pathlib import Path
from importlib.resources import files
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
rows = [json.loads(l) for l in src.read_text(encoding="utf-8").splitlines() if l.strip()]
picked, seen = [], {}
for r in rows:  # the first two questions of each category, in file order
    if seen.get(r["category"], 0) < 2:
        seen[r["category"]] = seen.get(r["category"], 0) + 1
        picked.append(r)
(dst / "mt_bench_16.jsonl").write_text("".join(json.dumps(r) + "\n" for r in picked), encoding="utf-8")
demo = (files("eagle3_ray.resources") / "demo_prompts.jsonl").read_text(encoding="utf-8")
extra = "".join(json.dumps({"id": f"mtbench-{r['question_id']}", "turns": r["turns"]}) + "\n" for r in picked)
(dst / "data.jsonl").write_text(demo + extra, encoding="utf-8")
print(f"{len(picked)} MT-bench questions ({sorted(seen)}) added as eval-only to {demo.count(chr(10))} demo prompts")
PYEOF
"$PY" -m eagle3_ray.cli run -c configs/demo-smollm2.yaml --data "$out/inputs/data.jsonl" --out "$out/run" \
  train.val_share=0.05 train.eval_every=20 \
  'train.val_groups={"mt_bench":"mtbench-[0-9]+","demo":"demo-.*"}' 'train.eval_only=["mt_bench"]' \
  "bench.prompts=$out/inputs/mt_bench_16.jsonl" bench.max_prompts=16 bench.max_new_tokens=128 \
  'bench.modes=[chain]' bench.untrained=false bench.prompt_lookup=false
"$PY" benchmarks/product_report.py --run "$out/run" --json "$out/report.json"
