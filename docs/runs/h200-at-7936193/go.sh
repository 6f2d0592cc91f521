#!/bin/bash
# H200 host at 7936193 (the lane's short records), one device call:
# 1. the shm tests built with cuda-uma (docs/runs/h200-at-7238105/build-here.sh
#    at 7936193): device messages and short records share a lane there;
# 2. an A/B of 7936193's zerohop (zerohop_new) against 1745f78's
#    (zerohop_base), both `cargo build --release -p zerohop-cli --features
#    cuda-uma`, stripped, alternating, two processes, UCX sm each round;
# 3. the one-thread bench (CPU time per one-way message, no peer to wait on);
# 4. scripts/bench-shm 3 with 7936193's build.
cd "$(dirname "$0")/../../../.gpu"
here=$PWD
repo=$(cd .. && pwd)
export LD_LIBRARY_PATH=$here/lib UCX_MODULE_DIR=$here/ucx
{ nproc; uname -r; uptime; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; } > $OUT/hw.log 2>&1
for t in std-shim-shm tests-lane zerohop-shm; do
    timeout 100 ./$t --test-threads=1 > $OUT/test-$t.log 2>&1
    echo "$t rc=$? $(grep 'test result' $OUT/test-$t.log)"
done
timeout 150 ./device_lane --nocapture --test-threads=1 > $OUT/test-device_lane.log 2>&1
echo "device_lane rc=$? $(grep 'test result' $OUT/test-device_lane.log)"
zh() { # binary round
    local port=$((20000 + RANDOM % 20000))
    timeout 60 bin/$1 perf --transport shm --listen 127.0.0.1:$port >/dev/null 2>&1 &
    local srv=$!
    sleep 0.3
    timeout 60 bin/$1 perf --transport shm --connect 127.0.0.1:$port --sizes 64,4k,64k --iters 50000 --stream-bytes 256M --json > /tmp/ab/$1.$2.json
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
mkdir -p /tmp/ab
t0=$SECONDS
for r in 1 2 3 4 5; do
    zh zerohop_base $r
    zh zerohop_new $r
    echo "64 $(ucx tag_lat 64 50000)" >> /tmp/ab/ucx_lat.$r.txt
done
echo "== A/B in $((SECONDS - t0)) s"
python3 - /tmp/ab <<'PY' | tee $OUT/ab.log
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
for i in 1 2 3; do timeout 30 bin/one_thread shm 200000; done > $OUT/one_thread.log 2>&1
cat $OUT/one_thread.log
t0=$SECONDS
BENCH_BIN_DIR=$here/bin UCX_PERFTEST=$here/bin/ucx_perftest BENCH_OUT=/tmp/bench-shm timeout 250 bash $repo/scripts/bench-shm 3 > $OUT/bench-shm.log 2>&1
echo "== bench-shm rc=$? in $((SECONDS - t0)) s"; tail -9 $OUT/bench-shm.log
