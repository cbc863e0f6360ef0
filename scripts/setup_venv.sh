#!/usr/bin/env bash
# Create the project's virtual environment and install sparse-mla into it.
# With an NVIDIA GPU the venv sees the machine's own (CUDA) torch and triton; without one it gets
# the CPU build of torch, pinned so pip never pulls the multi-GB CUDA build.
set -euo pipefail
venv=${1:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    python3 -m venv --system-site-packages "$venv"
else
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q torch==2.13.0
fi
"$venv/bin/python" -m pip install -q -e '.[test]'
