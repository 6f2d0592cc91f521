#!/bin/sh
# per-CPU /proc/stat deltas around each run, plus per-thread task-clock
bin=/work/main/target/release/zerohop
snap() { grep '^cpu[0-9]' /proc/stat > /tmp/s.$1; }
delta() { paste /tmp/s.a /tmp/s.b | awk -v tag="$1" '{n=NF/2; printf "%s %s user %d sys %d idle %d irq %d softirq %d\n", tag, $1, ($2+$3)-($(n+2)+$(n+3)), $4-$(n+4), $5-$(n+5), $7-$(n+7), $8-$(n+8)}' | sed 's/-//g'; }
for r in 1 2 3; do
  snap a; rxe-pair ib_send_bw -s 65536 -n 3000 | grep -E '^ 65536'; snap b; delta "pt$r"
  snap a
  $bin perf --transport rdma --sizes 64k --iters 100 --stream-bytes 192000k --zero-copy --json > /out/zc.$r.json &
  pid=$!; sleep 1.5
  perf stat --per-thread -e task-clock,context-switches,cpu-migrations -p $pid -o /out/pt.$r.txt &
  ppid=$!
  wait $pid; kill -INT $ppid 2>/dev/null; wait $ppid
  snap b; delta "zc$r"
  python3 -c "import json;r=json.load(open('/out/zc.$r.json'))['rows'][0];print('zc$r MB/s', r['bw_gb_per_s']*1000)" 2>/dev/null || grep -o '"bw_gb_per_s":[0-9.e-]*' /out/zc.$r.json
done
