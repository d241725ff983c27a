# `make bench` and `make test` each do the whole set-up (a .venv with colo-data
# installed) on a fresh machine, and skip it when it is already done.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: bench test benchmarks clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/colo-data bench configs/demo.toml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

benchmarks: $(STAMP)
	$(VENV)/bin/python benchmarks/core.py
	$(VENV)/bin/python benchmarks/sidecar.py
	$(VENV)/bin/python benchmarks/startup.py
	$(VENV)/bin/python benchmarks/lm.py
	$(VENV)/bin/python benchmarks/mixture.py
	$(VENV)/bin/python benchmarks/remote.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
