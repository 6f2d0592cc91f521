#!/bin/bash
# perf's copying latency, the parent's server (echo of the received buffer)
# against 3199593's (an answer from the server's own buffer), three
# alternating rounds beside ucx_perftest UCX_TLS=sm tag_lat at 64 KiB.
# /tmp/zerohop-old: the CLI built at 3199593's parent; /tmp/zerohop-new: at 3199593.
for r in 1 2 3; do
  for v in old new; do
    Z=/tmp/zerohop-$v
    $Z perf --transport shm --listen 127.0.0.1:2346$r >/dev/null 2>&1 & sleep 0.4
    echo "$v: $($Z perf --transport shm --connect 127.0.0.1:2346$r --sizes 64,64k,1M --iters 5000 --stream-bytes 16M 2>&1 |
      grep -E '^ +(64 B|64 KiB|1 MiB)' | awk '{print $1$2, $4}' | tr '\n' ' ')"
    wait
  done
  UCX_TLS=sm ucx_perftest -t tag_lat -s 65536 -n 5000 >/dev/null 2>&1 & sleep 0.5
  echo "ucx 64k: $(UCX_TLS=sm ucx_perftest 127.0.0.1 -t tag_lat -s 65536 -n 5000 2>&1 | tail -1)"
  wait
done
