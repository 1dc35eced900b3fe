#!/usr/bin/env bash
# The long-sample wall on one GPU (issue 49, items 1-3), torch and pydantic (session.sh wm or base):
#   1. one TTT step (7 steps, the Triton loss) against sample length, 2K doubling until out of memory, at the
#      Llama-3.1-8B and Kimi-K2.5 drafter shapes, without and with the memory options
#      (train.loss_chunk_tokens=4096, train.recompute_ttt_steps): benchmarks/train_step.py --sweep;
#   2. the memory of the heaviest rank of a 2-worker context-parallel group on a 128K-token sample at the
#      Kimi shape (benchmarks/cp_memory.py), and 4 workers;
#   3. flash attention's varlen kernel under context parallelism (tests/test_context_parallel.py, CUDA test).
#
#   source benchmarks/device/session.sh wm && OUT=<dir> PEAK=785 bash benchmarks/device/long_train.sh   # ~5 min, H100
# PARTS (default all) picks some, so that each can ride along a payload call of session.sh:
#   PARTS="8b kimi" ...; PARTS="8b_options kimi_options" ...; PARTS="cp flash" ...; PARTS="8b_chunk kimi_k3" (partial),
#   PARTS="8b_2k kimi_2k" (the bare 2K reference on this card)
# Writes $OUT/wall_<shape>[_options].json, $OUT/cp_memory.json, $OUT/long_train.log.
set -uo pipefail
: "${OUT:?set OUT}" "${PEAK:=785}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
log="$OUT/long_train.log"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$log"
PARTS=" ${PARTS:-8b kimi 8b_options kimi_options cp flash} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
sweep() {  # <preset> <tag> <max length> [options...]
  local preset=$1 tag=$2 max=$3; shift 3
  want "$tag" || return 0
  timeout "${SWEEP_S:-110}" python3 benchmarks/train_step.py --preset "$preset" --peak-tflops "$PEAK" --sweep --steps 2 --warmup 1 \
    --max-length "$max" --json "$OUT/wall_$tag.json" "$@" 2>&1 | grep -v "^\s*$" | tail -n 12 | tee -a "$log"
}
# the most wanted first: a call cut at its limit keeps what $OUT already holds
sweep llama3-8b 8b 65536
sweep kimi-k2.5 kimi 65536
sweep llama3-8b 8b_options 131072 --loss-chunk-tokens 4096 --recompute-ttt-steps
sweep kimi-k2.5 kimi_options 131072 --loss-chunk-tokens 4096 --recompute-ttt-steps
# partial options (not in the default PARTS): the loss chunks alone at 8B, the first 3 of 7 steps recomputed at Kimi
sweep llama3-8b 8b_chunk 65536 --loss-chunk-tokens 4096
sweep kimi-k2.5 kimi_k3 65536 --loss-chunk-tokens 4096 --recompute-ttt-steps 3
# the bare 2K step alone: the MFU reference when the partial options run on another card than the full sweep
sweep llama3-8b 8b_2k 2048
sweep kimi-k2.5 kimi_2k 2048
want cp && timeout 100 python3 benchmarks/cp_memory.py --tokens 131072 --sizes 2,4 --out "$OUT/cp_memory.json" 2>&1 | tee -a "$log"
want flash && timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py -k flash_varlen 2>&1 | tail -n 3 | tee -a "$log"
