#!/usr/bin/env bash
# Create the project's virtual environment and install sparse-mla into it, saying what it does.
# With an NVIDIA GPU the venv sees the machine's own (CUDA) torch and triton; without one it gets
# the CPU build of torch, pinned so pip never pulls the multi-GB CUDA build.
set -euo pipefail
venv=${1:-.venv}
step() { printf '\n==> [%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
pip_install() { "$venv/bin/python" -m pip install --progress-bar on "$@"; }
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    steps=2
    step "set-up 1/$steps: creating $venv on top of this machine's Python (it has an NVIDIA GPU: its CUDA torch is reused)"
    python3 -m venv --system-site-packages "$venv"
else
    steps=3
    step "set-up 1/$steps: creating $venv (no NVIDIA GPU found)"
    python3 -m venv "$venv"
    step "set-up 2/$steps: installing the CPU build of PyTorch (torch==2.13.0, ~200 MB: about a minute)"
    pip_install torch==2.13.0
fi
step "set-up $steps/$steps: installing sparse-mla and its test dependencies (pip install -e '.[test]')"
pip_install -e '.[test]'
step "set-up done: $venv ($("$venv/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
