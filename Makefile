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

# the transformers integration is supported on two releases (docs/transformers.md): the venv holds 5.23.0 (pyproject);
# the other is installed on its own (pure Python, its dependencies are 5.23's) and only the integration's tests rerun
# with it first on the path (~30 s)
TRANSFORMERS_NEXT := 5.24.0
TRANSFORMERS_NEXT_DIR := $(VENV)/transformers-$(TRANSFORMERS_NEXT)
TRANSFORMERS_TESTS := tests/test_transformers_integration.py tests/test_hf_v32_parity.py tests/test_bench_hf_smoke.py

$(TRANSFORMERS_NEXT_DIR)/.installed: $(STAMP)
	$(PY) -m pip install --no-cache-dir --no-deps --target $(TRANSFORMERS_NEXT_DIR) transformers==$(TRANSFORMERS_NEXT)
	touch $@

# the other Tritons the Gluon kernel is validated on (VALIDATED_STACKS in src/sparse_mla/ops/gluon/host.py), each
# installed on its own (--no-deps) for tests/test_portability.py to build the kernel for sm_90 with (~1 min). Each
# is ~0.7-0.9 GB: pip keeps no second copy in its cache, and the profiler's CUPTI libraries (~280 MB a Triton,
# never loaded to compile) are removed, so that CI's disk holds the whole set-up (~4 GB) with room to spare
GLUON_TRITONS := 3.6.0 3.7.1 3.8.0
GLUON_TRITON_STAMPS := $(foreach version,$(GLUON_TRITONS),$(VENV)/triton-$(version)/.installed)

$(VENV)/triton-%/.installed: $(STAMP)
	$(PY) -m pip install -q --no-cache-dir --no-deps --target $(VENV)/triton-$* triton==$*
	rm -rf $(VENV)/triton-$*/triton/backends/nvidia/lib/cupti*
	touch $@

# two workers that steal each other's queued tests when idle, the longest tests first (tests/conftest.py): on CI's
# two cores 9 min where xdist's fixed chunks took 12 (one worker's chunk held every long compile)
test: lint $(TRANSFORMERS_NEXT_DIR)/.installed $(GLUON_TRITON_STAMPS)
	$(PY) -m pytest -q -n 2 --dist worksteal $(PYTEST_ARGS) tests
	PYTHONPATH=$(TRANSFORMERS_NEXT_DIR) $(PY) -c "import transformers as t; assert t.__version__ == '$(TRANSFORMERS_NEXT)', t.__version__"
	PYTHONPATH=$(TRANSFORMERS_NEXT_DIR) $(PY) -m pytest -q -n 2 $(PYTEST_ARGS) $(TRANSFORMERS_TESTS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
