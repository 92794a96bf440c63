#!/usr/bin/env bash
# One H200 run (< 6 minutes) of the Triton half of issue 26 on the CUDA engine, logs under LOG_DIR:
# tests/test_gpu_triton_invariance.py: 100 concurrent streams through the PyTriton wheel's
# tritonserver, deterministic and default mode, each request equal to itself run alone offline.
#
#   benchmarks/gpu_triton_check.sh LOG_DIR ENGINE_DIR [CHECKPOINT]
#
# Run from the repository root with the machine's python3 after gpu_check.sh's setup stage (the
# editable install, the kernel library, the torch binding), ENGINE_DIR a CUDA engine (its engine
# stage); CHECKPOINT (optional) becomes DSA_TEST_CHECKPOINT. TEST_TIMEOUT (default 270 s) bounds the
# test, PYTEST_ARGS (e.g. "-k deterministic") narrows it. Carry .whl/ (git ignores it), made here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 -d /tmp/wheels \
#     nvidia-pytriton==0.7.0 numpy==1.26.4
#   python3 benchmarks/slim_wheel.py /tmp/wheels/nvidia_pytriton-0.7.0-*.whl .whl --drop \
#     'nvidia_pytriton.libs/libpython3-*' 'pytriton/tritonserver/python_backend_stubs/3.[89]/*' \
#     'pytriton/tritonserver/python_backend_stubs/3.1[013]/*'
#   python3 benchmarks/slim_wheel.py /tmp/wheels/numpy-1.26.4-*.whl .whl --drop '*/tests/*' 'numpy/f2py/*' \
#     'numpy/distutils/*' 'numpy/core/_simd.*' 'numpy/core/include/*' 'numpy/core/lib/*' \
#     'numpy/random/_examples/*' 'numpy/_pyinstaller/*' '*.pyi'
# (26 + 8 MiB: the server with the Python 3.12 stub alone; numpy without its tests and build tools).
#
# Why numpy 1.26: the machine's venv has numpy 2, under which the wheel's python backend stub
# (pybind11 2.10) breaks tensors (python_backend#384). The stub ignores PYTHONPATH: it embeds
# libpython3.12.so.1.0 and runs in the venv of the first python3 on PATH, which TritonServer makes
# the test's interpreter. So the test runs from an overlay venv, VENV, holding the two wheels and a
# .pth that adds the machine venv's site-packages after them: the test and the stub both import
# numpy 1.26 first, then torch, requests and dsa_trt (editable) from the machine's venv.
# Logs: triton_setup.log (wheels, paths, ldd of the stub), test_gpu_triton_invariance.log,
# tritonserver.log (each server's log).
set -uo pipefail
LOG=${1:?LOG_DIR}; ENGINE=${2:?ENGINE_DIR}; CKPT=${3:-}
VENV=${VENV:-/tmp/dsa-triton-venv}
TMPD=/tmp/dsa-triton-pytest  # pytest's basetemp: model repositories and server logs
TEST_TIMEOUT=${TEST_TIMEOUT:-270}
export PYTHONUNBUFFERED=1
[[ -n $CKPT ]] && export DSA_TEST_CHECKPOINT=$CKPT
mkdir -p "$LOG"
SETUP=$LOG/triton_setup.log
: > "$SETUP"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*"; }
fail() { echo "gpu_triton_check FAILED: $*" | tee -a "$SETUP"; exit 1; }
[[ -f $ENGINE/engine_config.json ]] || fail "$ENGINE holds no engine (no engine_config.json)"
pyver=$(python3 -c "import sys; print('%d.%d' % sys.version_info[:2])")
[[ $pyver == 3.12 ]] || fail "python3 is $pyver: .whl holds the 3.12 backend stub and a cp312 numpy"
WHEELS=(.whl/nvidia_pytriton-*.whl .whl/numpy-1.26.4-*.whl)
ls "${WHEELS[@]}" >> "$SETUP" 2>&1 || fail "no .whl/nvidia_pytriton-*.whl or numpy-1.26.4-*.whl: carry .whl (header)"

# 1. the overlay venv: the wheels first, then everything the machine's python3 sees
python3 -m venv --without-pip --clear "$VENV" >> "$SETUP" 2>&1 || fail "python3 -m venv $VENV (see triton_setup.log)"
PY=$VENV/bin/python3
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${WHEELS[@]}" \
  >> "$SETUP" 2>&1 || fail "pip install of .whl into $SITE (see triton_setup.log)"
python3 - "$SITE/dsa_machine_venv.pth" >> "$SETUP" 2>&1 <<'EOF' || fail "writing the .pth of the machine's site dirs"
import os, site, sys, sysconfig
dirs = [d for d in dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"],
                                  sysconfig.get_paths()["platlib"]]) if os.path.isdir(d)]
with open(sys.argv[1], "w") as f:  # addsitedir: their own .pth files run too (dsa_trt's editable finder)
    f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
print(f"machine python3 {sys.executable} (prefix {sys.prefix}, base {sys.base_prefix}); after the wheels: {dirs}")
EOF
stamp "overlay venv $VENV ready"

# 2. libpython3.12.so.1.0 for the stub: where the interpreter keeps its library, else the loader's cache, else a search
LIBPY=$("$PY" - <<'EOF'
import os, subprocess, sys, sysconfig
name = f"libpython{sys.version_info.major}.{sys.version_info.minor}.so.1.0"  # the stub's NEEDED entry
v = sysconfig.get_config_var
dirs = [v("LIBDIR"), os.path.join(v("LIBDIR") or "", v("MULTIARCH") or ""), v("LIBPL"),
        os.path.join(sys.base_prefix, "lib"), os.path.join(sys.base_prefix, "lib64"), "/usr/lib/x86_64-linux-gnu",
        "/usr/local/lib", "/usr/lib"]
hits = [d for d in dict.fromkeys(filter(None, dirs)) if os.path.isfile(os.path.join(d, name))]
if not hits:
    cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    hits = [line.split("=>")[-1].strip().rsplit("/", 1)[0] for line in cache.splitlines() if name in line]
print(hits[0] if hits else "")
EOF
)
if [[ -z $LIBPY ]]; then
  found=$(timeout 60 find / \( -path /proc -o -path /sys -o -path /dev \) -prune -o -name libpython3.12.so.1.0 -print \
    2>/dev/null | head -1)
  LIBPY=${found%/*}
fi
echo "libpython3.12.so.1.0 in: ${LIBPY:-(not found)}" >> "$SETUP"
[[ -n $LIBPY ]] && export LD_LIBRARY_PATH=$LIBPY${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# 3. diagnostics: what the server and its stub will load (TritonServer puts the wheel's libs first)
STUB=$SITE/pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub
SERVER=$SITE/pytriton/tritonserver/bin/tritonserver
stub_ldd=$(LD_LIBRARY_PATH=$SITE/nvidia_pytriton.libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} ldd "$STUB" 2>&1)
server_missing=$(ldd "$SERVER" 2>&1 | grep "not found")
{ echo "== ldd $STUB"; echo "$stub_ldd"; echo "== ldd $SERVER, not found: ${server_missing:-(none)}"; nvidia-smi -L; } \
  >> "$SETUP" 2>&1
missing=$(grep "not found" <<< "$stub_ldd" | tr -s ' \t' ' ' | tr '\n' ';')
[[ -z $missing ]] || fail "the python backend stub misses:$missing (its ldd is in triton_setup.log)"
[[ -z $server_missing ]] || fail "tritonserver misses: $server_missing"
"$PY" - >> "$SETUP" 2>&1 <<'EOF' || fail "the overlay venv's imports (see triton_setup.log)"
import sys, numpy, requests, torch
import dsa_trt.runtime.async_llm  # noqa: F401  (what the backend's model.py imports)
from dsa_trt.runtime.triton.server import pytriton_dir
print(f"overlay python {sys.executable}: numpy {numpy.__version__} ({numpy.__file__}), torch {torch.__version__} "
      f"(cuda {torch.cuda.is_available()}), requests {requests.__version__}, pytriton {pytriton_dir()}")
assert numpy.__version__.startswith("1."), "the stub needs numpy < 2 first on the overlay's path"
assert torch.cuda.is_available(), "torch sees no GPU"
EOF
stamp "setup checked: $(tail -1 "$SETUP")"

# 4. the test (SIGINT first: pytest then stops its servers). No plugin autoload: the machine's pytest
# plugins are built for its numpy 2 (jaxtyping's imports jax); the test needs none of them.
rm -rf "$TMPD"
# shellcheck disable=SC2086
DSA_TEST_GPU_ENGINE=$ENGINE PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -s INT -k 30 "$TEST_TIMEOUT" \
  "$PY" -m pytest -q -ra -s -p no:cacheprovider --basetemp="$TMPD" ${PYTEST_ARGS:-} tests/test_gpu_triton_invariance.py \
  > "$LOG/test_gpu_triton_invariance.log" 2>&1
rc=$?
stamp "test_gpu_triton_invariance: rc=$rc $(tail -1 "$LOG/test_gpu_triton_invariance.log")"
grep '^\[gpu-triton\]' "$LOG/test_gpu_triton_invariance.log"
for f in "$TMPD"/*/tritonserver.log; do
  [[ -f $f ]] && { echo "==== $f"; tail -n 400 "$f"; }
done > "$LOG/tritonserver.log" 2>&1
# a server the killed test left running (its own session): ours, named by the model repository under TMPD
for pid in $(pgrep -f -- "--model-repository=$TMPD" || true); do
  echo "stopping leftover tritonserver $pid" | tee -a "$SETUP"; kill "$pid"
done
exit $rc
