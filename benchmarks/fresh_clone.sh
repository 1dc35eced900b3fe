# Sourced by ci_time.sh and demo_time.sh: a fresh clone of this checkout's HEAD under $scratch/clone (the
# working directory after), a fresh virtual environment in it, and none of this user's caches: the SmolLM2
# conversion (EAGLE3_RAY_CACHE) and DeepSpeed's CPU communication op, compiled by the first training worker
# (TORCH_EXTENSIONS_DIR). Needs repo and scratch.
rm -rf "$scratch" && git clone -q "$repo" "$scratch/clone"
cd "$scratch/clone"
python3 -m venv .venv
export EAGLE3_RAY_CACHE="$scratch/cache/eagle3_ray" TORCH_EXTENSIONS_DIR="$scratch/cache/torch_extensions"
