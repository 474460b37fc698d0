# The two entry points a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-python lint bench clean

$(VENV)/.bootstrapped: pyproject.toml scripts/bootstrap.sh scripts/constraints.txt
	bash scripts/bootstrap.sh

demo: $(VENV)/.bootstrapped
	$(PY) -m cli demo

test: $(VENV)/.bootstrapped
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The suite under another Python than .venv's (pyproject claims >= 3.10), in a venv of its
# own, .venv-X.Y, without the engines extra (its tests skip, saying so):
#   make test-python PYTHON=python3.10 [PYTEST_ARGS=tests/test_settings.py]
PYTHON_XY = $(if $(PYTHON),$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'))
test-python:
	@test -n "$(PYTHON_XY)" || { echo "usage: make test-python PYTHON=python3.X (a working interpreter)" >&2; exit 2; }
	VENV=.venv-$(PYTHON_XY) PYTHON=$(PYTHON) EXTRAS=dev bash scripts/bootstrap.sh
	.venv-$(PYTHON_XY)/bin/python -m pytest -q $(PYTEST_ARGS)

lint: $(VENV)/.bootstrapped
	$(VENV)/bin/ruff check kvfs objectstore gds cli tests
	$(VENV)/bin/ruff format --check kvfs objectstore gds cli tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info .pytest_cache
