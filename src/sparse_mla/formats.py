"""KV cache storage formats (DESIGN §2): byte layouts, quantisation and dequantisation in torch.

A paged cache is a tensor ``(num_blocks, block_size, token_bytes)``:

* ``bf16``: a ``torch.bfloat16`` tensor ``(num_blocks, block_size, d)``, d = 512 (V4) or 576 (V3.2).
* ``fp8_v4`` (FlashMLA "MODEL1"): ``torch.uint8`` ``(num_blocks, block_size, 584)`` whose
  ``stride(0)`` is the padded block size. Inside a block, token ``t``'s 448 e4m3 nope bytes and
  128 bytes of bf16 rope sit at ``t * 576``; its 7 ue8m0 tile scales (and one pad byte) sit at
  ``block_size * 576 + t * 8``. The ``(block_size, 584)`` shape is a view only: row ``t`` of it
  is *not* token ``t``'s bytes.
* ``fp8_v32`` (vLLM ``fp8_ds_mla`` for V3.2): ``torch.uint8`` ``(num_blocks, block_size, 656)``,
  each token ``[512 e4m3][4 x fp32 scale][64 x bf16 rope]``.
* ``fp8_e4m3`` (per-tensor, FlashInfer TRTLLM-gen's V4 cache): ``torch.float8_e4m3fn``
  ``(num_blocks, block_size, 512)``, every dim (rope included) ``e4m3(x / kv_scale)``, saturated to
  ±448, with one float32 ``kv_scale`` for the whole cache, kept by its owner (``PagedCache.kv_scale``)
  and passed to every op that reads or writes the cache. The ops see its bytes (a ``uint8`` view).

The tiled fp8 formats use one power-of-two scale per tile of nope values:
``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))``, stored value ``e4m3(x / scale)``.

A *record* is one token's bytes in the canonical order ``[fields of the layout]`` used by
:func:`encode_records` / :func:`decode_records`; :func:`field_views` says where each slice of the
record lives inside a block, so the record never needs to be contiguous in the cache.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from ._checks import check_finite, check_kv_scale, check_positive_int, check_tensor, is_int

# ---- the byte-layout table: every number of every format, named once (the kernels import these) ----
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
MIN_SCALE = 1e-4  # floor of amax / 448, so an all-zero tile still gets a finite scale
UE8M0_BIAS = 127  # a ue8m0 byte e stands for 2^(e - 127)
ROPE_DIM = 64  # trailing rope dims of every latent
V4_DIM, V32_DIM = 512, 576  # latent width of V4 and V3.2 tokens
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
# format codes: the kernels' FMT constexprs
FMT_BF16, FMT_FP8_V4, FMT_FP8_V32, FMT_FP8_E4M3 = 0, 1, 2, 3
FORMAT_CODES = {"bf16": FMT_BF16, "fp8_v4": FMT_FP8_V4, "fp8_v32": FMT_FP8_V32, "fp8_e4m3": FMT_FP8_E4M3}


@dataclass(frozen=True)
class KVFormat:
    """One storage format. ``token_bytes`` is the size of the cache tensor's last axis."""

    name: str
    dim: int  # latent width per token
    token_bytes: int
    nope_dim: int  # dims stored as fp8 (0 for bf16)
    rope_dim: int  # trailing dims kept in bf16
    tile: int  # nope values sharing one scale (0 for bf16 and for the per-tensor fp8_e4m3)

    @property
    def is_fp8(self) -> bool:
        return self.nope_dim > 0

    @property
    def per_tensor(self) -> bool:
        """Whether one ``kv_scale`` for the whole cache scales every value (fp8_e4m3)."""
        return self.is_fp8 and self.tile == 0

    @property
    def num_tiles(self) -> int:
        return self.nope_dim // self.tile if self.tile else 0

    @property
    def code(self) -> int:
        """The kernels' format code (``FMT_*``)."""
        return FORMAT_CODES[self.name]


FP8_V4 = KVFormat("fp8_v4", dim=V4_DIM, token_bytes=V4_TOKEN_BYTES, nope_dim=V4_NOPE_DIM, rope_dim=ROPE_DIM,
                  tile=V4_TILE)
FP8_V32 = KVFormat("fp8_v32", dim=V32_DIM, token_bytes=V32_TOKEN_BYTES, nope_dim=V32_NOPE_DIM, rope_dim=ROPE_DIM,
                   tile=V32_TILE)
FP8_E4M3 = KVFormat("fp8_e4m3", dim=V4_DIM, token_bytes=E4M3_TOKEN_BYTES, nope_dim=V4_DIM, rope_dim=0, tile=0)
FORMAT_NAMES = ("bf16", "fp8_v4", "fp8_v32", "fp8_e4m3")


def get_format(fmt: str | KVFormat, dim: int | None = None) -> KVFormat:
    """The :class:`KVFormat` named ``fmt``. ``dim`` picks the width of ``bf16`` (512, the default,
    or 576); for the fp8 formats, whose width is fixed, a given ``dim`` must match it."""
    if not isinstance(fmt, (str, KVFormat)):
        raise TypeError(f"fmt must be a format name, one of {FORMAT_NAMES}, or a KVFormat; got {type(fmt).__name__}")
    if dim is not None and not is_int(dim):
        raise TypeError(f"dim must be an int or None, got {dim!r} ({type(dim).__name__})")
    if isinstance(fmt, KVFormat):
        f = fmt
    elif fmt == "fp8_v4":
        f = FP8_V4
    elif fmt == "fp8_v32":
        f = FP8_V32
    elif fmt == "fp8_e4m3":
        f = FP8_E4M3
    elif fmt == "bf16":
        dim = V4_DIM if dim is None else dim
        if dim not in (V4_DIM, V32_DIM):
            raise ValueError(f"dim must be 512 (V4) or 576 (V3.2) for bf16, got {dim}")
        return KVFormat("bf16", dim=dim, token_bytes=2 * dim, nope_dim=0, rope_dim=dim, tile=0)
    else:
        raise ValueError(f"fmt must be one of {FORMAT_NAMES}, got {fmt!r}")
    if dim is not None and dim != f.dim:
        raise ValueError(f"dim {dim} does not match format {f.name}, whose tokens have {f.dim} dims")
    return f


def bytes_per_token(fmt: str | KVFormat, dim: int | None = None) -> int:
    """Bytes one token takes in the cache's last axis (584 for fp8_v4, 656 for fp8_v32, 512 for fp8_e4m3,
    2·d for bf16)."""
    return get_format(fmt, dim).token_bytes


def block_bytes(fmt: str | KVFormat, block_size: int, dim: int | None = None) -> int:
    """Bytes of one cache block, i.e. the cache tensor's ``stride(0)`` in bytes.

    fp8_v4 pads each block up to a multiple of 576 bytes, as FlashMLA does.
    """
    f = get_format(fmt, dim)
    check_positive_int("block_size", block_size)
    raw = block_size * f.token_bytes
    if f.name == "fp8_v4":
        return math.ceil(raw / V4_BODY_BYTES) * V4_BODY_BYTES
    return raw


def infer_format(cache: torch.Tensor, name: str = "cache") -> KVFormat:
    """The format of a cache tensor from its dtype and last axis (bf16, uint8 with 584 / 656, or
    float8_e4m3fn with 512)."""
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
    for f in (FP8_V4, FP8_V32):
        if cache.shape[-1] == f.token_bytes:
            return f
    raise ValueError(
        f"{name} is uint8 with {cache.shape[-1]} bytes per token: expected 584 (fp8_v4) or 656 (fp8_v32)"
    )


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
    if cache.shape[0] > 1 and cache.stride(0) < block_bytes(fmt, cache.shape[1], fmt.dim) // cache.element_size():
        raise ValueError(
            f"{name} stride(0) = {cache.stride(0)} is smaller than one {fmt.name} block "
            f"({block_bytes(fmt, cache.shape[1], fmt.dim)} bytes)"
        )
    if fmt.is_fp8 and (cache.data_ptr() % 4 or cache.stride(0) % 4):
        # the GPU kernels read the rope, the scales and (fp8_v4) the e4m3 bytes as aligned 16- and 32-bit words
        raise ValueError(f"{name}: every {fmt.name} block must start on a 4-byte boundary; the cache starts at "
                         f"byte {cache.data_ptr() % 4} mod 4 and stride(0) = {cache.stride(0)}")
    return cache.view(torch.uint8) if fmt.per_tensor else cache


def resolve_cache(cache: torch.Tensor, fmt: str | KVFormat | None = None,
                  name: str = "cache") -> tuple[torch.Tensor, KVFormat]:
    """Infer a cache's format, check it against ``fmt`` when given, and validate its layout."""
    found = infer_format(cache, name)
    _check_format(cache, found, fmt, name)
    return as_paged(cache, found, name), found


def _check_format(cache: torch.Tensor, found: KVFormat, fmt: str | KVFormat | None, name: str) -> None:
    """``ValueError`` unless the cache's format ``found`` is the asked-for ``fmt`` (None: any)."""
    if fmt is not None and get_format(fmt, found.dim if fmt == "bf16" else None) != found:  # bf16: the cache's width
        want = fmt.name if isinstance(fmt, KVFormat) else fmt
        raise ValueError(f"{name} holds {found.name} data ({cache.dtype}, last axis {cache.shape[-1]}) "
                         f"but fmt is {want!r}"
                         + (f" (dim {fmt.dim})" if isinstance(fmt, KVFormat) else ""))


def field_views(cache: torch.Tensor, fmt: KVFormat) -> list[tuple[torch.Tensor, int, int]]:
    """Where each slice of a token's record lives: ``[(view, start, end)]``.

    ``view[block, offset]`` holds ``record[start:end]`` of the token at ``(block, offset)``.
    Views alias ``cache``'s storage, so writing through them writes the cache.
    """
    if fmt.name != "fp8_v4":
        return [(cache, 0, cache.shape[-1])]
    nb, bs, _ = cache.shape
    s0, base = cache.stride(0), cache.storage_offset()
    body = torch.as_strided(cache, (nb, bs, V4_BODY_BYTES), (s0, V4_BODY_BYTES, 1), base)
    scales = torch.as_strided(cache, (nb, bs, V4_SCALE_BYTES), (s0, V4_SCALE_BYTES, 1), base + bs * V4_BODY_BYTES)
    return [(body, 0, V4_BODY_BYTES), (scales, V4_BODY_BYTES, V4_BODY_BYTES + V4_SCALE_BYTES)]


def tile_scale_exponents(nope: torch.Tensor, tile: int) -> torch.Tensor:
    """``ceil(log2(max(amax / 448, 1e-4)))`` per tile: ``(n, nope_dim)`` float32 -> ``(n, tiles)`` int32.

    Computed exactly from the float's exponent and mantissa bits (a float32 ``log2`` can round
    ``2^e·(1+2^-23)`` down to ``e``), so every implementation can reproduce it bit for bit.
    """
    amax = nope.view(nope.shape[0], nope.shape[1] // tile, tile).abs().amax(-1)
    ratio = torch.clamp_min(amax / E4M3_MAX, MIN_SCALE)
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return (exponent - (mantissa == 0.5).to(torch.int32)).to(torch.int32)


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
    """Quantise tokens: ``kv (n, d)`` bf16 -> ``(n, token_bytes)`` uint8 records (fp8 formats only;
    ``kv_scale`` ``(1,)`` float32: fp8_e4m3's, required for it)."""
    if fmt.per_tensor:
        return quantize_per_tensor(kv, _per_tensor_scale(fmt, kv_scale))
    n = kv.shape[0]
    x = kv.float()
    nope, rope = x[:, : fmt.nope_dim], kv[:, fmt.nope_dim :]
    exps = tile_scale_exponents(nope, fmt.tile)
    scale = torch.exp2(exps.float())
    q = (nope.view(n, fmt.num_tiles, fmt.tile) / scale[..., None]).view(n, fmt.nope_dim)
    q_bytes = q.to(torch.float8_e4m3fn).view(torch.uint8)
    rope_bytes = rope.contiguous().view(torch.uint8)
    if fmt.name == "fp8_v4":
        scale_bytes = torch.zeros(n, V4_SCALE_BYTES, dtype=torch.uint8, device=kv.device)
        scale_bytes[:, : fmt.num_tiles] = (exps + UE8M0_BIAS).to(torch.uint8)
        return torch.cat([q_bytes, rope_bytes, scale_bytes], dim=1)
    return torch.cat([q_bytes, scale.contiguous().view(torch.uint8), rope_bytes], dim=1)


def record_scales(records: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Per-tile scales of records: ``(n, token_bytes)`` uint8 -> ``(n, tiles)`` float32 (tiled formats)."""
    if fmt.name == "fp8_v4":
        exps = records[:, V4_BODY_BYTES : V4_BODY_BYTES + fmt.num_tiles].to(torch.int32) - UE8M0_BIAS
        return torch.exp2(exps.float())
    return records[:, V32_SCALE_OFFSET : V32_ROPE_OFFSET].contiguous().view(torch.float32)


def decode_records(records: torch.Tensor, fmt: KVFormat, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantise records: ``(n, token_bytes)`` uint8 -> ``(n, d)`` float32 (tiled formats exact: e4m3 · 2^k;
    fp8_e4m3: e4m3 · kv_scale)."""
    n = records.shape[0]
    q = records[:, : fmt.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
    if fmt.per_tensor:
        return q * _per_tensor_scale(fmt, kv_scale)
    nope = (q.view(n, fmt.num_tiles, fmt.tile) * record_scales(records, fmt)[..., None]).view(n, fmt.nope_dim)
    rope_start = V4_ROPE_OFFSET if fmt.name == "fp8_v4" else V32_ROPE_OFFSET
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
    if f.name == "bf16":
        return torch.zeros(num_blocks, block_size, f.dim, dtype=torch.bfloat16, device=device)
    stride0 = block_bytes(f, block_size)
    raw = torch.zeros(num_blocks * stride0, dtype=_storage_dtype(f), device=device)
    return torch.as_strided(raw, (num_blocks, block_size, f.token_bytes), (stride0, f.token_bytes, 1))


def _block_grid(num_blocks: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.arange(num_blocks, device=device).repeat_interleave(block_size)
    offsets = torch.arange(block_size, device=device).repeat(num_blocks)
    return blocks, offsets


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
    scale = check_kv_scale(kv_scale, kv.device) if f.per_tensor else None
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
    scale = check_kv_scale(kv_scale, cache.device) if f.per_tensor else None
    blocks, offsets = _block_grid(nb, bs, cache.device)
    return read_tokens(cache, f, blocks, offsets, scale).to(torch.bfloat16).view(nb, bs, f.dim)


class IdentityMemo:
    """Values derived from objects, remembered per live object (by identity) and made again when the object's
    ``stamp`` changes: a cheap lookup (an ``id``, a dict, a weak reference) for what is checked once per object."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple] = {}

    def get(self, obj: object, stamp: object, make):
        """The value remembered for ``obj`` under ``stamp``, else ``make()`` (remembered if it returns). The value
        must not hold ``obj`` itself: the entry would then keep ``obj`` alive."""
        key = id(obj)
        hit = self._entries.get(key)
        if hit is not None and hit[1] == stamp and hit[0]() is obj:
            return hit[2]
        value = make()
        entries = self._entries
        # the entry leaves with its object (the callback runs before the id can be reused)
        self._entries[key] = (weakref.ref(obj, lambda _, key=key: entries.pop(key, None)), stamp, value)
        return value


_RESOLVED = IdentityMemo()  # cache tensor -> (paged view, format)


def resolve_cache_once(cache: torch.Tensor, fmt: str | KVFormat | None = None,
                       name: str = "cache") -> tuple[torch.Tensor, KVFormat]:
    """:func:`resolve_cache`, remembered per cache tensor: a tensor seen before with the same data pointer,
    shape, strides and dtype is not validated again (caches live for the whole serving run; the per-call
    checks of the ops and layers then cost a dictionary lookup). A given ``fmt`` is compared every time."""
    if not isinstance(cache, torch.Tensor):
        return resolve_cache(cache, fmt, name)  # raises the TypeError naming it
    paged, found = _RESOLVED.get(cache, cache_stamp(cache), lambda: _resolved_entry(cache, name))
    _check_format(cache, found, fmt, name)
    return (cache if paged is None else paged), found


def cache_stamp(cache: torch.Tensor) -> tuple:
    """What a cache tensor's validation depends on besides its identity: data pointer, shape, strides and dtype
    (the :class:`IdentityMemo` stamp of every memo of validated caches)."""
    return cache.data_ptr(), cache.shape, cache.stride(), cache.dtype


def _resolved_entry(cache: torch.Tensor, name: str) -> tuple[torch.Tensor | None, KVFormat]:
    """:func:`resolve_cache`'s result as the memo keeps it: None for a paged view that is the cache itself."""
    paged, found = resolve_cache(cache, None, name)
    return (None if paged is cache else paged), found
