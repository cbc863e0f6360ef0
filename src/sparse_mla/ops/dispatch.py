"""Which implementation runs (DESIGN §4): the one place that decides.

* The op family: ``"reference"`` (plain PyTorch, any device) or ``"triton"`` (Triton kernels on a CUDA
  device, or on the CPU under ``TRITON_INTERPRET=1``) — :func:`resolve_backend`, used by every public op,
  the layer, the step-metadata builders and the token order.
* The attention kernel inside the Triton family: ``"gluon"`` (the Hopper kernel of
  :mod:`.gluon`) or ``"triton"`` (:mod:`.triton.attention`) — :func:`attention_kernel`. Which GPU a
  device is comes from :mod:`.targets` (the vendor first: ROCm reports AMD GPUs as capability 9.x); the portable
  kernel's per-target launch configuration from :mod:`.launch_configs`.
"""
from __future__ import annotations

import itertools
import os

import torch

from .._checks import check_tensor
from ..formats import READERS
from . import targets

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # no Triton on this platform: the reference backend still works
    HAVE_TRITON = False

BACKENDS = ("reference", "triton")


def check_backend_name(name: str) -> None:
    """``name`` is ``"auto"`` or one of :data:`BACKENDS`."""
    if name != "auto" and name not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {name!r}")


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(name: str, device: torch.device) -> str:
    """The op family to run for tensors on ``device``: ``name`` (``"auto"``, ``"reference"`` or ``"triton"``)
    resolved. ``"auto"`` is Triton on a CUDA device and the reference elsewhere."""
    check_backend_name(name)
    if name == "auto":
        return "triton" if device.type == "cuda" and HAVE_TRITON else "reference"
    if name == "triton" and not HAVE_TRITON:
        raise ValueError("backend 'triton' needs the triton package, which is not installed")
    if name == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"backend 'triton' needs CUDA tensors (got {device}), or TRITON_INTERPRET=1 on the CPU")
    return name


def backend_for(name: str, first: torch.Tensor, first_name: str) -> str:
    """:func:`resolve_backend` for the device of an op's first tensor argument (checked to be a tensor)."""
    return resolve_backend(name, check_tensor(first_name, first).device)


def builders_use_triton(device: torch.device) -> bool:
    """Whether the step-metadata builders and the token order run their Triton kernels (on a CUDA device)."""
    return device.type == "cuda" and HAVE_TRITON


def _gluon_formats(dim: int) -> tuple[frozenset[str], ...]:
    """The scope-format sets the Gluon kernel reads at width ``dim`` (from :data:`sparse_mla.formats.READERS`):
    each format it reads with every scope alike, and every pair of one mix."""
    read = [name for name, r in READERS.items() if dim in r.gluon_dims]
    return tuple(dict.fromkeys(frozenset({a, b}) for a, b in itertools.product(read, read)
                               if a == b or READERS[a].gluon_mix and READERS[a].gluon_mix == READERS[b].gluon_mix))


# the scope formats the Gluon kernel reads, by q·k width: V4 (512: fp8_v4 or bf16, every scope alike), V4.1 (512: its
# fp8 and fp4 rows in either page layout, the two scopes in one format or two) and V3.2 (576: fp8_v32 or bf16)
GLUON_FORMATS = {dim: _gluon_formats(dim) for dim in (512, 576)}


def gluon_formats_text() -> str:
    """:data:`GLUON_FORMATS` in words, for error messages: per width, the formats read with every scope alike, and
    those whose scopes may also be in two formats."""
    parts = []
    for dim, sets in GLUON_FORMATS.items():
        paired = sorted({f for s in sets if len(s) > 1 for f in s})
        alike = sorted(f for s in sets if len(s) == 1 for f in s if f not in paired)
        text = f"{dim}-d: every scope {' or '.join(alike)}"
        parts.append(text + (f", or the scopes in any of {', '.join(paired)}" if paired else ""))
    return "; ".join(parts)


def gluon_fits(device: torch.device, dim: int, formats: frozenset[str], pages_16_byte_aligned: bool,
               padded: bool = True, q_fp8: bool = False) -> bool:
    """Whether the Gluon kernel can compute an attention call: an NVIDIA Hopper GPU (:attr:`.targets.Target.hopper`:
    never an AMD GPU, whatever capability ROCm reports, nor a Hopper lowered as another target), bf16 queries,
    scope formats its width reads (:data:`GLUON_FORMATS`) with padded index lists (not ragged, not
    combined), and caches whose base and page stride are multiples of 16 bytes (it copies bf16 rows and the fp8
    rope with 16-byte ``cp.async``)."""
    from . import gluon as gluon_kernel

    return (gluon_kernel.gluon is not None and device.type == "cuda" and padded and not q_fp8
            and formats in GLUON_FORMATS.get(dim, ()) and pages_16_byte_aligned and targets.target_of(device).hopper)


def attention_kernel(device: torch.device, dim: int, formats: frozenset[str], pages_16_byte_aligned: bool,
                     gluon: int | None = None, *, padded: bool = True, q_fp8: bool = False) -> str:
    """``"gluon"`` or ``"triton"``: the kernel that computes an attention call of the Triton family.

    padded: every scope's index list is padded (``False``: a ragged scope or a combined index); q_fp8: q is
    float8_e4m3fn. gluon: ``None`` (the default choice: Gluon where it fits and is enabled, see
    :func:`.gluon.enabled`), ``1`` (force it: a ``ValueError`` where it cannot compute the call) or
    ``0`` (the Triton kernel)."""
    from . import gluon as gluon_kernel

    fits = gluon_fits(device, dim, formats, pages_16_byte_aligned, padded, q_fp8)
    if gluon is None:
        if fits and gluon_kernel.enabled():
            return "gluon"
        if device.type == "cuda" and targets.target_of(device).hopper:
            gluon_kernel.warn_portable_once()  # a Triton the Gluon kernel is not validated on (or does not build with)
        return "triton"
    if gluon and not fits:
        raise ValueError(f"gluon=1 needs a Hopper GPU, bf16 q, scope formats it reads ({gluon_formats_text()}) with "
                         f"padded index lists, and caches whose base and page stride are multiples of 16 bytes; got "
                         f"{dim}-d {'fp8' if q_fp8 else 'bf16'} q on {device}, scopes {sorted(formats)}, "
                         f"{'padded' if padded else 'ragged / combined'} lists, "
                         f"{'' if pages_16_byte_aligned else 'not '}16-byte aligned")
    return "gluon" if gluon else "triton"
