"""Test set-up: without a CUDA device, Triton kernels run in Triton's CPU interpreter.

The variable must be set before any module defining a ``@triton.jit`` kernel is imported.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (dense.py) by name

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
