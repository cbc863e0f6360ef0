"""KV cache storage formats (DESIGN §2): byte layouts, quantisation and dequantisation in torch.

(About 600 lines: the one layout table and the torch codecs of all eight format names stay in one module, so every
byte layout has one home that the kernels import.)

A paged cache is a tensor ``(num_blocks, block_size, token_bytes)``; ``stride(0)`` is the page (block) stride:

* ``bf16``: a ``torch.bfloat16`` tensor ``(num_blocks, block_size, d)``, d = 512 (V4) or 576 (V3.2).
* ``fp8_v4`` (FlashMLA "MODEL1"): ``torch.uint8`` ``(num_blocks, block_size, 584)``, page-planar (below): a token's
  body ``[448 e4m3 nope][64 bf16 rope]`` (576 B), its scales ``[7 ue8m0][1 pad]`` (8 B), pages padded to a
  multiple of 576 bytes.
* ``fp8_v32`` (vLLM ``fp8_ds_mla`` for V3.2): ``torch.uint8`` ``(num_blocks, block_size, 656)``,
  each token ``[512 e4m3][4 x fp32 scale][64 x bf16 rope]``.
* ``fp8_e4m3`` (per-tensor, FlashInfer TRTLLM-gen's V4 cache): ``torch.float8_e4m3fn``
  ``(num_blocks, block_size, 512)``, every dim (rope included) ``e4m3(x / kv_scale)``, saturated to
  ±448, with one float32 ``kv_scale`` for the whole cache, kept by its owner (``PagedCache.kv_scale``)
  and passed to every op that reads or writes the cache. The ops see its bytes (a ``uint8`` view).
* ``fp8_v41`` / ``fp8_v41_planar`` (DeepSeek-V4.1's fp8 cache): ``torch.uint8`` ``(num_blocks, block_size, 528)``,
  a token ``[512 e4m3, rope dims included][16 ue8m0 scales, one per 32 dims]``.
* ``fp4_v41`` / ``fp4_v41_planar`` (V4.1's fp4 cache): ``torch.uint8`` ``(num_blocks, block_size, 288)``, a token
  ``[256 B of e2m1 codes: dim 2i in the low nibble of byte i, dim 2i+1 in the high one][32 e4m3 scales, one per
  16 dims]``.

Page layouts. *Token-interleaved* (bf16, fp8_v32, fp8_e4m3, fp8_v41, fp4_v41): a page is its tokens' records back
to back, row ``t`` of the ``(block_size, token_bytes)`` view is token ``t``; ``stride(0)`` may leave padding after
a page (for the V4.1 formats a whole number of rows: FlashMLA's rule). *Page-planar* (fp8_v4, fp8_v41_planar,
fp4_v41_planar; vLLM's and SGLang's V4.1 pages): a page holds every token's record bytes before ``scale_offset``,
then every token's remaining bytes (its scales), its size rounded up to a multiple of ``page_align``; the
``(block_size, token_bytes)`` shape is a view only: row ``t`` of it is *not* token ``t``'s bytes
(:func:`page_fields` says where they are). A 528- or 288-byte cache tensor reads as token-interleaved (its rows are
its tokens, as FlashMLA's API takes it); the page-planar V4.1 layout is named: ``fmt="fp8_v41_planar"``.

Quantisers (FlashMLA's reference rules; tiles of consecutive quantised dims):

* tiled fp8 (fp8_v4, fp8_v32, fp8_v41): ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` per tile (exact, from
  the float's bits), stored value ``e4m3(x / scale)`` rounded to nearest even. A tile holding NaN (±inf) gets a NaN
  (inf) scale, stored as ue8m0 ``0xFF`` (fp32 NaN / inf in fp8_v32), and its values ``e4m3(x / scale)`` in IEEE
  arithmetic, a NaN as ``0x7F``.
* fp4 (fp4_v41): ``scale = e4m3(clamp(amax / 6, 2^-9, 448))`` per tile of 16 (a NaN tile: scale NaN, ``0x7F``),
  codes the e2m1 value nearest ``x / scale`` (ties to the even code), saturating at ±6, the sign bit kept for -0
  and for negatives that round to 0, NaN -> code 0.

Dequantised values (``value · scale``) are exact in bf16, except in tiled fp8 for ``|x| >=``
:data:`FP8_TILE_INF_FROM` (~3.2958e38), which FlashMLA's rule stores as code 256 at scale 2^120: ±inf read back.

A *record* is one token's bytes in the canonical order ``[fields of the layout]`` used by
:func:`encode_records` / :func:`decode_records` (a V4.1 record is its token-interleaved row); :func:`field_views`
says where each slice of the record lives inside a page, so the record never needs to be contiguous in the cache.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from ._checks import check_device, check_finite, check_kv_scale, check_positive_int, check_tensor, is_int

# ---- the byte-layout table: every number of every format, named once (the kernels import these) ----
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
E4M3_NAN = 0x7F  # the float8_e4m3fn NaN the quantisers write
MIN_SCALE = 1e-4  # floor of amax / 448, so an all-zero tile still gets a finite scale
# where "a dequantised fp8 value is exact in bf16" stops: a tile whose amax exceeds 448 · 2^119 (~2.98e38) gets the
# scale 2^120, and in it |x| >= 248 · 2^120 (~3.2958e38, up to bf16's largest 3.39e38) has x / 2^120 >= 248, which
# e4m3 rounds (to even) to 256: the stored code is exact FlashMLA bytes, but 256 · 2^120 = 2^128 reads back as ±inf
# (every tiled fp8 format: fp8_v4, fp8_v32, fp8_v41). Every smaller value, down to the floor scale's subnormals,
# reads back exactly.
FP8_TILE_INF_FROM = 248 * 2.0**120
UE8M0_BIAS = 127  # a ue8m0 byte e stands for 2^(e - 127)
UE8M0_NAN = 0xFF  # the one ue8m0 byte that is not a power of two
ROPE_DIM = 64  # trailing rope dims of every latent
V4_DIM, V32_DIM = 512, 576  # latent width of V4 (and V4.1) and V3.2 tokens
# fp8_v4: per block, every token's body [448 e4m3 nope][64 bf16 rope] (576 B), then every token's
# [7 ue8m0 scales][1 pad] (8 B); each block padded up to a multiple of 576 bytes
V4_NOPE_DIM, V4_TILE, V4_NUM_TILES = 448, 64, 7
V4_TOKEN_BYTES = 584
V4_BODY_BYTES = 576
V4_SCALE_BYTES = 8
V4_ROPE_OFFSET = V4_NOPE_DIM  # byte offset of the rope inside a token's body
# fp8_v32: per token [512 e4m3 nope][4 fp32 scales, one per 128][64 bf16 rope]
V32_NOPE_DIM, V32_TILE, V32_NUM_TILES = 512, 128, 4
V32_TOKEN_BYTES = 656
V32_SCALE_OFFSET = V32_NOPE_DIM  # byte offset of the fp32 scales
V32_ROPE_OFFSET = V32_SCALE_OFFSET + 4 * V32_NUM_TILES  # 528
# fp8_e4m3: per token 512 e4m3 (rope included), one float32 kv_scale per cache
E4M3_TOKEN_BYTES = V4_DIM
# fp8_v41 (DeepSeek-V4.1): per token [512 e4m3, rope included][16 ue8m0 scales, one per 32 dims]
V41_FP8_TILE, V41_FP8_NUM_TILES = 32, 16
V41_FP8_TOKEN_BYTES = 528
V41_FP8_SCALE_OFFSET = V4_DIM  # 512: the scales follow the 512 e4m3 bytes
# fp4_v41: per token [256 B of e2m1 codes, two a byte, the even dim in the low nibble][32 e4m3 scales, one per 16]
V41_FP4_TILE, V41_FP4_NUM_TILES = 16, 32
V41_FP4_TOKEN_BYTES = 288
V41_FP4_SCALE_OFFSET = V4_DIM // 2  # 256
V41_PAGE_ALIGN = 512  # page-planar V4.1 pages are rounded up to a multiple of 512 bytes
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of e2m1 code c & 7; bit 3 (0x8) is the sign
E2M1_MAX = E2M1_VALUES[-1]
E2M1_SIGN = 0x8
E2M1_MIN_SCALE = 2.0**-9  # floor of an fp4 tile's scale (the smallest e4m3 subnormal); 448 is its ceiling
# format codes: the kernels' FMT constexprs, one per format name: a code says how a token's record is encoded and
# where its bytes sit in a page (the page-planar V4.1 layouts have codes of their own: see page_fields)
FMT_BF16, FMT_FP8_V4, FMT_FP8_V32, FMT_FP8_E4M3, FMT_FP8_V41, FMT_FP4_V41 = 0, 1, 2, 3, 4, 5
FMT_FP8_V41_PLANAR, FMT_FP4_V41_PLANAR = 6, 7
PLANAR_SUFFIX = "_planar"  # names the page-planar layout of a format whose tensors read as token-interleaved
FORMAT_CODES = {"bf16": FMT_BF16, "fp8_v4": FMT_FP8_V4, "fp8_v32": FMT_FP8_V32, "fp8_e4m3": FMT_FP8_E4M3,
                "fp8_v41": FMT_FP8_V41, "fp8_v41" + PLANAR_SUFFIX: FMT_FP8_V41_PLANAR,
                "fp4_v41": FMT_FP4_V41, "fp4_v41" + PLANAR_SUFFIX: FMT_FP4_V41_PLANAR}


@dataclass(frozen=True)
class KVFormat:
    """One storage format. ``token_bytes`` is the size of the cache tensor's last axis."""

    name: str
    dim: int  # latent width per token
    token_bytes: int
    nope_dim: int  # leading dims stored quantised (0 for bf16)
    rope_dim: int  # trailing dims kept in bf16
    tile: int  # quantised values sharing one scale (0 for bf16 and for the per-tensor fp8_e4m3)
    scale_offset: int = 0  # byte of a token's record where its tile scales start (0: no tile scales)
    page_align: int = 0  # page-planar formats: pages rounded up to a multiple of this many bytes; 0: token-interleaved

    @property
    def quantized(self) -> bool:
        """Whether values are stored quantised (every format but bf16)."""
        return self.nope_dim > 0

    @property
    def is_fp8(self) -> bool:
        """Whether the quantised values are e4m3 bytes (every quantised format but fp4_v41)."""
        return self.quantized and self.record_code != FMT_FP4_V41

    @property
    def per_tensor(self) -> bool:
        """Whether one ``kv_scale`` for the whole cache scales every value (fp8_e4m3)."""
        return self.quantized and self.tile == 0

    @property
    def num_tiles(self) -> int:
        return self.nope_dim // self.tile if self.tile else 0

    @property
    def code(self) -> int:
        """The kernels' format code (``FMT_*``): how a token's record is encoded and how a page holds the records
        (with the block size, a kernel's whole knowledge of a cache's bytes: :func:`page_fields`)."""
        return FORMAT_CODES[self.name]

    @property
    def record_code(self) -> int:
        """The code of the record encoding, whatever the page layout (both layouts of a V4.1 format share it)."""
        return FORMAT_CODES[self.encoding]

    @property
    def planar(self) -> bool:
        """Whether a page stores every token's bytes ``[0, scale_offset)`` first, then every token's scales."""
        return self.page_align > 0

    @property
    def encoding(self) -> str:
        """The name of the record encoding: the format's name without the layout suffix (both layouts of a V4.1
        format share it)."""
        return self.name.removesuffix(PLANAR_SUFFIX)

    @property
    def whole_row_pages(self) -> bool:
        """Whether the page stride must be a whole number of ``token_bytes`` rows (FlashMLA's token-interleaved
        V4.1 caches: padding after a page is allowed, in whole rows)."""
        return self.code in (FMT_FP8_V41, FMT_FP4_V41)


FP8_V4 = KVFormat("fp8_v4", dim=V4_DIM, token_bytes=V4_TOKEN_BYTES, nope_dim=V4_NOPE_DIM, rope_dim=ROPE_DIM,
                  tile=V4_TILE, scale_offset=V4_BODY_BYTES, page_align=V4_BODY_BYTES)
FP8_V32 = KVFormat("fp8_v32", dim=V32_DIM, token_bytes=V32_TOKEN_BYTES, nope_dim=V32_NOPE_DIM, rope_dim=ROPE_DIM,
                   tile=V32_TILE, scale_offset=V32_SCALE_OFFSET)
FP8_E4M3 = KVFormat("fp8_e4m3", dim=V4_DIM, token_bytes=E4M3_TOKEN_BYTES, nope_dim=V4_DIM, rope_dim=0, tile=0)
FP8_V41 = KVFormat("fp8_v41", dim=V4_DIM, token_bytes=V41_FP8_TOKEN_BYTES, nope_dim=V4_DIM, rope_dim=0,
                   tile=V41_FP8_TILE, scale_offset=V41_FP8_SCALE_OFFSET)
FP4_V41 = KVFormat("fp4_v41", dim=V4_DIM, token_bytes=V41_FP4_TOKEN_BYTES, nope_dim=V4_DIM, rope_dim=0,
                   tile=V41_FP4_TILE, scale_offset=V41_FP4_SCALE_OFFSET)
FP8_V41_PLANAR = replace(FP8_V41, name="fp8_v41" + PLANAR_SUFFIX, page_align=V41_PAGE_ALIGN)
FP4_V41_PLANAR = replace(FP4_V41, name="fp4_v41" + PLANAR_SUFFIX, page_align=V41_PAGE_ALIGN)
_FIXED_WIDTH = {f.name: f for f in (FP8_V4, FP8_V32, FP8_E4M3, FP8_V41, FP8_V41_PLANAR, FP4_V41, FP4_V41_PLANAR)}
FORMAT_NAMES = ("bf16", *_FIXED_WIDTH)


class Readers(NamedTuple):
    """Which attention kernels read a cache format, and beside which formats (a row of :data:`READERS`; the
    reference ops read every format).

    triton: the portable Triton kernels read it. gluon_dims: the q·k widths the Gluon (Hopper) kernel reads it at
    (``()``: never). gluon_mix: formats of one non-empty mix are read side by side in one Gluon call (the scopes in
    two formats); the others with every scope alike. gluon_narrow: the Gluon kernel also reads every scope of this
    format in narrow items (quantised rows: ``gluon.narrow_heads``). beside: as a layer's compressed cache, the
    window cache encoding (a format name less its page-layout suffix) it may sit beside besides its own (``""``:
    its own only)."""

    triton: bool = True
    gluon_dims: tuple[int, ...] = ()
    gluon_mix: str = ""
    gluon_narrow: bool = False
    beside: str = ""


# the read-capability table, a row per format name of the layout table: a new format is one row here
READERS = {
    "bf16": Readers(gluon_dims=(512, 576)),
    "fp8_v4": Readers(gluon_dims=(512,), gluon_narrow=True),
    "fp8_v32": Readers(gluon_dims=(576,), gluon_narrow=True),
    "fp8_e4m3": Readers(),
    "fp8_v41": Readers(gluon_dims=(512,), gluon_mix="v41", gluon_narrow=True),
    "fp8_v41_planar": Readers(gluon_dims=(512,), gluon_mix="v41", gluon_narrow=True),
    # FlashMLA reads fp4 only as the extra (compressed) cache
    "fp4_v41": Readers(gluon_dims=(512,), gluon_mix="v41", gluon_narrow=True, beside="fp8_v41"),
    "fp4_v41_planar": Readers(gluon_dims=(512,), gluon_mix="v41", gluon_narrow=True, beside="fp8_v41"),
}
_UINT8_INFERRED = (FP8_V4, FP8_V32, FP8_V41, FP4_V41)  # what a uint8 cache reads as, by its last axis


def get_format(fmt: str | KVFormat, dim: int | None = None) -> KVFormat:
    """The :class:`KVFormat` named ``fmt``. ``dim`` picks the width of ``bf16`` (512, the default,
    or 576); for the quantised formats, whose width is fixed, a given ``dim`` must match it."""
    if not isinstance(fmt, (str, KVFormat)):
        raise TypeError(f"fmt must be a format name, one of {FORMAT_NAMES}, or a KVFormat; got {type(fmt).__name__}")
    if dim is not None and not is_int(dim):
        raise TypeError(f"dim must be an int or None, got {dim!r} ({type(dim).__name__})")
    if isinstance(fmt, KVFormat):
        f = fmt
    elif fmt == "bf16":
        dim = V4_DIM if dim is None else dim
        if dim not in (V4_DIM, V32_DIM):
            raise ValueError(f"dim must be 512 (V4) or 576 (V3.2) for bf16, got {dim}")
        return KVFormat("bf16", dim=dim, token_bytes=2 * dim, nope_dim=0, rope_dim=dim, tile=0)
    elif fmt in _FIXED_WIDTH:
        f = _FIXED_WIDTH[fmt]
    else:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    if dim is not None and dim != f.dim:
        raise ValueError(f"dim {dim} does not match format {f.name}, whose tokens have {f.dim} dims")
    return f


def bytes_per_token(fmt: str | KVFormat, dim: int | None = None) -> int:
    """Bytes one token takes in the cache's last axis (584 for fp8_v4, 656 for fp8_v32, 512 for fp8_e4m3,
    528 for fp8_v41, 288 for fp4_v41, 2·d for bf16)."""
    return get_format(fmt, dim).token_bytes


def block_bytes(fmt: str | KVFormat, block_size: int, dim: int | None = None) -> int:
    """Bytes of one cache block, i.e. the cache tensor's ``stride(0)`` in bytes.

    Page-planar formats pad each block up to a multiple of ``page_align`` bytes (fp8_v4: 576, as FlashMLA does;
    the planar V4.1 formats: 512, as vLLM and SGLang do).
    """
    f = get_format(fmt, dim)
    check_positive_int("block_size", block_size)
    raw = block_size * f.token_bytes
    if f.planar:
        return math.ceil(raw / f.page_align) * f.page_align
    return raw


class PageFields(NamedTuple):
    """Where a token's bytes sit inside its page (byte offsets from the page's start), for a page of
    ``block_size`` tokens: bytes ``[0, scale_offset)`` of token ``t``'s record (its body) at
    ``t * body_stride``, bytes ``[scale_offset, token_bytes)`` (its scales, and fp8_v32's rope) at
    ``scales_base + t * scales_stride``. The kernels read both layouts of a format through these numbers."""

    body_stride: int
    scales_base: int
    scales_stride: int


def page_fields(fmt: KVFormat, block_size: int) -> PageFields:
    """:class:`PageFields` of ``fmt`` for pages of ``block_size`` tokens (e.g. fp8_v41: ``(528, 512, 528)``;
    fp8_v41_planar: ``(512, block_size * 512, 16)``; fp8_v4: ``(576, block_size * 576, 8)``)."""
    if not isinstance(fmt, KVFormat):
        raise TypeError(f"fmt must be a KVFormat (get_format), got {type(fmt).__name__}")
    if fmt.planar:
        return PageFields(fmt.scale_offset, block_size * fmt.scale_offset, fmt.token_bytes - fmt.scale_offset)
    return PageFields(fmt.token_bytes, fmt.scale_offset, fmt.token_bytes)


def _page_row(f: KVFormat) -> tuple[int, int, int, int]:
    """:func:`page_fields` of ``f`` as numbers for any block size ``B``: ``(body_stride, scales_base at B = 0,
    scales_base per token of B, scales_stride)`` (``scales_base`` is affine in the block size)."""
    none, one = page_fields(f, 0), page_fields(f, 1)
    return none.body_stride, none.scales_base, one.scales_base - none.scales_base, none.scales_stride


# page_fields by kernel format code (``KVFormat.code``) of the fixed-width formats, as :func:`_page_row` gives them:
# what kernels that know a cache by its code and block size read it by (data, which JIT code may hold)
PAGE_TABLE = {f.code: _page_row(f) for f in _FIXED_WIDTH.values()}


def infer_format(cache: torch.Tensor, name: str = "cache") -> KVFormat:
    """The format of a cache tensor from its dtype and last axis (bf16, uint8 with 584 / 656 / 528 / 288, or
    float8_e4m3fn with 512). A 528- or 288-byte cache reads as token-interleaved (fp8_v41, fp4_v41): the page-planar
    layout of those bytes cannot be told from the tensor and is named by the caller (:func:`resolve_cache`)."""
    check_tensor(name, cache, dtype=(torch.bfloat16, torch.uint8, torch.float8_e4m3fn))
    if cache.dim() == 0:
        raise ValueError(f"{name} must be a paged cache (num_blocks, block_size, token_bytes), got a scalar")
    if cache.dtype == torch.float8_e4m3fn:
        if cache.shape[-1] != E4M3_TOKEN_BYTES:
            raise ValueError(f"{name} is float8_e4m3fn with last axis {cache.shape[-1]}: expected "
                             f"{E4M3_TOKEN_BYTES} (fp8_e4m3)")
        return FP8_E4M3
    if cache.dtype == torch.bfloat16:
        if cache.shape[-1] not in (V4_DIM, V32_DIM):
            raise ValueError(f"{name} is bf16 with last axis {cache.shape[-1]}: expected 512 (V4) or 576 (V3.2)")
        return get_format("bf16", cache.shape[-1])
    for f in _UINT8_INFERRED:
        if cache.shape[-1] == f.token_bytes:
            return f
    expected = ", ".join(f"{f.token_bytes} ({f.name})" for f in _UINT8_INFERRED[:-1])
    raise ValueError(f"{name} is uint8 with {cache.shape[-1]} bytes per token: expected {expected} or "
                     f"{_UINT8_INFERRED[-1].token_bytes} ({_UINT8_INFERRED[-1].name})")


def _storage_dtype(fmt: KVFormat) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}.get(fmt.name, torch.uint8)


def as_paged(cache: torch.Tensor, fmt: KVFormat, name: str = "cache") -> torch.Tensor:
    """Validate a paged cache of ``fmt`` and return it as ``(num_blocks, block_size, token_bytes)``
    (an fp8_e4m3 cache as a ``uint8`` view of its bytes, like the other fp8 formats).

    Also accepts FlashMLA's 4-D ``(num_blocks, block_size, 1, token_bytes)``.
    """
    if cache.dim() == 4 and cache.shape[2] == 1:
        cache = cache.squeeze(2)
    want_dtype = _storage_dtype(fmt)
    last = fmt.dim if fmt.name == "bf16" else fmt.token_bytes
    check_tensor(name, cache, dtype=want_dtype, shape=(None, None, last))
    if cache.stride(2) != 1 or cache.stride(1) != last:
        raise ValueError(f"{name} must have contiguous tokens (stride (*, {last}, 1)), got {cache.stride()}")
    if cache.shape[0] > 1:
        page = block_bytes(fmt, cache.shape[1], fmt.dim)
        if cache.stride(0) < page // cache.element_size():
            raise ValueError(f"{name} stride(0) = {cache.stride(0)} is smaller than one {fmt.name} block "
                             f"({page} bytes)")
        if fmt.whole_row_pages and cache.stride(0) % fmt.token_bytes:
            raise ValueError(f"{name} stride(0) = {cache.stride(0)} is not a whole number of {fmt.token_bytes}-byte "
                             f"rows: an {fmt.name} page is its tokens' rows, any padding after it whole rows "
                             f"(a page-planar cache is fmt='{fmt.name}{PLANAR_SUFFIX}')")
    if fmt.quantized and (cache.data_ptr() % 4 or cache.stride(0) % 4):
        # the GPU kernels read the rope, the scales and (fp8_v4) the e4m3 bytes as aligned 16- and 32-bit words
        raise ValueError(f"{name}: every {fmt.name} block must start on a 4-byte boundary; the cache starts at "
                         f"byte {cache.data_ptr() % 4} mod 4 and stride(0) = {cache.stride(0)}")
    return cache.view(torch.uint8) if fmt.per_tensor else cache


def resolve_cache(cache: torch.Tensor, fmt: str | KVFormat | None = None,
                  name: str = "cache", fmt_name: str = "fmt") -> tuple[torch.Tensor, KVFormat]:
    """Infer a cache's format, check it against ``fmt`` when given, and validate its layout. ``fmt`` also picks
    the page layout of a V4.1 cache (``"fp8_v41_planar"``: its bytes read as page-planar). ``name`` / ``fmt_name``:
    the arguments the errors name."""
    found = declared_format(cache, infer_format(cache, name), fmt, name, fmt_name)
    return as_paged(cache, found, name), found


def declared_format(cache: torch.Tensor, found: KVFormat, fmt: str | KVFormat | None, name: str,
                     fmt_name: str = "fmt") -> KVFormat:
    """The format of a cache whose tensor reads as ``found``: ``fmt`` when it is ``found`` or the same encoding in
    the other page layout, ``found`` when ``fmt`` is None; ``ValueError`` when ``fmt`` is another format."""
    if fmt is None:
        return found
    want = get_format(fmt, found.dim if fmt == "bf16" else None)  # bf16: the cache's width
    if replace(want, name=found.name, page_align=found.page_align) == found:  # found, or found in another layout
        return want
    raise ValueError(f"{name} holds {found.name} data ({cache.dtype}, last axis {cache.shape[-1]}) "
                     f"but {fmt_name} is {want.name!r}" + (f" (dim {want.dim})" if isinstance(fmt, KVFormat) else ""))


def field_views(cache: torch.Tensor, fmt: KVFormat) -> list[tuple[torch.Tensor, int, int]]:
    """Where each slice of a token's record lives: ``[(view, start, end)]``.

    ``view[block, offset]`` holds ``record[start:end]`` of the token at ``(block, offset)``.
    Views alias ``cache``'s storage, so writing through them writes the cache.
    """
    if not fmt.planar:
        return [(cache, 0, cache.shape[-1])]
    nb, bs, _ = cache.shape
    fields = page_fields(fmt, bs)
    s0, base = cache.stride(0), cache.storage_offset()
    body = torch.as_strided(cache, (nb, bs, fmt.scale_offset), (s0, fields.body_stride, 1), base)
    scales = torch.as_strided(cache, (nb, bs, fields.scales_stride), (s0, fields.scales_stride, 1),
                              base + fields.scales_base)
    return [(body, 0, fmt.scale_offset), (scales, fmt.scale_offset, fmt.token_bytes)]


# ---- quantisers: (n, d) float32 values -> codes and per-tile scales; tiles are consecutive runs of ``tile`` dims ----


def tile_amax(x: torch.Tensor, tile: int) -> torch.Tensor:
    """``max |x|`` per tile: ``(n, d)`` -> ``(n, d // tile)`` (NaN where a tile holds NaN)."""
    return x.view(x.shape[0], x.shape[1] // tile, tile).abs().amax(-1)


def ceil_pow2(ratio: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(ratio))`` of positive float32 ``ratio``, elementwise; NaN stays NaN, +inf stays +inf.

    Exact: the exponent comes from the float's exponent and mantissa bits (a float32 ``log2`` can round
    ``2^e·(1+2^-23)`` down to ``e``), so every implementation can reproduce it bit for bit.
    """
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    power = torch.exp2((exponent - (mantissa == 0.5).to(torch.int32)).float())
    return torch.where(torch.isfinite(ratio), power, ratio)


def fp8_tile_scales(x: torch.Tensor, tile: int) -> torch.Tensor:
    """FlashMLA's fp8 tile scales ``2^ceil(log2(max(amax / 448, 1e-4)))``: ``(n, d)`` float32 -> ``(n, d // tile)``
    (exact: :func:`ceil_pow2`). A tile holding NaN gets NaN, one holding ±inf (and no NaN) +inf: the rule in IEEE
    arithmetic."""
    return ceil_pow2(torch.clamp_min(tile_amax(x, tile) / E4M3_MAX, MIN_SCALE))


def quantize_e4m3_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiled fp8: ``x (n, d)`` float32 -> e4m3 bytes ``(n, d)`` uint8 of ``x / scale`` (round to nearest even; a
    NaN as ``0x7F``) and the scales ``(n, d // tile)`` float32 (:func:`fp8_tile_scales`)."""
    n, d = x.shape
    scales = fp8_tile_scales(x, tile)
    q = x.view(n, d // tile, tile) / scales[..., None]  # |q| <= 448 in a finite tile: the cast never saturates
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(q), E4M3_NAN, codes).view(n, d), scales


def ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """ue8m0 bytes of power-of-two scales (``0xFF`` for NaN and inf): same shape, uint8."""
    _, exponent = torch.frexp(scales)  # 2^e = 0.5 * 2^(e + 1)
    return torch.where(torch.isfinite(scales), exponent - 1 + UE8M0_BIAS, UE8M0_NAN).to(torch.uint8)


def ue8m0_values(raw: torch.Tensor) -> torch.Tensor:
    """Values of ue8m0 bytes: ``2^(b - 127)``, NaN for ``0xFF``; float32."""
    return torch.where(raw == UE8M0_NAN, math.nan, torch.exp2((raw.to(torch.int32) - UE8M0_BIAS).float()))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in ``[0, 16)``) of float32 ``y``: the nearest of ``±E2M1_VALUES``, a tie going to the even
    code, beyond ±6 saturating at ±6; the sign bit (``0x8``) set for every negative ``y`` and -0 (a negative value
    that rounds to zero keeps it); NaN -> 0."""
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for c in range(1, len(E2M1_VALUES)):
        mid = (E2M1_VALUES[c - 1] + E2M1_VALUES[c]) / 2  # exact in float32: ties are detected exactly
        code += ((a >= mid) if c % 2 == 0 else (a > mid)).to(torch.uint8)  # a tie goes to the even code
    return code | (torch.signbit(y) & ~torch.isnan(y)).to(torch.uint8) * E2M1_SIGN


def quantize_e2m1_tiles(x: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4: ``x (n, d)`` float32 -> e2m1 codes ``(n, d)`` uint8 (:func:`e2m1_codes` of ``x / scale``, the division
    in float32) and the e4m3 scale bytes ``(n, d // tile)`` uint8 of ``scale = e4m3(clamp(amax / 6, 2^-9, 448))``
    (a NaN tile: ``0x7F``, and its codes 0)."""
    n, d = x.shape
    amax = tile_amax(x, tile)
    # amax / 6 rounded to float32, then to e4m3: the same as rounding the exact quotient (a bf16 amax over 6 is
    # never within float32 rounding of an e4m3 tie)
    scales = torch.clamp(amax / E2M1_MAX, E2M1_MIN_SCALE, E4M3_MAX).to(torch.float8_e4m3fn)
    scale_bytes = torch.where(torch.isnan(amax), E4M3_NAN, scales.view(torch.uint8))
    return e2m1_codes(x.view(n, d // tile, tile) / scales.float()[..., None]).view(n, d), scale_bytes


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Two e2m1 codes a byte: ``(n, d)`` -> ``(n, d // 2)`` uint8, dim ``2i`` in the low nibble of byte ``i``."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_e2m1` undone: ``(n, d // 2)`` uint8 -> codes ``(n, d)`` uint8."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], 2 * packed.shape[1])


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Values of e2m1 codes (code 8 is -0): same shape, float32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=codes.device)
    return table[codes.long()]


def _per_tensor_scale(fmt: KVFormat, kv_scale: torch.Tensor | None) -> torch.Tensor:
    """``kv_scale`` of an fp8_e4m3 cache (``ValueError`` when missing)."""
    if kv_scale is None:
        raise ValueError(f"kv_scale is required for an {fmt.name} cache (one float32 scale for the whole cache)")
    return kv_scale


def quantize_per_tensor(x: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """fp8_e4m3 bytes of ``x (n, d)``: ``e4m3(x / kv_scale)`` (IEEE division in float32, round to nearest
    even), saturated to ±448 as torch's cast does (a NaN stays NaN): ``(n, d)`` uint8."""
    y = (x.float() / kv_scale).clamp(-E4M3_MAX, E4M3_MAX)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def encode_records(kv: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantise tokens: ``kv (n, d)`` bf16 -> ``(n, token_bytes)`` uint8 records (quantised formats only;
    ``kv_scale`` ``(1,)`` float32: fp8_e4m3's, required for it). Non-finite values follow the rules of the module
    docstring (the ops reject them before they get here)."""
    if fmt.per_tensor:
        return quantize_per_tensor(kv, _per_tensor_scale(fmt, kv_scale))
    n = kv.shape[0]
    x = kv.float()
    if fmt.record_code == FMT_FP4_V41:  # [packed e2m1 codes][e4m3 scales]
        codes, scale_bytes = quantize_e2m1_tiles(x, fmt.tile)
        return torch.cat([pack_e2m1(codes), scale_bytes], dim=1)
    codes, scales = quantize_e4m3_tiles(x[:, : fmt.nope_dim], fmt.tile)
    rope_bytes = kv[:, fmt.nope_dim :].contiguous().view(torch.uint8)
    if fmt.record_code == FMT_FP8_V32:  # [e4m3 nope][fp32 scales][bf16 rope]
        return torch.cat([codes, scales.contiguous().view(torch.uint8), rope_bytes], dim=1)
    # fp8_v4: [e4m3 nope][bf16 rope][7 ue8m0][1 zero pad byte]; fp8_v41: [e4m3][16 ue8m0]
    pad = torch.zeros(n, fmt.token_bytes - fmt.scale_offset - fmt.num_tiles, dtype=torch.uint8, device=kv.device)
    return torch.cat([codes, rope_bytes, ue8m0_bytes(scales), pad], dim=1)


def record_scales(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Per-tile scales of records: ``(n, token_bytes)`` uint8 -> ``(n, tiles)`` float32 (tiled formats)."""
    raw = records[:, fmt.scale_offset :]
    if fmt.record_code == FMT_FP8_V32:
        return raw[:, : 4 * fmt.num_tiles].contiguous().view(torch.float32)
    raw = raw[:, : fmt.num_tiles]
    if fmt.record_code == FMT_FP4_V41:
        return raw.contiguous().view(torch.float8_e4m3fn).float()
    return ue8m0_values(raw)


def decode_records(records: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise records: ``(n, token_bytes)`` uint8 -> ``(n, d)`` float32, ``value · scale`` (exact in bf16
    for the tiled formats: e4m3 · 2^k, e2m1 · e4m3 — but ±inf for a value quantised from ``|x| >=``
    :data:`FP8_TILE_INF_FROM`; fp8_e4m3: e4m3 · kv_scale)."""
    n = records.shape[0]
    if fmt.record_code == FMT_FP4_V41:
        values = e2m1_values(unpack_e2m1(records[:, : fmt.scale_offset]))
    else:
        values = records[:, : fmt.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
        if fmt.per_tensor:
            return values * _per_tensor_scale(fmt, kv_scale)
    nope = (values.view(n, fmt.num_tiles, fmt.tile) * record_scales(records, fmt)[..., None]).view(n, fmt.nope_dim)
    if not fmt.rope_dim:
        return nope
    rope_start = V4_ROPE_OFFSET if fmt.code == FMT_FP8_V4 else V32_ROPE_OFFSET
    rope = records[:, rope_start : rope_start + 2 * fmt.rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def write_tokens(cache: torch.Tensor, fmt: KVFormat, blocks: torch.Tensor, offsets: torch.Tensor, kv: torch.Tensor,
                 kv_scale: torch.Tensor | None = None) -> None:
    """Store ``kv (n, d)`` bf16 at ``(blocks[i], offsets[i])`` of a validated paged cache; ``kv_scale``:
    fp8_e4m3's ``(1,)`` float32."""
    if fmt.name == "bf16":
        cache[blocks, offsets] = kv
        return
    records = encode_records(kv, fmt, kv_scale)
    for view, start, end in field_views(cache, fmt):
        view[blocks, offsets] = records[:, start:end]


def read_tokens(cache: torch.Tensor, fmt: KVFormat, blocks: torch.Tensor, offsets: torch.Tensor,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantised tokens at ``(blocks[i], offsets[i])`` of a validated paged cache: ``(n, d)`` float32."""
    if fmt.name == "bf16":
        return cache[blocks, offsets].float()
    records = torch.cat([view[blocks, offsets] for view, _, _ in field_views(cache, fmt)], dim=-1)
    return decode_records(records, fmt, kv_scale)


def allocate_cache(fmt: str | KVFormat, num_blocks: int, block_size: int, device: torch.device | str = "cpu",
                   dim: int | None = None) -> torch.Tensor:
    """A zeroed paged cache ``(num_blocks, block_size, token_bytes)``, a view of one contiguous buffer."""
    f = get_format(fmt, dim)
    num_blocks, block_size = check_positive_int("num_blocks", num_blocks), check_positive_int("block_size", block_size)
    device = check_device("device", device)
    if f.name == "bf16":
        return torch.zeros(num_blocks, block_size, f.dim, dtype=torch.bfloat16, device=device)
    stride0 = block_bytes(f, block_size)
    if num_blocks * stride0 >= 2**62:  # (torch failed to unpack the size: "Overflow when unpacking long long")
        raise ValueError(f"a cache of {num_blocks} blocks of {block_size} tokens ({num_blocks * stride0} bytes) is "
                         f"past any device")
    raw = torch.zeros(num_blocks * stride0, dtype=_storage_dtype(f), device=device)
    return torch.as_strided(raw, (num_blocks, block_size, f.token_bytes), (stride0, f.token_bytes, 1))


def _block_grid(num_blocks: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    offsets = torch.arange(block_size, device=device).repeat(num_blocks)
    return blocks, offsets


def cache_scale(f: KVFormat, kv_scale, device: torch.device, check_values: bool = True) -> torch.Tensor | None:
    """``kv_scale`` as ``(1,)`` float32 for an fp8_e4m3 cache (required), None for the others (must be None: a scale
    given to a tiled format would be ignored)."""
    if not f.per_tensor:
        if kv_scale is not None:
            raise ValueError(f"kv_scale is only for fp8_e4m3 caches, got a {f.name} cache")
        return None
    return check_kv_scale(kv_scale, device, "kv_scale", check_values)


def quantize_blocks(kv: torch.Tensor, fmt: str | KVFormat, kv_scale: float | torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Build a paged cache from ``kv (num_blocks, block_size, d)`` bf16 (every slot filled).

    Returns a ``(num_blocks, block_size, token_bytes)`` uint8 tensor (bf16 for ``fmt="bf16"``,
    float8_e4m3fn for ``"fp8_e4m3"``, which needs ``kv_scale``) whose ``stride(0)`` is
    :func:`block_bytes`: byte-identical to FlashMLA's / vLLM's / FlashInfer's caches.
    """
    check_tensor("kv", kv, dtype=torch.bfloat16, ndim=3)
    f = get_format(fmt, kv.shape[-1] if fmt == "bf16" else None)
    check_tensor("kv", kv, shape=(None, None, f.dim))
    check_finite("kv", kv)
    nb, bs, _ = kv.shape
    if nb == 0 or bs == 0:
        raise ValueError(f"kv must hold at least one block of at least one token, got shape {tuple(kv.shape)}")
    scale = cache_scale(f, kv_scale, kv.device)
    cache = allocate_cache(f, nb, bs, kv.device, f.dim)
    blocks, offsets = _block_grid(nb, bs, kv.device)
    write_tokens(as_paged(cache, f), f, blocks, offsets, kv.reshape(nb * bs, f.dim), scale)
    return cache


def dequantize_blocks(cache: torch.Tensor, fmt: str | KVFormat | None = None,
                      kv_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Every slot of a paged cache, dequantised: ``(num_blocks, block_size, d)`` bf16 (``kv_scale``: an
    fp8_e4m3 cache's)."""
    cache, f = resolve_cache(cache, fmt)
    nb, bs, _ = cache.shape
    scale = cache_scale(f, kv_scale, cache.device)
    blocks, offsets = _block_grid(nb, bs, cache.device)
    return read_tokens(cache, f, blocks, offsets, scale).to(torch.bfloat16).view(nb, bs, f.dim)
