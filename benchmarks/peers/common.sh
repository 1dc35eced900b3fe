# Sourced by specforge.sh and speculators.sh: stage markers and the timing of one command alone on the GPU.
# Needs RUN (the run's directory) and a TAG for the progress lines.
done_() { touch "$RUN/$1.done"; echo "[$TAG] $1 done at $(date +%T)"; }
is_done() { [ -f "$RUN/$1.done" ]; }
gpu_peak() {  # <file>: sample the GPU's used memory every 0.2 s until killed; the largest value, MiB, at the end
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$1.samples" 2>/dev/null &
  echo $!
}
peak_of() { sort -n "$1.samples" | tail -n 1 > "$1"; rm -f "$1.samples"; }
timed() {  # <name> <command...>: wall seconds and GPU peak of one command -> $RUN/<name>.time.json
  local name=$1; shift
  local pid t0 rc; pid=$(gpu_peak "$RUN/$name.peak_mib"); t0=$(date +%s.%N)
  "$@"; rc=$?
  kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; peak_of "$RUN/$name.peak_mib"
  python3 -c "import json,sys; json.dump({'seconds': round($(date +%s.%N) - $t0, 1), 'rc': $rc,
    'gpu_peak_mib': int(open('$RUN/$name.peak_mib').read() or 0)}, open('$RUN/$name.time.json', 'w'))"
  return $rc
}
