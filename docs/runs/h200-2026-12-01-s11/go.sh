#!/bin/bash
# Runs on the GPU host: every test binary, zerohop info, perf on uma, then
# scripts/bench-tcp with the binaries of $1 (new or old) for $2 rounds.
cd "$(dirname "$0")"
here=$PWD
export LD_LIBRARY_PATH=$here/lib:$here/ucx UCX_MODULE_DIR=$here/ucx
which=${1:-new} rounds=${2:-5} tests=${3:-yes}
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; nproc; uname -r; uptime; } > $OUT/hw.log 2>&1
if [ "$tests" = yes ]; then
  for t in cuda suite tcp uma verbs mock_faults backends_lib; do
    echo "=== $t" >> $OUT/tests.log
    timeout 240 ./${t}_tests --test-threads=1 >> $OUT/tests.log 2>&1; echo "$t rc=$? $(grep 'test result' $OUT/tests.log | tail -1)"
  done
  ./new/zerohop info > $OUT/info.log 2>&1; echo "info rc=$?"
  { timeout 120 ./new/zerohop perf --transport uma; echo "rc=$?"
    timeout 120 ./new/zerohop perf --transport uma --zero-copy; echo "rc=$?"
    timeout 60 ./new/zerohop perf --transport rdma; echo "rc=$? (no RDMA device there: a typed refusal expected)"
    timeout 120 ./new/zerohop perf; echo "rc=$? (the README's main job)"; } > $OUT/perf.log 2>&1
  grep -E "rc=|transport|64 B|65536|1048576" $OUT/perf.log | head -30
fi
rm -rf /tmp/bench-$which
t0=$SECONDS
BENCH_BIN_DIR=$here/$which UCX_PERFTEST=$here/ucx_perftest BENCH_OUT=/tmp/bench-$which \
  timeout 420 bash ../../scripts/bench-tcp $rounds > $OUT/bench-tcp-$which.log 2>&1
echo "bench-tcp $which rc=$? in $((SECONDS - t0)) s"; cat $OUT/bench-tcp-$which.log
tar czf $OUT/bench-$which-raw.tgz -C /tmp bench-$which
