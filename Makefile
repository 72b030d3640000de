# hvd_lm: the two commands a user needs are `make demo` and `make test`.
# Both go through scripts/setup.sh (idempotent: seconds when nothing changed).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo clean-venv

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

demo: setup
	$(VENV)/bin/hvd-lm demo --config configs/demo.yaml

clean-venv:
	rm -rf $(VENV)
