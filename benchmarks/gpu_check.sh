#!/usr/bin/env bash
# One H200 run of everything GPU-side (device time is scarce: one call, logs under LOG_DIR):
# the kernel library, every GPU test, the kernel benchmarks (and the read floors where CuPy is
# installed), a CUDA engine of the tiny checkpoint, its tests and the eager-vs-CUDA-graph step
# benchmark, the DSA_KERNELS=reference generation; stage "spec": MTP speculative tokens/s at B=1/8/32 on the
# held-out corpus lines, plain / MTP / fused MTP (benchmarks/bench_spec.py; ENGINE_DIR: an engine of the
# trained checkpoint; SPEC_ARGS passes e.g. "--modes plain mtp:2").
#
#   benchmarks/gpu_check.sh LOG_DIR CHECKPOINT [KV_CALIBRATION_JSON]
#
# Run from the repository root with the machine's python3 (torch + CUDA). Without ModelOpt there,
# pass the quant/fp8-kv-per-layer.json of a CPU build of the same checkpoint. ENGINE_DIR (default
# /tmp/dsa_gpu_engine) is reused when it already holds an engine. STAGES (default "setup tests bench
# engine"; setup installs the package and builds the kernel library, the torch binding and build/dsa_step) picks stages, so two GPUs can
# run two stage lists side by side after one setup. TEST_TIMEOUT (per test file) and BENCH_TIMEOUT
# (the kernel benchmarks), in seconds, keep one call inside the device's 10-minute limit.
set -uo pipefail
LOG=${1:?LOG_DIR}; CKPT=${2:?CHECKPOINT}; CAL=${3:-}
ENGINE=${ENGINE_DIR:-/tmp/dsa_gpu_engine}
STAGES=${STAGES:-setup tests bench engine}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}; BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
export PYTHONUNBUFFERED=1 DSA_TEST_CHECKPOINT=$CKPT
mkdir -p "$LOG"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has setup; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . > "$LOG/pip.log" 2>&1
  make kernels NVCC=nvcc -j"$(nproc)" > "$LOG/kernels.log" 2>&1 || { echo "make kernels failed (see kernels.log)"; exit 1; }
  # the C++ torch binding (the CUDA kernels of torch.ops.dsa.*) and the Python-free step runner
  make torch-ops step-runner NVCC=nvcc PY=python3 > "$LOG/torch_ops.log" 2>&1 || { echo "make torch-ops failed (see torch_ops.log)"; exit 1; }
fi
if has tests; then
  for t in tests/test_kernels_*.py; do
    name=$(basename "$t" .py)
    timeout "$TEST_TIMEOUT" python3 -m pytest -q -ra -p no:cacheprovider --durations=8 "$t" > "$LOG/$name.log" 2>&1
    echo "$name: rc=$? $(grep -E '(passed|failed|error)' "$LOG/$name.log" | tail -1)"
  done
fi
if has bench; then
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_kernels.py --iters 15 > "$LOG/bench_kernels.log" 2>&1
  echo "kernel benchmarks: rc=$? ($(grep -c '^|' "$LOG/bench_kernels.log") table rows)"
  # the real-size operators (issue 24): fp8 block linear and routed MoE, cuBLASLt / torch anchors in the same run
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_fp8_linear.py --quick --iters 10 > "$LOG/bench_fp8_linear.log" 2>&1
  echo "fp8 linear benchmark: rc=$? ($(grep -c '^|' "$LOG/bench_fp8_linear.log") table rows)"
  timeout "$BENCH_TIMEOUT" python3 benchmarks/bench_moe.py --quick --iters 10 > "$LOG/bench_moe.log" 2>&1
  echo "MoE benchmark: rc=$? ($(grep -c '^|' "$LOG/bench_moe.log") table rows)"
  if python3 -c "import cupy" 2>/dev/null; then  # the read floors of the memory-bound rows (~15 s)
    timeout 120 python3 benchmarks/read_floor.py --iters 15 > "$LOG/read_floor.log" 2>&1
    echo "read floors: rc=$? ($(grep -c '^|' "$LOG/read_floor.log") table rows)"
  fi
fi
if has engine; then
  if [[ ! -f $ENGINE/engine_config.json ]]; then
    python3 -m dsa_trt.builder.build --checkpoint "$CKPT" --out "$ENGINE" --cache fp8 \
      ${CAL:+--kv-calibration "$CAL"} > "$LOG/engine_build.log" 2>&1 || { echo "engine build failed"; tail -5 "$LOG/engine_build.log"; exit 1; }
  fi
  DSA_TEST_GPU_ENGINE=$ENGINE timeout 600 python3 -m pytest -q -ra -s tests/test_gpu_engine.py > "$LOG/engine_tests.log" 2>&1
  echo "engine tests: $(tail -1 "$LOG/engine_tests.log")"; grep '^\[gpu\]' "$LOG/engine_tests.log"
  (cd benchmarks && timeout 300 python3 bench_engine.py "$ENGINE") > "$LOG/bench_engine.log" 2>&1
  cat "$LOG/bench_engine.log" | grep '^|'
  # the plain-torch references on the GPU, asked for explicitly (no silent fallback otherwise)
  DSA_KERNELS=reference timeout 120 python3 -m dsa_trt.runtime.cli generate --engine "$ENGINE" --max-tokens 4 \
    --temperature 0 --prompt "Hello" > "$LOG/reference_generate.log" 2>&1
  echo "DSA_KERNELS=reference generate: rc=$? $(tail -1 "$LOG/reference_generate.log")"
fi
if has spec; then  # MTP speculative decoding: tokens/s with and without it, CUDA graphs on (issue 27)
  # on the held-out corpus lines (acceptance means nothing on random ids): build ENGINE from the trained checkpoint
  python3 -c "from dsa_trt.export.train_tiny import corpus_split; print('\n'.join(corpus_split()[1]))" > "$LOG/heldout.txt"
  # one process for every row (the engine's load cost once): plain, MTP, MTP with the fused verify + draft step
  timeout "${SPEC_TIMEOUT:-300}" python3 benchmarks/bench_spec.py "$ENGINE" "$LOG/heldout.txt" ${SPEC_ARGS:-} > "$LOG/bench_spec.log" 2>&1
  echo "spec benchmark: rc=$?"; grep '^|' "$LOG/bench_spec.log"
fi
