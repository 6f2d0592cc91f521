#!/bin/bash
# H200 host at 7238105: the lane tests with cuda-uma (suite, lane, std-shim
# shm and shm_descriptors, facade shm and endpoint; debug), the device lane and CUDA IPC tests
# (release), and the one_thread bench (shm with 0, 10 and 100 idle peers; tcp).
here=$(cd "$(dirname "$0")/../../../.gpu" && pwd)
cd "$here"
{ nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv; nproc; uname -r; uptime; } > $OUT/hw.log 2>&1
for t in tests-suite tests-lane std-shim-shm std-shim-shm-descriptors zerohop-shm zerohop-endpoint; do
  echo "=== $t" >> $OUT/tests.log
  timeout 150 ./$t --test-threads=1 >> $OUT/tests.log 2>&1
  echo "$t rc=$? $(grep 'test result' $OUT/tests.log | tail -1)"
done
echo "SKIPPED lines: $(grep -c SKIPPED $OUT/tests.log)"
run() { local name=$1; shift; echo "=== $name $*"; timeout 200 "$@"; echo "=== $name rc=$?"; }
{
run device_lane ./device_lane --test-threads=1 --nocapture
run cuda_ipc ./cuda_ipc --test-threads=1 --nocapture
} > $OUT/device_lane.log 2>&1
grep -E "^=== |test result| MiB  |MiB \||SKIPPED|panicked|lost" $OUT/device_lane.log | head -60
for n in 0 10 100; do for r in 1 2 3; do timeout 60 ./bin/one_thread shm 200000 $n; done; done > $OUT/one_thread.log 2>&1
for r in 1 2 3; do timeout 60 ./bin/one_thread tcp 50000 0; done >> $OUT/one_thread.log 2>&1
cat $OUT/one_thread.log
