VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint clean

$(STAMP): pyproject.toml scripts/setup_venv.sh
	scripts/setup_venv.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sparse-mla demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks scripts

test: lint
	$(PY) -m pytest -q -n 2 --durations=10 tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
