#!/usr/bin/env bash
# One call of the 2-GPU quality sequence on the lent H200 machine (see benchmarks/results/README.md,
# quality_smollm2_67k_*). Run from the repository root, calls back to back on one warm machine
# (its /tmp carries the GGUF, the answers and the drafters between calls).
# Needs /tmp/part-aa (a previous call: cp .gg/part-aa /tmp/part-aa); carry [".gg/part-ab", ".gq"].
cat /tmp/part-aa .gg/part-ab > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gq/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
for K in 0 1; do
  CUDA_VISIBLE_DEVICES=$K python3 benchmarks/quality_smollm2.py --gguf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
    --prompts .gq/train_prompts.jsonl --eval-dir .gq/eval --out $OUT/quality_distill_$K.json --work /tmp/q$K \
    --phase distill --deadline 345 --num-prompts 20000 --shard $K/2 --synthetic-prompts 14000 --synthetic-seconds 55 \
    --gen-batch 512 --distill-seconds 300 --samples-per-prompt 2 > $OUT/quality_distill_$K.log 2>&1 &
done
wait
cat /tmp/q0/distilled.jsonl /tmp/q1/distilled.jsonl > /tmp/d.jsonl
cat /tmp/q0/distilled_sampled.jsonl /tmp/q1/distilled_sampled.jsonl > /tmp/s.jsonl
for K in 0 1; do ln -sf /tmp/d.jsonl /tmp/q$K/distilled.jsonl; ln -sf /tmp/s.jsonl /tmp/q$K/distilled_sampled.jsonl; done
wc -l /tmp/d.jsonl /tmp/s.jsonl; ls -la /tmp/q0 /tmp/q1; grep -v "^\[self-distill\]" $OUT/quality_distill_*.log | tail -20
