#!/bin/bash
# Runs on the GPU host: every test binary, then zerohop info and perf smoke runs on uma.
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $OUT/gpu.txt 2>&1
for t in cuda suite tcp uma verbs mock_faults backends_lib; do
  ./${t}_tests --test-threads=1 > $OUT/$t.log 2>&1; echo "$t rc=$? $(grep 'test result' $OUT/$t.log | tail -1)"
done
./zerohop info > $OUT/info.txt 2>&1; echo "info rc=$?"
timeout 120 ./zerohop perf --transport uma > $OUT/perf-uma.txt 2>&1; echo "perf uma rc=$?"
timeout 120 ./zerohop perf --transport uma --zero-copy > $OUT/perf-uma-zc.txt 2>&1; echo "perf uma zc rc=$?"
timeout 60 ./zerohop perf --transport rdma > $OUT/perf-rdma.txt 2>&1; echo "perf rdma rc=$? (no RDMA device there: expect a typed refusal)"; tail -3 $OUT/perf-rdma.txt
