#!/usr/bin/env bash
# Times the README's test command as a new user (and CI) meets it: a fresh clone of HEAD in a fresh
# virtual environment, `make test` under CI=true (installs included), then writes the figures to
# benchmarks/results/ci_time.json of THIS checkout. Run it on an otherwise idle machine.
# Usage (repository root):  bash benchmarks/ci_time.sh [scratch dir, default /tmp/e3-ci-time]
set -euo pipefail
repo=$(pwd)
scratch=${1:-/tmp/e3-ci-time}
source "$repo/benchmarks/fresh_clone.sh"
start=$(date +%s)
# make's own timestamps: setup-dev ends where pytest starts (the first line pytest prints)
set +e
CI=true PATH="$PWD/.venv/bin:$PATH" make test PYTHON="$PWD/.venv/bin/python" 2>&1 \
  | while IFS= read -r line; do printf '%s %s\n' "$(date +%s)" "$line"; done > "$scratch/make-test.log"
rc=${PIPESTATUS[0]}
set -e
end=$(date +%s)
tests_start=$(grep -m1 -E '^[0-9]+ [^ ]*python -m pytest' "$scratch/make-test.log" | cut -d' ' -f1)
summary=$(grep -E '^[0-9]+ =*.*(passed|failed).* in [0-9.]+s' "$scratch/make-test.log" | tail -1 | cut -d' ' -f2- | tr -d '=')
python3 - "$repo/benchmarks/results/ci_time.json" <<PY
import json, platform, os, subprocess, sys
json.dump({
    "command": "bash benchmarks/ci_time.sh  (fresh clone + fresh venv + empty caches; CI=true make test)",
    "commit": subprocess.check_output(["git", "-C", "$scratch/clone", "rev-parse", "--short", "HEAD"], text=True).strip(),
    "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
    "exit_status": $rc,
    "wall_s": $end - $start,
    "install_s": ${tests_start:-$end} - $start,
    "tests_s": $end - ${tests_start:-$end},
    "pytest_summary": """$summary""".strip(),
}, open(sys.argv[1], "w"), indent=2)
open(sys.argv[1], "a").write("\n")
PY
cat "$repo/benchmarks/results/ci_time.json"
exit $rc
