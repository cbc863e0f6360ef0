"""Per-target launch configurations of the portable attention kernel (:mod:`.triton.attention`): the one table.

Each row says which key-block size, heads per program, warps and pipeline depth the kernel is compiled with on a
:class:`~.targets.Target`, and why (the reason is kept in :class:`AttentionConfig` so reports and tests can print it).
:func:`unsupported` names the cases a target cannot run, with what to use instead; :mod:`.attention_plan` reads both.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton

import torch

from ..formats import FMT_FP4_V41, FMT_FP8_V41, READERS, get_format
from . import targets
from .targets import Target

# the cache formats the Triton kernels read (formats.READERS: every name of the layout table; the Gluon kernel reads a
# subset: dispatch.GLUON_FORMATS)
V41_CODES = (FMT_FP8_V41, FMT_FP4_V41)  # V4.1's record encodings (either page layout)
TRITON_FORMATS = frozenset(name for name, r in READERS.items() if r.triton)
# the Triton whose compile of sm_80's fp8_v4 row with the L2 prefetch was checked spill-free and timed (the GPUs'):
# Triton 3.9's ptxas input reloads about 50 spilled values per key block there, so other versions go without it
SM80_PREFETCH_TRITON = "3.6."


@dataclass(frozen=True)
class AttentionConfig:
    """One launch configuration. constexprs: the kernel's tuned constexprs (``H_BLOCK``, ``BLOCK_N``, ...);
    num_warps / num_stages: Triton's launch options; reason: why this row."""

    constexprs: dict
    num_warps: int
    num_stages: int
    reason: str


def default_stages(formats: frozenset[str]) -> int:
    """Pipeline depth of the key loop: 2 when every scope is bf16, else 1.

    bf16 key tiles go from the gather straight into the dots, so Triton turns their loads into
    asynchronous copies one block ahead (28 % faster prefill on an H100). fp8 tiles pass through
    the dequantisation first; pipelining them only added spills (BENCHMARKS.md, prefetch/stages).
    """
    return 2 if formats == frozenset({"bf16"}) else 1


def attention_config(target: Target, dim: int, formats: frozenset[str], num_heads: int, q_fp8: bool,
                     interpret: bool) -> AttentionConfig:
    """The launch configuration of the portable attention kernel for q of ``num_heads`` heads of ``dim`` (512 or
    576) dims and caches of ``formats`` on ``target`` (``interpret``: Triton's CPU interpreter, where small key
    blocks keep the tests fast).

    The constexprs: ``H_BLOCK`` heads and ``BLOCK_N`` keys per step, ``NATIVE_FP8`` (:mod:`.fp8`), ``Q_IN_LOOP``,
    ``Q_ROPE_SCALAR`` and ``DECODE_FENCE`` (:func:`.triton.attention._scope_pass`). Each row was chosen by
    cross-compiling the candidates for its targets (registers, spills in the key loop, shared memory;
    ``tests/test_portability.py`` prints the chosen rows') and, for the NVIDIA rows, timing them on an H100 under
    each target's lowering.
    """
    fp8 = formats != frozenset({"bf16"}) or q_fp8
    heads = max(16, triton.next_power_of_2(num_heads))
    flags = dict(NATIVE_FP8=target.native_fp8, Q_IN_LOOP=False, Q_ROPE_SCALAR=False, DECODE_FENCE=False,
                 PREFETCH=False, PTX_DECODE=False)
    if interpret:
        return AttentionConfig(dict(flags, H_BLOCK=min(64, heads), BLOCK_N=16), 8, 1, "the interpreter: small blocks")
    if target.backend == "cuda" and target.arch == 90:
        return AttentionConfig(dict(flags, H_BLOCK=min(64, heads), BLOCK_N=64), 8, default_stages(formats),
                               "wgmma reads q and the key tiles from shared memory: 64 heads share each gathered "
                               "key block (fastest of the H100 sweeps; H 32 is 1.3-1.7x slower)")
    if target.backend == "cuda":
        # mma.sync: sm_80/86/89/120, and sm_100, where a dot of fewer than 64 rows stays out of tensor memory
        # (at H_BLOCK 64 its five accumulators need 576 of the 512 columns)
        h_block = min(32, heads)
        if fp8:
            # sm_80 / sm_86 build the ue8m0-scaled tiles' bf16 in PTX (PTX_DECODE: sm_80's fp8_v4 key loop 1,375 ->
            # 1,073 SASS instructions; no gain where the e4m3 conversion exists, sm_89's loop 810 -> 814)
            fenced = dict(flags, H_BLOCK=h_block, DECODE_FENCE=True, PTX_DECODE=not target.native_fp8)
            # the next block's rows asked of L2 (PREFETCH), V4 / V3.2 formats (V4.1's rows then spill in the key
            # loop, sm_120): the V4-Flash B 128 step 11 % faster under the sm89 lowering, 13 % with PTX_DECODE under
            # the sm80 one (H200); not at sm_90 (9.13 against 6.88 ms: its row spills already)
            v41 = any(get_format(f).record_code in V41_CODES for f in formats)
            prefetch = not v41
            if target.shared_bytes >= 101 * 1024:  # sm_80, sm_100
                # the prefetch where measured: sm_80, V4's fp8_v4 (its fp8_e4m3 row then spills in the loop), on the
                # Triton it was measured with
                measured = (formats <= {"fp8_v4", "bf16"} and not q_fp8 and not target.native_fp8
                            and triton.__version__.startswith(SM80_PREFETCH_TRITON))
                return AttentionConfig(dict(fenced, BLOCK_N=64, Q_IN_LOOP=q_fp8, PREFETCH=measured and dim == 512),
                                       8, 1,
                                       "mma.sync takes its operands from registers: the fence keeps their layout "
                                       "conversion on the dequantised bf16 tiles, not byte by byte on the raw ones "
                                       "(1.7x faster at sm_80); 64-key blocks (100-108 KB); an fp8 q read in the loop "
                                       "(its hoisted copy spills in the loop); stages 1: pipelined fp8 tiles spill; "
                                       "sm_80: bf16 built in PTX and the next block asked of L2, V4-Flash B 128 step "
                                       "7.96 -> 6.83 ms under its lowering (H100: 2.24x -> 1.96x FlashMLA; 32-key "
                                       "blocks 11.7 on an H200); the other formats, V3.2's 576 dims and sm_100 (not "
                                       "measured), and Triton other than 3.6 (3.9 spills with it) without the prefetch")
            if dim == 512:  # sm_86, sm_89, sm_120 (99 KB)
                # sm_120's ptxas spills in V4.1's key loops with q held (7-16 reloads per block on Triton 3.9;
                # sm_89's none): there q is read in the loop, 2-5 % slower under the sm89 lowering (H200)
                q_in_loop = v41 and target.arch == 120
                return AttentionConfig(dict(fenced, BLOCK_N=32, PREFETCH=prefetch, Q_IN_LOOP=q_in_loop), 8, 1,
                                       "as sm_80's fp8 row in 99 KB: 32-key blocks (56-66 KB; 64-key ones with q "
                                       "read in the loop fit, 1.3x faster, but reload registers inside the key loop "
                                       "on Triton 3.9); the next block's rows asked of L2 (V4 formats: 11 % faster "
                                       "under the sm89 lowering); sm_86: bf16 built in PTX (6 % faster, sm86 "
                                       "lowering, H200); sm_120: V4.1's q read in the loop (spill-free)")
            return AttentionConfig(dict(fenced, BLOCK_N=64, Q_IN_LOOP=True), 8, 1,
                                   "as sm_80's fp8 row in 99 KB, V3.2's 576 dims: q read in the loop so 64-key "
                                   "blocks fit (80-88 KB; 1.3x faster than 32-key ones)")
        if target.shared_bytes >= 101 * 1024:  # sm_80, sm_100: two 64-key stages (100.25 KB) fit
            return AttentionConfig(dict(flags, H_BLOCK=h_block, BLOCK_N=64, Q_IN_LOOP=True), 8, 2,
                                   "mma.sync: at H_BLOCK 32 Triton puts the warps along the key / value columns (at "
                                   "64 it stacks all 8 along the heads and the 64x512 accumulator spills); q from "
                                   "L1 so two pipelined 64-key stages fit 100 KB; 1.37x sm_90's time")
        if dim == 512:  # sm_86, sm_89, sm_120 (99 KB)
            return AttentionConfig(dict(flags, H_BLOCK=h_block, BLOCK_N=64, Q_IN_LOOP=True, Q_ROPE_SCALAR=True), 8, 2,
                                   "mma.sync with 99 KB of shared memory: sm_80's row (100.25 KB: a 64 KB key stage, "
                                   "32 KB of q, the 4 KB P tile), with q's rope piece read outside the pipeliner's "
                                   "buffers, where it shares space with the P tile: 96.25 KB")
        return AttentionConfig(dict(flags, H_BLOCK=h_block, BLOCK_N=32, Q_IN_LOOP=True), 8, 2,
                               "mma.sync with 99 KB of shared memory, V3.2's 576 dims: as sm_80's row, with 32-key "
                               "stages (74 KB; 64-key ones need 112 KB, 108 KB with Q_ROPE_SCALAR)")
    if target.warp_size == 64:  # CDNA: gfx90a, gfx942, gfx950
        return AttentionConfig(dict(flags, H_BLOCK=min(32, heads) if fp8 else 16, BLOCK_N=16 if fp8 else 32), 4, 1,
                               "CDNA (MFMA, wave64, 512 VGPRs with AGPRs at one wave per SIMD): 4 waves (at 8 each "
                               "has 256 and spills); bf16: 16 heads x 32 keys (32 heads or 64-key blocks spill); fp8, "
                               "whose dequantisation needs registers too: 32 heads x 16 keys, spill-free, one wave per "
                               "SIMD as at 16 heads, and each key decoded for 32 heads, not 16: 1.8-2.0x fewer "
                               "instructions per key and 64 heads (gfx942 fp8_v4: 2,237 -> 1,185; not run on silicon)")
    return AttentionConfig(dict(flags, H_BLOCK=16, BLOCK_N=32, Q_IN_LOOP=True), 8, 1,
                           "RDNA (WMMA, wave32, 256 VGPRs): Triton stacks the value dots' warps along the heads, so "
                           "each wave holds a 16x512 float32 accumulator and spills at every tile size (this row "
                           "spills least); needs a value-dim split")


def unsupported(target: Target, dim: int, formats: frozenset[str], q_fp8: bool) -> str | None:
    """Why the portable attention kernel cannot run this case on ``target`` (a sentence naming the GPU, the format
    and what to use instead), or None where it can. Every row of :data:`.targets.MATRIX` runs every format the
    Triton kernels read (:data:`TRITON_FORMATS`), fp8 q included: fp8 is decoded with integer operations
    where Triton has no e4m3 type (:mod:`.fp8`), and sm_100's configuration keeps the accumulators out of tensor
    memory (:func:`attention_config`). A format outside :data:`TRITON_FORMATS` (none of the layout table's today) is
    refused on every target."""
    unread = sorted(formats - TRITON_FORMATS)
    if unread:
        return (f"{target.name} ({target.gpus}): the Triton kernels do not read {', '.join(unread)} caches "
                f"(they read {', '.join(sorted(TRITON_FORMATS))}): use backend='reference' for them")
    return None


def refuse_unread(formats: frozenset[str], device: torch.device) -> None:
    """A ``ValueError`` (:func:`unsupported`'s sentence) where a cache of a format the Triton kernels do not read
    would reach them on ``device``: the cache kernels' side of the attention plan's check."""
    why = unsupported(targets.target_of(device), 0, formats, False)
    if why:
        raise ValueError(why)
