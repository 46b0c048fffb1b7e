#!/bin/bash
# One device call (issue 23, this round), from the checkout root after the kit install: the GPU test of the same-GPU
# path, then bench/gpu_weights.py --run RUN (default 8b: every path, both peers); what matters is copied to $OUT.
set -u
RUN=${1:-8b}; DEADLINE=${2:-480}; shift 2 || true
timeout 90 python3 tests/gpu/test_cuda_ipc_gpu.py > $OUT/gputest.log 2>&1; echo "gpu test rc=$?"
tail -c 2500 $OUT/gputest.log
W=/tmp/bench-$RUN; mkdir -p $W
timeout $((DEADLINE + 20)) python3 bench/gpu_weights.py --run $RUN --out $W --deadline-s $DEADLINE "$@" > $OUT/bench-$RUN.log 2>&1
echo "bench rc=$?"; tail -c 6000 $OUT/bench-$RUN.log
cp $W/h200-weights-$RUN.json $OUT/ 2>/dev/null
grep -E "weights fetched|sglang apply|fallback|Traceback|Error|rror:" $W/worker.log | tail -c 3000000 > $OUT/worker-$RUN.log
tail -c 40000 $W/worker.log > $OUT/worker-tail-$RUN.log
tail -c 20000 $W/peers.log > $OUT/peers-$RUN.log 2>/dev/null
