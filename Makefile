# unified_dist — set-up, tests, demo. Every target works from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS ?= 1
export NO_MKDOCS_2_WARNING ?= 1

.PHONY: setup system-deps test docs demo bench mutants versions gpu-check clean

setup: system-deps $(STAMP)

# tests/multinode needs network namespaces (iproute2) and sshd (horovodrun reaches the second
# test host over ssh); the srun and mpirun tests need a real SLURM (tools/slurm_cluster.sh starts a
# one-node cluster) and Open MPI. Installed only as root with apt; otherwise those tests skip with
# the reason (and fail under CI=true).
SYSTEM_PACKAGES := iproute2 openssh-server slurmd slurmctld slurm-client openmpi-bin
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { ! command -v ip >/dev/null || [ ! -x /usr/sbin/sshd ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/slurmctld ] || \
	    ! command -v srun >/dev/null || ! command -v mpirun >/dev/null; }; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); fi

$(STAMP): requirements-ci.txt requirements-offline-data.txt setup.cfg tools/build_horovod.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==26.3 wheel==0.48.0 setuptools==84.2.1
	$(PY) -m pip install --quiet -r <(grep -v '^deepspeed==' requirements-ci.txt)
	# DeepSpeed's sdist imports torch to build: against the torch just installed, no isolation, no compiled ops
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --no-build-isolation -c requirements-ci.txt $$(grep '^deepspeed==' requirements-ci.txt)
	$(PY) -m pip install --quiet --no-deps -r requirements-offline-data.txt
	if [ "$${UNIFIED_DIST_WITHOUT_HOROVOD:-0}" = 1 ]; then echo 'skipping Horovod (UNIFIED_DIST_WITHOUT_HOROVOD=1)'; else tools/build_horovod.sh $(PY); fi
	$(PY) -m pip install --quiet --no-deps -e .
	# DeepSpeed's CPU collectives op, built once here into $(VENV)/torch_extensions, where the tests load it
	$(PY) -c "from unified_dist.testing.launchers import prebuild_deepspeed_ops; prebuild_deepspeed_ops()"
	$(PY) -c "import torch, accelerate, transformers, datasets, trl, peft, torchft, deepspeed, unified_dist; print('setup ok: torch', torch.__version__)"
	touch $(STAMP)

# Lint first (rules in pyproject.toml's [tool.ruff]): a finding fails the target before the tests run. Every test's
# seconds per phase go to build/test-times.json, every launch's wall and CPU seconds to build/launches.jsonl
# (bench/suite_time/suite_time.py turns both into docs/testing.md's budget).
# The test files run on TEST_WORKERS pytest-xdist workers, a file's tests on one worker in order (--dist loadfile:
# a module's shared launches stay shared); a launch leaves a core idle a third of its time (rendezvous, waits, I/O),
# which the other worker's file uses. TEST_WORKERS=0: one process, as plain pytest.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m ruff check .
	$(MAKE) --no-print-directory docs
	mkdir -p build && rm -f build/launches.jsonl
	UNIFIED_DIST_TEST_TIMES=build/test-times.json UNIFIED_DIST_LAUNCH_LOG=$(abspath build)/launches.jsonl $(PY) -m pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadfile tests

# The documentation site (mkdocs.yml): strict, so a broken link or an unresolved reference fails it.
docs: setup
	$(PY) -m mkdocs build --strict --site-dir site

demo: setup
	$(PY) examples/bert_sentiment/train.py

# The mutation check (tools/mutants/mutants.py): each mutant in tools/mutants/mutants.toml breaks one documented
# promise on a copy of the code; its guarding tests must fail. Not in `make test` (it reruns launches).
mutants: setup
	$(PY) tools/mutants/mutants.py

# The version matrix (tools/versions/versions.py, issue #52): a scratch venv per Python x torch outside the repository
# (~/.cache/unified_dist/versions/), the contract under every launcher and the unit tests in each, rows in
# tools/versions/versions.json, docs/versions.md rendered from them. Not in `make test` (GBs of CUDA wheels).
versions: setup
	$(PY) tools/versions/versions.py

# Every CUDA path in a few minutes on one GPU (unified_dist/checks/gpu.py), written to
# bench/gpu/results/gpu_check_<date>.json for docs/gpus.md; without a GPU one line, exit status 0.
gpu-check: setup
	$(PY) -m unified_dist test --gpu

bench: setup
	$(PY) bench/shared/run.py --short
	$(PY) bench/network/network.py --short  # needs root (network namespaces); skips with the reason otherwise
	if [ -f bench/network/results/network_short.json ]; then $(PY) bench/network/network_report.py bench/network/results/network_short.json; fi

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache
