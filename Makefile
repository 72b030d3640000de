# hvd_lm: the two commands a user needs are `make demo` and `make test`.
# Both go through scripts/setup.sh (idempotent: seconds when nothing changed).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test demo clean-venv

setup:
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

demo: setup
	$(VENV)/bin/hvd-lm demo --config configs/demo.yaml

clean-venv:
	rm -rf $(VENV)
