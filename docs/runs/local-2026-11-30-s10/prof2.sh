#!/bin/sh
bin=/work/main/target/release/zerohop
$bin perf --transport rdma --sizes 64k --iters 100 --stream-bytes 192000k --zero-copy --json > /out/zc.json &
pid=$!; sleep 1.5
perf record -a -g -o /tmp/perf.data -- sleep 2 2>/dev/null
wait $pid
for c in 0 1; do
perf report -i /tmp/perf.data --cpu $c --sort comm,dso --stdio --no-children -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | head -8 > /out/cpu$c-dso.txt
perf report -i /tmp/perf.data --cpu $c --sort tid,sym --stdio --no-children -g none 2>/dev/null | grep -v "^#" | grep -v "^$" | grep "\[k\]" | head -25 > /out/cpu$c-k.txt
perf report -i /tmp/perf.data --cpu $c --sort sym --stdio --no-children -g caller,0.5,callee --percent-limit 3 2>/dev/null | grep -v "^$" | head -120 > /out/cpu$c-callers.txt
done
