#!/bin/bash
# Alternating rounds, two processes, 64 B one-way p50: the busy-polling raw
# program plain, then taken step by step towards zerohop's system calls
# (std-shim/examples/raw_tcp.rs: epoll2, record, stage), then zerohop perf
# over TCP. What the raw program's shapes add is the kernel's share of the
# gap; what is left beyond them is zerohop's own (user-space) work.
#   RAW=.gpu/bin/raw_tcp ZEROHOP=.gpu/bin/zerohop-plain bash shape-ab.sh ROUNDS
raw=${RAW:-target/release/examples/raw_tcp}; zh=${ZEROHOP:-target/release/zerohop}; rounds=${1:-7}
. "$(dirname "$0")/../../../scripts/lib/perf-pair.sh"
one() { # label, raw args...
  local label=$1 port srv v try; shift
  for try in 1 2 3; do # a server slow to listen, or a port taken: another
    port=$((20000 + RANDOM % 20000))
    timeout 60 $raw 64 spin "$@" listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!
    sleep 0.3
    v=$(timeout 60 $raw 64 spin "$@" connect 127.0.0.1:$port 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0]["lat_p50_us"])' 2>/dev/null)
    kill $srv 2>/dev/null; wait $srv 2>/dev/null
    [ -n "$v" ] && { echo "$label $r $v"; return; }
  done
}
tmp=$(mktemp -d)
for r in $(seq 1 $rounds); do
  one plain
  one epoll2 epoll2
  one record+stage record stage
  one all epoll2 record stage
  perf_pair "$zh" tcp "$tmp/z.json" --sizes 64 --iters 20000 --stream-bytes 64M >/dev/null 2>&1 &&
    echo "zerohop $r $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["rows"][0]["lat_p50_us"])' "$tmp/z.json")"
done | tee /dev/stderr | python3 -c '
import sys, statistics
d = {}
for l in sys.stdin:
    m, r, v = l.split(); d.setdefault(m, []).append(float(v))
base = statistics.median(d["plain"])
for m, v in d.items(): print(f"{m:14} median {statistics.median(v):.3f} us  {statistics.median(v)/base:.3f}x plain  rounds {v}")'
rm -rf "$tmp"
