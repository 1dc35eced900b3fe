#!/usr/bin/env bash
# Does the drafter pay where users serve it? SGLang's EAGLE-3 decoding against SGLang's plain decoding,
# both CUDA-graphed, through the product (`eagle3-ray bench bench.engine=sglang`), on one GPU.
# Each step is one device call, issued back to back (the machine keeps /tmp while warm), after the
# payload steps of session.sh (gg1, gg2, base; sgl1, sgl2, sgl3). Results go to $OUT.
#
#   source benchmarks/device/session.sh env && STEP=<step> BUDGET=<s> bash benchmarks/device/serving.sh
#
# Steps:
#   train    the preset's pipeline to its export (HF engine), trimmed to one call: one answer per prompt
#            and 3,000 requests of the target's own, 3 epochs (the preset: two answers, 12,000 requests,
#            5 epochs, three calls). Resumes like product_run.sh; the drafter comes back as drafter.tgz.part-*.
#   bench    the SGLang bench of that drafter: MT-bench all 80 questions, both turns, 1024 new tokens,
#            plain / chain(3) / the preset's tree at concurrency 1, 8 and 32. BENCH_EXTRA adds overrides
#            (one word each), e.g. bench.cuda_graphs=false to see whether a silent EAGLE-3 engine is the graphs'.
#   compare  bench.engine=both on 16 MT-bench questions (2 per category), chain(3), concurrency 1: SGLang's
#            tau against the project's own HF decoder on the same prompts (COMPARE_PROMPTS=8: 1 per category).
#   cycle    where the cycle goes (sglang_cycle.py): the Llama-3.1-8B shape with dummy weights, then SmolLM2.
#            Three engine starts at 8B outlast one call: CYCLE_8B_ARGS="--modes chain --max-new-tokens 128" fits
#            (on 2026-12-07 the full step printed nothing in 200 s). CYCLE_PARTS=smollm2 runs the SmolLM2 part alone:
#            BUDGET=250 on a fresh H100 (2026-12-07) got through plain (its engine up in 85 s, cold) and chain, not
#            tree, and cycle.json is written at the end only: BUDGET=420, or CYCLE_SMOLLM2_ARGS="--modes chain".
#   generate self-distillation of the same 3,000 training prompts by the HF generator and by SGLang (the
#            stage's engine, and SGLang's default graph bound as before; GEN_ENGINES picks some of hf sglang sglang-256
#            sglang-noprefill).
#            GEN_PROMPTS (default 3000) sets how many.
set -uo pipefail
: "${STEP:?STEP=train|bench|compare|cycle|generate}" "${BUDGET:=540}" "${RUN:=/tmp/serving}" "${OUT:=/tmp/serving-out}"
mkdir -p "$RUN" "$OUT"
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE=/tmp/e3cache RAY_DATA_DISABLE_PROGRESS_BARS=1
GGUF=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
SG='target.sglang.extra_engine_kwargs={attention_backend: triton, sampling_backend: pytorch, grammar_backend: none, log_level: info}'
MT='bench.prompts=[{"path":".gq/mt_bench.jsonl","max_prompts":80}]'
t0=$(date +%s)
cli() { timeout -k 30 -s INT "$BUDGET" python3 -m eagle3_ray.cli "$@"; }
case "$STEP" in
  train)
    DATA=.gq/train_prompts_mt.jsonl RUN=$RUN/train BUDGET=$BUDGET OUT=$OUT \
      EXTRA='generate.samples_per_prompt=1 generate.synthetic_prompts=3000 extract.compact=fp8 train.epochs=3 train.eval_every=400 train.val_groups={"mt_bench":"mtbench-[0-9]+","gsm8k":"gsm8k-.*","synthetic":"synthetic:.*","chat":".*"} train.eval_only=["mt_bench"] --stop-after export' \
      bash benchmarks/device/product_run.sh ;;
  bench)
    # a drafter from an earlier machine: carry .drafter/ (git-ignored) holding the train step's drafter.tgz*
    [ -d "$RUN/train/out/drafter" ] || { mkdir -p "$RUN/train/out" && cat .drafter/drafter.tgz* | tar -xz -C "$RUN/train/out"; }
    cli bench -c configs/smollm2-h200.yaml --drafter "$RUN/train/out/drafter" --out "$RUN/bench" \
      target.model=$GGUF bench.engine=sglang bench.max_new_tokens=1024 "$MT" "$SG" ${BENCH_EXTRA:-} 2>&1 | tee "$RUN/bench.log"
    cp "$RUN/bench/results.json" "$OUT/sglang_bench.json"; cp "$RUN/bench/report.md" "$OUT/sglang_bench_report.md"
    cp "$RUN/bench.log" "$OUT/sglang_bench.log" ;;
  compare)
    cli bench -c configs/smollm2-h200.yaml --drafter "$RUN/train/out/drafter" --out "$RUN/compare" \
      target.model=$GGUF bench.engine=both bench.modes=[chain] bench.concurrency=[1] bench.untrained=false \
      bench.max_new_tokens=1024 'bench.prompts=[{"path":".gq/mt_bench.jsonl","max_prompts":'"${COMPARE_PROMPTS:-16}"'}]' "$SG" 2>&1 | tee "$RUN/compare.log"
    cp "$RUN/compare/results.json" "$OUT/sglang_compare.json"; cp "$RUN/compare/report.md" "$OUT/sglang_compare_report.md" ;;
  cycle)
    # SGLang builds a random:<dir> target with dummy weights from the dir's config.json (no tokenizer:
    # the engine takes token ids; single-turn prompts, since no history is decoded from its tokens)
    # CYCLE_PARTS picks some of: 8b smollm2 (the SmolLM2 part: serving1's drafter, trained, chain and tree)
    if [[ " ${CYCLE_PARTS:-8b smollm2} " == *" 8b "* ]]; then
      mkdir -p /tmp/l8b && cp eagle3_ray/resources/llama3.1-8b-shape.json /tmp/l8b/config.json
      timeout -k 30 -s INT "$BUDGET" python3 benchmarks/device/sglang_cycle.py --target random:/tmp/l8b \
        --prompts .gq/gsm8k_test.jsonl --max-prompts 8 ${CYCLE_8B_ARGS:-} --out "$RUN/cycle_8b" 2>&1 | grep "\[cycle\]\|\[bench\]\|Error\|error"
      cp "$RUN/cycle_8b/cycle.json" "$OUT/sglang_cycle_8b.json" ||
        cp "$RUN/cycle_8b/cycle_partial.json" "$OUT/sglang_cycle_8b_partial.json"
    fi
    if [[ " ${CYCLE_PARTS:-8b smollm2} " == *" smollm2 "* ]]; then
      [ -d "$RUN/train/out/drafter" ] || { mkdir -p "$RUN/train/out" && cat .drafter/drafter.tgz* | tar -xz -C "$RUN/train/out"; }
      timeout -k 30 -s INT $(( BUDGET - ($(date +%s) - t0) )) python3 benchmarks/device/sglang_cycle.py \
        --target $GGUF --drafter "$RUN/train/out/drafter" ${CYCLE_SMOLLM2_ARGS:-} --out "$RUN/cycle_smollm2" 2>&1 |
        grep "\[cycle\]\|\[bench\]\|Error\|error"
      cp "$RUN/cycle_smollm2/cycle.json" "$OUT/sglang_cycle_smollm2.json" ||
        cp "$RUN/cycle_smollm2/cycle_partial.json" "$OUT/sglang_cycle_smollm2_partial.json"
    fi ;;
  generate)
    # sglang: the generate stage's engine (graphs up to generate.batch_size, that many requests running);
    # sglang-256: as before 2026-12-07, SGLang's own graph bound (256 on an H100/H200) and no cap on the
    # running requests (4 calls of 512 queued); sglang-noprefill: the stage's engine without prefill CUDA
    # graphs (their capture is most of an engine's start on a new machine: 52 s of 80 on 2026-12-07)
    SG256="${SG%\}}, cuda_graph_max_bs_decode: 256}"  # $SG and that one key: the A/B differs in it alone
    SGNP="${SG%\}}, cuda_graph_backend_prefill: disabled}"
    for engine in ${GEN_ENGINES:-hf sglang sglang-256}; do
      extra=()
      case $engine in
        sglang) extra=(target.backend=sglang "$SG") ;;
        sglang-256) extra=(target.backend=sglang "$SG256") ;;
        sglang-noprefill) extra=(target.backend=sglang "$SGNP") ;;
      esac
      /usr/bin/time -f "[generate] $engine wall %e s" timeout -k 30 -s INT $(( (BUDGET - ($(date +%s) - t0)) / 3 )) \
        python3 -m eagle3_ray.cli generate -c configs/smollm2-h200.yaml --data .gq/train_prompts_mt.jsonl \
        --out "$RUN/gen-$engine" target.model=$GGUF data.max_samples=${GEN_PROMPTS:-3000} generate.samples_per_prompt=1 \
        generate.synthetic_prompts=0 "${extra[@]}" 2>&1 | tee "$RUN/gen-$engine.log" | grep -v "^\[self-distill\]\|Running" | tail -n 5
      # the engine's start, phase by phase (SGLang's info lines), and the stage's progress
      grep -a "Init torch\|Load weight\|KV Cache\|CUDA graph\|server_args\|self-distill\|\[generate\]" "$RUN/gen-$engine.log" |
        cut -c1-300 > "$OUT/generate_$engine.log"
    done
    for engine in ${GEN_ENGINES:-hf sglang sglang-256}; do cp "$RUN/gen-$engine/summary.json" "$OUT/generate_$engine.json"; done ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
echo "step $STEP: $(( $(date +%s) - t0 )) s"
