#!/usr/bin/env bash
# One call of the 2-GPU quality sequence on the lent H200 machine (see benchmarks/results/README.md,
# quality_smollm2_67k_*). Run from the repository root, calls back to back on one warm machine
# (its /tmp carries the GGUF, the answers and the drafters between calls).
# carry [".gq"]; after quality_2gpu_distill.sh.
export PYTHONPATH=/tmp/site:$PWD
ls /tmp/q0 /tmp/q1 /tmp/site >/dev/null || exit 1
common="--gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf --prompts .gq/train_prompts.jsonl --eval-dir .gq/eval --phase train
 --deadline 570 --num-prompts 20000 --distill-seconds 0 --synthetic-prompts 0 --feature-memory 0.5 --train-seconds 480
 --row-tokens 2048 --attention sdpa"
mkdir -p /tmp/q0/out /tmp/q1/out
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/quality_smollm2.py $common --out /tmp/q0/out/quality_train.json --work /tmp/q0 \
  --lr 5e-4 --warmup 50 > $OUT/quality_train_0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 benchmarks/quality_smollm2.py $common --out /tmp/q1/out/quality_train.json --work /tmp/q1 \
  --lr 1e-3 --warmup 100 > $OUT/quality_train_1.log 2>&1 &
wait
cp /tmp/q0/out/quality_train.json $OUT/quality_train_0.json; cp /tmp/q1/out/quality_train.json $OUT/quality_train_1.json
grep -v "^\[self-distill\]" $OUT/quality_train_*.log | tail -30
