#!/usr/bin/env bash
# Profile one decode-kernel launch with Nsight Compute (c4a, h_q 64, batch 128): bash scripts/ncu_decode.sh
set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
ncu --clock-control none --kernel-name regex:_sparse_mla_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    python3 benchmarks/bench_decode.py --families c4a --batches 128 --rep 20 --skip-torch --out /tmp/ncu "$@"
