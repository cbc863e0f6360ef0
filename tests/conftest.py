"""Test set-up: without a CUDA device, Triton kernels run in Triton's CPU interpreter; Hypothesis profiles.

The variable must be set before any module defining a ``@triton.jit`` kernel is imported.

Hypothesis profiles, chosen by ``HYPOTHESIS_PROFILE``: ``ci`` (the default: few examples, so ``make test``
stays under two minutes on two cores) and ``thorough`` (many examples; before a release, or after
changing a kernel: ``HYPOTHESIS_PROFILE=thorough make test``). Property tests take their example
counts from the profile, not from their own ``@settings``.
"""
import os
import sys

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests import their helpers (helpers.py, dense.py) by name

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
