#!/usr/bin/env bash
# vLLM's speculators 0.9.0 beside eagle3-ray on one GPU (issue 59, item 4), after specforge.sh's chain: the
# same target, conversations and captured features (its $RUN/bf16 store and $RUN/ours1 run), the same epochs;
# then its drafters' tau in SGLang on the same MT-bench turns as ours. Steps (STEP=...), each resumable (a
# finished part leaves a marker under $RUN and is skipped when run again):
#   install   .spec (benchmarks/peers/make-speculators-wheelhouse.sh) -> /tmp/spec; checks that its trainer imports
#   smoke     specin (below), then 3 steps of its trainer, a validation and the export, in minutes: whether it
#             runs on this GPU's torch at all before the chain spends its time (needs install)
#   start     copies the repository to $RUN/repo-spec and runs `chain` there in a session of its own (setsid),
#             so that it goes on across device calls; its log: $RUN/spec-chain.log
#   chain     specin: its trainer's inputs from the bf16 store (speculators_inputs.py inputs; its own capture
#               needs a vLLM server, docs in that script)
#             spec-aligned-1ep: `speculators train` alone on the GPU, timed, GPU memory sampled: its offline
#               example's recipe (lr 1e-4, total-seq-len 8192, its defaults otherwise: Muon, linear schedule,
#               TTT 3, KL), the draft vocabulary aligned with ours (16,384), and the two flags SGLang needs to
#               serve what it trained (--no-norm-before-residual, --full-attention-indices 0); then the
#               SGLang export (speculators_inputs.py export)
#             then, at once (speeds not figures): spec-aligned-3ep and spec-default-1ep (its example's 32,000)
#   tau       SGLang tau of TAU_LABELS' drafters exported so far (default ours1, ours3 and speculators' three;
#             the first is the paired baseline), chain and tree, on specforge.sh's fixed MT-bench turns
#             -> $RUN/tau-spec
#   wait      until $RUN/$WAIT_FOR exists or BUDGET seconds pass; prints the chain log's tail
#   collect   results -> $OUT/spec.tgz (logs, markers, inputs.json, tau, run.yaml, its tensorboard events)
# Environment: `source benchmarks/device/session.sh env` first (PYTHONPATH: /tmp/sgl, /tmp/base, the project).
#   STEP=install bash benchmarks/peers/speculators.sh   (a call that carries .spec)
#   STEP=start bash benchmarks/peers/speculators.sh     (once specforge.sh's bf16 and ours1 are done)
set -uo pipefail
: "${STEP:?STEP=install|smoke|start|chain|tau|wait|collect}" "${RUN:=/tmp/peers}" "${BUDGET:=540}"
: "${OUT:=$RUN/out}" "${GGUF:=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf}" "${CONCURRENCY:=8}" "${CFG:=configs/smollm2-h200.yaml}"
: "${TAU_LABELS:=ours1 ours3 spec-aligned-1ep spec-aligned-3ep spec-default-1ep}"  # the first: the paired baseline
: "${SPEC_FLAGS:=}"  # more `speculators train` flags for every run, e.g. "--ttt-steps 7" for a recipe probe
export PYTHONUNBUFFERED=1 EAGLE3_RAY_CACHE=/tmp/e3cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SGL_KW="target.sglang.extra_engine_kwargs={attention_backend: triton, sampling_backend: pytorch, grammar_backend: none}"
SPEC=$RUN/spec
mkdir -p "$RUN" "$OUT"
TAG=spec
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
# speculators first, then SGLang 0.5.17's wheelhouse (its transformers 5.12.1, as SpecForge ran with) and the
# project's (pydantic); the image's transformers 5.17 also satisfies speculators' pin (<=5.19)
spec_env() { export PYTHONPATH=/tmp/spec:/tmp/sgl:/tmp/base:${PYTHONPATH:-}; }
inputs_field() { python3 -c "import json; v = json.load(open('$SPEC/inputs.json'))['$1']; print(*v) if isinstance(v, list) else print(v)"; }

specin() {
  is_done specin && return 0
  for m in bf16 ours1; do
    is_done $m || { echo "[spec] $RUN/$m.done missing: run specforge.sh's chain (STEP=start) up to its bf16 step first"; return 1; }
  done
  # the run's resolved config names the target (target.model=$GGUF) and the held-out split
  timed specin python3 benchmarks/peers/speculators_inputs.py inputs --features "$RUN/bf16" \
    --config "$RUN/ours1/config.resolved.yaml" --out "$SPEC" || return 1
  done_ specin
}
spec_train() {  # <dir> <epochs> <draft vocab> [flags]: `speculators train` on $SPEC/data -> <dir>/checkpoints
  local dir=$1 epochs=$2 vocab=$3; shift 3
  # --train-data-ratio cuts its rows exactly at our held-out samples; --on-missing raise: never ask a vLLM
  # server for a missing file; --log-freq 50: its default 1 synchronizes the GPU every step (its own
  # advice: keep log_freq > 1 in perf-sensitive runs); the rest is its offline example or its default
  # shellcheck disable=SC2046,SC2086
  python3 -m speculators.train --verifier-name-or-path "$SPEC/target" \
    --data-path "$SPEC/data" --save-path "$dir/checkpoints" --log-dir "$dir/logs" --logger tensorboard \
    --target-layer-ids $(inputs_field target_layer_ids) --train-data-ratio "$(inputs_field train_data_ratio)" \
    --draft-vocab-size "$vocab" --epochs "$epochs" --lr 1e-4 --total-seq-len 8192 --on-missing raise \
    --no-norm-before-residual --full-attention-indices 0 --log-freq 50 $SPEC_FLAGS "$@" > "$dir/train.log" 2>&1
}
spec_export() {  # <dir> <epoch>: its checkpoint of that epoch -> <dir>/sglang
  python3 benchmarks/peers/speculators_inputs.py export --checkpoint "$1/checkpoints/$2" --out "$1/sglang"
}
spec_run() {  # <name> <epochs> <draft vocab>: speculators' training, timed, then the SGLang export of its last epoch
  local name=$1 epochs=$2 vocab=$3 dir=$SPEC/$1
  is_done "spec-$name" && return 0
  mkdir -p "$dir"
  ( spec_env && timed "spec-$name" spec_train "$dir" "$epochs" "$vocab" && spec_export "$dir" $((epochs - 1)) ) ||
    { echo "[spec] spec-$name failed:"; tail -n 40 "$dir/train.log"; return 1; }
  # wall-clock tokens per second (imports, torch.compile, validation and checkpoints included)
  python3 -c "import json; t = json.load(open('$RUN/spec-$name.time.json')); n = json.load(open('$SPEC/inputs.json'))['train_tokens']
json.dump({'train_tokens': n, 'epochs': $epochs, 'seconds': t['seconds'], 'wall_tokens_per_s': round(n * $epochs / t['seconds'], 1)},
          open('$dir/speed.json', 'w'))"
  done_ "spec-$name"
}
smoke() {  # 3 steps of its default GPU path (flex attention under torch.compile, its Triton loss), 1 validation,
  # the export: whether it runs here at all, in minutes, before the chain spends its time (not timed)
  specin || return 1
  local dir=$SPEC/smoke
  rm -rf "$dir" && mkdir -p "$dir"
  ( spec_env && spec_train "$dir" 1 16384 --max-steps 3 && spec_export "$dir" 0 ) ||
    { echo "[spec] smoke failed:"; tail -n 40 "$dir/train.log"; return 1; }
  grep -E "Checkpoint saved|Validation epoch" "$dir/train.log" | tail -n 3; echo "[spec] smoke ok"
}
chain() {
  specin || return 1
  while [ ! -f /tmp/spec/.ready ]; do sleep 5; done  # STEP=install, from another call
  # the first run alone: its timing is the row of the table. It also writes d2t-16384.npy / t2d-16384.npy
  # into $SPEC/data (derived from token_freq.pt), which aligned-3ep then reads instead of racing to write
  spec_run aligned-1ep 1 16384 || return 1
  spec_run aligned-3ep 3 16384 > "$RUN/spec-aligned-3ep.out" 2>&1 & local p=$!
  spec_run default-1ep 1 32000 > "$RUN/spec-default-1ep.out" 2>&1
  wait $p; cat "$RUN/spec-aligned-3ep.out" "$RUN/spec-default-1ep.out"
  done_ spec-chain
}
target_hf() { python3 -c "from pathlib import Path; from eagle3_ray.engines.targets import gguf_to_hf_dir
print(gguf_to_hf_dir(Path('$GGUF')))"; }
tau() {
  local args=() d
  [ -f "$RUN/mt_fixed.jsonl" ] || { echo "[spec] $RUN/mt_fixed.jsonl missing: specforge.sh's data step writes it"; return 1; }
  local -A dirs=([ours1]=ours1/drafter [ours3]=ours3/drafter [spec-aligned-1ep]=spec/aligned-1ep/sglang
                  [spec-aligned-3ep]=spec/aligned-3ep/sglang [spec-default-1ep]=spec/default-1ep/sglang)
  for d in $TAU_LABELS; do
    [ -n "${dirs[$d]:-}" ] || { echo "[spec] unknown TAU_LABELS entry $d (known: ${!dirs[*]})"; return 1; }
    [ -f "$RUN/${dirs[$d]}/config.json" ] && args+=(--drafter "$d=$RUN/${dirs[$d]}")
  done
  timeout -k 20 -s INT "$BUDGET" python3 benchmarks/peers/sglang_tau.py -c $CFG --prompts "$RUN/mt_fixed.jsonl" \
    "${args[@]}" --out "$RUN/tau-spec" target.model="$(target_hf)" target.backend=sglang "$SGL_KW" \
    target.sglang.mem_fraction_static=0.12 bench.max_new_tokens=1024 bench.max_prompts=80 \
    "bench.concurrency=[$CONCURRENCY]"
}
collect() {
  (cd "$RUN" && find . \( -path './spec/*' -o -path './tau-spec/*' -o -name 'spec-*' -o -name 'specin*' \) \
     \( -name '*.json' -o -name '*.log' -o -name '*.yaml' -o -name '*.txt' -o -name '*.out' -o -name '*.done' \
     -o -name '*peak_mib' -o -name 'events.out.tfevents*' \) -size -8M \
     ! -path './spec/data/*' ! -path './spec/target/*' ! -path '*/checkpoints/*/model.safetensors' \
     ! -name 'turns.json' -print | tar -czf "$OUT/spec.tgz" -T -)
  ls -la "$OUT"
}

case "$STEP" in
  install) [ -f /tmp/spec/.ready ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
             --target /tmp/spec .spec/*.whl && touch /tmp/spec/.ready; }
           spec_env; python3 -c "import speculators.train.cli, speculators.train.__main__, torch, transformers, datasets
print('speculators ok', torch.__version__, transformers.__version__, datasets.__version__)" ;;
  start) mkdir -p "$RUN/repo-spec" && cp -r benchmarks configs eagle3_ray pyproject.toml "$RUN/repo-spec/" || exit 1
         cd "$RUN/repo-spec" || exit 1
         (STEP=chain setsid nohup bash benchmarks/peers/speculators.sh > "$RUN/spec-chain.log" 2>&1 < /dev/null &)
         sleep 5; echo "[spec] chain started (log $RUN/spec-chain.log)"; cat "$RUN/spec-chain.log" ;;
  chain) export PYTHONPATH=$PWD:${PYTHONPATH:-}; chain; echo "[spec] chain rc $?" ;;
  smoke) export PYTHONPATH=$PWD:${PYTHONPATH:-}; smoke ;;
  tau) cd "$RUN/repo-spec" 2>/dev/null || cd "$RUN/repo" 2>/dev/null || true; tau ;;
  wait) t0=$(date +%s); while [ ! -f "$RUN/${WAIT_FOR:?}" ] && [ $(( $(date +%s) - t0 )) -lt "$BUDGET" ]; do sleep 5; done
        tail -n 25 "$RUN/spec-chain.log" ;;
  collect) collect ;;
  *) echo "unknown STEP $STEP" >&2; exit 2 ;;
esac
