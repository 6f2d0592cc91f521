#!/bin/bash
# spin A/B for two-process zerohop perf over TCP: default (busy-poll) vs --spin-us 1000, 1 MiB and 4 MiB
zh=target/release/zerohop
for r in 1 2 3 4 5 6; do
  for spin in default 1000; do
    args=(); [ $spin != default ] && args=(--spin-us $spin)
    port=$((20000 + RANDOM % 20000))
    $zh perf --transport tcp --listen 127.0.0.1:$port "${args[@]}" >/dev/null 2>&1 & srv=$!
    sleep 0.3
    $zh perf --transport tcp --connect 127.0.0.1:$port --sizes 1048576,4194304 --json "${args[@]}" > /tmp/tcpab/$spin.$r.json
    wait $srv
  done
done
