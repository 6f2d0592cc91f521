#!/bin/bash
cd "$(dirname "$0")"
run() { local name=$1; shift; echo "=== $name $*"; timeout 240 "$@"; echo "=== $name rc=$?"; }
{
run cuda_ipc ./cuda_ipc --test-threads=1 --nocapture device_memory_crosses
run device_lane ./device_lane --test-threads=1 --nocapture device_messages_cross
run device_lane_2 ./device_lane --test-threads=1 --nocapture device_messages_cross
run device_lane_3 ./device_lane --test-threads=1 --nocapture device_messages_cross
} > $OUT/probe.log 2>&1
grep -E "^=== |test result| MiB  |SKIPPED|panicked|MiB \|" $OUT/probe.log
