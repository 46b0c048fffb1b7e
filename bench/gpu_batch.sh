#!/bin/bash
# One device call that runs several GPU benches one after another, within the call's limit, and brings back
# what matters in few files (the device tool returns at most a handful of files from $OUT; the rest are "left out").
#
#   bash bench/gpu_batch.sh BUDGET_S 'NAME|LIMIT_S|COMMAND' ['NAME|LIMIT_S|COMMAND' ...]
#
# From the checkout root, with the SGLang kit copied to .sgkit/ (see ../shared/sglang-kit/README.md) and carried.
# It installs the kit, then runs each step as `timeout LIMIT_S bash -c COMMAND` in its own folder
# ($W/NAME, given to the command as $STEP: write results there), never past BUDGET_S from its start (a step
# that would start with less than 30 s left is skipped and said so). After each step: its *.json files are
# copied to $OUT (flat, named as written), the tail of its log goes to $OUT/batch.log, and every process the
# step left behind (its sglang children among them) is killed, so the next step starts on an empty GPU.
# At the end every log is packed into $OUT/logs.tar.gz.
#   bash bench/gpu_batch.sh 560 'episodes|240|python3 bench/gpu_episodes.py --out $STEP' \
#                               'tp1|200|python3 bench/gpu_tp.py --tp-size 1 --pairs 3 --out $STEP'
# A before/after on one machine (hosts differ call to call by up to 1.7x): put the other commit's tree in an ignored
# folder (`git archive COMMIT rollpool bench | tar x -C .before`, `.before/` in .git/info/exclude, carried) and run its
# step from inside it, so its package comes first on sys.path and its workers' too (they start with cwd = its root):
#   'before|180|ln -s ../.sgkit .before/.sgkit; cd .before && export PYTHONPATH=/tmp/site:$PWD && python3 bench/gpu_weights.py ...'
# (PYTHONPATH=.../.before alone is not enough: the checkout's own rollpool/ is found first from its root.)
set -u
BUDGET=${1:?budget in seconds}; shift
R=$PWD W=/tmp/gpu_batch
mkdir -p "$W" "$OUT"
log() { echo "[batch $(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$OUT/batch.log"; }
if ! bash .sgkit/install.sh .sgkit /tmp/site >"$W/install.log" 2>&1; then
  log "kit install failed"; tail -20 "$W/install.log" | tee -a "$OUT/batch.log"; exit 1
fi
# the test runner the GPU tests need (the device's python has pytest without pytest-asyncio): wheels carried in
# .gpuextra/ (fetched here with `pip download --no-deps -d .gpuextra pytest==9.2.0 pytest-asyncio==1.5.0 pytest-timeout
# pluggy iniconfig`; carry [".sgkit", ".gpuextra"])
if ls .gpuextra/pytest_asyncio-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .gpuextra/pytest-*.whl .gpuextra/pytest_asyncio-*.whl \
    .gpuextra/pytest_timeout-*.whl .gpuextra/pluggy-*.whl .gpuextra/iniconfig-*.whl >"$W/pytest-install.log" 2>&1 \
    || { log "pytest wheels did not install"; tail -5 "$W/pytest-install.log" | tee -a "$OUT/batch.log"; }
fi
export PYTHONPATH=/tmp/site:$R TVM_FFI_CACHE_DIR=/tmp/tvm-ffi-cache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/batch.log"
log "kit installed"
for step in "$@"; do
  IFS='|' read -r name limit cmd <<<"$step"
  left=$((BUDGET - SECONDS - 10))
  if [ "$left" -lt 30 ]; then log "$name: skipped (${left} s left)"; continue; fi
  [ "$limit" -gt "$left" ] && limit=$left
  export STEP="$W/$name"; mkdir -p "$STEP"
  log "$name: start (limit ${limit} s): $cmd"
  s=$SECONDS
  before=" $(ps -e -o pid= | tr -s ' \n' ' ') "
  setsid timeout "$limit" bash -c "$cmd" >"$STEP/step.log" 2>&1 &
  pid=$!
  wait "$pid"; rc=$?
  pkill -KILL -s "$pid" 2>/dev/null  # the step's session: whatever it started and left running
  sleep 2
  # and whatever still holds the GPU (a step killed for memory or time leaves children of other sessions: seen thrice, the next
  # step's SGLang then found a quarter of the GPU free; nvidia-smi names no pids inside the container): every process
  # made since the step began, but this script's own
  for p in $(ps -e -o pid=); do
    case "$before" in *" $p "*) ;; *) [ "$p" != "$$" ] && [ "$p" != "$BASHPID" ] && kill -KILL "$p" 2>/dev/null ;; esac
  done
  # a killed step's CUDA contexts can hold the GPU a while after the kill: the next step's SGLang would size its KV
  # cache from what is free (seen: "Loaded weights leave no GPU memory for the KV cache"); wait (at most 60 s)
  for _ in $(seq 60); do
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | sort -n | tail -1)
    [ "${used:-0}" -lt 2048 ] && break
    sleep 1
  done
  log "$name: rc=$rc in $((SECONDS - s)) s"
  tail -c 3000 "$STEP/step.log" >>"$OUT/batch.log"; echo >>"$OUT/batch.log"
  for f in "$STEP"/*.json; do [ -e "$f" ] && cp "$f" "$OUT/${name}--$(basename "$f")"; done
done
tar -czf "$OUT/logs.tar.gz" -C "$W" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' . 2>/dev/null
log "done"
