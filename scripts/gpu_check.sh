#!/usr/bin/env bash
# Everything a GPU session checks, in one call (device tool: carry .whl; run from the repo root):
#   bash scripts/gpu_check.sh [bench args...]          BENCH=v32 bash scripts/gpu_check.sh --parts decode
# Installs the carried FlashMLA wheel, runs the GPU tests, then one benchmark: benchmarks/bench_$BENCH.py
# (the step benchmark by default) with the given args. Logs and JSON go to $OUT (default results/); the
# benchmark's table prints last.
# GPU_TESTS defaults to the subset every session runs (5-6.5 min on an H100, mostly kernel compiles): the plan /
# CUDA-graph step, batch invariance on both kernels, the dsa layer (Gluon's 576-d path), FlashMLA against our
# FlashMLA API (and its remembered calls) and caches, the direct launcher and bound launches, per-request lens, the
# Gluon kernel's persistent programs (V4 fp8: several rounds, and split rows), tail splits (V3.2 fp8) and narrow
# items (at most 16 heads, both fp8 formats).
# Beside it runs the essentials of tests/test_lowerings.py (every kernel over every format, every layer kind with MTP
# and padding rows) with the kernels lowered as for sm_80 and sm_89 (one process each: SPARSE_MLA_LOWERING).
# GPU_TESTS=all adds the kernel, layer, cache, index and order files (more than one 10-minute call: split them over
# two). GPU_TESTS=lowerings runs all of tests/test_lowerings.py under the sm_80, sm_86 and sm_89 lowerings (and
# nothing else; with BENCH=none, one 10-minute call). GPU_TESTS=cp (a host with 2 GPUs: the device tool's
# nvidia-h100-x2) runs the 2-GPU context-parallel test (NCCL, eager and a CUDA graph) and, unless BENCH=none, the
# context-parallel benchmark instead (~3 min). BENCH=none skips the benchmark.
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
EVERY_SESSION="tests/test_step_plan.py tests/test_batch_invariance.py tests/test_dsa.py tests/test_flash_mla_api_gpu.py
    tests/test_flashmla_interop.py tests/test_layer_forms.py tests/test_flash_mla_memo.py tests/test_launch.py
    tests/test_ops_memo.py
    tests/test_triton_attention.py::test_lens_shared_by_consecutive_tokens_read_like_expanded_ones
    tests/test_triton_attention.py::test_persistent_programs_compute_the_same_bits[300-1-fp8_v4-512]
    tests/test_triton_attention.py::test_persistent_programs_compute_the_same_bits[170-3-fp8_v4-512]
    tests/test_triton_attention.py::test_tail_splits_cut_only_the_last_tokens_lists[7-3-False-fp8_v32-576]
    tests/test_triton_attention.py::test_tail_splits_cut_only_the_last_tokens_lists[150-18-True-fp8_v32-576]
    tests/test_triton_attention.py::test_narrow_items_match_the_reference[16-16-fp8_v32-576]
    tests/test_triton_attention.py::test_narrow_items_match_the_reference[11-16-fp8_v4-512]"
MORE="tests/test_triton_attention.py tests/test_layer.py tests/test_triton_cache.py tests/test_triton_index.py
    tests/test_order.py tests/test_checks.py
    tests/test_launch_configs.py::test_every_target_s_row_computes_the_reference_on_this_gpu"
lowered() {  # lowered ARCH [pytest args...]: tests/test_lowerings.py with the kernels lowered as for ARCH
    local arch=$1
    shift
    echo "== lowered as $arch"
    SPARSE_MLA_LOWERING=$arch python3 -m pytest -q -s -p no:cacheprovider tests/test_lowerings.py "$@" 2>&1 \
        | tee "$OUT/gpu_tests_$arch.log" | grep -E "registers|passed|failed|Error" | tail -n 15
}
TESTS=${GPU_TESTS:-$EVERY_SESSION}
[ "$TESTS" = all ] && TESTS="$EVERY_SESSION $MORE"
if [ "$TESTS" = cp ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel_gpu.py 2>&1 | tee "$OUT/gpu_tests_cp.log" \
        | tail -n 5
    [ "${BENCH:-}" = none ] && exit 0
    python3 benchmarks/bench_context_parallel.py --out "$OUT" 2>&1 | tee "$OUT/bench_context_parallel.log" \
        | grep -v '^{'
    exit 0
elif [ "$TESTS" = lowerings ]; then
    for arch in sm80 sm86 sm89; do lowered $arch; done
else
    if [ -z "${GPU_TESTS:-}" ]; then  # beside the main run (mostly compiles, on the host's other cores): ~2 min saved
        (for arch in sm80 sm89; do lowered $arch -k "plans_for or kernels_match or layers_match"; done) \
            > "$OUT/gpu_tests_lowered.log" 2>&1 &
    fi
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider --durations=10 $TESTS 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
    wait
    [ -f "$OUT/gpu_tests_lowered.log" ] && cat "$OUT/gpu_tests_lowered.log"
fi
python3 -m sparse_mla.cli demo 2>&1 | tee "$OUT/demo.log"
BENCH=${BENCH:-step}
[ "$BENCH" = none ] && exit 0
python3 "benchmarks/bench_$BENCH.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_$BENCH.log" | grep -v '^{'
