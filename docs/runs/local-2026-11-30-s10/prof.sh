#!/bin/sh
bin=/work/main/target/release/zerohop
$bin perf --transport rdma --sizes 64k --iters 100 --stream-bytes 192000k --zero-copy --json > /out/zc.json &
pid=$!; sleep 1.5
perf record -a -o /tmp/perf.data -- sleep 2 2>/dev/null
wait $pid
perf report -i /tmp/perf.data --sort cpu,comm,dso --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -30 > /out/report.txt
rxe-pair ib_send_bw -s 65536 -n 3000 > /out/pt.txt 2>&1 &
sleep 1.5
perf record -a -o /tmp/perf2.data -- sleep 1.5 2>/dev/null
wait
perf report -i /tmp/perf2.data --sort cpu,comm,dso --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | head -30 > /out/report-pt.txt
