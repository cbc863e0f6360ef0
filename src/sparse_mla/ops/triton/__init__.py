"""Triton kernels of the sparse-index pipeline (one module per job: the indexer's scores, the compressors, the
key-cache insert); each has its plain-PyTorch reference in :mod:`sparse_mla`."""
