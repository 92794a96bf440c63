# DSA-TRT. Two commands on a fresh machine (README):  make engine   and   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= checkpoints/tiny-v32
OUT ?= engines/tiny-v32
TP ?= 1
CACHE ?= fp8
COMPILER ?= auto

NVCC ?= nvcc
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a
KERNEL_SRCS := $(wildcard plugins/csrc/*.cu)
KERNEL_OBJS := $(patsubst plugins/csrc/%.cu,build/kernels/%.o,$(KERNEL_SRCS))
KERNEL_LIB := build/libdsa_kernels.so
NVCC_FLAGS := -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC -Xptxas -v --expt-relaxed-constexpr -lineinfo

.PHONY: setup engine test kernels trt-plugins trt-plugins-check clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,build,serve]"
	# the bundled tritonserver's python-backend stub links the system libpython3.11
	ldd $$($(PY) -c "import pytriton,os;print(os.path.dirname(pytriton.__file__))")/tritonserver/python_backend_stubs/3.11/triton_python_backend_stub | grep -q "not found" && apt-get install -y libpython3.11 || true
	touch $@

setup: $(VENV)/.installed

$(CHECKPOINT)/config.json: | setup
	$(PY) -m dsa_trt.export.tiny_checkpoint $(CHECKPOINT)

engine: setup $(CHECKPOINT)/config.json
	$(PY) -m dsa_trt.builder.build --checkpoint $(CHECKPOINT) --out $(OUT) --tp $(TP) --cache $(CACHE) --compiler $(COMPILER)
	$(PY) -m dsa_trt.runtime.cli generate --engine $(OUT) --max-tokens 24 --temperature 0 \
		--prompt "The quick brown fox" --prompt "Once upon a time, in a small village" --prompt "Hello"

test: setup
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

# CUDA kernel library (sm_90a). Compiles on any machine with nvcc; runs on Hopper.
kernels: $(KERNEL_LIB)

build/kernels/%.o: plugins/csrc/%.cu plugins/csrc/*.h plugins/csrc/*.cuh
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@ 2> >(tee $@.ptxas.txt >&2)

$(KERNEL_LIB): $(KERNEL_OBJS)
	$(NVCC) $(CUDA_ARCH) -shared -o $@ $^

# TensorRT plugin library (needs TENSORRT_ROOT or TENSORRT_INCLUDE; says plainly what it skipped)
trt-plugins: kernels
	$(MAKE) -C plugins/tensorrt lib

# compile-only check of the IPluginV3 wrappers against TensorRT headers alone (TENSORRT_INCLUDE=...)
trt-plugins-check:
	$(MAKE) -C plugins/tensorrt check

clean:
	rm -rf build engines
