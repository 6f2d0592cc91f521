#!/bin/bash
# Build VM: the lane's short records (7936193's build, zerohop_new) against
# 1745f78's (zerohop_base), alternating, two processes as scripts/bench-shm
# runs them, with ucx_perftest (UCX_TLS=sm) each round. BIN holds the two
# builds (target/release/zerohop of each commit); OUT the raw outputs.
#   BIN=dir OUT=dir bash ab.sh [rounds]
set -u
zh() { # binary round
    local port=$((20000 + RANDOM % 20000))
    timeout 60 $BIN/$1 perf --transport shm --listen 127.0.0.1:$port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    timeout 60 $BIN/$1 perf --transport shm --connect 127.0.0.1:$port --sizes 64,4k,64k --iters 50000 --stream-bytes 256M --json > $OUT/$1.$2.json
    wait $srv
}
ucx() { # test size count
    local port=$((20000 + RANDOM % 20000))
    UCX_TLS=sm timeout 60 ucx_perftest -p $port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    UCX_TLS=sm timeout 60 ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" 2>/dev/null | awk '/^Final:/{print}'
    wait $srv || true
}
for r in $(seq 1 ${1:-5}); do
    zh zerohop_base $r
    zh zerohop_new $r
    echo "64 $(ucx tag_lat 64 50000)" >> $OUT/ucx_lat.$r.txt
done
python3 - "$OUT" <<'PY'
import glob, json, os, re, statistics, sys
out = sys.argv[1]
runs = {}
for f in sorted(glob.glob(f"{out}/*.json")):
    name = re.sub(r"\.\d+\.json$", "", os.path.basename(f))
    for row in json.load(open(f))["rows"]:
        runs.setdefault((name, row["size"]), []).append((row["lat_p50_us"], row.get("bw_gb_per_s")))
ucx = [float(l.split()[3]) for f in glob.glob(f"{out}/ucx_lat.*.txt") for l in open(f) if len(l.split()) > 3]
print("UCX sm 64 B p50 (us):", sorted(ucx), "median", statistics.median(ucx) if ucx else None)
for (name, size), v in sorted(runs.items()):
    lat = [x[0] for x in v]
    bw = [x[1] for x in v if x[1] is not None]
    print(f"{name:16} {size:>6}  p50 us {statistics.median(lat):7.3f}  rounds {[round(x, 3) for x in lat]}  GB/s median {statistics.median(bw) if bw else float('nan'):.2f}")
PY
