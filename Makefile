# `make bench`, `make test` and `make docs` each do the whole set-up on a fresh machine and
# skip it when it is already done: a .venv with colo-data installed (editable), at the
# versions that uv.lock pins. `make bench` installs what the bench needs, `make test` and
# `make docs` the test extras too.
#
# The installer is uv (a pinned copy, put into .uv/ with pip on first use: about 5 s; the
# whole test set then installs in about 10 s, where pip takes about 4 minutes).
# SETUP=pip is the fallback for machines without uv: pip installs the same pinned versions
# from requirements/*.txt, which `make lock` exports from uv.lock.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
UV_VERSION := 0.13.9
UV ?= .uv/bin/uv
SETUP ?= uv
# the machine's Python, never one that uv would download
export UV_PYTHON_DOWNLOADS := never

.PHONY: bench test test-fast train docs benchmarks lock clean

.uv/bin/uv:
	$(PYTHON) -m pip install -q --disable-pip-version-check --target .uv 'uv==$(UV_VERSION)'

ifeq ($(SETUP),pip)
$(VENV)/.installed-%: pyproject.toml requirements/%.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q -r requirements/$*.txt -e .
	touch $@
else
# --locked: a uv.lock that no longer matches pyproject.toml is an error (run `make lock`). Each
# sync first removes every stamp: where $(PYTHON) is not the path of the venv's own interpreter (a
# pyenv shim), uv replaces the whole environment, and what another target installed is gone.
$(VENV)/.installed-bench: pyproject.toml uv.lock | $(UV)
	rm -f $(VENV)/.installed-*
	$(UV) sync -q --locked --inexact --python $(PYTHON)
	touch $@
# --compile-bytecode (about 40 s here): the suite starts hundreds of Python processes, and where
# nothing may write bytecode caches (PYTHONDONTWRITEBYTECODE, as on CI) each would compile JAX
# and its neighbours from source again (8 s an import instead of 3 s). `pip install` compiles too.
# The test extra holds the train extra (tests/test_train_lm.py) and all that the bench needs:
# after it, `make train` and `make bench` install nothing (.ci/run checks it).
$(VENV)/.installed-test: pyproject.toml uv.lock | $(UV)
	rm -f $(VENV)/.installed-*
	$(UV) sync -q --locked --extra test --compile-bytecode --python $(PYTHON)
	touch $@ $(VENV)/.installed-train $(VENV)/.installed-bench
$(VENV)/.installed-train: pyproject.toml uv.lock | $(UV)
	rm -f $(VENV)/.installed-*
	$(UV) sync -q --locked --inexact --extra train --python $(PYTHON)
	touch $@
endif

bench: $(VENV)/.installed-bench
	$(VENV)/bin/colo-data bench configs/demo.toml
	@echo "colo-data is installed in $(VENV): run $(VENV)/bin/colo-data --help (or source $(VENV)/bin/activate first)"

# The tests in 2 processes (pytest-xdist), a module to a process: the suite spends most of
# its time on CPU (JAX's import in the processes that the tests start), so on 2 CPUs it runs
# in about three quarters of the time of one process. Tests marked `serial` run alone
# (tests/conftest.py). TEST_PROCESSES=0 runs them all in this one.
# First colo-data's own bytecode, as an installed copy has it (the editable install has none):
# where nothing may write bytecode caches, each process would compile its modules again (0.05 s).
TEST_PROCESSES ?= 2
COMPILE := $(VENV)/bin/python -m compileall -q colo_data
test: $(VENV)/.installed-test
	$(COMPILE)
	$(VENV)/bin/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --durations=25

# The fast tier, for the loop of changing code: the modules marked `unit` (docs/development.md).
test-fast: $(VENV)/.installed-test
	$(COMPILE)
	$(VENV)/bin/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile -m unit --durations=10

# examples/train_lm.py on its embedded defaults (docs/training.md): a small transformer trained on
# the LM demo corpus, checkpointed into .train/ (run it again to resume), its steps logged there.
train: $(VENV)/.installed-train
	$(VENV)/bin/python examples/train_lm.py

# The documentation site from docs/ into site/; tests/test_docs.py builds it the same way.
docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Every benchmark (the list is benchmarks/table.py's), each writing its tables to benchmarks/results/
# and its headline figures to benchmarks/headlines/; then docs/performance.md's table from those.
benchmarks: $(VENV)/.installed-test
	$(VENV)/bin/python benchmarks/table.py --run

# After a change to the dependencies in pyproject.toml: pin them again (uv.lock) and export
# the pins for SETUP=pip (tests/test_setup.py checks that the three agree).
lock: | $(UV)
	$(UV) lock --python $(PYTHON)
	$(UV) export -q --frozen --no-hashes --no-emit-project -o requirements/bench.txt
	$(UV) export -q --frozen --no-hashes --no-emit-project --extra test -o requirements/test.txt
	$(UV) export -q --frozen --no-hashes --no-emit-project --extra train -o requirements/train.txt

clean:
	rm -rf $(VENV) .uv .train .pytest_cache .mypy_cache .ruff_cache .hypothesis site
