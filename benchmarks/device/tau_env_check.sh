#!/usr/bin/env bash
# Where does the H200 lose the fourth product run's tau? MT-bench coding, chain(3), greedy, 128 new tokens,
# the product's BenchActor (benchmarks/tau_category.py), one variable changed per process, all processes at
# once (tau does not depend on timing): the graphed StaticTarget in bf16 (the bench's path), the same without
# CUDA graphs (the HF model, eager), the StaticTarget in fp32, the bf16 path with the GGUF converted through
# $EAGLE3_RAY_CACHE (as in the product run), the code of the product run itself (c321632, in $OLD), and the
# aux states against an fp32 forward (aux_compare.py). CPU yardsticks: fp32 1,224 verify steps (tau 2.075),
# the product run 1,252 (2.029), the re-bench 1,365 (1.861).
#
#   After `source benchmarks/device/h200_session.sh env` (base, gg1, gg2 done), in a snapshot of HEAD:
#   OLD=<snapshot of c321632> DRAFTER=<dir with drafter.tgz.part-*> OUT=$OUT bash benchmarks/device/tau_env_check.sh
set -uo pipefail
: "${DRAFTER:=../.drafter5}" "${OUT:=/tmp/tau-env}" "${OLD:=}" "${CATEGORY:=coding}"
gguf=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
d=/tmp/bench-drafter/drafter
mkdir -p /tmp/bench-drafter "$OUT"
[ -d "$d" ] || cat "$DRAFTER"/drafter.tgz.part-* | tar -xz -C /tmp/bench-drafter
[ -d .gq ] || cp -r /tmp/gq .gq
python3 - > "$OUT/versions.txt" 2>&1 <<'EOF'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
print("transformers", transformers.__version__, "gpu", torch.cuda.get_device_name(0))
print("tf32 matmul", torch.backends.cuda.matmul.allow_tf32, "bf16 reduced", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
EOF
tau() {  # <name> <dir> <VAR=value> [tau_category args ...]: one process in the background
  local name=$1 dir=$2 var=$3; shift 3
  (cd "$dir" && env "$var" python3 benchmarks/tau_category.py --drafter "$d" --target "$gguf" \
     --category "$CATEGORY" --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1; echo "[$name] rc $?" >> "$OUT/$name.log") &
}
t0=$(date +%s)
tau graphs_bf16 . X=1 --dtype bfloat16
tau eager_bf16 . X=1 --dtype bfloat16 --set bench.cuda_graphs=false
tau graphs_fp32 . X=1 --dtype float32
tau cache_bf16 . EAGLE3_RAY_CACHE=/tmp/e3cache --dtype bfloat16
if [ -n "$OLD" ]; then
  cp benchmarks/tau_category.py "$OLD/benchmarks/tau_category.py"
  [ -d "$OLD/.gq" ] || cp -r .gq "$OLD/.gq"
  tau old_c321632_bf16 "$OLD" "PYTHONPATH=/tmp/base:$(cd "$OLD" && pwd)" --dtype bfloat16
fi
python3 benchmarks/device/aux_compare.py --drafter "$d" --out "$OUT/aux.json" > "$OUT/aux.log" 2>&1 &
wait
echo "[tau_env_check] $(( $(date +%s) - t0 )) s"
cat "$OUT/versions.txt"
for f in "$OUT"/*.log; do echo "== $f"; grep -v "clean_up_tokenization\|Token authentication" "$f" | tail -n 6; done
