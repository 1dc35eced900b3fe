#!/usr/bin/env bash
# The product's bench stage alone on one H200 (`eagle3-ray bench`), over a drafter that a product run
# exported and sent back (drafter.tgz.part-*, product_run.sh), on the sets the product runs bench:
# MT-bench's 80 questions, GSM8K test 15, HumanEval 15, Spec-Bench 20, 128 new tokens.
#
#   After `source benchmarks/device/session.sh env` (the base, gg1, gg2 steps done: packages, the
#   GGUF, /tmp/gq), in a copy of the repository at the commit to measure:
#   TAG=<name> DRAFTER=<dir with drafter.tgz.part-*> OUT=$OUT bash benchmarks/device/bench_drafter.sh [SETS]
#   SETS: all (default) or mt_bench (MT-bench's 80 questions only). Results: $OUT/$TAG/{results.json,report.md,bench.log}
#   MAX_NEW=<new tokens per turn> (default 128), MT_MAX=<MT-bench questions, taken round-robin over its
#   categories> (default 80), BUDGET=<seconds> (default 540: SIGINT then; the categories measured by then
#   come back under $OUT/$TAG/partial/).
set -uo pipefail
: "${TAG:=bench}" "${DRAFTER:=.drafter5}" "${OUT:=/tmp/bench-out}" "${MAX_NEW:=128}" "${MT_MAX:=80}" "${BUDGET:=540}"
sets=${1:-all}
mt="{\"path\":\".gq/mt_bench.jsonl\",\"max_prompts\":$MT_MAX}"
if [ "$sets" = all ]; then
  prompts="[$mt,{\"path\":\".gq/gsm8k_test.jsonl\",\"max_prompts\":15},{\"path\":\".gq/humaneval.jsonl\",\"max_prompts\":15},{\"path\":\".gq/spec_bench.jsonl\",\"name\":\"spec_bench\",\"max_prompts\":20}]"
else
  prompts="[$mt]"
fi
[ -d .gq ] || cp -r /tmp/gq .gq
mkdir -p /tmp/bench-drafter "$OUT/$TAG"
[ -d /tmp/bench-drafter/drafter ] || cat "$DRAFTER"/drafter.tgz.part-* | tar -xz -C /tmp/bench-drafter
export PYTHONUNBUFFERED=1 RAY_DATA_DISABLE_PROGRESS_BARS=1
t0=$(date +%s)
timeout -k 20 -s INT "$BUDGET" python3 -m eagle3_ray.cli bench -c configs/smollm2-h200.yaml --out "/tmp/bench-$TAG" \
  --drafter /tmp/bench-drafter/drafter target.model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bench.untrained=false \
  bench.max_new_tokens="$MAX_NEW" "bench.prompts=$prompts" > "$OUT/$TAG/bench.log" 2>&1
rc=$?
echo "[$TAG] rc $rc after $(( $(date +%s) - t0 )) s"
cp "/tmp/bench-$TAG/results.json" "/tmp/bench-$TAG/report.md" "$OUT/$TAG/" 2>/dev/null
[ -d "/tmp/bench-$TAG/partial" ] && cp -r "/tmp/bench-$TAG/partial" "$OUT/$TAG/"
grep -v "clean_up_tokenization\|^Running\|Token authentication" "$OUT/$TAG/bench.log" | tail -n 15
exit 0
