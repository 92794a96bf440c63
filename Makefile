# DSA-TRT. Two commands on a fresh machine (README):  make engine   and   make test
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHECKPOINT ?= checkpoints/tiny-v32-trained
# How a missing $(CHECKPOINT) is written: the embedded tiny V3.2 with the weights trained on
# export/data/corpus.txt (export/train_tiny.py); the random one (the tests' checkpoint):
# make engine CHECKPOINT=checkpoints/tiny-v32 TINY_ARGS="--seed 0"
TINY_ARGS ?= --trained
TRAINED_WEIGHTS := export/data/tiny_trained.safetensors
OUT ?= engines/tiny-v32
TP ?= 1
# EP=P CP=P: one expert- / context-parallel group of P ranks (COMPILER=aoti; EP alone is refused)
EP ?= 1
CP ?= 1
CACHE ?= fp8
COMPILER ?= auto

NVCC ?= nvcc
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a
KERNEL_SRCS := $(wildcard plugins/csrc/*.cu)
KERNEL_OBJS := $(patsubst plugins/csrc/%.cu,build/kernels/%.o,$(KERNEL_SRCS))
KERNEL_LIB := build/libdsa_kernels.so
NVCC_FLAGS := -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC -Xptxas -v --expt-relaxed-constexpr -lineinfo

.PHONY: setup engine test kernels trt-plugins trt-plugins-check torch-ops torch-ops-check step-runner clean

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
	$(PY) -m dsa_trt.export.tiny_checkpoint $(CHECKPOINT) $(TINY_ARGS)

# The default checkpoint is rewritten when the committed trained weights change.
checkpoints/tiny-v32-trained/config.json: $(TRAINED_WEIGHTS)

# The prompts open paragraphs of the corpus the default model was trained on: it continues them.
engine: setup $(CHECKPOINT)/config.json
	$(PY) -m dsa_trt.builder.build --checkpoint $(CHECKPOINT) --out $(OUT) --tp $(TP) --ep $(EP) --cp $(CP) --cache $(CACHE) --compiler $(COMPILER)
	$(PY) -m dsa_trt.runtime.cli generate --engine $(OUT) --max-tokens 32 --temperature 0 \
		--prompt "In the first week of January the sea" --prompt "Bread is made of four things:" \
		--prompt "Why do the stars twinkle?"

test: setup
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

# CUDA kernel library (sm_90a). Compiles on any machine with nvcc; runs on Hopper.
kernels: $(KERNEL_LIB)

build/kernels/%.o: plugins/csrc/%.cu plugins/csrc/*.h plugins/csrc/*.cuh
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@ 2> >(tee $@.ptxas.txt >&2)

# soname: a consumer's NEEDED entry then matches a copy preloaded from elsewhere (DSA_KERNEL_LIB)
$(KERNEL_LIB): $(KERNEL_OBJS)
	$(NVCC) $(CUDA_ARCH) -shared -Xlinker -soname=libdsa_kernels.so -o $@ $^

# C++ torch binding (build/libdsa_torch_ops.so: the CUDA kernels of torch.ops.dsa.*, plugins/torch_binding)
# and the standalone decode-step runner (build/dsa_step: no Python). Both link the CUDA torch of
# $(PY) (the H200's torch 2.11+cu130); on a CPU wheel only torch-ops-check (compile, no link) works.
CXX ?= g++
CUDA_HOME ?= /usr/local/cuda
TORCH_OPS_LIB := build/libdsa_torch_ops.so
STEP_RUNNER := build/dsa_step
# torch include flags, ABI define and lib dir of $(PY): asked once, and only by the targets that use them
TORCH_PY = $(eval TORCH_PY := $$(shell $(PY) -c "import torch, torch.utils.cpp_extension as c, os; print(' '.join('-isystem ' + p for p in c.include_paths()), '-D_GLIBCXX_USE_CXX11_ABI=%d' % torch._C._GLIBCXX_USE_CXX11_ABI, os.path.join(os.path.dirname(torch.__file__), 'lib'))"))$(TORCH_PY)
TORCH_CXXFLAGS = -O2 -std=c++20 -fPIC $(filter-out $(lastword $(TORCH_PY)),$(TORCH_PY)) -isystem $(CUDA_HOME)/include
TORCH_LIBDIR = $(lastword $(TORCH_PY))
TORCH_LDLIBS = -L$(TORCH_LIBDIR) -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 -lc10_cuda -ltorch_cuda -Wl,--as-needed \
	-Wl,-rpath,$(TORCH_LIBDIR)
TORCH_OPS_SRC := $(filter-out plugins/torch_binding/dsa_schemas.cpp,$(wildcard plugins/torch_binding/*.cpp))
STEP_SRCS := runtime/cpp/dsa_step.cpp plugins/torch_binding/dsa_schemas.cpp
# The CPU wheel ships c10/cuda headers without their generated cuda_cmake_macros.h: a stand-in for the check only.
TORCH_SHIM := build/torch-shim/c10/cuda/impl/cuda_cmake_macros.h

torch-ops: $(TORCH_OPS_LIB)

$(TORCH_OPS_LIB): $(TORCH_OPS_SRC) plugins/torch_binding/message.h plugins/csrc/dsa_kernels.h plugins/csrc/dsa_moe_kernels.h $(KERNEL_LIB)
	$(CXX) $(TORCH_CXXFLAGS) -Wall -Wextra -shared -o $@ $(TORCH_OPS_SRC) -Lbuild -Wl,--no-as-needed -ldsa_kernels \
		$(TORCH_LDLIBS) -Wl,-rpath,'$$ORIGIN'

$(TORCH_SHIM):
	@mkdir -p $(dir $@)
	printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > $@

# compile-only check (no link) of the binding and the step runner: works on a CPU torch wheel (CI)
torch-ops-check: setup $(TORCH_SHIM)
	$(CXX) $(TORCH_CXXFLAGS) -isystem build/torch-shim -Wall -Wextra -Werror -fsyntax-only $(TORCH_OPS_SRC)
	$(CXX) $(TORCH_CXXFLAGS) -isystem build/torch-shim -Wall -Wextra -Werror -fsyntax-only $(STEP_SRCS)

step-runner: $(STEP_RUNNER)

# The binding is linked --no-as-needed: nothing references its symbols, its static registrars are the point.
$(STEP_RUNNER): $(STEP_SRCS) $(TORCH_OPS_LIB)
	$(CXX) $(TORCH_CXXFLAGS) -Wall -Wextra -o $@ $(STEP_SRCS) -Lbuild -Wl,--no-as-needed -ldsa_torch_ops \
		-ldsa_kernels $(TORCH_LDLIBS) -Wl,-rpath,'$$ORIGIN'

# TensorRT plugin library (needs TENSORRT_ROOT or TENSORRT_INCLUDE; says plainly what it skipped)
trt-plugins: kernels
	$(MAKE) -C plugins/tensorrt lib

# compile-only check of the IPluginV3 wrappers against TensorRT headers alone (TENSORRT_INCLUDE=...)
trt-plugins-check:
	$(MAKE) -C plugins/tensorrt check

clean:
	rm -rf build engines
