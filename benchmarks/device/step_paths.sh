#!/usr/bin/env bash
# The one training step on one H200: the product's Ray Train loop (tokens/s, input_wait) against the
# same step with the packs already in GPU memory (DeepSpeed; plain torch + fused AdamW) and copied from
# the host per step (benchmarks/device/step_paths.py), on the same SmolLM2 feature store; then the
# quality benchmark's train and eval phases, briefly, through the product's step (a check that the
# CUDA path runs: bf16 autocast, fused AdamW, TrainStep.evaluate).
#
#   export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/device/step_paths.sh   (about 6-7 minutes; at most 9:20)
#   DEVICE=cpu GGUF=smollm2 bash benchmarks/device/step_paths.sh                   (a smoke test, tiny sizes)
#
# Results under $OUT: product_metrics.jsonl, product.log, step_paths.json, quality_smoke.json, logs.
set -uo pipefail
: "${OUT:=/tmp/step-paths-out}" "${WORK:=/tmp/step-paths}" "${DEVICE:=cuda}"
: "${GGUF:=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}"
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE="$WORK/cache"
PY=${PYTHON:-python3}
t0=$(date +%s)
say() { echo "[step_paths.sh +$(( $(date +%s) - t0 ))s] $*"; }

if [ "$DEVICE" = cuda ]; then
  # The demo config at the quality benchmark's pack size (16K tokens; rows of 2048), 40 epochs of the
  # shipped 300 prompts, so the loop runs a few hundred steps.
  RUN_ARGS=(-c configs/demo-smollm2.yaml target.model="$GGUF" extract.num_gpus_per_actor=1 train.use_gpu=true
            bench.num_gpus=1 ray.num_cpus=16 generate.batch_size=128 train.batch_tokens=16384 train.epochs=40
            train.log_every=20 train.checkpoint_every=100000 train.lr=0.001 train.warmup_steps=20)
  STEP_ARGS=(--steps 60 --warmup 5)
  Q_ARGS=(--device cuda --num-prompts 400 --distill-seconds 40 --train-seconds 40 --eval-seconds 40 --per-set 4)
  Q_DEADLINE=150
else
  RUN_ARGS=(-c configs/ci-tiny.yaml train.batch_tokens=512 train.max_steps=6 train.log_every=2 train.epochs=8)
  STEP_ARGS=(--steps 3 --warmup 1 --device cpu)
  Q_ARGS=(--device cpu --num-prompts 10 --max-new-tokens 8 --gen-batch 4 --distill-seconds 60 --train-seconds 5
          --eval-seconds 5 --per-set 1 --max-turns 1 --eval-new-tokens 8 --batch-tokens 1024 --val-samples 1
          --eager-turns 0 --warmup 1)
  Q_DEADLINE=400
fi
CFG=${RUN_ARGS[1]}
OVR=("${RUN_ARGS[@]:2}")

say "1/3 the product: eagle3-ray run --stop-after train"
timeout -k 20 -s INT 240 $PY -m eagle3_ray.cli run "${RUN_ARGS[@]}" --out "$WORK/run" --stop-after train \
  > "$OUT/product.log" 2>&1
say "product run rc $? ($(grep -c '\[train\] step' "$OUT/product.log") logged steps)"
grep "\[train\]\|^\[run\]" "$OUT/product.log" | sed "s/.*\[train\]/[train]/" | tail -n 15
cp "$WORK/run/train/metrics.jsonl" "$OUT/product_metrics.jsonl" 2>/dev/null

say "2/3 the step alone on the same store: DeepSpeed / torch, packs on the device / from the host"
timeout -k 10 100 $PY benchmarks/device/step_paths.py -c "$CFG" --features "$WORK/run/features" \
  --vocab "$WORK/run/vocab" --out "$OUT/step_paths.json" --work "$WORK/paths" "${STEP_ARGS[@]}" "${OVR[@]}" \
  > "$OUT/step_paths.log" 2>&1
say "step_paths rc $?"; tail -n 6 "$OUT/step_paths.log"

say "3/3 quality_smollm2.py, train then eval, through the product's step"
mkdir -p "$WORK/eval" "$WORK/q"
$PY - "$WORK/eval/mt_bench.jsonl" <<'EOF'
import json, sys
from importlib import resources
rows = [json.loads(l) for l in resources.files("eagle3_ray.resources").joinpath("demo_eval.jsonl").read_text().splitlines() if l.strip()]
with open(sys.argv[1], "w") as f:
    for r in rows:
        f.write(json.dumps({"turns": r.get("turns") or [r["prompt"]]}) + "\n")
EOF
PROMPTS=$($PY -c "from importlib import resources; print(resources.files('eagle3_ray.resources').joinpath('demo_prompts.jsonl'))")
timeout -k 20 $(( Q_DEADLINE + 30 )) $PY benchmarks/quality_smollm2.py --gguf "$GGUF" --prompts "$PROMPTS" \
  --eval-dir "$WORK/eval" --out "$WORK/q/quality_smoke.json" --work "$WORK/quality" --deadline "$Q_DEADLINE" \
  "${Q_ARGS[@]}" > "$OUT/quality_smoke.log" 2>&1
say "quality_smollm2 rc $?"; tail -n 8 "$OUT/quality_smoke.log"
cp "$WORK/q/quality_smoke.json" "$OUT/" 2>/dev/null  # not the drafter export beside it (8 files come back)
ls -la "$OUT"
exit 0
