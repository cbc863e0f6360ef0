"""The Gluon kernel's host side: whether it can run at all (the import guard, :func:`enabled`), the shapes and
register budgets the launch and the kernel modules share, and the launch's choices (:func:`persistent`,
:func:`narrow_heads`). Imports without Triton or without Gluon (``gluon`` is then None), so that the token order
(``ops/order.py``) can count key blocks on any platform.

Gluon's API is experimental: the kernel builds on Triton 3.6-3.9 (:mod:`.compat` spells the builtins Triton renamed)
and is used with the Triton versions it passed the GPU suite on (:data:`VALIDATED_STACKS`) unless
``SPARSE_MLA_GLUON=1`` asks for it anyway (``=0`` turns it off); elsewhere a Hopper GPU runs the portable kernel, and
the first plan made for one says so once (:func:`warn_portable_once`).
"""
from __future__ import annotations

import warnings

from ...env import env_value
from ...formats import READERS

try:
    import triton
except ImportError:  # pragma: no cover - no Triton on this platform
    triton = None
try:  # Gluon ships with Triton >= 3.5; its API is experimental, so any mismatch disables this path
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

    from . import compat  # noqa: F401  (the builtins Triton renamed: ImportError where it knows neither name)
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
# The torch / Triton pairs the GPU suite (``GPU_TESTS=all bash scripts/gpu_check.sh``: the Gluon kernel against the
# reference ops, tests/test_triton_attention.py, test_gluon_v41.py) passed on, an H100 / H200: the one list to extend
# after a pass on another pair. The Gluon kernel is enabled by default with these Triton versions (beside any torch);
# the support statement (``sparse_mla.verify.stack_line``) prints the pairs
# 2.11 + 3.9 (H200, 2026-11-28, SPARSE_MLA_GLUON=1): tests/test_gluon_v41.py 44 passed, and the V4-Flash B 32 / 128
# steps of benchmarks/bench_step.py equal FlashMLA's outputs (rel err <= 2.3e-3) at 0.87x / 0.94x its time; 2026-11-29:
# GPU_TESTS=default 112 passed (lowered essentials 3 + 3), GPU_TESTS=more 183 passed
# 2.11 + 3.8 (H200, 2026-11-29, SPARSE_MLA_GLUON=1): GPU_TESTS=default 112 passed (its sm_80 / sm_89 lowered
# essentials 3 + 3), GPU_TESTS=more 182 passed, tests/test_gluon_v41.py 45 passed, and the four decode steps of
# benchmarks/bench_step.py equal FlashMLA's outputs at 0.82x / 0.89x / 1.05x / 1.21x its time (V4-Pro B 128 1.17x with
# the persistent programs below; docs/history.md, version 29)
# 2.11 + 3.7 (H200, 2026-11-29, 3.7.1, SPARSE_MLA_GLUON=1): GPU_TESTS=default 112 passed (lowered essentials 3 + 3),
# GPU_TESTS=more 183 passed, tests/test_gluon_v41.py 45 passed, and the four decode steps equal FlashMLA's outputs at
# 0.97x / 0.95x / 1.19x / 1.22x its time (docs/history.md, version 30)
VALIDATED_STACKS = (("2.11", "3.6"), ("2.11", "3.7"), ("2.11", "3.8"), ("2.11", "3.9"))
VALIDATED_TRITON = tuple(f"{version}." for _, version in VALIDATED_STACKS)  # prefixes of triton.__version__


# Persistent programs (one per SM, each taking work items in turn: an item's q load and output store then overlap the
# next item's first gathers) pay for their item loop, some 5 % of a V3.2 item's time, even where a program gets one
# item; they win where items are short and many: on the H100, 4 rounds of fp8_v4 items of 1, 4, 8 and 16 key blocks
# ran 13, 7, 4 and 2 % faster, the V4-Pro decode step at B 128 2 % (BENCHMARKS.md, version 12)
PERSISTENT_MIN_ROUNDS = 2
PERSISTENT_MAX_BLOCKS = 24
# The Triton versions on which persistent programs are used: those whose persistent build keeps the copy warpgroup's
# key-block loop (nearly) free of spills and ran faster for them on the H200 (sm_90, fp8_v4: ``scripts/sm90_report.py
# --kernel gluon --persistent``; local loads and stores a key block in the 144 registers left to that warpgroup: 3.6
# none, 3.7 10, 3.8 2, 3.9 29). V4-Pro B 128's c4a layers, the one benchmark shape that runs persistent, ran 2 % (3.6)
# and 5 % (3.8) faster with them and 8 % slower on 3.9, whose step takes 1.25x FlashMLA's time without them and 1.33x
# with them (docs/history.md, version 29); 3.7 runs a program per item, as 3.9 (its build spills there too; the A/B
# not measured)
PERSISTENT_TRITON = ("3.6.", "3.8.")


def persistent(items: int, max_blocks: int, sms: int) -> bool:
    """Whether a launch of ``items`` work items whose key lists span at most ``max_blocks`` key blocks runs as
    persistent programs on ``sms`` SMs (else a program per item): only on :data:`PERSISTENT_TRITON`."""
    return (items >= PERSISTENT_MIN_ROUNDS * sms and max_blocks <= PERSISTENT_MAX_BLOCKS
            and triton.__version__.startswith(PERSISTENT_TRITON))


def narrow_heads(formats: frozenset[str], num_heads: int) -> int:
    """The head width (the wgmmas' N) of narrow items for ``num_heads`` heads over scopes of ``formats``, or 0 for
    64-head items: every scope of one format whose row of :data:`sparse_mla.formats.READERS` says ``gluon_narrow``
    (quantised rows: decode, bound by the copy warpgroups), at most ``NARROW_HEADS`` heads (scopes of two formats
    have only the 64-head items' copy loop)."""
    return NARROW_HEADS if (len(formats) == 1 and READERS[next(iter(formats))].gluon_narrow
                            and num_heads <= NARROW_HEADS) else 0


TURNED_OFF = "SPARSE_MLA_GLUON=0"


def off_reason() -> str | None:
    """Why the Gluon path is off on this machine — :data:`TURNED_OFF`, or a sentence about the installed Triton —
    or None where it may be used: Gluon builds here and the Triton is validated (``VALIDATED_TRITON``) or
    ``SPARSE_MLA_GLUON=1`` forces it."""
    choice = env_value("SPARSE_MLA_GLUON")
    if choice == "0":
        return TURNED_OFF
    if gluon is None:
        return "the Gluon kernel does not build with this Triton" + (f" ({triton.__version__})" if triton else "")
    if choice != "1" and not triton.__version__.startswith(VALIDATED_TRITON):
        tested = ", ".join(version for _, version in VALIDATED_STACKS)
        return (f"the Gluon kernel builds with Triton {triton.__version__} but passed the GPU tests on Triton "
                f"{tested} only: SPARSE_MLA_GLUON=1 uses it anyway")
    return None


def enabled() -> bool:
    """Whether the Gluon path may be used at all: Gluon importable and a validated Triton (or forced)."""
    return off_reason() is None


_warned = False


def warn_portable_once() -> None:
    """On a Hopper GPU whose Triton leaves the Gluon kernel off (:func:`off_reason`; not when the user turned it
    off): a warning, once per process, that the portable kernel runs instead."""
    global _warned
    reason = off_reason()
    if _warned or reason is None or reason == TURNED_OFF:
        return
    _warned = True
    warnings.warn(f"sparse-mla: {reason}; this Hopper GPU runs the portable Triton kernel, slower than the Gluon "
                  "kernel (README, Support)", RuntimeWarning, stacklevel=2)
