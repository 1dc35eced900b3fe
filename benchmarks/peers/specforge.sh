#!/usr/bin/env bash
# eagle3-ray and SpecForge 0.2.0 side by side on one GPU (issue 59): the same target (SmolLM2-135M-Instruct),
# the same self-distilled conversations, the same captured features, the same epochs; then both drafters'
# tau in SGLang on the same MT-bench turns. Steps (STEP=...), each resumable (a finished part leaves a
# marker under $RUN and is skipped when run again):
#   install   .sf (benchmarks/peers/make-specforge-wheelhouse.sh) -> /tmp/sf
#   start     copies the repository to $RUN/repo and runs `chain` there in a session of its own (setsid), so
#             that it goes on across device calls; its log: $RUN/chain.log
#   chain     data: N prompts of .gq/train_prompts.jsonl answered once by the target (the generate stage),
#               MT-bench's 80 questions answered at 1024 new tokens (the fixed history of the tau benches)
#             ours1: `eagle3-ray run` on those conversations, the preset's recipe, 1 epoch (fp8 store)
#             bf16: the same prepared samples captured again in bf16 (what SpecForge's trainer reads)
#             ours3: `eagle3-ray train` 3 epochs on the fp8 store, then export
#             sfin: SpecForge's trainer inputs from the bf16 store (specforge_inputs.py; its own capture
#               needs SGLang 0.5.14 internals, docs in that script)
#             sf-aligned-1ep: `specforge train` (its offline example's recipe; draft vocabulary 16,384 as ours)
#               alone on the GPU, timed, GPU memory sampled; `specforge export --to sglang`
#             then, at once (speeds not figures): sf-aligned-3ep and sf-default-1ep (its 32,000 vocabulary)
#             SF_AT_ONCE="aligned-1ep:1:16384 default-1ep:1": those SpecForge runs at once, beside ours3 and `recipe`
#             (tau, not speeds); TAU_IN_CHAIN=1: `tau` of ours (recipe variants included) while SpecForge
#             trains, then of SpecForge's drafters and the summary of all (tau skips what it measured)
#             OURS_EXTRA: overrides of every eagle3-ray training here (the runs before 2026-12-08 used the preset's
#               former packs: OURS_EXTRA="train.batch_tokens=16384 train.eval_every=400 train.checkpoint_every=200
#               train.log_every=50")
#             NO_SF=1: no SpecForge this run (its figures from an earlier one): ours1, ours3 (unless SKIP), the
#               recipe variants, BEST3, and with TAU_IN_CHAIN the SGLang tau of TAU_WHILE's drafters
#             FROM_RECORD=1: data is the record's committed conversations and fixed history (no generation)
#   tau       SGLang tau of every drafter exported so far (sglang_tau.py), chain and tree; TAU_RECIPE=1 TAU_OUT=tau-recipe:
#             the recipe variants' drafters beside SpecForge's 1-epoch one
#   recipe    one epoch of ours per recipe variant (VARIANTS) on ours1's store: why SpecForge won at 1 epoch
#   wait      until $RUN/$WAIT_FOR exists or BUDGET seconds pass; prints the chain log's tail
#   collect   results -> $OUT (one archive: logs, markers, metrics, inputs.json, tau.json, SpecForge's events)
# Environment: `source benchmarks/device/session.sh env` first (PYTHONPATH, the GGUF).
#   STEP=start N=4000 bash benchmarks/peers/specforge.sh
# The second run (tau of the adopted recipe, chain and tree, in one chain; MEM_FRACTION per SGLang engine):
#   STEP=start FROM_RECORD=1 SF_AT_ONCE="aligned-1ep:1:16384" TAU_IN_CHAIN=1 MODES_AT_ONCE=1 MEM_FRACTION=0.05 \
#     VARIANTS="steps100:train.warmup_steps=100,train.warmup_ratio=null" BUDGET=420 \
#   (record specforge_recipe_h200). SGLang sizes its KV pool as total x MEM_FRACTION less what the GPU already
#   holds, so engines that start beside others (or beside training) need a fraction above the others' share:
#   0.05 failed there for one drafter's engines; alone, 0.12 and three engines at once worked (the first run).
#     bash benchmarks/peers/specforge.sh
set -uo pipefail
: "${STEP:?STEP=install|start|chain|recipe|tau|wait|collect}" "${RUN:=/tmp/peers}" "${N:=4000}" "${BUDGET:=540}"
: "${OUT:=$RUN/out}" "${GGUF:=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}" "${CONCURRENCY:=8}" "${MT_N:=80}" "${MT_TOKENS:=1024}"
: "${CFG:=configs/smollm2-h200.yaml}"  # the CPU smoke (tests/test_benchmark_scripts.py) passes the demo preset
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE=/tmp/e3cache RAY_DATA_DISABLE_PROGRESS_BARS=1 HF_HUB_OFFLINE=1
SGL_KW="target.sglang.extra_engine_kwargs={attention_backend: triton, sampling_backend: pytorch, grammar_backend: none}"
mkdir -p "$RUN" "$OUT"
cli() { python3 -m eagle3_ray.cli "$@"; }
TAG=peers
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# SpecForge beside SGLang 0.5.17's wheelhouse (its transformers 5.12.1: what it was seen importing with)
sf_env() { export PYTHONPATH=/tmp/sf:/tmp/sgl:${PYTHONPATH:-}; }
target_hf() { python3 -c "from pathlib import Path; from eagle3_ray.engines.targets import gguf_to_hf_dir
print(gguf_to_hf_dir(Path('$GGUF')))"; }

data() {
  is_done data && return 0
  if [ -n "${FROM_RECORD:-}" ]; then  # the record's own conversations and fixed history (generated once, 2026-12-07)
    mkdir -p "$RUN/gen" && gunzip -c benchmarks/results/specforge_smollm2_conversations.jsonl.gz > "$RUN/gen/conversations.jsonl" &&
      gunzip -c benchmarks/results/specforge_smollm2_mt_fixed.jsonl.gz > "$RUN/mt_fixed.jsonl" && done_ data
    return
  fi
  head -n "$N" .gq/train_prompts.jsonl > "$RUN/prompts.jsonl"
  cli generate -c $CFG --data "$RUN/prompts.jsonl" --out "$RUN/gen" target.model=$GGUF \
    generate.samples_per_prompt=1 generate.synthetic_prompts=0 || return 1
  head -n "$MT_N" .gq/mt_bench.jsonl > "$RUN/mt_bench.jsonl"
  cli generate -c $CFG --data "$RUN/mt_bench.jsonl" --out "$RUN/mtgen" target.model=$GGUF \
    generate.max_new_tokens=$MT_TOKENS generate.samples_per_prompt=1 generate.synthetic_prompts=0 || return 1
  python3 benchmarks/long_eval_set.py history --input "$RUN/mt_bench.jsonl" --out "$RUN/mt_fixed.jsonl" \
    --conversations "$RUN/mtgen/conversations.jsonl" || return 1
  done_ data
}
ours1() {
  is_done ours1 && return 0
  timed ours1 cli run -c $CFG --data "$RUN/gen/conversations.jsonl" --out "$RUN/ours1" target.model=$GGUF \
    generate.samples_per_prompt=1 generate.synthetic_prompts=0 train.epochs=1 ${OURS_EXTRA:-} --stop-after export || return 1
  done_ ours1
}
bf16() {
  is_done bf16 && return 0
  timed bf16 cli extract -c $CFG --data "$RUN/ours1/prepare" --out "$RUN/bf16" target.model=$GGUF \
    extract.compact=none || return 1
  done_ bf16
}
skipped() { case " ${SKIP:-} " in *" $1 "*) echo "[peers] $1 skipped (SKIP)"; return 0;; esac; return 1; }
ours3() {
  is_done ours3 || skipped ours3 && return 0
  timed ours3 cli train -c $CFG --features "$RUN/ours1/features" --vocab "$RUN/ours1/vocab" --out "$RUN/ours3/train" \
    target.model=$GGUF train.epochs=3 ${OURS_EXTRA:-} || return 1
  cli export --checkpoint "$RUN/ours3/train" --out "$RUN/ours3/drafter" --engine sglang || return 1
  done_ ours3
}
sfin() {
  is_done sfin && return 0
  local target=(); [ -f "$GGUF" ] && target=(--target "$(target_hf)")  # the CPU smoke's random target has none
  python3 benchmarks/peers/specforge_inputs.py --features "$RUN/bf16" --config "$RUN/ours1/config.resolved.yaml" \
    "${target[@]}" --out "$RUN/sf" --compare "$RUN/ours1/features" || return 1
  done_ sfin
}
sf_run() {  # <name> <epochs> [draft vocab]: SpecForge's training, then its SGLang export
  local name=$1 epochs=$2 vocab=${3:-}
  is_done "sf-$name" && return 0
  ( sf_env
    python3 benchmarks/peers/specforge_config.py --inputs "$RUN/sf" --name "$name" --epochs "$epochs" \
      ${vocab:+--draft-vocab $vocab} --out "$RUN/sf/$name" &&
    timed "sf-$name" python3 -m specforge.cli train -c "$RUN/sf/$name/run.yaml" > "$RUN/sf/$name/train.log" 2>&1 &&
    python3 -m specforge.cli export --to sglang --checkpoint "$RUN/sf/$name/out" \
      --draft-config "$RUN/sf/$name/draft_config.json" --output-dir "$RUN/sf/$name/sglang" ) || {
    echo "[peers] sf-$name failed:"; tail -n 30 "$RUN/sf/$name/train.log"; return 1; }
  done_ "sf-$name"
}
chain() {
  if [ -n "${NO_SF:-}" ]; then  # ours alone (SpecForge's figures from an earlier run): variants, BEST3, their tau
    data && ours1 && ours3 && recipe && best3 || return 1
    done_ chain
    [ -z "${TAU_IN_CHAIN:-}" ] && return 0
    sgl_ready && tau_pick TAU_WHILE && done_ tau
    return
  fi
  data && ours1 && bf16 && sfin || return 1
  [ -n "${NO_SPECFORGE:-}" ] && return 0  # the CPU smoke: SpecForge's trainer needs a GPU (FSDP, Triton)
  while [ ! -f /tmp/sf/.ready ]; do sleep 5; done  # STEP=install, from another call
  if [ -z "${SF_AT_ONCE:-}" ]; then  # the first run (2026-12-07, H100): SpecForge alone on the GPU, timed
    sf_run aligned-1ep 1 16384 || return 1
    sf_run aligned-3ep 3 16384 > "$RUN/sf-aligned-3ep.out" 2>&1 & local p=$!
    sf_run default-1ep 1 > "$RUN/sf-default-1ep.out" 2>&1
    wait $p; cat "$RUN/sf-aligned-3ep.out" "$RUN/sf-default-1ep.out"
  else  # SF_AT_ONCE="name:epochs[:vocab] ...": SpecForge's runs beside ours3 and the recipe variants (tau, not speeds)
    local r name ep voc pids=()
    for r in $SF_AT_ONCE; do IFS=: read -r name ep voc <<< "$r"
      sf_run "$name" "$ep" "$voc" > "$RUN/sf-$name.out" 2>&1 & pids+=($!); done
    ours3 && recipe && best3 || return 1
    [ -n "${TAU_IN_CHAIN:-}" ] && sgl_ready && tau_pick TAU_WHILE  # ours' engines while SpecForge trains
    wait "${pids[@]}"; cat "$RUN"/sf-*.out
  fi
  done_ chain
  [ -z "${TAU_IN_CHAIN:-}" ] && return 0  # then every drafter's SGLang tau (the engines not yet run), and
  sgl_ready && tau_pick TAU_AFTER && done_ tau  # the summary of all of them on the same turns
}
sgl_ready() {  # SGLang installed (STEP=sgl3 of session.sh, from another call) and importable
  while [ ! -f /tmp/sgl/.ready ]; do sleep 5; done
  case ":$PYTHONPATH:" in *:/tmp/sgl:*) ;; *) export PYTHONPATH=/tmp/sgl:$PYTHONPATH;; esac
  export SGLANG_IS_FLASHINFER_AVAILABLE=false
}
label_dir() {  # a drafter's label -> its directory under $RUN (best, best3: the BEST3 step's pick)
  local l=$1; [ -f "$RUN/best.name" ] && { l=${l/#best3/recipe-$(cat "$RUN/best.name")-3ep}; l=${l/#best/recipe-$(cat "$RUN/best.name")}; }
  case $l in ours*) echo "$l:$l/drafter";; sf-*) echo "$l:sf/${l#sf-}/sglang";; recipe-*) echo "$l:recipe/${l#recipe-}/drafter";; esac
}
tau_pick() {  # <variable>: the tau of the drafters it names when it is set (TAU_WHILE, TAU_AFTER), else of
  # every drafter and recipe variant (the runs before those variables)
  if [ -n "${!1+x}" ]; then LABELS=${!1} TAU_RECIPE= tau; else TAU_RECIPE=1 tau; fi
}
tau() {  # LABELS (names: ours1 ours3 sf-<run> recipe-<variant> best best3) picks the drafters (unset: the default
  # list below); TAU_RECIPE=1 adds every recipe variant
  local args=() d
  local labels=${LABELS-ours1 ours3 sf-aligned-1ep sf-aligned-3ep sf-default-1ep}
  labels=$(for d in $labels; do label_dir "$d"; done)
  [ "${TAU_RECIPE:-}" = 1 ] && labels="$labels $(cd "$RUN" && for d in recipe/*/drafter; do
    n=${d#recipe/}; printf 'recipe-%s:%s ' "${n%/drafter}" "$d"; done)"
  for d in $labels; do
    [ -f "$RUN/${d#*:}/config.json" ] && args+=(--drafter "${d%%:*}=$RUN/${d#*:}")
  done
  timeout -k 20 -s INT "$BUDGET" python3 benchmarks/peers/sglang_tau.py ${MODES_AT_ONCE:+--modes-at-once} \
    ${MEM_STEP:+--mem-step $MEM_STEP} -c $CFG --prompts "$RUN/mt_fixed.jsonl" \
    "${args[@]}" --out "$RUN/${TAU_OUT:-tau}" target.model="$(target_hf)" target.backend=sglang "$SGL_KW" \
    target.sglang.mem_fraction_static=${MEM_FRACTION:-0.12} bench.max_new_tokens=1024 bench.max_prompts=80 \
    "bench.concurrency=[$CONCURRENCY]"
}
recipe() {  # one epoch of ours per recipe variant on ours1's store (VARIANTS: name:override,override ...), each
  # exported; then their SGLang tau beside SpecForge's 1-epoch drafter on the same turns (tau step, LABELS)
  local v name over
  for v in ${VARIANTS:-ratio: steps100:train.warmup_steps=100,train.warmup_ratio=null b4k:train.batch_tokens=4096 b2k:train.batch_tokens=2048}; do
    name=${v%%:*}; over=${v#*:}
    is_done "recipe-$name" && continue
    timed "recipe-$name" cli train -c $CFG --features "$RUN/ours1/features" --vocab "$RUN/ours1/vocab" \
      --out "$RUN/recipe/$name/train" target.model=$GGUF train.epochs=1 ${OURS_EXTRA:-} ${over//,/ } || return 1  # later k=v win
    cli export --checkpoint "$RUN/recipe/$name/train" --out "$RUN/recipe/$name/drafter" --engine sglang || return 1
    done_ "recipe-$name"
  done
}
best3() {  # BEST3=1: the recipe variant with the best 1-epoch held-out tau, trained 3 epochs as <name>-3ep
  [ -z "${BEST3:-}" ] && return 0
  local best; best=$(python3 - "$RUN" <<'PY'
import json, sys
from pathlib import Path
def tau(s):  # the best held-out tau; a run without held-out samples (the CPU smoke's): its last training tau
    return (s.get("best") or {}).get("val_tau") or s["metrics"].get("val_tau") or s["metrics"]["tau"]
runs = {p.parts[-3]: tau(json.loads(p.read_text()))
        for p in Path(sys.argv[1]).glob("recipe/*/train/summary.json") if not p.parts[-3].endswith("-3ep")}
print(max(runs, key=runs.get)); print(runs, file=sys.stderr)
PY
) || return 1
  echo "$best" > "$RUN/best.name"; echo "[peers] best 1-epoch variant: $best"
  local over; for v in ${VARIANTS:-}; do [ "${v%%:*}" = "$best" ] && over=${v#*:}; done
  VARIANTS="$best-3ep:${over:+$over,}train.epochs=3" recipe
}
collect() {
  (cd "$RUN" && find . \( -name '*.json' -o -name '*.jsonl' -o -name '*.log' -o -name '*.yaml' -o -name '*.out' \
     -o -name '*.done' -o -name '*peak_mib' -o -name 'events.out.tfevents*' \) -size -8M \
     ! -name 'conversations*' ! -name 'prompts.jsonl' ! -path './repo/*' ! -path '*/features/*' ! -path './bf16/*' \
     ! -path './sf/train/*' ! -path './sf/eval/*' ! -path '*/checkpoints/*' -print | tar -czf "$OUT/peers.tgz" -T -)
  [ -f "$RUN/gen/conversations.jsonl" ] && gzip -c "$RUN/gen/conversations.jsonl" > "$OUT/conversations.jsonl.gz"
  ls -la "$OUT"
}

case "$STEP" in
  install) [ -f /tmp/sf/.ready ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
             --target /tmp/sf .sf/*.whl && touch /tmp/sf/.ready; }
           PYTHONPATH=/tmp/sf:${PYTHONPATH:-} python3 -c "import specforge.cli, specforge.training.assembly; print('specforge ok')" ;;
  start) mkdir -p "$RUN/repo" && cp -r benchmarks configs eagle3_ray pyproject.toml "$RUN/repo/" || exit 1
         [ -d .gq ] && cp -r .gq "$RUN/repo/"
         cd "$RUN/repo" || exit 1
         (STEP=chain setsid nohup bash benchmarks/peers/specforge.sh > "$RUN/chain.log" 2>&1 < /dev/null &)
         sleep 5; echo "[peers] chain started (log $RUN/chain.log)"; cat "$RUN/chain.log" ;;
  chain) export PYTHONPATH=$PWD:${PYTHONPATH:-}; chain; echo "[peers] chain rc $?" ;;
  tau) cd "$RUN/repo" 2>/dev/null || true; tau ;;
  recipe) cd "$RUN/repo" && export PYTHONPATH=$PWD:${PYTHONPATH:-} && recipe ;;
  wait) t0=$(date +%s)  # until the marker, the budget, or the chain's end (which may not write it)
        while [ ! -f "$RUN/${WAIT_FOR:?}" ] && [ $(( $(date +%s) - t0 )) -lt "$BUDGET" ] &&
              ! grep -q "chain rc" "$RUN/chain.log" 2>/dev/null; do sleep 5; done
        tail -n 25 "$RUN/chain.log" ;;
  collect) collect ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
