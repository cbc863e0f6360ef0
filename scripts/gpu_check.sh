#!/usr/bin/env bash
# Everything a GPU session checks, in one call (device tool: carry .whl; run from the repo root):
#   bash scripts/gpu_check.sh [bench args...]          BENCH=prefill bash scripts/gpu_check.sh
# Installs the carried FlashMLA wheel, runs the GPU tests (kernels vs reference, FlashMLA interop),
# then one benchmark: benchmarks/bench_$BENCH.py (decode by default) with the given args.
# Logs and JSON go to $OUT (default results/); the benchmark's tables print last.
# Budget: on an H100 the attention tests alone take ~4 min (mostly kernel compiles) and the whole default
# list more than the device tool's 10-minute call; pick a subset with GPU_TESTS="tests/a.py tests/b.py".
set -uo pipefail
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/test_triton_attention.py tests/test_flashmla_interop.py tests/test_layer.py tests/test_triton_cache.py tests/test_triton_index.py tests/test_order.py} \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
python3 -m sparse_mla.cli demo 2>&1 | tee "$OUT/demo.log"
BENCH=${BENCH:-decode}
python3 "benchmarks/bench_$BENCH.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_$BENCH.log" | grep -v '^{'
