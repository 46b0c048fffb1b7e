#!/bin/bash
# One device call, from the checkout root after the kit install: the GPU tests of the weight paths (each
# timeout-wrapped), then bench/gpu_weights.py --run RUN [options], its --deadline-s what is left of BUDGET seconds
# (give BUDGET as the call's limit less what the install took, less a margin); what matters is copied to $OUT.
#   bash bench/gpu_weights_call.sh 8b 540 --rows shm_cuda,tcp_cuda --streams 8 --chunk-mib 8 --no-cuda-graph
# SAMPLE_THREADS=1 also writes $OUT/threads.log: about every second, a timestamp and the busiest threads of the machine
# (top -H), to find which thread bounds a row (the tcp row's 7.2-7.6 GB/s in session 6 is not explained yet).
set -u
if [ "${SAMPLE_THREADS:-0}" = 1 ]; then
  (while :; do echo "== $(date +%s.%N)"; top -H -b -n2 -d 0.5 -w 160 2>/dev/null | awk '/^top -/{f++} f==2' | sed -n '7,40p'; done) > "$OUT/threads.log" 2>&1 &
  SAMPLER=$!
  trap 'kill $SAMPLER 2>/dev/null' EXIT
fi
RUN=${1:-8b}; BUDGET=${2:-540}; shift 2 || true
for t in tests/gpu/test_shm_device_gpu.py tests/gpu/test_cuda_ipc_gpu.py; do
  n=$(basename "$t" .py); s=$SECONDS
  timeout 110 python3 "$t" > "$OUT/$n.log" 2>&1; echo "$n rc=$? in $((SECONDS - s)) s"
  tail -c 1800 "$OUT/$n.log"; echo
done
DEADLINE=$((BUDGET - SECONDS - 25))
echo "bench deadline ${DEADLINE} s"
W=/tmp/bench-$RUN; mkdir -p "$W"
timeout $((DEADLINE + 15)) python3 bench/gpu_weights.py --run "$RUN" --out "$W" --deadline-s "$DEADLINE" "$@" > "$OUT/bench-$RUN.log" 2>&1
echo "bench rc=$?"; tail -c 5000 "$OUT/bench-$RUN.log"
cp "$W/h200-weights-$RUN.json" "$OUT/" 2>/dev/null
grep -E "weights fetched|weight segments registered|sglang apply|fallback|Traceback|Error|rror:|hello_required|joined|engine" "$W/worker.log" | tail -c 2000000 > "$OUT/worker-$RUN.log"
tail -c 40000 "$W/worker.log" > "$OUT/worker-tail-$RUN.log"
head -c 40000 "$W/worker.log" > "$OUT/worker-head-$RUN.log"
tail -c 20000 "$W/peers.log" > "$OUT/peers-$RUN.log" 2>/dev/null
