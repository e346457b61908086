# hpc-ddp developer entry points. `make demo` and `make test` work on a brand-new machine:
# they create .venv and install what they need (Slurm and munge through apt-get for the tests).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SLURM_ENV := /var/tmp/hpc-ddp-slurm/env.sh

.PHONY: install dist demo test test-slurm-versions test-fast test-gpu gpu-check gpu-wheels slurm-up slurm-down bench scale clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Install torch with its matching torchvision first, as one pair (see constraints.txt).
	$(PY) -m pip install -q -c constraints.txt torch torchvision
	# [plot]: make demo draws its training curve; [test]: make test (and its plot and timeline tests).
	$(PY) -m pip install -q -c constraints.txt -e '.[plot,test]'
	$(PY) -c 'import torch, torchvision, submitit, click, jinja2, matplotlib; print("installed torch", torch.__version__, "torchvision", torchvision.__version__)'
	touch $(STAMP)

# The wheel to copy to a cluster or a laptop (docs/install.md): dist/hpc_ddp-VERSION-py3-none-any.whl.
# build/ is setuptools' own scratch folder; removed first so no stale file ships.
dist: install
	rm -rf build
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/*.whl

demo: install
	$(PY) -m hpc_ddp.demo

slurm-up:
	@bash tests/cluster/slurm-up.sh | tee $(SLURM_ENV) | tail -n 1

slurm-down:
	@bash tests/cluster/slurm-down.sh

# The tests, the real-Slurm ones included: brings the test Slurms up and takes them down again. Two lanes at
# once, the test Slurm's and the rest (tests/run-lanes.sh, CONTRIBUTING.md); HPC_DDP_TEST_LANES=serial: one pytest.
# The tests marked extended only with HPC_DDP_TEST_EXTENDED=1 (CI: .ci/run runs every test).
test: install
	@PY=$(PY) bash tests/run-lanes.sh

# The core Slurm tests (marked slurm_core) on each supported Slurm in turn: 22.05 here, 24.11 and 26.05 from
# Debian roots built and cached once (tests/cluster/chroot.sh). SLURM_VERSIONS="24.11" for one.
SLURM_VERSIONS ?= 22.05 24.11 26.05
test-slurm-versions: install
	@PY=$(PY) bash tests/run-versions.sh $(SLURM_VERSIONS)

# hpc-ddp against plain alternatives (bench/README.md); writes bench/results.json and .png (~10 min).
# Quick check of the harness only: make bench BENCH_ARGS=--quick
bench: install
	$(PY) bench/run.py $(BENCH_ARGS)

# The launcher-side paths at 2 to 256 nodes x 8 ranks, simulated on this machine (bench/README.md, "Scale");
# writes bench/scale_results.json (~5 min on 2 cores). A few sizes only: make scale SCALE_ARGS=--nodes=2,8
scale: install
	$(PY) bench/scale_sim.py $(SCALE_ARGS)

# Unit and CLI tests only (no Slurm, no DDP processes).
test-fast: install
	$(PY) -m pytest -q -m 'not slurm and not e2e' tests

# What only a GPU shows (tests/gpu, and the Session tests with the GPU's one-step-late flags); the GPU
# tests skip where torch sees no GPU, so `make test` passes on CPU-only machines and CI.
test-gpu: install
	$(PY) -m pytest -q tests/gpu tests/trainer/test_session.py

# One visit to a GPU machine (issue 40; bench/gpu_check.py): make test-gpu's tests, the trainer on ImageFolder
# JPEGs (data_path device and cpu x bf16 and fp32, each to a finite loss, device within 10% of cpu) and the
# gpu_data bench rows, summarised in $(GPU_CHECK_OUT)/gpu-check.md and .json (under 8 minutes on one H100/H200).
# It runs with the machine's own python3 and no network: run `make gpu-wheels` here first and carry .gpu-wheels.
# Without a GPU: make gpu-check GPU_CHECK_ARGS=--smoke runs the same parts small on the CPU (what CI runs).
GPU_PY ?= python3
GPU_CHECK_OUT ?= $(if $(OUT),$(OUT),gpu-check)
gpu-check:
	$(GPU_PY) bench/gpu_check.py --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

# The wheels a GPU machine's python3 lacks (submitit, and pytest for the GPU tests), for make gpu-check there.
gpu-wheels: install
	$(PY) -m pip download -q --no-deps -d .gpu-wheels submitit cloudpickle pytest pluggy iniconfig packaging

clean:
	rm -rf $(VENV) build dist *.egg-info
