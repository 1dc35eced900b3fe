#!/usr/bin/env bash
# The demo's training recipe, variant against variant on the same store: `make demo`'s stages up to the vocab
# map once ($CFG, default configs/demo-smollm2.yaml, the shipped answers), then one `eagle3-ray train` per
# variant with a tenth of the samples held out, each printing its held-out tau (chain3: the bench's chain(3) walk).
#   bash benchmarks/demo_recipe.sh <out dir> "base:" "head:train.lm_head_init=target" "ep5:train.epochs=5"
#   CFG=configs/demo-smollm2-chat.yaml bash benchmarks/demo_recipe.sh ...   (the general-chat demo)
# Each variant is name:override,override (none: the preset's recipe). Lines go to <out>/recipe.txt.
set -uo pipefail
out=${1:?usage: demo_recipe.sh <out dir> name:overrides ...}; shift
py=${PYTHON:-python3}
cfg=${CFG:-configs/demo-smollm2.yaml}
mkdir -p "$out"
"$py" -m eagle3_ray.cli run -c $cfg --out "$out/store" --stop-after vocab > "$out/store.log" 2>&1 ||
  { tail -n 20 "$out/store.log"; exit 1; }
common="train.val_share=0.1 train.eval_every=100000 train.log_every=10 train.checkpoint_every=100000"
for v in "$@"; do
  name=${v%%:*}; over=${v#*:}; start=$(date +%s)
  "$py" -m eagle3_ray.cli train -c $cfg --features "$out/store/features" --vocab "$out/store/vocab" \
    --out "$out/$name" $common ${over//,/ } > "$out/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s ${over:-preset} $(grep -o 'held out: [^)]*)' "$out/$name.log" | tail -1)" \
    | tee -a "$out/recipe.txt"
done
