#!/bin/bash
# H200 host: a sender spinning for room moves the wire every try (base,
# 4cb2cb7) or one try in eight (pe8); perf over shm, zero-copy and copying,
# four alternating rounds.
here=$(cd "$(dirname "$0")/../../../.gpu" && pwd)
for r in 1 2 3 4; do for b in base pe8; do for mode in --zero-copy ""; do
  zh=$here/ab/zh-$b
  port=$((20000 + RANDOM % 20000))
  $zh perf --transport shm --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!
  sleep 0.3
  echo "$r $b ${mode:-copy} $(timeout 60 $zh perf --transport shm --connect 127.0.0.1:$port --sizes 64,65536,1048576 $mode --json | python3 -c "import json,sys; print(' | '.join(f\"{r['size']} {r['lat_p50_us']:.2f}us {r['bw_gb_per_s']:.2f}GB/s\" for r in json.load(sys.stdin)['rows']))")" | tee -a $OUT/ab.log
  wait $srv
done; done; done
