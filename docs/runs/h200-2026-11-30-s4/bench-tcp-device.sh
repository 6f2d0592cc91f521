#!/bin/bash
# bench-tcp's runs, on the device machine (binaries carried in .gpu/run). Writes the same files under $1.
out=$1; runs=${2:-5}; here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib:$here/ucx UCX_MODULE_DIR=$here/ucx/none
sizes=64,4096,65536,1048576
ucx() { local port=$((20000 + RANDOM % 20000)); UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest -p $port >/dev/null 2>&1 & local srv=$!; sleep 0.5; UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" 2>/dev/null | awk '/^Final:/{print}'; wait $srv || true; }
for r in $(seq 1 $runs); do
  port=$((20000 + RANDOM % 20000))
  $here/zerohop perf --transport tcp --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!; sleep 0.3
  $here/zerohop perf --transport tcp --connect 127.0.0.1:$port --sizes $sizes --json > $out/zerohop.$r.json; wait $srv
  $here/zerohop perf --transport tcp --sizes $sizes --json > $out/zerohop1.$r.json
  $here/raw_tcp $sizes > $out/raw.$r.json
  $here/raw_tcp $sizes spin > $out/rawspin.$r.json
  for s in 64 4096 65536 1048576; do
    n=$(( s >= 1048576 ? 2000 : (s >= 65536 ? 20000 : 100000) ))
    echo "$s $(ucx tag_lat $s 10000)" >> $out/ucx_lat.$r.txt
    echo "$s $(ucx tag_bw $s $n)" >> $out/ucx_bw.$r.txt
  done
done
