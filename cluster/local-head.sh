#!/usr/bin/env bash
# Start / stop a local Ray head whose dashboard and job server listen on 127.0.0.1 only.
#
#   cluster/local-head.sh start     # then: ray job submit --address http://127.0.0.1:8265 ...
#   cluster/local-head.sh address   # the GCS address for RAY_ADDRESS / `ray start --address` on workers
#   cluster/local-head.sh stop
#
# Settings (environment): RAY_HEAD_PORT (6379), RAY_DASHBOARD_PORT (8265), RAY_METRICS_PORT (8080),
# RAY_CLIENT_PORT (10001), RAY_AGENT_PORT (52365), RAY_NUM_CPUS (all), RAY_NUM_GPUS (all),
# RAY_HEAD_DIR (/tmp/eagle3-ray-head: pid, logs, Ray temp dir).
#
# `stop` ends only the head this script started (by the pid of `ray start --block`, whose SIGTERM
# handler shuts down every process of that node). `ray stop` would instead kill every Ray process
# of the user on this machine, including other people's sessions and test runs.
set -euo pipefail

HEAD_PORT="${RAY_HEAD_PORT:-6379}"
DASHBOARD_PORT="${RAY_DASHBOARD_PORT:-8265}"
METRICS_PORT="${RAY_METRICS_PORT:-8080}"
CLIENT_PORT="${RAY_CLIENT_PORT:-10001}"
AGENT_PORT="${RAY_AGENT_PORT:-52365}"
HEAD_DIR="${RAY_HEAD_DIR:-/tmp/eagle3-ray-head}"
PID_FILE="$HEAD_DIR/head.pid"
START_TIMEOUT_S="${RAY_START_TIMEOUT_S:-120}"
# The GCS listens on every interface, so the cluster keeps Ray's token authentication on. Clients
# (`ray job submit`, drivers, worker nodes) need RAY_AUTH_MODE=token and the same token: from
# RAY_AUTH_TOKEN or ~/.ray/auth_token (created here when neither exists).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"

running() {
    [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null
}

start() {
    if running; then
        echo "a head started by this script is already running (pid $(cat "$PID_FILE"))" >&2
        exit 1
    fi
    mkdir -p "$HEAD_DIR/ray"
    if [[ "$RAY_AUTH_MODE" == token && -z "${RAY_AUTH_TOKEN:-}" && ! -f "$HOME/.ray/auth_token" ]]; then
        ray get-auth-token --generate >/dev/null
    fi
    local args=(
        start --head --block
        --port "$HEAD_PORT"
        --node-ip-address 127.0.0.1
        --include-dashboard true
        --dashboard-host 127.0.0.1
        --dashboard-port "$DASHBOARD_PORT"
        --metrics-export-port "$METRICS_PORT"
        --ray-client-server-port "$CLIENT_PORT"
        --dashboard-agent-listen-port "$AGENT_PORT"
        --temp-dir "$HEAD_DIR/ray"
        --disable-usage-stats
    )
    [[ -n "${RAY_NUM_CPUS:-}" ]] && args+=(--num-cpus "$RAY_NUM_CPUS")
    [[ -n "${RAY_NUM_GPUS:-}" ]] && args+=(--num-gpus "$RAY_NUM_GPUS")
    nohup ray "${args[@]}" >"$HEAD_DIR/head.log" 2>&1 &
    echo $! >"$PID_FILE"
    local deadline=$((SECONDS + START_TIMEOUT_S))
    until python - "$DASHBOARD_PORT" <<'PY' 2>/dev/null
import sys, urllib.error, urllib.request
try:  # any HTTP answer, 401 included (Ray 2.60 token auth), means the job server is listening
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/version", timeout=2).read()
except urllib.error.HTTPError:
    pass
PY
    do
        if ! running; then
            echo "ray head exited during start; see $HEAD_DIR/head.log" >&2
            tail -n 30 "$HEAD_DIR/head.log" >&2
            exit 1
        fi
        if ((SECONDS > deadline)); then
            echo "dashboard not up after ${START_TIMEOUT_S}s; see $HEAD_DIR/head.log" >&2
            stop
            exit 1
        fi
        sleep 1
    done
    echo "ray head up: GCS 127.0.0.1:$HEAD_PORT, dashboard + job server http://127.0.0.1:$DASHBOARD_PORT," \
         "metrics http://127.0.0.1:$METRICS_PORT/metrics (pid $(cat "$PID_FILE"))"
}

stop() {
    if ! running; then
        echo "no head started by this script is running"
        rm -f "$PID_FILE"
        return 0
    fi
    local pid
    pid="$(cat "$PID_FILE")"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "head (pid $pid) still running after 60s; sending SIGKILL" >&2
        kill -KILL "$pid"
    fi
    rm -f "$PID_FILE"
    echo "ray head stopped (pid $pid)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    address) echo "127.0.0.1:$HEAD_PORT" ;;
    status) if running; then echo "running (pid $(cat "$PID_FILE"))"; else echo "stopped"; exit 1; fi ;;
    *) echo "usage: $0 start|stop|status|address" >&2; exit 2 ;;
esac
