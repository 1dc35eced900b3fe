#!/usr/bin/env bash
# Drafter training MFU on one H200 (issue 24): the bare step and the Ray Train + DeepSpeed loop at the
# Llama-3.1-8B and Kimi-K2.5 shapes, in one call of at most 5 minutes. Run from the repository root:
#
#     OUT=/path/to/out bash benchmarks/device/train_mfu.sh               # H200, at most 4.5 min + the final summary
#     DEVICE=cpu OUT=/tmp/mfu bash benchmarks/device/train_mfu.sh        # tiny shapes: the script's smoke test
#
# Phases, in order of importance; each gets what is left of BUDGET_S (default 270 s) and is skipped
# when too little is left:
#   1. bare step (benchmarks/train_step.py, torch engine: bf16 weights, fused AdamW), 8B then Kimi shape:
#      tokens/s, MFU against PEAK_TFLOPS (785), peak GiB (max_memory_allocated), host syncs per step
#   2. Ray Train + DeepSpeed loop (benchmarks/train_loop.py, synthetic store, one worker), LOOP_RUNS
#      (default 8b:1,kimi:preset,kimi:1,8b:2: ZeRO-1 and the Kimi preset's stage at both shapes, in
#      that order; a run that does not fit in the budget is reported as skipped, one that runs out of
#      memory with oom: true; an entry SHAPE:STAGE+KEY=VALUE adds config overrides to that run, e.g.
#      8b:1+train.loss_kernel=torch, reported under train_mfu_loop_8b_zero1+train.loss_kernel=torch)
#   3. if time is left (rarely in the same call: a Ray Train run's start-up takes about a minute):
#      DeepSpeed's engine without Ray (train_step.py --engine deepspeed), 8B ZeRO-1 and Kimi ZeRO-2,
#      with host syncs per step: what DeepSpeed costs against the bare step, apart from Ray
#
# BARE_EXTRA adds train_step.py arguments to the two bare phases, e.g. "--attention varlen,sdpa --check"
# (both attentions timed after a check against sdpa, the best one reported), DS_EXTRA to the two
# DeepSpeed phases; BARE_CAP (default 60 s) is each bare phase's timeout (flex compiles its kernels first).
# PHASES (default "bare_8b bare_kimi loop ds_8b_zero1 ds_kimi_zero2") picks the phases of a call (they
# run in the order above), e.g. a second call (another OUT):
#     PHASES="loop ds_8b_zero1 ds_kimi_zero2" LOOP_RUNS=kimi:1,8b:2 OUT=... bash benchmarks/device/train_mfu.sh
# The bare and DeepSpeed phases also time 3 steps taken apart (forward, backward, optimizer step).
#
# $OUT gets two files, rewritten after every phase: train_mfu.json (the summary keys train_mfu_bare_8b,
# train_mfu_loop_8b, train_mfu_bare_kimi, train_mfu_loop_kimi, train_peak_gib_kimi, ... and every
# phase's full JSON under "parts") and train_mfu.log (every phase's output).
set -u
: "${OUT:?set OUT to the results directory}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
PEAK_TFLOPS=${PEAK_TFLOPS:-785}
BUDGET_S=${BUDGET_S:-270}
LOOP_RUNS=${LOOP_RUNS:-8b:1,kimi:preset,kimi:1,8b:2}
PHASES=${PHASES:-bare_8b bare_kimi loop ds_8b_zero1 ds_kimi_zero2}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/train_mfu.XXXXXX")
LOG="$OUT/train_mfu.log"
: > "$LOG"
START=$SECONDS

left() { echo $((BUDGET_S - (SECONDS - START))); }

say() { echo "[train_mfu $(($SECONDS - START))s] $*" | tee -a "$LOG"; }

# phase NAME MIN_S CAP_S CMD...: run CMD with a timeout of min(CAP_S, time left - 5) if at least MIN_S is left
phase() {
  local name=$1 min_s=$2 cap_s=$3; shift 3
  case " $PHASES " in *" $name "*) ;; *) return ;; esac
  local l; l=$(left)
  if [ "$l" -lt "$min_s" ]; then
    say "$name: skipped ($l s left, needs $min_s)"
    echo "{\"status\": \"skipped (budget: ${l} s left)\"}" > "$WORK/$name.json"
    return
  fi
  local cap=$(( cap_s < l - 5 ? cap_s : l - 5 ))
  say "$name: start (timeout ${cap}s): $*"
  timeout -k 5 "$cap" "$@" >> "$LOG" 2>&1
  local rc=$?
  say "$name: exit $rc"
  [ $rc -eq 124 ] && say "$name: stopped at its ${cap}s timeout (partial results kept)"
  summarize
}

summarize() {
  "$PY" - "$WORK" "$OUT/train_mfu.json" "$DEVICE" "$PEAK_TFLOPS" <<'EOF'
import json, sys
from pathlib import Path

work, out, device, peak = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], float(sys.argv[4])
parts = {}
for p in sorted(work.glob("*.json")):
    try:
        parts[p.stem] = json.loads(p.read_text())
    except ValueError as e:  # a phase killed while writing
        parts[p.stem] = {"status": f"unreadable: {e}"}

def get(part, key):
    return parts.get(part, {}).get(key)

s = {"device": device if device != "cpu" else "cpu (tiny shapes: a smoke test of the script)",
     "peak_tflops": peak}
for shape in ("8b", "kimi"):
    s[f"train_mfu_bare_{shape}"] = get(f"bare_{shape}", "mfu")
    s[f"train_tokens_per_s_bare_{shape}"] = get(f"bare_{shape}", "tokens_per_s")
    s[f"train_peak_gib_bare_{shape}"] = get(f"bare_{shape}", "peak_memory_gib")
    s[f"train_host_syncs_bare_{shape}"] = get(f"bare_{shape}", "host_syncs_per_step")
    s[f"train_parts_s_bare_{shape}"] = get(f"bare_{shape}", "breakdown_seconds")
s["train_peak_gib_kimi"] = s["train_peak_gib_bare_kimi"]
for name, part in (("8b_zero1", "ds_8b_zero1"), ("kimi_zero2", "ds_kimi_zero2")):
    s[f"train_mfu_deepspeed_{name}"] = get(part, "mfu")
    s[f"train_peak_gib_deepspeed_{name}"] = get(part, "peak_memory_gib")
    s[f"train_host_syncs_deepspeed_{name}"] = get(part, "host_syncs_per_step")
    s[f"train_parts_s_deepspeed_{name}"] = get(part, "breakdown_seconds")
loop = parts.get("loop", {})
# On CPU the loop runs the tiny shape at ZeRO-1 and 2, standing in for both shapes.
s8, sk = ("tiny", "tiny") if device == "cpu" else ("8b", "kimi")
for run in loop.get("runs", []):
    key = f"{run['shape']}_zero{run.get('zero_stage')}" + "".join(f"+{o}" for o in run.get("overrides", []))
    s[f"train_mfu_loop_{key}"] = run.get("mfu")
    s[f"train_tokens_per_s_loop_{key}"] = run.get("tokens_per_s")
    s[f"train_peak_gib_loop_{key}"] = run.get("peak_gpu_gib_nvidia_smi")
    s[f"train_input_wait_loop_{key}"] = run.get("input_wait")
    s[f"train_status_loop_{key}"] = run.get("status", "") + (" (OUT OF MEMORY: does not fit)" if run.get("oom") else "")
# The headline loop figures: ZeRO-1 at 8B, the preset's stage (the Kimi run that is not ZeRO-1) at Kimi.
kimi_stage = next((r.get("zero_stage") for r in loop.get("runs", [])
                   if r["shape"] == sk and r.get("zero_stage") not in (1, "1") and not r.get("overrides")), None)
s["train_mfu_loop_8b"] = s.get(f"train_mfu_loop_{s8}_zero1")
s["train_mfu_loop_kimi"] = s.get(f"train_mfu_loop_{sk}_zero{kimi_stage}")
s["train_kimi_loop_fits"] = (None if f"train_status_loop_{sk}_zero{kimi_stage}" not in s
                             else "OUT OF MEMORY" not in s[f"train_status_loop_{sk}_zero{kimi_stage}"])
s["train_kimi_preset_zero_stage"] = kimi_stage
s["parts"] = parts
tmp = out.with_suffix(".tmp")
tmp.write_text(json.dumps(s, indent=2))
tmp.replace(out)
EOF
}

if [ "$DEVICE" = cpu ]; then
  BARE_8B=(--device cpu --preset smollm2 --seq 128 --vocab 4096 --draft-vocab 512 --steps 2 --warmup 1)
  BARE_KIMI=(--device cpu --preset smollm2 --hidden 256 --heads 4 --kv-heads 2 --seq 128 --vocab 8192
             --draft-vocab 512 --steps 2 --warmup 1)
  LOOP=(--device cpu --runs tiny:1,tiny:2 --seq 128 --samples 4 --steps 3 --warmup-steps 1 --log-every 1
        --draft-vocab 256 --store "$WORK")
  BARE_CAP=300; LOOP_CAP=900; DS_CAP=300
else
  BARE_8B=(--preset llama3-8b --steps 10 --warmup 3)
  BARE_KIMI=(--preset kimi-k2.5 --steps 8 --warmup 3)
  LOOP=(--runs "$LOOP_RUNS" --steps 30 --warmup-steps 10 --log-every 5 --samples 4 --min-run-s 75)
  BARE_CAP=${BARE_CAP:-60}; LOOP_CAP=400; DS_CAP=60
fi

say "device $DEVICE, budget ${BUDGET_S}s, peak ${PEAK_TFLOPS} TFLOP/s; work dir $WORK"
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv >> "$LOG" 2>&1

phase bare_8b 30 "$BARE_CAP" "$PY" benchmarks/train_step.py "${BARE_8B[@]}" --peak-tflops "$PEAK_TFLOPS" \
  --sync-check --breakdown 3 ${BARE_EXTRA:-} --json "$WORK/bare_8b.json"
phase bare_kimi 30 "$BARE_CAP" "$PY" benchmarks/train_step.py "${BARE_KIMI[@]}" --peak-tflops "$PEAK_TFLOPS" \
  --sync-check --breakdown 3 ${BARE_EXTRA:-} --json "$WORK/bare_kimi.json"
# The loop's budget is the script's; DeepSpeed's engine without Ray gets what is left after it.
L=$(left)
phase loop 60 "$LOOP_CAP" "$PY" benchmarks/train_loop.py "${LOOP[@]}" --peak-tflops "$PEAK_TFLOPS" \
  --budget-s $(( L - 10 > 60 ? L - 10 : 60 )) --run-cap-s 130 --json "$WORK/loop.json"
phase ds_8b_zero1 40 "$DS_CAP" "$PY" benchmarks/train_step.py "${BARE_8B[@]}" --engine deepspeed --zero-stage 1 \
  --peak-tflops "$PEAK_TFLOPS" --sync-check --breakdown 3 ${DS_EXTRA:-} --json "$WORK/ds_8b_zero1.json"
phase ds_kimi_zero2 40 "$DS_CAP" "$PY" benchmarks/train_step.py "${BARE_KIMI[@]}" --engine deepspeed --zero-stage 2 \
  --peak-tflops "$PEAK_TFLOPS" --sync-check --breakdown 3 ${DS_EXTRA:-} --json "$WORK/ds_kimi_zero2.json"

summarize
say "done; summary in $OUT/train_mfu.json"
"$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); s.pop('parts'); print(json.dumps(s, indent=1))" \
  "$OUT/train_mfu.json" | tee -a "$LOG"
rm -rf "$WORK"
