#!/bin/bash
out=$1; runs=${2:-6}; here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib:$here/ucx UCX_MODULE_DIR=$here/ucx/none
ucx() { local port=$((20000 + RANDOM % 20000)); UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest -p $port >/dev/null 2>&1 & local srv=$!; sleep 0.5; UCX_TLS=tcp timeout 120 $here/ucx/ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" 2>/dev/null | awk '/^Final:/{printf "%.3f", $7*1.048576e-3}'; wait $srv || true; }
for r in $(seq 1 $runs); do
  for v in 0 1048576 4194304 16777216; do
    port=$((20000 + RANDOM % 20000))
    e=""; [ $v != 0 ] && e="ZH_BUF=$v"
    env $e $here/zh-buf perf --transport tcp --listen 127.0.0.1:$port >/dev/null 2>&1 & srv=$!; sleep 0.3
    env $e $here/zh-buf perf --transport tcp --connect 127.0.0.1:$port --sizes 64k,1M --iters 10 --json > $out/b$v.$r.json; wait $srv
  done
  echo "$(ucx tag_bw 65536 20000) $(ucx tag_bw 1048576 2000)" > $out/ucx.$r.txt
done
