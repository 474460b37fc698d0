# The two entry points a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint bench clean

$(VENV)/.bootstrapped: pyproject.toml scripts/bootstrap.sh scripts/constraints.txt
	bash scripts/bootstrap.sh

demo: $(VENV)/.bootstrapped
	$(PY) -m cli demo

test: $(VENV)/.bootstrapped
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.bootstrapped
	$(VENV)/bin/ruff check kvfs objectstore gds cli tests
	$(VENV)/bin/ruff format --check kvfs objectstore gds cli tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
