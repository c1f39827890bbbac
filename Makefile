# Two commands on a fresh machine: `make run` (the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-bench test-fast test-browser test-deploy gpu-check setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, where no torch is present (any other request pulls a multi-GB CUDA build).
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[test]"
	# AEGIS-256X4 for the sealed connection (latecomer[aegis]): built from source, so a machine without a C
	# compiler goes on without it (AES-256-GCM only; its tests skip unless LATECOMER_REQUIRE_AEGIS=1, as in CI).
	$(BIN)/python -m pip install -q -e ".[aegis]" || echo "pyaegis could not be built: the sealed connection uses AES-256-GCM"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/latecomer run

# Unit and simulator tests are CPU-bound and independent: two processes (pytest-xdist) on the
# 2 cores. The real-process tests run one at a time: several measure rates and liveness.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests/unit tests/sim
	$(BIN)/python -m pytest -q --durations=25 -m "not bench and not attack" tests/integration

# The hostile-input suite (tests/integration/test_attack_*.py: floods, descriptor exhaustion,
# crafted state files, ... each through a real server with real workers training): about 9
# minutes, a stage of its own that CI runs after `make test`.
test-attack: $(STAMP)
	$(BIN)/python -m pytest -q --durations=0 -m attack tests/integration

# The benchmark harnesses end to end (`latecomer bench --quick`, `--models`, `--shards`, the GPU
# check's plan on CPU workers): about 3 minutes, a stage of its own that CI runs after `make test`.
test-bench: $(STAMP)
	$(BIN)/python -m pytest -q --durations=0 -m bench tests/integration

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow" tests/unit tests/sim
	$(BIN)/python -m pytest -q -m "not slow" tests/integration

# The dashboard in a real headless Chromium (also part of `make test`; skipped without chromium).
test-browser: $(STAMP)
	$(BIN)/python -m pytest -q -m browser tests/integration

# The deployment recipes run for real (deploy/README.md): SLURM (two slurmd on this host), the
# container image under podman/compose, the Kubernetes manifests rendered and validated. Needs root;
# tests/deploy/install_*.sh install what each part needs from Debian's packages and PyPI.
test-deploy: $(STAMP)
	for s in tests/deploy/install_*.sh; do PY=$(abspath $(BIN))/python bash $$s || exit 1; done
	$(BIN)/python -m pytest -q --durations=0 tests/deploy

# On a machine with a CUDA device (under 5 minutes): CUDA workers beside CPU workers on a user's
# TorchProblem, exact replay with --log-payloads, same-host and TCP rows; writes benchmarks/RESULTS-gpu.md.
gpu-check: $(STAMP)
	$(BIN)/python -m benchmarks.gpu_check

clean:
	rm -rf $(VENV) build *.egg-info
