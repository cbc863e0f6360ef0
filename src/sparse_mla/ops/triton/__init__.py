"""The portable Triton kernels (every GPU target, and Triton's CPU interpreter for tests), one module per job; each
has its plain-PyTorch reference in :mod:`sparse_mla`.

* :mod:`.rows`: the row helpers and byte-layout constants the attention and cache kernels share (token pointers,
  dequantised pieces of gathered rows in every cache format).
* :mod:`.attention`: sparse MLA attention over paged caches and the split merge (planned by
  :mod:`sparse_mla.ops.attention_plan`).
* :mod:`.cache`: quantise-and-insert and dequantise-and-gather (DESIGN §4).
* :mod:`.index`: the step's index lists, the compressed picks, the ragged form of a padded list, the token order.
* The sparse-index pipeline (DESIGN §6): :mod:`.compress` (the compressors), :mod:`.index_cache` (the indexer key
  insert), :mod:`.indexer` (the lightning indexer's query prep, scores and select).
"""
