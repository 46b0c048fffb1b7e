# Developer shortcuts (docs/development.md). Uses .venv (the README's test command makes it) when present.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)
PYTEST = $(PYTHON) -m pytest -p no:cacheprovider

.PHONY: lint type unit fast test check

lint:
	$(PYTHON) -m ruff check rollpool tests bench

type:
	$(PYTHON) -m mypy

# pure logic only; lint and types are their own targets (tests/unit/test_static.py runs them inside pytest)
unit:
	$(PYTEST) tests/unit -q -m "not slow" --ignore=tests/unit/test_static.py

fast:
	$(PYTEST) -q -m "not slow and not chaos"

# the whole suite, as the README's test command and CI run it
test:
	$(PYTHON) -m pytest

check: lint type unit
