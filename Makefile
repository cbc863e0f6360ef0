VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test clean

$(STAMP): pyproject.toml scripts/setup_venv.sh
	scripts/setup_venv.sh $(VENV)
	touch $@

demo: $(STAMP)
	$(VENV)/bin/sparse-mla demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2 tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
