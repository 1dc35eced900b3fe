#!/usr/bin/env bash
# The fourth run's drafter on MT-bench coding (chain(3) verify steps, benchmarks/tau_category.py) and the
# StaticTarget's aux states against an fp32 forward (aux_compare.py), under torch's sdpa backends restricted
# for the whole process (with_sdpa.py: nocudnn, math, efficient, default), all processes at once; one JSON back.
# CPU fp32 yardstick: 1,224 verify steps (tau 2.075). tau_env_check.sh (same session) gave, default backends:
# graphs bf16 1,365, graphs fp32 1,334, eager bf16 1,301; aux rel. error up to 1.38 (prefill, layer 2).
#
#   After `source benchmarks/device/h200_session.sh env` (base, gg1, gg2 done), in a snapshot of HEAD:
#   DRAFTER=<dir with drafter.tgz.part-*> OUT=$OUT bash benchmarks/device/sdpa_matrix.sh
set -uo pipefail
: "${DRAFTER:=../.drafter5}" "${OUT:=/tmp/sdpa-matrix}" "${CATEGORY:=coding}"
gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
d=/tmp/bench-drafter/drafter
work=/tmp/sdpa-matrix-work
mkdir -p /tmp/bench-drafter "$OUT" "$work"
[ -d "$d" ] || cat "$DRAFTER"/drafter.tgz.part-* | tar -xz -C /tmp/bench-drafter
[ -d .gq ] || cp -r /tmp/gq .gq
tau() {  # <name> <sdpa> [tau_category args ...]
  local name=$1 sdpa=$2; shift 2
  python3 benchmarks/device/with_sdpa.py "$sdpa" benchmarks/tau_category.py --drafter "$d" --target "$gguf" \
    --category "$CATEGORY" --out "$work/tau_$name.json" "$@" > "$work/tau_$name.log" 2>&1 &
}
aux() {  # <name> <sdpa> [aux_compare args ...]
  local name=$1 sdpa=$2; shift 2
  python3 benchmarks/device/with_sdpa.py "$sdpa" benchmarks/device/aux_compare.py --drafter "$d" --num-prompts 4 \
    --out "$work/aux_$name.json" "$@" > "$work/aux_$name.log" 2>&1 &
}
t0=$(date +%s)
tau graphs_bf16_nocudnn nocudnn --dtype bfloat16
tau graphs_bf16_math math --dtype bfloat16
tau graphs_bf16_efficient efficient --dtype bfloat16
tau graphs_fp32_math math --dtype float32
tau eager_fp32 default --dtype float32 --set bench.cuda_graphs=false
tau eager_bf16_nocudnn nocudnn --dtype bfloat16 --set bench.cuda_graphs=false
aux bf16_default default
aux bf16_nocudnn nocudnn
aux bf16_math math
aux fp32_default default --dtype float32
wait
echo "[sdpa_matrix] $(( $(date +%s) - t0 )) s"
python3 - "$work" "$OUT/sdpa_matrix.json" <<'PY'
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), sys.argv[2]
res = {}
for f in sorted(work.glob("*.json")):
    d = json.loads(f.read_text())
    if f.name.startswith("tau_"):
        res[f.stem] = {k: d[k] for k in ("tau", "verify_steps", "new_tokens", "seconds", "decoding")} | {
            "per_turn_steps": [r["steps"] for r in d["chain"]]}
    else:
        res[f.stem] = {k: d[k] for k in ("worst", "torch", "cudnn", "dtype")}
for f in sorted(work.glob("*.log")):
    if not (work / (f.stem + ".json")).exists():
        res[f.stem] = {"failed": f.read_text()[-3000:]}
pathlib.Path(out).write_text(json.dumps(res, indent=1))
for k, v in res.items():
    print(k, {x: v[x] for x in ("tau", "verify_steps") if x in v} or v.get("worst") or v)
PY
tar -czf "$OUT/sdpa_matrix_logs.tgz" -C "$work" .
