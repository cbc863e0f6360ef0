"""The plan of an attention launch: which kernel (the portable Triton kernel of :mod:`.triton.attention` or the
Hopper kernel of :mod:`.gluon`), its grid, how key lists are split, its constexprs and launch options (the
portable kernel's from :mod:`.launch_configs`' row for the GPU's :class:`~.targets.Target`); and the ops' cache of
plans by geometry. The kernels themselves live in their own modules; this one decides and launches.

No Triton exception reaches a caller: a case the target cannot run is a ``ValueError`` when the plan is made
(:func:`.launch_configs.unsupported`), and a compile or launch failure is re-raised as one naming the target, the
formats and the shapes.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import triton
import triton.language as tl
from triton.errors import TritonError

from ..cache_views import pages_16_byte_aligned
from ..env import env_value
from . import dispatch, gluon as gluon_kernel, launch_configs, targets
from .launch import Launch, cached_launch
from .triton.attention import _combine_kernel, _sparse_mla_kernel
from .triton.rows import latent_pieces
from .validate import D_V, LOG2E, AttentionArgs, kernel_takes_q

def choose_splits(num_tokens: int, num_heads: int, head_blocks: int, max_blocks: int, sms: int,
                  tails: bool = False) -> tuple[int, int]:
    """How many pieces key lists are cut into (the pieces merged by the combine kernel), and whose: ``(pieces,
    tokens)``, the tokens being the last ones in the launch's order (``(1, 0)``: nothing is cut).

    num_heads: a token's heads (all its head blocks'); max_blocks: the longest key list the widths allow, in key
    blocks (the scopes' widths summed). A program holds a whole SM (its accumulators fill the register file), so
    the grid runs in waves of one program per SM. A grid that leaves at least half the SMs idle may be split to fill
    them — up to as many pieces as fit and ``max_blocks // 2`` (two blocks a piece on average); of those, the fewest
    that give the shortest piece — where that cuts its estimated time, in key-block times, by over 10 %: the
    longest piece's blocks, plus 2 for the combine's launch and the pieces' prologues and 4.5 × (heads a program /
    64) × programs / SMs for the partial rows written and read again (a fit to the Gluon kernel on an H200, V4-Flash
    decode at B 8-32: 64 tokens of 64 heads and 10 blocks, B 32's c4a, take 35.7 µs unsplit and 36.0 in two pieces,
    so they stay whole and skip the combine's launch; 32 tokens of 6 blocks 21.5 and 17.9 in three; docs/history.md
    version 32; other GPUs and the Triton kernel not measured). A larger grid is split, into
    pieces of at least 4 blocks, only where that cuts its estimated time by over 15 %, counted in key-block times:
    ``waves × blocks per program``, plus per piece (none when unsplit) one block for its prologue and one per 32
    heads for its float32 partial rows, written and read again by the combine.
    E.g. 148 tokens of 16 heads and 32 blocks on 132 SMs take 2 waves × 32 = 64 block times unsplit and
    5 × 8 + 4 × 1.5 = 46 with every token in four pieces; grids of whole waves (128 or 256 programs on an H100), and
    large ones, whose last wave is a small part of their time, stay unsplit.

    ``tails`` (the Gluon kernel, which numbers its items so): where the last wave is at most half full, only the
    tokens of that wave may be cut instead; their pieces then fill the SMs the other tokens' whole lists leave idle:
    ``full waves × blocks + the pieces' waves × (blocks per piece + the per-piece costs above)``, kept where it is
    5 % shorter. The 16-head example: the last 16 tokens in 8 pieces, 1 × 32 + 1 × (4 + 1.5) = 37.5; 148 tokens of
    128 heads (296 programs): unsplit 3 × 32 = 96, the last 16 tokens in 4 pieces 2 × 32 + (8 + 5) = 77. (Calibrated
    on the H100: BENCHMARKS.md, version 13.)
    """
    programs = num_tokens * head_blocks
    if max_blocks <= 1 or programs == 0:
        return 1, 0
    if 2 * programs <= sms:
        most = min(sms // programs, max_blocks // 2, 32)
        pieces = min(range(2, most + 1), key=lambda p: triton.cdiv(max_blocks, p), default=1)
        split_cost = 2 + 4.5 * num_heads / head_blocks / 64 * programs / sms
        if pieces > 1 and triton.cdiv(max_blocks, pieces) + split_cost < 0.9 * max_blocks:
            return pieces, num_tokens
        return 1, 0
    per_piece = 1 + num_heads / 32
    sizes = [p for p in (2, 4, 8) if 4 * p <= max_blocks]
    unsplit = triton.cdiv(programs, sms) * max_blocks
    # (estimated time, pieces, tokens cut), kept where it beats the unsplit grid by 15 % (every token's partials
    # cost more than counted here) or, cutting a tail (the partials of at most half a wave), by 5 %
    options = [(triton.cdiv(programs * p, sms) * triton.cdiv(max_blocks, p) + p * per_piece, p, num_tokens)
               for p in sizes]
    options = [o for o in options if o[0] < 0.85 * unsplit]
    last_wave = programs % sms
    if tails and 0 < 2 * last_wave <= sms:
        cut = triton.cdiv(last_wave, head_blocks)  # the last wave's tokens
        options += [o for o in ((programs // sms * max_blocks + triton.cdiv(cut * head_blocks * p, sms)
                                 * (triton.cdiv(max_blocks, p) + per_piece), p, cut) for p in sizes)
                    if o[0] < 0.95 * unsplit]
    return min(options, default=(unsplit, 1, 0))[1:]


# Batch-invariant mode: every token's key list is cut into splits of this many key blocks, whatever the batch,
# and the splits are always merged by the combine kernel (also a token of one split), so a token's output
# depends on its own lists alone. 32 blocks = 2048 keys: every V4 row (at most 128 + 1024 keys) and V3.2 row (top-k
# 2048) is one split (at 16 blocks V4-Pro's rows were two).
INVARIANT_SPLIT_BLOCKS = 32


def _launch(kernel_name: str, constexprs: tuple, options: tuple) -> Launch:
    """The shared :class:`Launch` of the ``"triton"``, ``"gluon"`` or ``"combine"`` kernel."""
    kernel = {"triton": _sparse_mla_kernel, "combine": _combine_kernel}.get(kernel_name)
    if kernel is None:  # the Gluon kernel's modules load with its first launch (the plan chose it: it builds here)
        from .gluon.kernel import _attention_kernel as kernel
    return cached_launch(kernel, constexprs, options)


class AttentionPlan:
    """One attention launch decided ahead of its tensors: which kernel, grid, splits, the launches and the
    constexprs. Made once per step and layer kind by the layer's step plan, or by :func:`run` for each new
    geometry of the ops' calls; called with any tensors of the planned shapes, formats and alignment.

    q_shape: ``(T, H, d)``. scopes: per scope ``(fmt, block_size, width)``: the cache's format and block size,
    the index rows' width (a ragged scope's: the longest row it can hold, at most its flat capacity).
    ragged: per scope, whether its index list is ragged (an ``indptr`` where a padded scope has its lens).
    combined: the two scopes are the parts of one combined index (FlashInfer's form): scope 0 its first
    ``width0`` columns, scope 1 the rest, and both calls' lens the whole row's count. q_fp8: q is
    float8_e4m3fn (calls pass its ``q_scale``). tokens_per_len: the calls' lens hold one length per that many
    consecutive tokens (``AttentionArgs.tokens_per_len``). has_sink / has_order: whether calls pass a sink / an order.
    batch_invariant: see
    :data:`INVARIANT_SPLIT_BLOCKS`. pages_16_byte_aligned: whether every cache the calls pass has a 16-byte
    aligned base and page stride. scratch: keep the split partials' buffers in the plan (a plan used on one
    stream, as the layer's are) instead of allocating them per call. The remaining keyword arguments override
    tuned launch choices (benchmarks sweep them; ``splits``: every token's list in that many pieces, or with
    ``tail`` (the Gluon kernel) just the last ``tail`` tokens' (:func:`choose_splits`); ``persistent``: the Gluon
    kernel's persistent programs, ``gluon.persistent``; ``narrow=False``: 64-head items where the Gluon
    kernel would take narrow ones, ``gluon.narrow_heads``).

    target: the GPU to plan for (default: ``targets.target_of(device)``). Given with a CPU device, the plan is the
    one that GPU would launch (no interpreter settings): :meth:`kernels` and :meth:`launch_arguments` say what it
    compiles, for the portability matrix (``tests/test_portability.py``); such a plan is not called.
    A case the target cannot run raises a ``ValueError`` saying why and what to use instead.
    """

    def __init__(self, q_shape: tuple[int, int, int], device: torch.device, scopes: list, has_sink: bool,
                 has_order: bool, *, batch_invariant: bool = False, pages_16_byte_aligned: bool = True,
                 scratch: bool = False, ragged: tuple[bool, ...] = (), combined: bool = False, q_fp8: bool = False,
                 tokens_per_len: int = 1, block_n: int | None = None, splits: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None, h_block: int | None = None,
                 gluon: int | None = None,
                 persistent: bool | None = None, tail: int | None = None, narrow: bool | None = None,
                 target: targets.Target | None = None) -> None:
        num_tokens, num_heads, dim = q_shape
        formats = frozenset(f.name for f, _, _ in scopes)
        interpret = device.type != "cuda" and target is None
        self.target = target or targets.target_of(device)
        self.formats = formats
        ragged = tuple(bool(r) for r in ragged) + (False,) * (len(scopes) - len(ragged))
        if combined and (len(scopes) != 2 or any(ragged)):
            raise ValueError("a combined index has two padded scopes")
        if tokens_per_len != 1 and any(ragged):
            raise ValueError("tokens_per_len must be 1 with ragged scopes (an indptr row per token)")
        self.q_fp8, self.tokens_per_len = q_fp8, tokens_per_len
        self.kernel = dispatch.attention_kernel(device, dim, formats, pages_16_byte_aligned, gluon,
                                                padded=not (any(ragged) or combined), q_fp8=q_fp8)
        if self.kernel == "gluon":
            h_block, block_n = gluon_kernel.HEADS_PER_PROGRAM, gluon_kernel.KEYS_PER_BLOCK
        else:
            why_not = launch_configs.unsupported(self.target, dim, formats, q_fp8)
            if why_not:
                raise ValueError(why_not)
            config = launch_configs.attention_config(self.target, dim, formats, num_heads, q_fp8, interpret)
            h_block = h_block or config.constexprs["H_BLOCK"]
            block_n = block_n or config.constexprs["BLOCK_N"]
        head_blocks, sms = triton.cdiv(num_heads, h_block), targets.num_sms(device, target)
        max_blocks = sum(triton.cdiv(width, block_n) for _, _, width in scopes)
        split_blocks = 0
        if batch_invariant:
            split_blocks = max(1, INVARIANT_SPLIT_BLOCKS * 64 // block_n)  # the same keys per split on every kernel
            splits, tail = max(1, triton.cdiv(max_blocks, split_blocks)), None
        if tail is not None and (self.kernel != "gluon" or (splits or 0) < 2 or not 0 < tail <= num_tokens):
            raise ValueError(f"tail={tail} needs the Gluon kernel, splits >= 2 and 0 < tail <= {num_tokens} tokens")
        if not splits:
            splits, tail = choose_splits(num_tokens, num_heads, head_blocks, max_blocks, sms,
                                         tails=self.kernel == "gluon")
        self.q_shape, self.device, self.splits = q_shape, device, splits
        self.partial = splits > 1 or batch_invariant
        # the tokens whose lists are cut (the last ones in the launch's order); the others' items write the output
        self.tail = (num_tokens if tail is None else tail) if self.partial else 0
        tail_only = 0 < self.tail < num_tokens  # the Gluon kernel's TAIL numbering, and the combine's
        self.has_extra = len(scopes) > 1
        self._scratch = self._partials() if self.partial and scratch else None
        (f0, bs0, _), *rest = scopes
        f1, bs1, _ = rest[0] if rest else scopes[0]
        constants = dict(BS0=bs0, BS1=bs1, HAS_EXTRA=self.has_extra, HAS_SINK=has_sink, HAS_ORDER=has_order,
                         SPLITS=splits, SPLIT_BLOCKS=split_blocks)
        if self.kernel == "gluon":
            # the scopes' formats (dispatch.GLUON_FORMATS: one format, or V4.1's fp8 and fp4 rows side by side)
            constants.update(FMT=f0.code, FMT1=f1.code, D_QK=dim)
            options = {"num_warps": gluon_kernel.PARTITION_WARPS}
            # a program per work item (token × head block × split), or persistent: one per SM, taking items in turn
            items = (num_tokens + self.tail * (splits - 1)) * head_blocks
            constants["PERSISTENT"] = (gluon_kernel.persistent(items, max_blocks, sms) if persistent is None
                                       else persistent)
            constants["TAIL"] = tail_only
            heads_n = gluon_kernel.narrow_heads(formats, num_heads)
            constants["HEADS_N"] = heads_n if narrow is None or narrow else 0
            self.grid = (sms if constants["PERSISTENT"] else items,)
        else:
            pa, pb, pc, v_has_rope = latent_pieces(dim)
            constants.update(config.constexprs)  # the target's strategy constexprs (NATIVE_FP8, ...)
            constants.update(FMT0=f0.code, FMT1=f1.code, PA=pa, PB=pb, PC=pc,
                             V_HAS_ROPE=v_has_rope, H_BLOCK=h_block, BLOCK_N=block_n,
                             DOT=tl.float32 if interpret else tl.bfloat16,  # the interpreter's bf16 dots are wrong
                             Q_FP8=q_fp8, RAGGED0=ragged[0], RAGGED1=ragged[-1] and self.has_extra,
                             COMBINED=combined)
            options = {} if interpret else {"num_warps": num_warps or config.num_warps,
                                            "num_stages": num_stages or config.num_stages}
            self.grid = (num_tokens * head_blocks, splits)
        self._constants, self._options = tuple(constants.items()), tuple(options.items())
        self.attention = _launch(self.kernel, self._constants, self._options)
        self.combine = (_launch("combine", (("SPLITS", splits), ("HAS_SINK", has_sink),
                                            ("TAIL", tail_only), ("HAS_ORDER", has_order)), ())
                        if self.partial else None)

    def _partials(self) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, num_heads, _ = self.q_shape
        f32 = dict(dtype=torch.float32, device=self.device)
        return (torch.empty(self.splits, num_tokens, num_heads, D_V, **f32),
                torch.empty(self.splits, num_tokens, num_heads, **f32))

    def __call__(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                 scale: float, caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...],
                 lens: tuple[torch.Tensor, ...], order: torch.Tensor | None, q_scale: torch.Tensor | None = None,
                 kv_scale: torch.Tensor | None = None) -> object | None:
        """Launch on ``q (T, H, d)`` with unit-stride rows into ``out (T, H, 512)`` (contiguous) and ``lse (T, H)``
        float32; per scope a paged cache, its index rows ``(T, width)`` (unit stride along a row) and lens
        ``(T,)`` (contiguous) — a ragged scope its flat ``(capacity,)`` list and its ``indptr (T+1,)`` in their
        place, a combined index's two scopes its column ranges ``[:, :W]`` / ``[:, W:]`` and the row lens twice;
        ``order (T,)`` int32 when planned with one; ``q_scale`` (an fp8 q) / ``kv_scale`` (fp8_e4m3 caches):
        ``(1,)`` float32. Returns the attention kernel's compiled binary (for register and spill reports: ``n_regs``,
        ``n_spills``, ``asm``), None under the CPU interpreter or where no token or head launched anything."""
        num_tokens, num_heads, _ = self.q_shape
        if num_tokens == 0 or num_heads == 0:
            return None
        tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
        args = self._args(tensors, scale)
        try:
            compiled = self.attention(self.grid, *args)
            if self.combine is not None:
                self.combine((self.tail * num_heads,), *self._combine_args(tensors))
        except Exception as error:
            if not _from_triton(error):
                raise
            raise ValueError(self._failure(error)) from error
        return compiled

    def _failure(self, error: Exception) -> str:
        """What a user reads where Triton could not compile or launch this plan's kernels (the last line of
        defence: :mod:`.launch_configs` is checked to fit every target by ``tests/test_portability.py``)."""
        num_tokens, num_heads, dim = self.q_shape
        first_line = (str(error).strip().splitlines() or [""])[0]
        return (f"sparse MLA attention failed to compile or launch on {self.target.name} ({self.kernel} kernel, "
                f"{'/'.join(sorted(self.formats))} caches, {'fp8' if self.q_fp8 else 'bf16'} q of {num_tokens} "
                f"tokens x {num_heads} heads x {dim} dims, {self.splits} split(s), options {dict(self._options)}): "
                f"{type(error).__name__}: {first_line} (please report it; backend='reference' computes the same "
                f"in plain PyTorch)")

    def kernels(self) -> list[tuple[str, object, dict, dict]]:
        """What this plan launches: ``(name, kernel, constexprs, launch options)`` for the attention kernel and,
        where key lists are split, the combine kernel (the portability matrix compiles exactly these)."""
        launches = [("attention", self.attention), ("combine", self.combine)]
        return [(name, launch.kernel, {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "num_stages")},
                 {k: v for k, v in launch.kwargs.items() if k in ("num_warps", "num_stages")})
                for name, launch in launches if launch is not None]

    def launch_arguments(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                         scale: float, caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...],
                         lens: tuple[torch.Tensor, ...], order: torch.Tensor | None = None,
                         q_scale: torch.Tensor | None = None, kv_scale: torch.Tensor | None = None) -> list[tuple]:
        """The runtime arguments :meth:`__call__` passes each kernel of :meth:`kernels`, in that order."""
        tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
        return [self._args(tensors, scale)] + ([self._combine_args(tensors)] if self.combine is not None else [])

    # slots of _tensors' list: what a step plan's bound launch fixes (lists_fixed: lse, order, the scopes' indices and
    # lens; the scratch partials), and the combine's tensors in its argument order (partials, out, lse, sink, order)
    LIST_SLOTS, PARTIAL_SLOTS, COMBINE_SLOTS = (2, 6, 8, 9, 11, 12), (3, 4), (3, 4, 1, 2, 5, 6)

    def _combine_args(self, tensors: list[torch.Tensor]) -> tuple:
        """The combine kernel's arguments for :meth:`_tensors`' list."""
        num_tokens, num_heads, _ = self.q_shape
        return (*[tensors[k] for k in self.COMBINE_SLOTS], num_tokens * num_heads, num_heads, num_tokens - self.tail)

    def _tensors(self, q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale) -> list[torch.Tensor]:
        """The attention kernel's tensor arguments, in its order (absent optional ones stand in as ``lse``, which the
        kernel then does not read): q, out, lse, the split partials, sink, order, per scope cache / indices / lens,
        and for the Triton kernel the fp8 scales."""
        if self.q_fp8:
            q = q.view(torch.uint8)  # the kernel reads an fp8 q's bytes
        c0, i0, l0 = caches[0], indices[0], lens[0]
        c1, i1, l1 = (caches[1], indices[1], lens[1]) if self.has_extra else (c0, i0, l0)
        part_o, part_lse = (self._scratch or self._partials()) if self.partial else (out, lse)
        tensors = [q, out, lse, part_o, part_lse, lse if sink is None else sink, lse if order is None else order,
                   c0, i0, l0, c1, i1, l1]
        if self.kernel == "triton":  # the Gluon kernel reads neither (dispatch gives it no fp8 q or fp8_e4m3)
            tensors += [lse if kv_scale is None else kv_scale, lse if q_scale is None else q_scale]
        return tensors

    def _args(self, tensors: list[torch.Tensor], scale: float) -> tuple:
        """The attention kernel's arguments: :meth:`_tensors` with the strides, sizes and scale between them."""
        q, out, lse, part_o, part_lse, sink_arg, order_arg, c0, i0, l0, c1, i1, l1, *fp8_scales = tensors
        num_tokens, num_heads, _ = self.q_shape
        return (q, q.stride(0), q.stride(1), out, lse, part_o, part_lse, sink_arg, order_arg,
                c0, c0.stride(0), c0.shape[0] * c0.shape[1], i0, i0.stride(0), l0, i0.shape[-1],
                c1, c1.stride(0), c1.shape[0] * c1.shape[1], i1, i1.stride(0), l1, i1.shape[-1],
                num_tokens, num_heads, self.tokens_per_len, scale * LOG2E,
                *(fp8_scales if self.kernel == "triton" else (self.tail,)))

    def bind(self, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None, scale: float,
             caches: tuple[torch.Tensor, ...], indices: tuple[torch.Tensor, ...], lens: tuple[torch.Tensor, ...],
             order: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
             kv_scale: torch.Tensor | None = None, *, lists_fixed: bool = False):
        """After a call with these arguments, a function ``bound(q, out, lse, sink, caches, indices, lens, order,
        q_scale, kv_scale) -> bool`` that launches the same kernel (and, for split key lists, the combine) with
        ``scale`` on new tensors laid out as these (every stride, size, dtype and 16-byte alignment: the caller's
        guarantee), skipping the argument assembly and the fingerprint. It reads only the new tensors' data pointers,
        so a tensor of another rank over the same bytes (a 4-D cache for its 3-D paged view) serves. lists_fixed: every
        later call passes these very ``lse``, ``indices``, ``lens`` and ``order`` (a step plan's buffers), whose
        pointers are then bound too (the plan's scratch partials always are). False means it launched nothing (call
        the plan). None where there is no direct launch path."""
        num_tokens, num_heads, _ = self.q_shape
        if num_tokens == 0 or num_heads == 0:
            return None
        tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
        fixed = (set(self.PARTIAL_SLOTS if self._scratch is not None else ())
                 | set(self.LIST_SLOTS if lists_fixed else ()))
        varying = [k for k in range(len(tensors)) if k not in fixed]
        args = self._args(tensors, scale)
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]  # the slots' places in args
        launch = self.attention.bind(self.grid, args, frozenset(positions[k] for k in fixed))
        combine = None
        if self.combine is not None:  # split partials: the per-call buffers of a plan without scratch are new each call
            combine_varying = [k for k in self.COMBINE_SLOTS if k not in fixed]
            combine = self.combine.bind((self.tail * num_heads,), self._combine_args(tensors),
                                        frozenset(i for i, k in enumerate(self.COMBINE_SLOTS) if k in fixed))
            if combine is None:
                return None
        if launch is None:
            return None

        def bound(q, out, lse, sink, caches, indices, lens, order=None, q_scale=None, kv_scale=None) -> bool:
            tensors = self._tensors(q, out, lse, sink, caches, indices, lens, order, q_scale, kv_scale)
            if not launch([tensors[k] for k in varying]):
                return False
            if combine is not None:  # it launches: the attention's launch just passed the same device and hook test
                combine([tensors[k] for k in combine_varying])
            return True
        return bound


def _from_triton(error: Exception) -> bool:
    """Whether ``error`` is Triton's (a compile error, ``OutOfResources``, a ptxas failure, or the plain
    ``RuntimeError`` its compiler passes raise, which name Triton or its passes) rather than PyTorch's (out of memory,
    a device fault of an earlier launch surfacing here: those pass through unwrapped)."""
    if isinstance(error, TritonError):
        return True
    text = str(error)
    return type(error) is RuntimeError and ("Triton" in text or "PassManager" in text or "ptxas" in text)


_PLANS: OrderedDict[tuple, AttentionPlan] = OrderedDict()  # the ops' plans, by geometry (least recently used out)
_MAX_PLANS = 64


def invariant_split(batch_invariant: bool) -> int | bool:
    """What of ``batch_invariant`` a plan depends on: the split size (:data:`INVARIANT_SPLIT_BLOCKS`, which tests
    change) when on, else False (a part of the keys of plans and of the ops' remembered calls)."""
    return batch_invariant and INVARIANT_SPLIT_BLOCKS


def plan_switches() -> tuple[str | None, str | None]:
    """What decides a plan besides its call's geometry and may change within a process: ``SPARSE_MLA_GLUON`` as set
    (whether :func:`.gluon.enabled`) and the architecture Triton lowers for (``TRITON_OVERRIDE_ARCH`` /
    :func:`.targets.lower_as`, which :func:`.targets.target_of` follows). A part of the plans' keys, and compared
    again by every remembered call of the ops (:func:`.memo.recall`), so read the cheapest way: two environment
    reads (the first checked against its values, :func:`sparse_mla.env.env_value`), ~1 us on a slow 2-core CPU."""
    return env_value("SPARSE_MLA_GLUON"), targets.override_arch()


def plan_geometry(args: AttentionArgs, batch_invariant: bool = False) -> tuple[tuple, dict]:
    """The positional and keyword arguments of :class:`AttentionPlan` for checked arguments' geometry (what
    :func:`plan_for` plans, and the portability matrix compiles for each target)."""
    q = args.q
    scopes = [(s.fmt, s.cache.shape[1], s.width) for s in args.scopes]
    forms = dict(ragged=tuple([s.indptr is not None for s in args.scopes]), combined=args.scopes[-1].len_skip > 0,
                 q_fp8=args.q_scale is not None, tokens_per_len=args.tokens_per_len)
    aligned = all(pages_16_byte_aligned(s.cache) for s in args.scopes)
    return ((tuple(q.shape), q.device, scopes, args.sink is not None, args.order is not None),
            dict(batch_invariant=batch_invariant, pages_16_byte_aligned=aligned, **forms))


def plan_for(args: AttentionArgs, batch_invariant: bool = False, **overrides) -> AttentionPlan:
    """The shared :class:`AttentionPlan` of checked arguments' geometry under the current :func:`plan_switches` (made
    on first sight, least recently used out); see :class:`AttentionPlan` for the overrides."""
    q = args.q
    key = (q.shape, q.device, tuple([(s.fmt.name, s.fmt.dim, s.cache.shape[1], s.width) for s in args.scopes]),
           args.sink is not None, args.order is not None, invariant_split(batch_invariant),
           tuple([pages_16_byte_aligned(s.cache) for s in args.scopes]),
           tuple([s.indptr is not None for s in args.scopes]), args.scopes[-1].len_skip > 0,
           args.q_scale is not None, args.tokens_per_len, tuple(sorted(overrides.items())) if overrides else (),
           plan_switches())
    plan = _PLANS.get(key)
    if plan is None:
        positional, keywords = plan_geometry(args, batch_invariant)
        plan = _PLANS[key] = AttentionPlan(*positional, **keywords, **overrides)
        if len(_PLANS) > _MAX_PLANS:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    return plan


def call_arguments(args: AttentionArgs) -> tuple:
    """The arguments of an :class:`AttentionPlan` call for checked arguments (``out``: ``args.out`` or a new
    ``(T, H, 512)`` bf16 tensor; ``lse``: a new ``(T, H)`` float32 one), in :meth:`AttentionPlan.__call__`'s order."""
    q = args.q if kernel_takes_q(args.q) else args.q.contiguous()
    out = args.out if args.out is not None else torch.empty(*q.shape[:2], D_V, dtype=torch.bfloat16, device=q.device)
    lse = torch.empty(*q.shape[:2], dtype=torch.float32, device=q.device)
    return (q, out, lse, args.sink, args.scale, tuple(s.cache for s in args.scopes),
            tuple(s.indices for s in args.scopes),
            tuple(s.lens if s.indptr is None else s.indptr for s in args.scopes), args.order, args.q_scale,
            args.kv_scale)


def run(args: AttentionArgs, batch_invariant: bool = False, plan: AttentionPlan | None = None,
        **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the attention kernel (and the combine kernel when the key lists are split) for checked arguments,
    through ``plan``, by default the plan of their geometry (:func:`plan_for`). On Hopper, where
    ``dispatch.gluon_fits`` (scope formats of ``dispatch.GLUON_FORMATS``), the kernel is ``gluon``'s
    (``gluon=0`` forces this module's Triton kernel, ``gluon=1`` the Gluon one); see :class:`AttentionPlan` for the
    overrides. Returns out ``(T, H, 512)`` bf16 (``args.out`` when given) and lse ``(T, H)`` float32."""
    plan = plan or plan_for(args, batch_invariant, **overrides)
    call = call_arguments(args)
    plan(*call)
    return call[1], call[2]
