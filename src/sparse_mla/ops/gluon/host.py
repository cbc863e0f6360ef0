"""The Gluon kernel's host side: whether it can run at all (the import guard, :func:`enabled`), the shapes and
register budgets the launch and the kernel modules share, and the launch's choices (:func:`persistent`,
:func:`narrow_heads`). Imports without Triton or without Gluon (``gluon`` is then None), so that the token order
(``ops/order.py``) can count key blocks on any platform.

Gluon's API is experimental: the kernel is used with the Triton versions it was validated on
(``VALIDATED_TRITON``) unless ``SPARSE_MLA_GLUON=1`` asks for it anyway (``=0`` turns it off).
"""
from __future__ import annotations

from ...env import env_value

try:  # Gluon ships with Triton >= 3.5; its API is experimental, so any mismatch disables this path
    import triton
    from triton.experimental import gluon
    # what the kernel modules use, imported here to check it is there
    from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: F401
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.core import _aggregate  # noqa: F401  (Triton 3.6 has no public gl.aggregate)
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

# the GPU kernels' key block (this kernel's shared buffers hold one): a program's time goes by these (ops/order.py)
KEYS_PER_BLOCK = 64
HEADS_PER_PROGRAM = 64
PARTITION_WARPS = 4  # each of the three warpgroups
# registers per thread of the fp8 formats' logits warpgroup (its 64 × 256 fp32 accumulator, the 64 × 64 logits and P;
# 576-d: q's rope dims, 16 more) and values warpgroup (the accumulator), and of each of bf16's paired math warpgroups
# (32 B of spills at 576-d, outside the key loop); the copy warpgroup, the default partition, gets what is left: 128
# for fp8_v32 and 144 for fp8_v4, where two gathered half blocks at once need about 100; 72 for bf16 (cp.async holds
# nothing in registers). No fp8 spills (scripts/sm90_report.py). fp8_v32's logits warpgroup spilled 28 B at 208 once
# it loaded q itself (version 11), and 216 made V3.2 decode 3 % faster; with 152 for the values warpgroup its epilogue
# did not fit, and ptxas then ignored every partition's register budget and serialised the wgmmas
LOGITS_REGS = {"fp8_v4": 200, "fp8_v32": 216}
VALUES_REGS = 160
PAIRED_REGS = 216
# Narrow items: fp8 rows of at most NARROW_HEADS heads (tensor-parallel shards), the heads as the wgmmas' N, so that
# one math warpgroup's accumulators leave the registers for two copy warpgroups: the second copy warpgroup's and the
# math warpgroup's registers per thread (the first copy warpgroup, the default partition, gets what is left: 176).
# On the H100, V3.2 16-head shards ran 7-12 % faster than as 64-head items, V4's 6 %; 32 heads stay 64-head items:
# as narrow items of N = 32 (copy warpgroups at 136 registers) V3.2 ran up to 12 % slower (version 15), and with a
# math warpgroup per 16 heads (four warpgroups of 128 registers) 8-9 % slower (docs/history.md, version 17)
NARROW_HEADS = 16
NARROW_COPY_REGS, NARROW_MATH_REGS = 168, 160
VALIDATED_TRITON = ("3.6.",)  # checked on an H100 against the reference ops (tests/test_triton_attention.py)


# Persistent programs (one per SM, each taking work items in turn: an item's q load and output store then overlap the
# next item's first gathers) pay for their item loop, some 5 % of a V3.2 item's time, even where a program gets one
# item; they win where items are short and many: on the H100, 4 rounds of fp8_v4 items of 1, 4, 8 and 16 key blocks
# ran 13, 7, 4 and 2 % faster, the V4-Pro decode step at B 128 2 % (BENCHMARKS.md, version 12)
PERSISTENT_MIN_ROUNDS = 2
PERSISTENT_MAX_BLOCKS = 24


def persistent(items: int, max_blocks: int, sms: int) -> bool:
    """Whether a launch of ``items`` work items whose key lists span at most ``max_blocks`` key blocks runs as
    persistent programs on ``sms`` SMs (else a program per item)."""
    return items >= PERSISTENT_MIN_ROUNDS * sms and max_blocks <= PERSISTENT_MAX_BLOCKS


def narrow_heads(formats: frozenset[str], num_heads: int) -> int:
    """The head width (the wgmmas' N) of narrow items for ``num_heads`` heads over scopes of ``formats``, or 0 for
    64-head items: quantised rows of one format (decode, bound by the copy warpgroups) of at most ``NARROW_HEADS``
    heads (scopes of two formats have only the 64-head items' copy loop)."""
    return NARROW_HEADS if len(formats) == 1 and "bf16" not in formats and num_heads <= NARROW_HEADS else 0


def enabled() -> bool:
    """Whether the Gluon path may be used at all: Gluon importable and a validated Triton (or forced)."""
    choice = env_value("SPARSE_MLA_GLUON")
    if gluon is None or choice == "0":
        return False
    return choice == "1" or triton.__version__.startswith(VALIDATED_TRITON)
