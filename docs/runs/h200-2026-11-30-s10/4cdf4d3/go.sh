#!/bin/bash
# Runs on the GPU host: every test binary (logs into one file), then zerohop info and perf smoke runs.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $OUT/gpu.txt 2>&1
for t in cuda suite tcp uma verbs mock_faults backends_lib; do
  echo "===== $t" >> $OUT/tests.log
  ./${t}_tests --test-threads=1 >> $OUT/tests.log 2>&1; rc=$?
  echo "$t rc=$rc $(grep 'test result' $OUT/tests.log | tail -1)"
done
./zerohop info > $OUT/info.txt 2>&1; echo "info rc=$?"
timeout 120 ./zerohop perf --transport uma > $OUT/perf-uma.txt 2>&1; echo "perf uma rc=$?"
timeout 120 ./zerohop perf --transport uma --zero-copy > $OUT/perf-uma-zc.txt 2>&1; echo "perf uma zc rc=$?"
timeout 60 ./zerohop perf --transport rdma > $OUT/perf-rdma.txt 2>&1; echo "perf rdma rc=$? (no RDMA device there: expect a typed refusal)"; tail -1 $OUT/perf-rdma.txt
