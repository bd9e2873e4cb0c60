# The two commands of the README, on a fresh machine (Python 3.11; no GPU needed):
#   make demo   set up .venv, build, continue held-out prompts with the shipped small pair: plain vs
#               speculative decoding (eagle3 demo --batch 4); `make selfcheck` runs every op once (a table)
#   make test   set up .venv, build, run the test suite (CPU + Triton interpreter; GPU tests skip)
# CI also runs `make compile-check`: every csrc/*.cu compiled for sm_80 (throw-away objects, nvcc and a CUDA
# torch needed), so that a Hopper-only instruction left unguarded fails CI instead of a pre-Hopper build.
#
# torch: a new .venv gets CUDA_TORCH (~5.5 GB with its CUDA libraries) where `nvidia-smi -L` lists a GPU,
# else CPU_TORCH (small; the C++ op table only, every op through its reference). TORCH=<pip requirement>
# picks one; given for a .venv made with another, it reinstalls torch there and rebuilds. The build compiles
# the CUDA kernels for sm_90a whenever torch is a CUDA build and nvcc exists, GPU or not: CI, without a GPU,
# asks for TORCH=$(CUDA_TORCH).

PYTHON ?= python3
VENV ?= .venv
JOBS ?= 2
CUDA_TORCH := torch==2.14.1
CPU_TORCH := torch==2.13.0
# CUDA_TORCH's own Triton; the CPU torch comes without one, and the tests run the Triton kernels interpreted.
TRITON := triton==3.8.0
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
TORCH_GIVEN := $(filter-out undefined,$(origin TORCH))
TORCH ?= $(if $(GPU),$(CUDA_TORCH),$(CPU_TORCH))
WHY := $(if $(TORCH_GIVEN),TORCH given,$(if $(GPU),nvidia-smi lists a GPU,no GPU found by nvidia-smi; make TORCH=$(CUDA_TORCH) ... for the CUDA build))
PY := $(VENV)/bin/python
DEPS := $(VENV)/.deps-installed
TEST_DEPS := $(VENV)/.test-deps-installed
TORCH_USED := $(VENV)/.torch
BUILT := $(VENV)/.eagle3-built
# The build-time switches setup.py reads from the environment: a build made under other values is rebuilt.
FLAGS_USED := $(VENV)/.build-flags
BUILD_FLAGS := EAGLE3_DEV_BUILD=$(EAGLE3_DEV_BUILD) EAGLE3_DEVICE_CHECKS=$(EAGLE3_DEVICE_CHECKS) DEBUG=$(DEBUG) \
  TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST)
SOURCES := setup.py $(wildcard csrc/*.cpp csrc/*.cu csrc/include/eagle3/*)
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c

.PHONY: demo selfcheck test compile-check clean FORCE
.NOTPARALLEL:  # one pip at a time in .venv (the build runs MAX_JOBS compilers itself)

demo: $(BUILT)
	$(PY) -m eagle3_ops demo --batch 4

selfcheck: $(BUILT)
	$(PY) -m eagle3_ops selfcheck

test: $(BUILT) $(TEST_DEPS)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

compile-check: $(TORCH_USED)
	@$(PY) -c "import sys, torch; sys.exit(None if torch.version.cuda else 'make compile-check needs the headers of a CUDA torch: make TORCH=$(CUDA_TORCH) compile-check')"
	$(PY) scripts/nvcc_check.py -j $(JOBS) --arch 8.0 $(wildcard csrc/*.cu)

$(DEPS):
	@echo "eagle3_ops: creating $(VENV) with $(TORCH) ($(WHY))"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip  # editable builds need pip >= 25 with setuptools >= 80
	@echo "eagle3_ops: installing $(TORCH) and the build tools (pip is silent while it unpacks torch)"
	$(PY) -m pip install "$(TORCH)" ninja pybind11 numpy safetensors tqdm setuptools wheel
	echo "$(TORCH)" > $(TORCH_USED)
	touch $@

# What .venv's torch was installed from. A TORCH given that differs reinstalls torch (and so rebuilds); a .venv
# made before this file was kept records the torch it has.
$(TORCH_USED): $(DEPS) FORCE
	@[ -e $@ ] || $(PY) -c "import importlib.metadata as m; print('torch==' + m.version('torch').split('+')[0])" > $@
	@if [ -n "$(TORCH_GIVEN)" ] && [ "$$(cat $@)" != "$(TORCH)" ]; then \
	  echo "eagle3_ops: $(VENV) has $$(cat $@), TORCH=$(TORCH) asked for: reinstalling torch, then rebuilding"; \
	  $(PY) -m pip install "$(TORCH)" && echo "$(TORCH)" > $@; \
	fi

# The switches the last build ran under. A .venv built before this stamp existed is taken to match it.
$(FLAGS_USED): $(DEPS) FORCE
	@if [ ! -e $@ ]; then echo "$(BUILD_FLAGS)" > $@; if [ -e $(BUILT) ]; then touch -r $(BUILT) $@; fi; \
	elif [ "$$(cat $@)" != "$(BUILD_FLAGS)" ]; then \
	  echo "eagle3_ops: the build switches changed ($$(cat $@) -> $(BUILD_FLAGS)): rebuilding"; \
	  echo "$(BUILD_FLAGS)" > $@; \
	fi

# pip -v shows the build as it goes; of it, the terminal gets the compile steps (one line each) and setup.py's
# own lines (once each), flushed line by line, and .venv/build.log the whole, printed if the build fails.
$(BUILT): $(TORCH_USED) $(FLAGS_USED) $(SOURCES)
	@echo "eagle3_ops: building the extension against $$(cat $(TORCH_USED)) with MAX_JOBS=$(JOBS) (JOBS=N):" \
	  "the C++ op table, plus every CUDA kernel for sm_90a when torch is a CUDA build and nvcc exists (minutes)"
	@echo "MAX_JOBS=$(JOBS) $(PY) -m pip install -v --no-build-isolation --no-deps -e . > $(VENV)/build.log"
	@MAX_JOBS=$(JOBS) $(PY) -m pip install -v --no-build-isolation --no-deps -e . 2>&1 | tee $(VENV)/build.log \
	  | awk '/^ *\[[0-9]+\/[0-9]+\] / && match($$0, /[^ ]+\.(cpp|cu)( |$$)/) { src = substr($$0, RSTART, RLENGTH); \
	         sub(/.*\//, "", src); sub(/ $$/, "", src); print "  " $$1 " compiling " src; fflush() } \
	         /^ *eagle3_ops: / && !seen[$$0]++ { sub(/^ */, "  "); print; fflush() }' \
	  || { cat $(VENV)/build.log; echo "eagle3_ops: the build failed (its whole log above, and in $(VENV)/build.log)"; exit 1; }
	touch $@

$(TEST_DEPS): $(DEPS)
	@echo "eagle3_ops: installing the test tools"
	$(PY) -m pip install pytest pytest-benchmark hypothesis "$(TRITON)"
	touch $@

FORCE:

clean:
	rm -rf $(VENV) build *.egg-info eagle3_ops/_C*.so eagle3_ops/_built_with.py
