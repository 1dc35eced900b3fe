#!/usr/bin/env bash
# The capture audit on one lent GPU (issue 61), after `source benchmarks/device/session.sh env` on a machine
# that ran gg1/gg2 (the GGUF) and, for the SGLang part, sgl1-3:
#   PART=hf      the real SmolLM2 through the HF engine on the GPU: healthy figures and every fault
#   PART=sglang  the same target through SGLang 0.5.17: healthy figures, then FAULTS=1 each fault of
#                tests/sglang_audit_faults.py in an engine of its own (a few minutes more)
#   PART=cost    the audit's cost against the capture at the 8B shape (a random-weight Llama-3.1-8B) and its
#                lm_head math at the Kimi-K2.5 shape (one TP rank's vocab slice of 8, and the whole vocab)
# MEM_FRACTION: the SGLang engine's share of the GPU (beside other work). Results: $OUT/capture_audit_*.json
set -uo pipefail
: "${PART:?PART=hf|sglang|cost}" "${OUT:=/tmp/out}" "${MEM_FRACTION:=0.3}"
GGUF=${GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}
tgt() { python3 -c "from pathlib import Path; from eagle3_ray.engines.targets import gguf_to_hf_dir
print(gguf_to_hf_dir(Path('$GGUF')))"; }
case "$PART" in
  hf) python3 benchmarks/capture_audit.py --target "$(tgt)" --device cuda --faults --prompts 32 --max-new-tokens 128 \
        --out "$OUT/capture_audit_smollm2_hf_gpu.json" ;;
  sglang) python3 benchmarks/capture_audit.py --target "$(tgt)" --backend sglang --device cuda --prompts 32 \
        --max-new-tokens 128 --mem-fraction "$MEM_FRACTION" ${FAULTS:+--faults} \
        --sglang-kwargs '{"attention_backend": "triton", "sampling_backend": "pytorch", "grammar_backend": "none"}' \
        --out "$OUT/capture_audit_smollm2_sglang_gpu.json" ;;
  cost) python3 benchmarks/capture_audit.py --target random:builtin:llama3.1-8b-shape --device cuda --sets none \
        --cost 0.1,0.25,1 --cost-seqs 8x2048 --batch-tokens 16384 --shape 4096,128256,1 --shape 7168,163840,8 \
        --shape 7168,163840,1 --out "$OUT/capture_audit_cost_gpu.json" ;;
  *) echo "unknown PART $PART" >&2; exit 2 ;;
esac
