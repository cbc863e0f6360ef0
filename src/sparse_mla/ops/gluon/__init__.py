"""Hopper sparse MLA attention for V4 (512 latent dims) and V3.2 (576), written in Gluon (Triton's explicit dialect).

Same contract and arguments as ``triton.attention``'s kernel, for the cases that dominate serving
on an sm_90 GPU: every scope ``fp8_v4`` / ``fp8_v32`` (decode, paged-direct prefill), V4.1's ``fp8_v41`` / ``fp4_v41``
rows in either page layout (the scopes alike, or an fp8 window beside an fp4 compressed cache), or every scope
``bf16`` (workspace prefill, bf16 caches). A work item is one query token × 64 heads × one split of the key list (every
token's list cut alike, or with ``TAIL`` just the last tokens', whose pieces fill the SMs the others' whole lists
leave idle: ``attention_plan.choose_splits``); a program takes one item, or, launched persistent
(``persistent``: many short items), one program per SM takes items in turn, so that an item's q load and output
store overlap the next item's first gathers. A program is three warpgroups that run out of step, synchronised by
mbarriers only: copy warpgroups fill two shared buffers of 64 keys, one 256-dim half of a block at a time, each
half as soon as its last reader of the block two back is done, and math warpgroups read them. The variants:

* :mod:`.wide`: fp8 and fp4 rows, 64 heads (decode: bound by the copy warpgroup): a copy warpgroup that gathers and
  dequantises (V4 / V3.2 rows a pair of blocks per loop step; V4.1's block by block, in runs of one format), a logits
  warpgroup that hands P to a values warpgroup.
* :mod:`.paired`: bf16 rows (workspace prefill: bound by the math): a ``cp.async`` copy warpgroup and two paired
  math warpgroups that trade row maxima and P.
* :mod:`.narrow`: fp8 rows of at most 16 heads (tensor-parallel shards): two copy warpgroups, one per buffer, and
  one math warpgroup with the heads as the wgmmas' N.

V3.2 (``D_QK = 576``): the shared rows hold the 512 V dims as V4's do; the 64 rope dims of the keys go by
``cp.async`` into a buffer of their own (``r_smem``) with the second half, and the query's rope dims join the
logits as one more wgmma per block. The split merge and the sink of split rows are ``triton.attention``'s combine
kernel.

Modules: :mod:`.host` (import guard, the validated Tritons, shapes, register budgets, launch choices: imports without
Gluon; the package imports only this one, so that the token order and the launch plans load no kernel module: the
plan imports :mod:`.kernel` at the first Gluon launch), :mod:`.compat` (the builtins Triton renamed between 3.6 and
3.9, bound to the installed one's names), :mod:`.common` (constants, argument bundles, barrier waits, work items,
q loads, output stores), :mod:`.fp8_rows` (fp8 and fp4 gathers and dequantisation), the three variants, and
:mod:`.kernel` (the entry kernel).
"""
from .host import (HEADS_PER_PROGRAM, KEYS_PER_BLOCK, LOGITS_REGS, NARROW_COPY_REGS, NARROW_HEADS, NARROW_MATH_REGS,
                   PAIRED_REGS, PARTITION_WARPS, VALIDATED_STACKS, VALIDATED_TRITON, VALUES_REGS, enabled, gluon,
                   narrow_heads, off_reason, persistent, warn_portable_once)

__all__ = ["HEADS_PER_PROGRAM", "KEYS_PER_BLOCK", "LOGITS_REGS", "NARROW_COPY_REGS", "NARROW_HEADS",
           "NARROW_MATH_REGS", "PAIRED_REGS", "PARTITION_WARPS", "VALIDATED_STACKS", "VALIDATED_TRITON", "VALUES_REGS",
           "enabled", "gluon", "narrow_heads", "off_reason", "persistent", "warn_portable_once"]
