# hvd_lm: the two commands a user needs are `make demo` and `make test`.
# Both go through scripts/setup.sh (idempotent: seconds when nothing changed).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test check coverage demo clean-venv

setup:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh

# The linter first (ruff: pycodestyle, pyflakes, import order), then the suite in two parts: first
# what may share the machine, TEST_WORKERS tests at a time
# (pytest-xdist, a file per worker; 0: one at a time), then the `serial` tests alone (those that
# compare timings, and the cluster in a box). A part left empty by PYTEST_ARGS (exit 5) passes.
TEST_WORKERS ?= 2
test: setup
	@$(PY) -m ruff check . && echo "ruff: the code rules hold (pyproject.toml [tool.ruff])"
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS); \
	    s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s
	@$(PY) -m pytest -m serial $(PYTEST_ARGS); \
	    s=$$?; [ $$s -eq 0 ] || [ $$s -eq 5 ] || exit $$s

# The quick tier for the edit loop: the linter, then every test that starts no launcher job, no
# cluster and no long run (not marked slow, serial or cuda), TEST_WORKERS at a time.
check: setup
	@$(PY) -m ruff check . && echo "ruff: the code rules hold (pyproject.toml [tool.ruff])"
	@$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial and not cuda" \
	    $(PYTEST_ARGS)

# Line coverage of hvd_lm/ and data_prep/ over every Python process the whole suite starts
# (pyproject.toml [tool.coverage]: a process started with COVERAGE_PROCESS_START set measures
# itself, coverage's own .pth file starts it), combined, reported, and the total written to
# coverage.txt.
COVERAGE_DATA_DIR ?= $(CURDIR)/.coverage-data
coverage: setup
	@rm -rf $(COVERAGE_DATA_DIR) && mkdir -p $(COVERAGE_DATA_DIR)
	@export COVERAGE_PROCESS_START=$(CURDIR)/pyproject.toml COVERAGE_DATA_DIR=$(COVERAGE_DATA_DIR); \
	    $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS); \
	    s1=$$?; $(PY) -m pytest -m serial $(PYTEST_ARGS); s2=$$?; \
	    unset COVERAGE_PROCESS_START; \
	    $(PY) -m coverage combine -q && $(PY) -m coverage report | tee coverage.txt | tail -n 1; \
	    [ $$s1 -eq 0 ] || [ $$s1 -eq 5 ] || exit $$s1; [ $$s2 -eq 0 ] || [ $$s2 -eq 5 ] || exit $$s2

demo: setup
	$(VENV)/bin/hvd-lm demo --config configs/demo.yaml

clean-venv:
	rm -rf $(VENV)
