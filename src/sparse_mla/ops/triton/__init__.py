"""Triton kernels of the sparse-index pipeline (DESIGN §6), one module per job; each has a plain-PyTorch reference
in :mod:`sparse_mla` and runs in Triton's CPU interpreter for tests."""
