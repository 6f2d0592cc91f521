#!/bin/bash
# H200 host at 7424284: the shm lane tests, then scripts/bench-shm 3 (UCX carried).
cd "$(dirname "$0")"
here=$PWD
export LD_LIBRARY_PATH=$here/lib UCX_MODULE_DIR=$here/ucx
repo=$(cd .. && pwd)
{ nproc; uname -r; uptime; } > $OUT/hw.log 2>&1
timeout 120 ./std-shim-shm --test-threads=1 --nocapture > $OUT/std-shim-shm.log 2>&1; echo "std-shim-shm rc=$? $(grep 'test result' $OUT/std-shim-shm.log)"
rm -rf /tmp/bench-shm; t0=$SECONDS
BENCH_BIN_DIR=$here/new UCX_PERFTEST=$here/ucx_perftest BENCH_OUT=/tmp/bench-shm timeout 300 bash $repo/scripts/bench-shm 3 > $OUT/bench-shm.log 2>&1
echo "== rc=$? in $((SECONDS - t0)) s"; tail -9 $OUT/bench-shm.log
