#!/usr/bin/env bash
# One call of the 2-GPU quality sequence on the lent H200 machine (see benchmarks/results/README.md,
# quality_smollm2_67k_*). Run from the repository root, calls back to back on one warm machine
# (its /tmp carries the GGUF, the answers and the drafters between calls).
# carry [".gq"]; after quality_2gpu_train.sh.
export PYTHONPATH=/tmp/site:$PWD
ls /tmp/q0/ckpt /tmp/q1/ckpt >/dev/null || exit 1
common="--gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --prompts .gq/train_prompts.jsonl --eval-dir .gq/eval --phase eval
 --deadline 340 --per-set 40 --max-turns 2 --eager-turns 0 --baseline-turns 6 --mt-share 0.5 --eval-seconds 300"
for K in 0 1; do
  CUDA_VISIBLE_DEVICES=$K python3 benchmarks/quality_smollm2.py $common --out $OUT/quality_eval_$K.json --work /tmp/q$K \
    > $OUT/quality_eval_$K.log 2>&1 &
done
wait
tail -n 8 $OUT/quality_eval_*.log
