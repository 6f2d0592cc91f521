#!/bin/bash
# H200: uma endpoints with same-host lanes. The facade's shm tests (the uma
# one among them), the endpoint tests, std-shim's shm tests; then `zerohop
# info` and `zerohop perf` with auto (uma here) and with tcp, two processes.
cd "$(dirname "$0")"
for t in zerohop-shm zerohop-endpoint std-shim-shm; do
  echo "=== $t" >> $OUT/tests.log
  timeout 150 ./$t --test-threads=1 --nocapture >> $OUT/tests.log 2>&1
  echo "$t rc=$? $(grep 'test result' $OUT/tests.log | tail -1)"
done
grep -E "SKIPPED|panicked" $OUT/tests.log | head
./bin/zerohop info > $OUT/info.log 2>&1; head -30 $OUT/info.log
for tr in auto tcp auto tcp; do
  port=$((20000 + RANDOM % 20000))
  ./bin/zerohop perf --transport $tr --listen 127.0.0.1:$port > /dev/null 2>&1 &
  sleep 0.5
  echo "== perf $tr"
  timeout 120 ./bin/zerohop perf --transport $tr --connect 127.0.0.1:$port --sizes 64,64k,1M 2>&1 | tee -a $OUT/perf.log
  wait
done
