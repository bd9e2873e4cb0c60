# The two commands of the README, on a fresh machine (Python 3.11; no GPU needed):
#   make demo   set up .venv, build, continue held-out prompts with the shipped small pair: plain vs
#               speculative decoding (eagle3 demo); `make selfcheck` runs every op once (a table)
#   make test   set up .venv, build, run the test suite (CPU + Triton interpreter; GPU tests skip)
# CI also runs `make compile-check`: every csrc/*.cu compiled for sm_80 (throw-away objects, nvcc needed),
# so that a Hopper-only instruction left unguarded fails CI instead of a pre-Hopper build.
# The build compiles the CUDA kernels for sm_90a whenever torch is a CUDA build and nvcc exists,
# GPU or not. Override TORCH=torch==2.13.0 for a small CPU-only torch (C++ op table only).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.14.1
JOBS ?= 2
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
BUILT := $(VENV)/.eagle3-built
SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/include/eagle3/*)

.PHONY: demo selfcheck test compile-check clean

demo: $(BUILT)
	$(PY) -m eagle3_ops demo

selfcheck: $(BUILT)
	$(PY) -m eagle3_ops selfcheck

test: $(BUILT)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

compile-check: $(DEPS)
	$(PY) scripts/nvcc_check.py -j $(JOBS) --arch 8.0 $(wildcard csrc/*.cu)

$(DEPS):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip  # editable builds need pip >= 25 with setuptools >= 80
	$(PY) -m pip install -q "$(TORCH)" ninja pybind11 numpy safetensors tqdm setuptools wheel pytest pytest-benchmark hypothesis
	touch $@

$(BUILT): $(DEPS) $(SOURCES)
	MAX_JOBS=$(JOBS) $(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info eagle3_ops/_C*.so
