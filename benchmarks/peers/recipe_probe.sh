#!/usr/bin/env bash
# Why SpecForge's drafter beat ours at 1 epoch of the side-by-side run (record specforge_side_by_side): the
# same 3,991 conversations (CONV, the run's conversations.jsonl.gz), captured once on this machine, then one
# epoch of ours per recipe variant; each variant's held-out tau (the 80 samples SpecForge evaluated too) is
# what this compares. On a CPU the captures are fp32 (the GPU's were bf16), so only the variants' order is
# a result here, not their absolute tau.
#   CONV=benchmarks/results/specforge_smollm2_conversations.jsonl.gz RUN=/tmp/recipe bash benchmarks/peers/recipe_probe.sh
# VARIANTS: "name:overrides" words (overrides joined by ','), default the four below.
set -uo pipefail
: "${CONV:?the side-by-side run's conversations (jsonl or jsonl.gz)}" "${RUN:=/tmp/recipe}"
CFG=configs/smollm2-h200.yaml
CPU="target.device=cpu extract.num_gpus_per_actor=0 extract.num_cpus_per_actor=2 extract.batch_tokens=8192
     ray.num_cpus=4 train.use_gpu=false train.cpus_per_worker=2 train.loss_chunk_tokens=4096 train.epochs=1"
: "${VARIANTS:=preset: warmup2:train.warmup_steps=2 b4k:train.batch_tokens=4096,train.warmup_steps=5
  b2k:train.batch_tokens=2048,train.warmup_steps=10}"
mkdir -p "$RUN"
case "$CONV" in *.gz) gunzip -c "$CONV" > "$RUN/conversations.jsonl" ;; *) cp "$CONV" "$RUN/conversations.jsonl" ;; esac
python3 -m eagle3_ray.cli run -c $CFG --data "$RUN/conversations.jsonl" --out "$RUN/base" $CPU \
  generate.samples_per_prompt=1 generate.synthetic_prompts=0 --stop-after vocab || exit 1
for v in $VARIANTS; do
  name=${v%%:*}; over=${v#*:}
  [ -f "$RUN/$name/summary.json" ] || python3 -m eagle3_ray.cli train -c $CFG --features "$RUN/base/features" \
    --vocab "$RUN/base/vocab" --out "$RUN/$name" $CPU ${over//,/ } > "$RUN/$name.log" 2>&1
  python3 -c "import json,sys; m=json.load(open('$RUN/$name/summary.json'))['metrics']
print('$name', '$over', 'steps', m['step'], 'held-out tau %.3f chain3 %.3f acc0 %.3f' % (m['val_tau'], m['val_tau_chain3'], m['val_acc_0']))"
done | tee "$RUN/recipe.txt"
