#!/bin/bash
# H200 host: the lane's reader prefetching the next frame's lines beside its
# look at the head (zerohop_pf) against b0bc2ac (zerohop_base), alternating,
# two processes as scripts/bench-shm runs them, with ucx_perftest (UCX_TLS=sm)
# each round; and TCP 64 B with one epoll look in 64 polls instead of 8
# (zerohop_ep64) against b0bc2ac and the busy-polling raw program in two
# processes (spin2p). Also std-shim's shm tests (testing feature) of the tree built.
cd "$(dirname "$0")/../../../.gpu"
here=$PWD
export LD_LIBRARY_PATH=$here/lib UCX_MODULE_DIR=$here/ucx
{ nproc; uname -r; uptime; } > $OUT/hw.log 2>&1
timeout 90 ./std-shim-shm --test-threads=1 > $OUT/std-shim-shm-testing.log 2>&1
echo "std-shim-shm (testing) rc=$? $(grep 'test result' $OUT/std-shim-shm-testing.log)"
zh() { # binary round [transport sizes]
    local port=$((20000 + RANDOM % 20000)) t=${3:-shm}
    timeout 60 bin/$1 perf --transport $t --listen 127.0.0.1:$port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    timeout 60 bin/$1 perf --transport $t --connect 127.0.0.1:$port --sizes ${4:-64,4k,64k} --iters 50000 --stream-bytes 256M --json > $OUT/$1.$t.$2.json
    wait $srv
}
spin2p() { # round
    local port=$((20000 + RANDOM % 20000))
    timeout 60 bin/raw_tcp 64 spin listen 127.0.0.1:$port >/dev/null &
    local srv=$!
    sleep 0.2
    timeout 60 bin/raw_tcp 64 spin connect 127.0.0.1:$port > $OUT/spin2p.$1.json
    wait $srv
}
ucx() { # test size count
    local port=$((20000 + RANDOM % 20000))
    UCX_TLS=sm timeout 60 bin/ucx_perftest -p $port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.5
    UCX_TLS=sm timeout 60 bin/ucx_perftest 127.0.0.1 -p $port -t "$1" -s "$2" -n "$3" 2>/dev/null | awk '/^Final:/{print}'
    wait $srv || true
}
for r in 1 2 3 4 5; do
    zh zerohop_base $r
    zh zerohop_pf $r
    echo "64 $(ucx tag_lat 64 50000)" >> $OUT/ucx_lat.$r.txt
done
for r in 1 2 3 4 5; do
    zh zerohop_base $r tcp 64
    zh zerohop_ep64 $r tcp 64
    spin2p $r
done
cat $OUT/ucx_lat.*.txt
command -v python3 >/dev/null || { echo "no python3: raw outputs only"; exit 0; }
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
    print(f"{name:24} {size:>6}  p50 us {statistics.median(lat):7.3f}  rounds {[round(x, 3) for x in lat]}  GB/s median {statistics.median(bw) if bw else float('nan'):.2f}")
PY
