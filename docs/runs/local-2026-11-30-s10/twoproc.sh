#!/bin/sh
bin=/work/main/target/release/zerohop
for r in 1 2 3 4; do
  rxe-pair ib_send_lat -s 64 -n 20000 | awk '$1==64{print "pt_lat", $5}'
  $bin perf --transport rdma --listen $RXE_ADDR:7600 > /dev/null 2>&1 & s=$!; sleep 0.5
  $bin perf --transport rdma --connect $RXE_ADDR:7600 --sizes 64 --iters 20000 --stream-bytes 64k --zero-copy --json > /out/lat2p.$r.json; wait $s
  $bin perf --transport rdma --sizes 64 --iters 20000 --stream-bytes 64k --zero-copy --json > /out/lat1p.$r.json
  rxe-pair ib_send_bw -s 65536 -n 3000 | awk '$1==65536{print "pt_bw", $4}'
  $bin perf --transport rdma --listen $RXE_ADDR:7601 > /dev/null 2>&1 & s=$!; sleep 0.5
  $bin perf --transport rdma --connect $RXE_ADDR:7601 --sizes 64k --iters 100 --stream-bytes 192000k --zero-copy --json > /out/bw2p.$r.json; wait $s
  $bin perf --transport rdma --sizes 64k --iters 100 --stream-bytes 192000k --zero-copy --json > /out/bw1p.$r.json
done
