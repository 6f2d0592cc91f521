#!/bin/bash
# Runs on the GPU host from .gpu/run (binaries built on the build machine):
# `go.sh tests` — every test binary built with cuda-uma, zerohop info, perf
# on uma, the examples on uma and as picked, and scripts/bench-shm 3;
# `go.sh final` — the same without the benchmark; `go.sh tcp` — the IPC and
# endpoint tests again, then scripts/bench-tcp 5. Logs under $OUT.
cd "$(dirname "$0")"
here=$PWD
export LD_LIBRARY_PATH=$here/lib UCX_MODULE_DIR=$here/ucx
repo=$(cd ../.. && pwd)
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; nproc; uname -r; uptime; } > $OUT/hw.log 2>&1
if [ "$1" = tests ] || [ "$1" = final ]; then
  for t in backends-cuda backends-cuda_ipc backends-zerohop_backends backends-mock_faults std-shim-uma std-shim-shm std-shim-tcp std-shim-zerohop_std zerohop-endpoint zerohop-shm zerohop-tokio tests-suite cli-cli; do
    echo "=== $t" >> $OUT/tests.log
    ZEROHOP_CLI_UNDER_TEST=$here/new/zerohop timeout 120 ./$t --test-threads=1 --nocapture >> $OUT/tests.log 2>&1
    echo "$t rc=$? $(grep 'test result' $OUT/tests.log | tail -1)"
  done
  ./new/zerohop info > $OUT/info.log 2>&1; echo "info rc=$?"
  { timeout 60 ./new/zerohop perf --transport uma; echo "rc=$?"
    timeout 60 ./new/zerohop perf --transport uma --zero-copy; echo "rc=$?"
    timeout 60 ./new/zerohop perf; echo "rc=$? (auto)"
    timeout 60 ./new/zerohop perf --transport shm; echo "rc=$? (shm, one process)"; } > $OUT/perf.log 2>&1
  grep -E "rc=|transport|^ *64 |65536|1048576" $OUT/perf.log | head -30
  for tr in uma auto; do
    { ZEROHOP_TRANSPORT=$tr timeout 120 ./new/echo selftest 300 && ZEROHOP_TRANSPORT=$tr timeout 120 ./new/gossip --spawn 8 --messages 100; echo "rc=$?"; } > $OUT/examples-$tr.log 2>&1
    echo "examples $tr: $(tail -2 $OUT/examples-$tr.log | tr '\n' ' ')"
  done
  [ "$1" = final ] && exit 0
  rm -rf /tmp/bench-shm; t0=$SECONDS
  BENCH_BIN_DIR=$here/new UCX_PERFTEST=$here/ucx_perftest BENCH_OUT=/tmp/bench-shm timeout 200 bash $repo/scripts/bench-shm 3 > $OUT/bench-shm.log 2>&1
  echo "bench-shm rc=$? in $((SECONDS - t0)) s"; cat $OUT/bench-shm.log | tail -12
  tar czf $OUT/bench-shm-raw.tgz -C /tmp bench-shm
fi
if [ "$1" = tcp ]; then
  for t in backends-cuda_ipc zerohop-endpoint; do
    echo "=== $t" >> $OUT/tests.log
    timeout 120 ./$t --test-threads=1 --nocapture >> $OUT/tests.log 2>&1
    echo "$t rc=$? $(grep 'test result' $OUT/tests.log | tail -1)"
  done
  grep -A12 "IPC GB/s" $OUT/tests.log
  rm -rf /tmp/bench-tcp; t0=$SECONDS
  BENCH_BIN_DIR=$here/new UCX_PERFTEST=$here/ucx_perftest BENCH_OUT=/tmp/bench-tcp timeout 540 bash $repo/scripts/bench-tcp 5 > $OUT/bench-tcp.log 2>&1
  echo "bench-tcp rc=$? in $((SECONDS - t0)) s"; tail -14 $OUT/bench-tcp.log
  tar czf $OUT/bench-tcp-raw.tgz -C /tmp bench-tcp
fi
