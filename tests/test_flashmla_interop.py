"""Caches built by ``quantize_blocks`` are read by FlashMLA exactly as by our ops (H100 + sgl-flash-mla).

The case itself is ``sparse_mla.verify.flashmla_case``, which ``sparse-mla verify`` runs too. Skipped where
CUDA or the ``flash_mla`` package is missing.
"""
from __future__ import annotations

import pytest
import torch

from helpers import rel_err
from sparse_mla.verify import FLASHMLA_CASES, flashmla_case

flash_mla = pytest.importorskip("flash_mla") if torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(flash_mla is None, reason="needs CUDA and flash_mla")


@pytest.mark.parametrize("num_heads,extra_topk,extra_block,ragged", FLASHMLA_CASES)
def test_flashmla_reads_our_fp8_v4_cache(num_heads, extra_topk, extra_block, ragged):
    fm, ref, ours = flashmla_case(num_heads, extra_topk, extra_block, ragged)
    assert rel_err(fm, ref) < 1e-2
    assert rel_err(ours, fm) < 1e-2
