#!/usr/bin/env bash
# Builds .sf/ (git-ignored): SpecForge 0.2.0 and the packages of requirements-specforge.txt as wheels for
# the lent GPU machine (Python 3.12, x86-64), small enough to ride along one device call (about 15 MB).
# Usage (repository root):  bash benchmarks/peers/make-specforge-wheelhouse.sh
# On the machine: python3 -m pip install -q --no-index --no-deps --target /tmp/sf .sf/*.whl
# (benchmarks/peers/specforge.sh STEP=install does it), then PYTHONPATH=/tmp/sf:<SGLang's and the project's>.
set -euo pipefail
out=.sf
if [ -d .git ]; then grep -qx '/.sf/' .git/info/exclude 2>/dev/null || echo '/.sf/' >> .git/info/exclude; fi
rm -rf "$out" && mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" -r "$(dirname "$0")/requirements-specforge.txt" 2>&1 | grep -v 'is ignored' || true
n=$(grep -cv '^\s*#' "$(dirname "$0")/requirements-specforge.txt")
[ "$(ls "$out"/*.whl | wc -l)" -eq "$n" ] || { echo "expected $n wheels in $out" >&2; ls "$out" >&2; exit 1; }
du -sh "$out"
