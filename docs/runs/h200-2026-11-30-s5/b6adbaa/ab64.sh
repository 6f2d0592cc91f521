#!/bin/bash
# 64 KiB (and 1 MiB) two-process A/B on the device: the tree before this session (zh-base) vs now (zerohop), alternating.
out=$1; runs=${2:-8}; here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq 1 $runs); do
  for v in base now; do
    bin=$here/zerohop; [ $v = base ] && bin=$here/zh-base
    port=$((20000 + RANDOM % 20000))
    $bin perf --transport tcp --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!; sleep 0.3
    $bin perf --transport tcp --connect 127.0.0.1:$port --sizes 65536,1048576 --json > $out/$v.$r.json; wait $srv
  done
  $here/raw_tcp 65536,1048576 > $out/raw.$r.json
done
