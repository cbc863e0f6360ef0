#!/usr/bin/env bash
# The GPU tests, the demo and a benchmark, in one device call (device tool: carry .whl; run from the repo root).
#   bash scripts/gpu_check.sh [bench args...]           the every-session subset, the demo, then the step benchmark
#   GPU_TESTS=<subset> bash scripts/gpu_check.sh         one subset of scripts/gpu_subsets.txt (listed below)
#   GPU_TESTS="tests/test_x.py ..." bash scripts/gpu_check.sh   these tests, the demo and the step benchmark
#   bash scripts/gpu_check.sh --help                     this text and every subset's tests
# Every subset fits one 10-minute call on an H200; in turn they run every GPU test (docs/checks.md, "GPU tests"):
#   bash scripts/gpu_check.sh; then GPU_TESTS=more, layers, v41, v41gluon, misc, pipeline, guards, hf, lowerings (each
#   BENCH=none by default); then GPU_TESTS=cp on 2 or 4 GPUs (nvidia-h200-x2 / -x4). GPU_TESTS=all runs every
#   single-GPU subset: one after another on one GPU (several calls' worth), spread over the GPUs where the machine
#   has several (one queue per GPU, CUDA_VISIBLE_DEVICES; on 4 H200s one call), its table of subsets printed last.
#   The sequence on 4 GPUs: GPU_TESTS=all GPU_WORKERS=6 bash scripts/gpu_check.sh; then GPU_TESTS=cp.
# Environment:
#   GPU_TESTS   a subset's name (default: default) or test paths
#   BENCH       benchmarks/bench_$BENCH.py after the tests, with the given args (default: step for the default
#               subset and for test paths, none for the other subsets); BENCH=none: no benchmark
#   SPARSE_MLA_EXPECT_MISSING  comma-separated software this call accepts as missing (flash_mla, gluon, transformers,
#               compute-sanitizer): otherwise a test whose dependency is missing on the GPU box fails, naming it
#   OUT         where logs and JSON go (default: results/); the benchmark's table prints last
#   GPU_WORKERS pytest-xdist workers for the tests (default 1; the box has 16 cores and the tests are mostly kernel
#               compiles: GPU_WORKERS=6 runs a subset in about half the time; never under compute-sanitizer)
# How the subsets run:
#   default     beside it, the essentials of tests/test_lowerings.py (every kernel over every format, every layer
#               kind with MTP and padding rows) lowered as for sm_80 and sm_89 (one process each, on the host's
#               other cores: ~2 min saved); ~6.5 min on an H100 / H200 with the benchmark's ~1 min after it
#   lowerings   the whole file under SPARSE_MLA_LOWERING=sm80, sm86 and sm89 (one process each, at once)
#   guards      under compute-sanitizer --tool memcheck (PYTORCH_NO_CUDA_MEMORY_CACHING=1: every tensor its own
#               allocation, so a read past one is caught), each test on the Triton and (Hopper) Gluon kernels.
#               compute-sanitizer from PATH, /usr/local/cuda*/bin, or a carried wheel
#               (pip download --no-deps nvidia-cuda-sanitizer-api==13.*, which ships the binary)
#   hf          needs transformers 5.23.0 (the box has 5.17): carry in .whl/ the wheels of
#               pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#                   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl transformers==5.23.0 \
#                   "huggingface-hub>=1.31,<2" "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" "regex>=2025.10.22" typer
#               (transformers 5.23.0's Requires-Dist newer than the box may have; huggingface-hub 2.x imports httpx2,
#               which the box lacks); the call prints any unmet
#   cp          2 or 4 GPUs: the context-parallel test (NCCL, 2 ranks and, with 4 GPUs, 4; both exchange forms,
#               eager and a CUDA graph), the kernels on GPU 1 while GPU 0 is current, and, unless BENCH=none, the
#               context-parallel benchmark instead of the step one (1, 2 and, with 4 GPUs, 4 ranks; ~3 min)
set -uo pipefail
SUBSETS=scripts/gpu_subsets.txt
SINGLE_GPU="default more layers v41 v41gluon misc pipeline guards hf lowerings"  # GPU_TESTS=all, in this order

subset_tests() {  # subset_tests NAME: the subset's lines, as written (globs unexpanded)
    awk -v s="$1" '!/^#/ && $1 == s { print $2 }' "$SUBSETS"
}

list_subsets() {  # every subset: its description (the comment above its first line) and its tests
    awk '/^[[:space:]]*$/ { desc = ""; next }
         /^#/ { desc = desc "    " substr($0, 3) "\n"; next }
         { if (!($1 in text)) { order[++n] = $1; text[$1] = desc }
           text[$1] = text[$1] "      " $2 "\n"; desc = "" }
         END { for (i = 1; i <= n; i++) printf "GPU_TESTS=%s\n%s", order[i], text[order[i]] }' "$SUBSETS"
}

if [ "${1:-}" = --help ] || [ "${1:-}" = -h ]; then
    sed -n '2,/^set /p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
    echo
    list_subsets
    exit 0
fi

OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"  # after the caller's (another Triton first)
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
status=0

tests_of() {  # tests_of NAME: the subset's tests, its globs expanded
    local t
    while read -r t; do
        if [[ $t == *'*'* ]]; then compgen -G "$t" || true; else echo "$t"; fi
    done < <(subset_tests "$1")
}

expected_missing() {  # expected_missing NAME: whether SPARSE_MLA_EXPECT_MISSING lists NAME
    [[ ",${SPARSE_MLA_EXPECT_MISSING:-}," == *",$1,"* ]]
}

pytest_run() {  # pytest_run LOG [pytest args...]: the tests (log: $OUT/LOG; $RUNNER before python3, if set); a
    local log=$1  # failure makes this call's status 1
    shift
    local workers=()  # pytest-xdist workers: kernel compiles run on the host's cores (not under compute-sanitizer)
    [ -z "${RUNNER:-}" ] && [ "${GPU_WORKERS:-1}" -gt 1 ] && workers=(-n "$GPU_WORKERS")
    ${RUNNER:-} python3 -m pytest -q -p no:cacheprovider --durations=10 "${workers[@]}" "$@" 2>&1 | tee "$OUT/$log" \
        | tail -n 25
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

lowered() {  # lowered ARCH [pytest args...]: the tests with the kernels lowered as for ARCH; returns pytest's status
    local arch=$1
    shift
    echo "== lowered as $arch"
    SPARSE_MLA_LOWERING=$arch python3 -m pytest -q -s -p no:cacheprovider "$@" 2>&1 \
        | tee "$OUT/gpu_tests_$arch.log" | grep -E "registers|passed|failed|Error" | tail -n 15
    return "${PIPESTATUS[0]}"
}

sanitizer() {  # the compute-sanitizer executable, or nothing
    local found
    found=$(command -v compute-sanitizer || compgen -G "/usr/local/cuda*/bin/compute-sanitizer" \
        || compgen -G "/tmp/site/nvidia/*/compute-sanitizer/compute-sanitizer")
    echo "${found%%$'\n'*}"
}

hf_requirements() {  # transformers' own requirements the installed packages do not meet, named
    python3 - <<'EOF'
import importlib.metadata as md

from packaging.requirements import Requirement

try:
    requires = md.requires("transformers") or []
    print("transformers", md.version("transformers"))
except md.PackageNotFoundError:
    requires = []
    print("transformers: not installed")
for line in requires:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        found = md.version(req.name)
    except md.PackageNotFoundError:
        found = None
    if found is None or not req.specifier.contains(found, prereleases=True):
        print(f"  unmet: {req} (found {found})")
EOF
}

run_subset() {  # run_subset NAME
    local name=$1 tests lowering arch pid path
    mapfile -t tests < <(tests_of "$name")
    echo "== GPU_TESTS=$name: ${tests[*]}"
    case $name in
    default)
        mapfile -t lowering < <(tests_of lowerings)
        (rc=0; for arch in sm80 sm89; do
             lowered $arch "${lowering[@]}" -k "plans_for or kernels_match or layers_match" || rc=1
         done; exit $rc) > "$OUT/gpu_tests_lowered.log" 2>&1 &
        pid=$!
        pytest_run gpu_tests.log "${tests[@]}"
        wait $pid || status=1
        cat "$OUT/gpu_tests_lowered.log";;
    lowerings)  # the three lowerings at once (each a process on its own cores: the tests are mostly compiles)
        for arch in sm80 sm86 sm89; do lowered $arch "${tests[@]}" > "$OUT/lowered_$arch.out" 2>&1 & done
        for pid in $(jobs -p); do wait "$pid" || status=1; done
        cat "$OUT"/lowered_sm*.out;;
    guards)
        path=$(sanitizer)
        if [ -n "$path" ]; then
            echo "== under $path --tool memcheck"
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 RUNNER="$path --tool memcheck --error-exitcode 86 --print-limit 20" \
                pytest_run gpu_tests_guards.log "${tests[@]}"
        elif expected_missing compute-sanitizer; then
            echo "== compute-sanitizer missing (expected): the guard tests without it"
            pytest_run gpu_tests_guards.log "${tests[@]}"
        else
            echo "FAILED: compute-sanitizer not found (PATH, /usr/local/cuda*/bin, a carried" \
                 "nvidia-cuda-sanitizer-api wheel); SPARSE_MLA_EXPECT_MISSING=compute-sanitizer runs the guard" \
                 "tests without it"
            status=1
        fi;;
    hf)
        hf_requirements
        pytest_run gpu_tests_hf.log "${tests[@]}";;
    *)
        pytest_run "gpu_tests_$name.log" "${tests[@]}";;
    esac
}

spread_subsets() {  # every single-GPU subset, one queue per visible GPU (longest first, each to the least loaded)
    local gpus=$1 i name cost failed=0
    local -a queue load
    # rough minutes each subset takes on an H200 with GPU_WORKERS=6 (a subset not listed: 2); the subsets of
    # SINGLE_GPU are dealt longest first
    local -A minutes=([lowerings]=6 [guards]=5 [default]=5 [pipeline]=3 [more]=3 [layers]=3)
    for ((i = 0; i < gpus; i++)); do queue[i]=""; load[i]=0; done
    while read -r cost name; do
        local best=0
        for ((i = 1; i < gpus; i++)); do [ "${load[i]}" -lt "${load[best]}" ] && best=$i; done
        queue[best]="${queue[best]} $name"
        load[best]=$((load[best] + cost))
    done < <(for name in $SINGLE_GPU; do echo "${minutes[$name]:-2} $name"; done | sort -rn -s -k1,1)
    for ((i = 0; i < gpus; i++)); do
        (export CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i"; mkdir -p "$OUT"; rc=0
         for name in ${queue[i]}; do
             status=0; run_subset "$name" > "$OUT/subset_$name.log" 2>&1
             echo "$name $status $(grep -hEo '[0-9]+ (passed|failed|error|errors|skipped)' "$OUT"/gpu_tests*.log \
                 2>/dev/null | tr '\n' ' ')" >> "$OUT/../subsets.txt"
             for f in "$OUT"/gpu_tests*.log; do [ -f "$f" ] && mv "$f" "$OUT/$name.${f##*/}"; done
             [ "$status" -eq 0 ] || rc=1
         done; exit $rc) &
    done
    for job in $(jobs -p); do wait "$job" || failed=1; done
    echo "== subsets (name, status 0 = passed, counts)"; sort "$OUT/subsets.txt"
    return $failed
}

TESTS=${GPU_TESTS:-default}
if [ "$TESTS" = all ]; then
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [ "$gpus" -gt 1 ]; then
        spread_subsets "$gpus" || status=1
    else
        for name in $SINGLE_GPU; do run_subset "$name"; done
    fi
    BENCH=${BENCH:-none}
elif [ -n "$(subset_tests "$TESTS")" ]; then
    run_subset "$TESTS"
    case $TESTS in default) BENCH=${BENCH:-step};; cp) BENCH=${BENCH:-context_parallel};; *) BENCH=${BENCH:-none};; esac
else  # test paths
    # shellcheck disable=SC2086
    pytest_run gpu_tests.log $TESTS
    BENCH=${BENCH:-step}
fi
if [ "$TESTS" != cp ]; then
    python3 -m sparse_mla.cli demo 2>&1 | tee "$OUT/demo.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if [ "$BENCH" != none ]; then
    python3 "benchmarks/bench_$BENCH.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_$BENCH.log" | grep -v '^{'
fi
exit $status
