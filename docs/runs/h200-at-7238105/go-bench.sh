#!/bin/bash
# H200 host at 7238105: scripts/bench-shm 3 and scripts/bench-tcp 3, UCX carried.
cd "$(dirname "$0")/../../../.gpu"
here=$PWD
repo=$(cd .. && pwd)
export LD_LIBRARY_PATH=$here/lib UCX_MODULE_DIR=$here/ucx
{ nproc; uname -r; uptime; } > $OUT/hw-bench.log 2>&1
# std-shim's shm tests again, built with the testing feature (the first call's
# build lacked it, and with it two tests of half-written frames).
timeout 60 ./std-shim-shm --test-threads=1 > $OUT/std-shim-shm-testing.log 2>&1
echo "std-shim-shm (testing) rc=$? $(grep 'test result' $OUT/std-shim-shm-testing.log)"
t0=$SECONDS
BENCH_BIN_DIR=$here/bin UCX_PERFTEST=$here/bin/ucx_perftest BENCH_OUT=/tmp/bench-shm timeout 280 bash $repo/scripts/bench-shm 3 > $OUT/bench-shm.log 2>&1
echo "== bench-shm rc=$? in $((SECONDS - t0)) s"; tail -9 $OUT/bench-shm.log
t0=$SECONDS
BENCH_BIN_DIR=$here/bin UCX_PERFTEST=$here/bin/ucx_perftest BENCH_OUT=/tmp/bench-tcp timeout 290 bash $repo/scripts/bench-tcp 3 > $OUT/bench-tcp.log 2>&1
echo "== bench-tcp rc=$? in $((SECONDS - t0)) s"; tail -12 $OUT/bench-tcp.log
# A third call, for the one_thread figures of the first (0.73-0.82 us against
# 0.42-0.48 at a154dbc): a154dbc's bench binary and this one alternately
# (one_thread_ab.log):
#   cd .gpu/bin && for r in 1 2 3; do for b in one_thread_a154dbc one_thread; do
#   echo -n "$b: "; timeout 30 ./$b shm 200000 0; done; done
