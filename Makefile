# The two commands of the contract: `make test` and `make demo`. Both create .venv first.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo bench clean

venv: $(STAMP)

$(STAMP): setup.py requirements/cpu-constraints.txt tools/fetch_sglang_contract.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip setuptools wheel
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -c requirements/cpu-constraints.txt -e '.[dev,logging]'
	$(BIN)/python tools/fetch_sglang_contract.py --out $(VENV)/sglang-contract
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -rfE tests

demo: venv
	$(BIN)/python examples/demo.py

bench: venv
	for b in benchmarks/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
