#!/bin/bash
# H200 host: pool chunks from the heap allocator (base, 4c6370e) or mapped
# 2 MiB-aligned and advised huge (huge); perf over shm, copying and
# zero-copy, four alternating rounds; the host's THP mode and the
# receiver's huge pages in use.
here=$(cd "$(dirname "$0")/../../../.gpu" && pwd)
{ cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; } > $OUT/thp.log 2>&1
for r in 1 2 3 4; do for b in base huge; do for mode in "" --zero-copy; do
  zh=$here/ab/zh-$b
  port=$((20000 + RANDOM % 20000))
  $zh perf --transport shm --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!
  sleep 0.3
  ( sleep 2; echo "$r $b ${mode:-copy} server $(grep AnonHugePages /proc/$srv/smaps_rollup 2>/dev/null)" >> $OUT/thp.log ) &
  echo "$r $b ${mode:-copy} $(timeout 60 $zh perf --transport shm --connect 127.0.0.1:$port --sizes 64,65536,1048576 $mode --json | python3 -c "import json,sys; print(' | '.join(f\"{r['size']} {r['lat_p50_us']:.2f}us {r['bw_gb_per_s']:.2f}GB/s\" for r in json.load(sys.stdin)['rows']))")" | tee -a $OUT/ab.log
  wait $srv
done; done; done
cat $OUT/thp.log
