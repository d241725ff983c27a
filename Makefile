# `make bench`, `make test` and `make docs` each do the whole set-up (a .venv with colo-data
# installed) on a fresh machine, and skip it when it is already done.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: bench test docs benchmarks clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

bench: $(STAMP)
	$(VENV)/bin/colo-data bench configs/demo.toml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

# The documentation site from docs/ into site/; tests/test_docs.py builds it the same way.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

benchmarks: $(STAMP)
	$(VENV)/bin/python benchmarks/core.py
	$(VENV)/bin/python benchmarks/sidecar.py
	$(VENV)/bin/python benchmarks/startup.py
	$(VENV)/bin/python benchmarks/lm.py
	$(VENV)/bin/python benchmarks/mixture.py
	$(VENV)/bin/python benchmarks/remote.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site
