VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?= --durations=10

.PHONY: demo test lint clean

$(STAMP): pyproject.toml scripts/setup_venv.sh
	scripts/setup_venv.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sparse-mla demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

test: lint
	$(PY) -m pytest -q -n 2 $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
