#!/bin/sh
bin=/work/main/target/release/zerohop
for r in 1 2 3 4; do
  rxe-pair ib_send_lat -s 64 -n 20000 | awk '$1==64{print $5}' > /out/pa.$r
  $bin perf --transport rdma --sizes 64 --iters 20000 --stream-bytes 64k --json --zero-copy > /out/zc.$r.json
  $bin perf --transport rdma --sizes 64 --iters 20000 --stream-bytes 64k --json > /out/cp.$r.json
  rxe-pair ib_send_lat -s 64 -n 20000 | awk '$1==64{print $5}' > /out/pb.$r
done
