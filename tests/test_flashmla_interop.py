"""Caches built by ``quantize_blocks`` are read by FlashMLA exactly as by our ops (H100 + sgl-flash-mla).

The case itself is ``sparse_mla.verify.flashmla_case``, which ``sparse-mla verify`` runs too. Needs CUDA and the
``flash_mla`` package (on a GPU without it: a failure unless SPARSE_MLA_EXPECT_MISSING=flash_mla).
"""
from __future__ import annotations

import pytest

from helpers import needs, rel_err
from sparse_mla.verify import FLASHMLA_CASES, flashmla_case

pytestmark = needs("gpu", "flash_mla")


@pytest.mark.parametrize("num_heads,extra_topk,extra_block,ragged", FLASHMLA_CASES)
def test_flashmla_reads_our_fp8_v4_cache(num_heads, extra_topk, extra_block, ragged):
    fm, ref, ours = flashmla_case(num_heads, extra_topk, extra_block, ragged)
    assert rel_err(fm, ref) < 1e-2
    assert rel_err(ours, fm) < 1e-2
