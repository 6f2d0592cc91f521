# Sourced by the bench scripts (bench-shm, bench-tcp, bench-scale,
# ab-perf): one `zerohop perf` run as two processes on 127.0.0.1.
#
#   perf_pair BINARY TRANSPORT OUT [CLIENT ARGS...]
#
# A server (`--listen`) on a random port, then the client (`--connect`, the
# arguments given, `--json`) into OUT. A server not up in time, or a port
# taken meanwhile: another port, up to three tries. Returns the server's
# status after a client that printed rows, else fails. PERF_SERVER_ARGS:
# more arguments for the server (e.g. `--spin-us 50`).
perf_pair() {
    local bin=$1 transport=$2 out=$3 port try srv
    shift 3
    for try in 1 2 3; do
        port=$((20000 + RANDOM % 20000))
        # shellcheck disable=SC2086 # PERF_SERVER_ARGS: words
        timeout 120 "$bin" perf --transport "$transport" --listen 127.0.0.1:$port ${PERF_SERVER_ARGS:-} >/dev/null 2>&1 &
        srv=$!
        sleep 0.3
        if timeout 120 "$bin" perf --transport "$transport" --connect 127.0.0.1:$port "$@" --json > "$out" &&
            grep -q '"rows"' "$out"; then
            wait $srv
            return
        fi
        echo "perf_pair: try $try (port $port) failed: $(head -c 300 "$out")" >&2
        kill $srv 2>/dev/null || true
        wait $srv 2>/dev/null || true
    done
    return 1
}
