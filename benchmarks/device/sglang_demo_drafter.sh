#!/usr/bin/env bash
# Trains the demo drafter on the H200 through the product pipeline (HF backend, Ray + DeepSpeed from
# .whl, installed by sglang_setup.sh) on the converted SmolLM2 (/tmp/smollm2), and exports it in
# SGLang's layout to /tmp/demo/drafter, for sglang_h200.py's spec step. Usage: after sglang_setup.sh,
#   bash benchmarks/device/sglang_demo_drafter.sh $OUT
set -euo pipefail
out=${1:?results dir}
python3 -m eagle3_ray.cli run -c configs/demo-smollm2.yaml --out /tmp/demo --stop-after export \
  target.model=/tmp/smollm2 extract.num_gpus_per_actor=1 train.use_gpu=true ray.num_cpus=16 \
  generate.batch_size=128 "${@:2}" 2>&1 | tail -n 40 | tee "$out/sglang_demo_drafter.log"
ls -la /tmp/demo/drafter | tee -a "$out/sglang_demo_drafter.log"
