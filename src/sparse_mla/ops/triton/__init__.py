"""Triton kernels of the sparse-index pipeline (DESIGN §6), one module per job: compress.py (the compressors),
index_cache.py (the indexer key insert), indexer.py (the lightning indexer's query prep, scores and select). Each has
its plain-PyTorch reference in :mod:`sparse_mla` and runs in Triton's CPU interpreter for tests."""
