"""Argument checking shared by every public entry point.

Each check raises ``ValueError`` (``TypeError`` for non-tensors) naming the argument and what was
expected, so a bad call never reaches a kernel.
"""
from __future__ import annotations

import numbers
from typing import Sequence

import torch


def is_int(v: object) -> bool:
    """An integer (Python or numpy), not a bool."""
    # (a plain int first: isinstance against the numbers ABC costs ~0.25 us, and the builder asks per request)
    return type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool))


def check_positive_int(name: str, v: object) -> int:
    """``v`` is an integer (Python or numpy, not a bool: else ``TypeError``) of at least 1 (else ``ValueError``)."""
    if not is_int(v):
        raise TypeError(f"{name} must be a positive int, got {v!r} ({type(v).__name__})")
    if v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check ``t`` is a tensor with the given dtype(s), rank, shape (``None`` = any size) and device, and not a meta
    tensor (it holds no values: a meta tensor among others names the device; meta tensors alone would otherwise fail
    in a value check, or as an overlap: every one has data pointer 0)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise ValueError(f"{name} must have dtype {want}, got {t.dtype}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        for axis, (want, got) in enumerate(zip(shape, t.shape)):
            if want is not None and want != got:
                dims = ["*" if s is None else str(s) for s in shape]
                expected = f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)} (axis {axis})")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if t.is_meta:
        raise _meta_error(name)
    return t


def _meta_error(name: str) -> ValueError:
    return ValueError(f"{name} is on the meta device: it holds no values")


# the device types an object that keeps its device may name: the CPU, a GPU (ROCm's too: torch calls it "cuda"), and
# torch's shape-only "meta" device (its tensors hold no values: the kernels' entry checks refuse them)
DEVICE_TYPES = ("cpu", "cuda", "meta")


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a :class:`torch.device`: a device or a string torch knows (``"cpu"``, ``"cuda:0"``), and (a GPU)
    one this machine has. A GPU without an index (``"cuda"``) becomes the current one's (``"cuda:1"`` where that is
    current), as torch places a tensor made there: an object that keeps the device (a builder, a cache, a pool) then
    makes every later tensor on the GPU of its first ones, whichever is current by then, and compares equal to its
    tensors' devices."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cuda:0', got {device!r}") from None
    if dev.type not in DEVICE_TYPES:  # torch's other backends (xpu, mps, ...): their errors came from deep inside
        raise ValueError(f"{name} must be the CPU or a CUDA / ROCm GPU ('cpu', 'cuda:0'), got {device!r}: the library "
                         f"runs on no {dev.type} device")
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"{name} {device!r} is not a GPU of this machine ({torch.cuda.device_count()} visible)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_index_range(name: str, idx: torch.Tensor, upper: int, valid: torch.Tensor | None = None) -> None:
    """Check every entry of ``idx`` (where ``valid``) is ``-1`` or in ``[0, upper)``."""
    vals = idx if valid is None else idx[valid]
    bad = (vals < -1) | (vals >= upper)
    if bool(bad.any()):
        first = int(vals[bad][0])
        raise ValueError(f"{name} holds {first}, out of range: entries must be -1 or in [0, {upper})")


def check_distinct_slots(name: str, slots: torch.Tensor) -> None:
    """No slot (``>= 0``; ``-1`` is skipped) appears twice in ``slots``: two rows written to one slot race on a GPU
    (which lands, or a mix of an fp8 entry's codes and another's scale, is undefined)."""
    written = slots[slots >= 0]
    values, counts = torch.unique(written, return_counts=True)
    if bool((counts > 1).any()):
        raise ValueError(f"{name} holds slot {int(values[counts > 1][0])} more than once: each written row needs "
                         f"its own slot")


def check_finite(name: str, t: torch.Tensor) -> None:
    """``t`` holds values (not a meta tensor) and all of them are finite."""
    if t.is_meta:
        raise _meta_error(name)
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} must be finite (no NaN or inf)")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` a tensor's elements can touch in its storage."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_rows_apart(name: str, t: torch.Tensor) -> None:
    """Check the 2-D output ``t``'s rows share no memory (row stride at least its width, where it has two rows or
    more): a kernel writing each row whole would write one row's values over another's (an expanded view)."""
    if t.shape[0] > 1 and t.stride(0) < t.shape[1]:
        raise ValueError(f"{name}'s rows must not overlap (rows apart: row stride >= its {t.shape[1]} columns), got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")


def check_no_overlap(name: str, t: torch.Tensor, inputs: dict[str, torch.Tensor]) -> None:
    """Check the output ``t`` shares no memory with any of ``inputs`` (a kernel would read what it wrote)."""
    storage = t.untyped_storage().data_ptr()
    for other_name, other in inputs.items():
        # tensors of different storages cannot overlap; this test keeps the check to ~1 us per call
        if other is None or other.untyped_storage().data_ptr() != storage or other.device != t.device:
            continue
        (start, end), (o_start, o_end) = _byte_span(t), _byte_span(other)
        if start < o_end and o_start < end:
            raise ValueError(f"{name} overlaps {other_name} in memory: the output must not alias an input")


def check_sink(sink: object, num_heads: int, device: torch.device | None = None, values: bool = True) -> torch.Tensor:
    """An attention sink ``(num_heads,)`` float32; with ``values`` (it syncs) also no NaN."""
    check_tensor("sink", sink, dtype=torch.float32, shape=(num_heads,), device=device)
    if values and bool(torch.isnan(sink).any()):
        raise ValueError("sink must not be NaN (-inf means no sink, +inf zeroes the head)")
    return sink


def check_scale(scale: object) -> float:
    """A softmax scale as a Python float: a positive finite real number (Python or numpy, not a bool) or a 0-d
    tensor holding one (read once here: a sync for a GPU tensor)."""
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or scale.dtype == torch.bool or scale.is_complex() or scale.is_meta:
            raise ValueError(f"scale must be a positive finite number or a 0-d real tensor, got a {scale.dtype} "
                             f"tensor of shape {tuple(scale.shape)} on {scale.device}")
        scale = scale.item()
    if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) and 0 < scale < float("inf")):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale)


def check_kv_scale(kv_scale: object, device: torch.device, name: str = "kv_scale",
                   values: bool = True) -> torch.Tensor:
    """A per-tensor fp8 scale as a ``(1,)`` float32 tensor on ``device``: a positive finite Python number, or a
    one-element float32 tensor on ``device`` (an engine's buffer, read by the kernels at run time: no sync, CUDA
    graphs see updates). With ``values`` (it syncs for a tensor) also positive and finite."""
    if kv_scale is None:
        raise ValueError(f"{name} is required: an fp8_e4m3 cache or an fp8 q needs its float32 scale")
    if isinstance(kv_scale, torch.Tensor):
        check_tensor(name, kv_scale, dtype=torch.float32, device=device)
        if kv_scale.numel() != 1:
            raise ValueError(f"{name} must hold one value, got shape {tuple(kv_scale.shape)}")
        if values and not bool(((kv_scale > 0) & torch.isfinite(kv_scale)).all()):
            raise ValueError(f"{name} must be positive and finite, got {kv_scale.item()}")
        return kv_scale if kv_scale.dim() == 1 else kv_scale.reshape(1)  # a (1,) tensor: itself
    if isinstance(kv_scale, bool) or not (isinstance(kv_scale, (int, float)) and 0 < kv_scale < float("inf")):
        raise ValueError(f"{name} must be a positive finite number or a one-element float32 tensor, got {kv_scale!r}")
    return torch.full((1,), float(kv_scale), dtype=torch.float32, device=device)
