#!/bin/bash
# H200: the device lane tests (kill tests, three bandwidth runs).
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > $OUT/gpu.txt 2>&1
run() { local name=$1; shift; echo "=== $name $*"; timeout 300 "$@"; echo "=== $name rc=$?"; }
{
run device_lane ./device_lane --test-threads=1 --nocapture
run device_lane_2 ./device_lane --test-threads=1 --nocapture device_messages_cross
run device_lane_3 ./device_lane --test-threads=1 --nocapture device_messages_cross
} > $OUT/device_lane.log 2>&1
grep -E "^=== |test result|MiB|SKIPPED|panicked|reported lost" $OUT/device_lane.log
