#!/bin/bash
out=$1; runs=${2:-6}; here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib:$here/ucx UCX_MODULE_DIR=$here/ucx/none
ucx() { local port=$((20000 + RANDOM % 20000)); UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest -p $port >/dev/null 2>&1 & local srv=$!; sleep 0.5; UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" 2>/dev/null | awk '/^Final:/{printf "%.3f", $7*1.048576e-3}'; wait $srv || true; }
j() { python3 -c 'import json,sys; print(" ".join("%.3f"%r["bw_gb_per_s"] for r in json.load(sys.stdin)["rows"]))' 2>/dev/null || cat; }
for r in $(seq 1 $runs); do
  for v in nodefer defer; do
    port=$((20000 + RANDOM % 20000))
    $here/zh-$v perf --transport tcp --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!; sleep 0.3
    $here/zh-$v perf --transport tcp --connect 127.0.0.1:$port --sizes 64k,1M --iters 10 --json > $out/$v.$r.json; wait $srv
  done
  $here/raw_tcp 65536,1048576 spin > $out/spin.$r.json
  echo "$(ucx tag_bw 65536 20000) $(ucx tag_bw 1048576 2000)" > $out/ucx.$r.txt
done
