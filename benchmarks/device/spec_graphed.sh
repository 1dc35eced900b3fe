#!/usr/bin/env bash
# Speculative decoding on the H200 against the project's CUDA-graphed plain decoding: drafter
# CUDA-graphed vs eager, chain(3) and tree, MT-bench turns, bf16, with the divergence audit
# (benchmarks/device/spec_graphed.py drives the product's BenchActor). Run from the repository root,
# after `source benchmarks/device/session.sh env` (PYTHONPATH set):
#
#   DRAFTER=<exported drafter dir> TARGET=<HF dir of SmolLM2-135M-Instruct> MTBENCH=<mt_bench.jsonl> \
#       bash benchmarks/device/spec_graphed.sh
#
# DRAFTER unset: a seeded random drafter is exported on the fly (launch overhead only, tau ~ 1).
# TARGET unset: the SmolLM2 GGUF at /tmp/SmolLM2-135M-Instruct.Q4_1.gguf (converted by the product).
# SGLANG_PLAIN_TPS: SGLang's plain tokens/s on the same turns, for spec_vs_sglang_plain (else null).
# MAX_PROMPTS (8 = one per category, 16 turns), MAX_NEW_TOKENS (128), DEADLINE (seconds after start
# when no new category starts; 170), EXTRA (more arguments). TINY=1: the CPU smoke run, no GPU.
# Writes $OUT/spec_h200.json (after every category), $OUT/spec_h200.log, $OUT/report/ (4 files).
# VERIFY_SWEEP=1: only the verify cost by storage capacity and attention span (~30 s; no DRAFTER or
# MTBENCH needed): $OUT/verify_sweep.json and a table in $OUT/spec_h200.log.
set -uo pipefail
OUT=${OUT:?set OUT to the results directory}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${VERIFY_SWEEP:-0}" = 1 ]; then
    if [ "${TINY:-0}" = 1 ]; then sweep=(--tiny); else sweep=(--target "${TARGET:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}"); fi
    python3 benchmarks/device/spec_graphed.py --verify-sweep "${sweep[@]}" --out "$OUT" ${EXTRA:-} 2>&1 | tee "$OUT/spec_h200.log"
    exit "${PIPESTATUS[0]}"
fi
args=(--out "$OUT" --max-prompts "${MAX_PROMPTS:-8}" --max-new-tokens "${MAX_NEW_TOKENS:-128}")
if [ "${TINY:-0}" = 1 ]; then
    args+=(--tiny --deadline "${DEADLINE:-100000}")
else
    args+=(--target "${TARGET:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}" --mtbench "${MTBENCH:?set MTBENCH to mt_bench.jsonl}"
           --device cuda --dtype bfloat16 --deadline "${DEADLINE:-170}")
fi
[ -n "${DRAFTER:-}" ] && args+=(--drafter "$DRAFTER")
[ -n "${SGLANG_PLAIN_TPS:-}" ] && args+=(--sglang-plain-tps "$SGLANG_PLAIN_TPS")
[ "${TINY:-0}" != 1 ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | tee "$OUT/spec_h200.log"
python3 benchmarks/device/spec_graphed.py "${args[@]}" ${EXTRA:-} 2>&1 | tee -a "$OUT/spec_h200.log"
exit "${PIPESTATUS[0]}"
