#!/bin/bash
# Alternating rounds: raw_tcp spin two processes, without and with epoll watching its sockets.
raw=${RAW:-target/release/examples/raw_tcp}; rounds=${1:-9}
for r in $(seq 1 $rounds); do
  for mode in plain epoll; do
    port=$((20000 + RANDOM % 20000)); extra=; [ $mode = epoll ] && extra=epoll
    timeout 60 $raw 64 spin $extra listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!
    sleep 0.2
    v=$(timeout 60 $raw 64 spin $extra connect 127.0.0.1:$port | python3 -c 'import json,sys; print(json.load(sys.stdin)["rows"][0]["lat_p50_us"])')
    wait $srv
    echo "$mode $r $v"
  done
done | tee /dev/stderr | python3 -c '
import sys, statistics
d = {}
for l in sys.stdin:
    m, r, v = l.split(); d.setdefault(m, []).append(float(v))
for m, v in d.items(): print(m, "median", round(statistics.median(v), 3), v)
print("epoll/plain", round(statistics.median(d["epoll"]) / statistics.median(d["plain"]), 3))'
