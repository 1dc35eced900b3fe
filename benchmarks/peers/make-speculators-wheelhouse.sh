#!/usr/bin/env bash
# Builds .spec/ (git-ignored): speculators 0.9.0 and the packages of requirements-speculators.txt as wheels
# for the lent GPU machine (Python 3.12, x86-64), small enough to ride along one device call (about 4 MB).
# Usage (repository root):  bash benchmarks/peers/make-speculators-wheelhouse.sh
# On the machine: benchmarks/peers/speculators.sh STEP=install installs them --no-deps into /tmp/spec;
# its runs put PYTHONPATH=/tmp/spec:/tmp/sgl:/tmp/base:<the project> (speculators.sh spec_env).
set -euo pipefail
out=.spec
req="$(dirname "$0")/requirements-speculators.txt"
if [ -d .git ]; then grep -qx '/.spec/' .git/info/exclude 2>/dev/null || echo '/.spec/' >> .git/info/exclude; fi
rm -rf "$out" && mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" -r "$req" 2>&1 | grep -v 'is ignored' || true
n=$(grep -cv '^\s*#' "$req")
[ "$(ls "$out"/*.whl | wc -l)" -eq "$n" ] || { echo "expected $n wheels in $out" >&2; ls "$out" >&2; exit 1; }
du -sh "$out"
