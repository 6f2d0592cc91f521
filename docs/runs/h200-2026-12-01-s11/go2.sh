#!/bin/bash
# Second call: the uma test again, then bench-tcp with the tree before the engine (old) and after (new).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib:$PWD/ucx
timeout 240 ./uma_tests --test-threads=1 --nocapture > $OUT/uma.log 2>&1; echo "uma rc=$?"; cat $OUT/uma.log
bash go.sh old 5 no
bash go.sh new 3 no
