#!/usr/bin/env bash
# One H200 run (< 9 minutes) of the issue-26 GPU half and the issue-25 item-7 benchmarks, logs under LOG_DIR:
# the kernel library and torch binding (gpu_check.sh's setup stage), a CUDA engine of the tiny
# checkpoint, tests/test_gpu_invariance.py, row_invariance.py, bench_deterministic.py,
# bench_step_profile.py and bench_realdims.py (random real-dims weights made on the GPU: no 37 GB
# checkpoint to carry).
#
#   benchmarks/gpu_invariance_check.sh LOG_DIR CHECKPOINT [KV_CALIBRATION_JSON]
#
# Run from the repository root with the machine's python3 (torch + CUDA). STAGES (default
# "setup engine test rows det profile realdims") picks stages ("rows": benchmarks/row_invariance.py,
# which op's rows depend on the step's token count); ENGINE_DIR (default /tmp/dsa_gpu_engine)
# is reused when it already holds an engine. REALDIMS_ARGS (default "--quick") goes to
# bench_realdims.py, e.g. "--quick --experts 64 --contexts 4096 32768" to shorten it.
set -uo pipefail
LOG=${1:?LOG_DIR}; CKPT=${2:?CHECKPOINT}; CAL=${3:-}
ENGINE=${ENGINE_DIR:-/tmp/dsa_gpu_engine}
STAGES=${STAGES:-setup engine test rows det profile realdims}
export PYTHONUNBUFFERED=1 DSA_TEST_CHECKPOINT=$CKPT
mkdir -p "$LOG"
has() { [[ " $STAGES " == *" $1 "* ]]; }
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
if has setup; then
  STAGES=setup benchmarks/gpu_check.sh "$LOG" "$CKPT" || exit 1
  stamp "setup done"
fi
if has engine && [[ ! -f $ENGINE/engine_config.json ]]; then
  python3 -m dsa_trt.builder.build --checkpoint "$CKPT" --out "$ENGINE" --cache fp8 \
    ${CAL:+--kv-calibration "$CAL"} > "$LOG/engine_build.log" 2>&1 || { echo "engine build failed"; tail -5 "$LOG/engine_build.log"; exit 1; }
  stamp "engine built"
fi
if has test; then
  DSA_TEST_GPU_ENGINE=$ENGINE timeout 120 python3 -m pytest -q -ra -s -p no:cacheprovider tests/test_gpu_invariance.py \
    > "$LOG/test_gpu_invariance.log" 2>&1
  stamp "test_gpu_invariance: rc=$? $(tail -1 "$LOG/test_gpu_invariance.log")"; grep '^\[gpu-invariance\]' "$LOG/test_gpu_invariance.log"
fi
if has rows; then
  timeout 150 python3 benchmarks/row_invariance.py --quick > "$LOG/row_invariance.log" 2>&1
  stamp "row_invariance: rc=$?"; grep '^|' "$LOG/row_invariance.log"
fi
if has det; then
  timeout 75 python3 benchmarks/bench_deterministic.py "$ENGINE" --quick > "$LOG/bench_deterministic.log" 2>&1
  stamp "bench_deterministic: rc=$?"; grep -E '^(\||engine)' "$LOG/bench_deterministic.log"
fi
if has profile; then
  timeout 90 python3 benchmarks/bench_step_profile.py "$ENGINE" --quick > "$LOG/bench_step_profile.log" 2>&1
  stamp "bench_step_profile: rc=$?"; grep -E '^(\||engine|host)' "$LOG/bench_step_profile.log"
fi
if has realdims; then
  # eager rows of every shape, then the decode shapes again under CUDA graphs (capture, replays, a
  # profiler split per layer; "--quick --no-graphs" in REALDIMS_ARGS skips them); the tail below shows
  # the graph table and the 8xH200 model, the log holds the eager table too
  # shellcheck disable=SC2086
  timeout 240 python3 benchmarks/bench_realdims.py ${REALDIMS_ARGS:---quick} > "$LOG/bench_realdims.log" 2>&1
  stamp "bench_realdims: rc=$?"; grep -vE '^  ' "$LOG/bench_realdims.log" | tail -40
fi
