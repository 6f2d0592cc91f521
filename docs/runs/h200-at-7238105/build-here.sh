#!/bin/bash
# Builds, on the build VM, what the H200 run carries in .gpu/ (stripped).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exe() { # cargo args... -> the executable of the one test/bench target built
    cargo "$@" --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] != ["bin"]:
        print(m["executable"])' | tail -1
}
put() { install -m 755 "$1" ".gpu/$2"; strip ".gpu/$2"; }
mkdir -p .gpu/bin
put "$(exe test --no-run -p zerohop-tests --features cuda-uma --test suite)" tests-suite
put "$(exe test --no-run -p zerohop-tests --features cuda-uma --test lane)" tests-lane
put "$(exe test --no-run -p zerohop-std --features cuda-uma,testing --test shm)" std-shim-shm
put "$(exe test --no-run -p zerohop-std --features cuda-uma --test shm_descriptors)" std-shim-shm-descriptors
put "$(exe test --no-run -p zerohop --features cuda-uma --test shm)" zerohop-shm
put "$(exe test --no-run -p zerohop --features cuda-uma --test endpoint)" zerohop-endpoint
put "$(exe test --release --no-run -p zerohop --features cuda-uma --test device_lane)" device_lane
put "$(exe test --release --no-run -p zerohop-backends --features cuda-uma --test cuda_ipc)" cuda_ipc
put "$(exe bench --no-run -p zerohop --bench one_thread)" bin/one_thread
cargo build --release -q -p zerohop-cli --features cuda-uma
cargo build --release -q -p zerohop-std --example raw_tcp
put target/release/zerohop bin/zerohop
put target/release/examples/raw_tcp bin/raw_tcp
ls -la .gpu .gpu/bin
