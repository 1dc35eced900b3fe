#!/usr/bin/env bash
# The product on one H200: `eagle3-ray run -c configs/smollm2-h200.yaml` on the project's training
# prompt set, within one device call of at most 10 minutes; the same command in the next call,
# issued at once (the machine keeps /tmp while it stays warm), resumes where the first one stopped
# (stage markers, training checkpoint), so the run spans calls.
#
#   carry [".gq"] (train_prompts.jsonl from benchmarks/train_prompts.py, mt_bench.jsonl from
#   ../shared/data); the GGUF at /tmp/SmolLM2-135M-Instruct.Q4_1.gguf; PYTHONPATH holds Ray,
#   DeepSpeed, pydantic and gguf (.whl) and the repository.
#   BUDGET=<seconds this call may run the pipeline> bash benchmarks/device/product_run.sh
#   EXTRA="$(cat benchmarks/device/overrides/product4.txt)" adds overrides (one word each, no spaces): the
#   next run's, with the target's own requests (the third run's differ only in its generate options).
#   DATA=<prompts.jsonl> replaces the training prompt set (default .gq/train_prompts.jsonl); the sixth
#   run's: DATA=.gq/train_prompts_g2k.jsonl EXTRA="$(cat benchmarks/device/overrides/product6.txt)".
#
# The generate stage's output (the conversations: minutes of device time) also comes back, once, as
# generate.tgz.part-* (under the 16-MiB limit on a returned file). On a fresh machine (the last one went
# back between calls, or a later session) put those parts under .gen/ (carried; or /tmp/gen, copied by an
# earlier call: `source benchmarks/device/session.sh gen`) and the run starts past generate: its
# marker's hash matches when the config and --data are the same, under any RUN (a stage's recorded
# output is found in the out dir where it is now). The eighth run restored the seventh's that way, its
# archive split in two so that each half rode with a payload of its own (gg1, base):
#   DATA=.gq/train_prompts_mt.jsonl EXTRA="$(cat benchmarks/device/overrides/product8.txt)" ...
set -uo pipefail
: "${BUDGET:=480}" "${RUN:=/tmp/product}" "${OUT:=/tmp/product-out}" "${DATA:=.gq/train_prompts.jsonl}"
mkdir -p "$RUN" "$OUT"
restore_generate() {  # <dir with generate.tgz.part-*>: unpack into $RUN/out unless a generate stage is there
  local parts=("$1"/generate.tgz.part-*)
  [ -e "${parts[0]}" ] && [ ! -f "$RUN/out/generate/_DONE.json" ] || return 0
  mkdir -p "$RUN/out" && cat "${parts[@]}" | tar -xz -C "$RUN/out" && touch "$RUN/.generate-returned" &&
    echo "restored the generate stage from $1 ($(wc -l < "$RUN/out/generate/conversations.jsonl") conversations)"
}
return_generate() {  # a finished generate stage, once per run: $OUT/generate.tgz.part-*
  [ -f "$RUN/out/generate/_DONE.json" ] && [ ! -f "$RUN/.generate-returned" ] || return 0
  tar -czf - -C "$RUN/out" --exclude='*.part-*' generate | split -b 15000000 - "$OUT/generate.tgz.part-" &&
    touch "$RUN/.generate-returned"
}
for d in .gen /tmp/gen; do restore_generate "$d"; done
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE=/tmp/e3cache RAY_DATA_DISABLE_PROGRESS_BARS=1
call=$(( $(ls "$RUN"/call-*.log 2>/dev/null | wc -l) + 1 ))
log="$RUN/call-$call.log"
t0=$(date +%s)
# SIGINT first (the CLI stops its stages and Ray), SIGKILL 30 s later if it has not.
timeout -k 30 -s INT "$BUDGET" python3 -m eagle3_ray.cli run -c configs/smollm2-h200.yaml \
  --data "$DATA" --out "$RUN/out" \
  target.model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf bench.prompts=.gq/mt_bench.jsonl \
  ${EXTRA:-} 2>&1 | tee "$log" | grep -v "^\[self-distill\]\|Running\|^- \|^Running Dataset" | tail -n 400
rc=${PIPESTATUS[0]}
echo "call $call: rc $rc after $(( $(date +%s) - t0 )) s"
# One archive back (at most 8 files return): logs, stage markers, reports, metrics; no features.
(cd "$RUN" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.md' -o -name '*.yaml' \) \
   -size -8M ! -name 'conversations*' ! -path '*/features/*' ! -path '*/generate/*' -print | tar -czf "$OUT/product.tgz" -T -)
# The exported drafter too (tens of MB for SmolLM2), so that it can be benchmarked after the machine is gone;
# in parts under the 16-MiB limit on a returned file (a whole 23-MB archive stayed behind once):
#   cat drafter.tgz.part-* | tar -xz
[ -d "$RUN/out/drafter" ] && tar -czf - -C "$RUN/out" drafter | split -b 15000000 - "$OUT/drafter.tgz.part-"
return_generate
ls -la "$OUT"
exit 0
