#!/usr/bin/env bash
# Same-call A/B of the attention kernels on a GPU: this tree's src/ against a reference copy of src/
# (a git ref's), each side in its own processes, run twice in ABAB order so that clock drift hits both.
#   here:    rm -rf _ref && mkdir _ref && git archive main src | tar -x -C _ref      (_ref/ is git-ignored)
#   device:  bash scripts/ab_ref.sh [bench_decode args...]                         (carry .whl and _ref)
# Per run: the decode table (default: --batches 128 --rep 30 --skip-torch) and the layer-prefill rows;
# JSON under $OUT/{new,ref}{1,2}/.
set -uo pipefail
OUT=${OUT:-results}
[ -d _ref/src ] || { echo "no _ref/src: see the header" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1
DECODE_ARGS=("$@")
[ ${#DECODE_ARGS[@]} -eq 0 ] && DECODE_ARGS=(--batches 128 --rep 30 --skip-torch)
side() {  # side NAME SRC_DIR
    mkdir -p "$OUT/$1"
    echo "== $1"
    PYTHONPATH="$PWD/$2:/tmp/site" timeout 200 python3 benchmarks/bench_decode.py "${DECODE_ARGS[@]}" --out "$OUT/$1" \
        2>&1 | grep -E "^│"
    PYTHONPATH="$PWD/$2:/tmp/site" timeout 200 python3 benchmarks/bench_prefill.py --parts layer --rep 20 \
        --out "$OUT/$1" 2>&1 | grep -E "^│ +c(4|128)a"
}
side new1 src; side ref1 _ref/src; side new2 src; side ref2 _ref/src
