"""GPU targets as Triton compiles for them: which architecture a device is, and the limits a launch must fit.

The one place that says what a GPU is. Every other decision (which kernel runs, its launch configuration, whether
fp8 bytes are decoded by conversion instructions or by integer arithmetic) reads a :class:`Target`, never a
capability number: ROCm's PyTorch reports AMD CDNA GPUs as capability 9.x, so the vendor comes first
(``torch.version.hip``), and a device is what Triton would compile for on it, ``TRITON_OVERRIDE_ARCH`` included
(that is how the GPU tests run the kernels as lowered for another target on the H100).

Limits per target (per program: shared memory / LDS a block may use; tensor-memory columns; registers per thread)
come from the vendors' tables (CUDA C Programming Guide, "Compute capabilities"; AMD's CDNA / RDNA ISA guides) and
were checked by compiling the kernels for each target (``tests/test_portability.py``).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Target:
    """One GPU architecture. backend: ``"cuda"`` or ``"hip"``; arch: the CUDA capability as an int (80, 86, 89, 90,
    100, 120) or the AMD ``gfx`` name; warp_size: threads per warp / wavefront; shared_bytes: the most shared memory
    (LDS) one program may use; tmem_columns: 32-bit tensor-memory columns per SM (0: none); registers: the most
    32-bit registers per thread (AMD: VGPRs, AGPRs included where the hardware has them); sms: the SMs (AMD: the
    compute units ROCm reports, ``multi_processor_count``) of the product named first in ``gpus``, which a plan made
    for the target on the CPU counts (the portability report's split decodes); gpus: the products it is; verified:
    how the library is checked on it; limits: what is known to hold it back there (both in README's support table
    and ``sparse-mla verify``; the numbers come from BENCHMARKS.md's portability table and the matrix's compile
    report, ``scripts/portability_report.py --ranges``)."""

    backend: str
    arch: int | str
    warp_size: int
    shared_bytes: int
    tmem_columns: int = 0
    registers: int = 255
    sms: int = 0
    gpus: str = ""
    verified: str = "compiles, fits"
    limits: str = ""

    @property
    def name(self) -> str:
        """``"sm_80"`` … ``"sm_120"`` or the ``gfx`` name."""
        return f"sm_{self.arch}" if self.backend == "cuda" else str(self.arch)

    @property
    def native_fp8(self) -> bool:
        """Whether Triton converts ``float8_e4m3fn`` bytes with instructions on this target (CUDA capability 8.9 and
        later; CDNA 4, gfx950, whose fp8 is OCP's: its fp8_v4 key loop 1,370 -> 855 instructions); elsewhere the
        kernels decode the bytes with integer operations (exact for every finite code). CDNA 3's own fp8 is the other
        e4m3 (no negative zero), which Triton would emulate; RDNA 4 (gfx1201) converts OCP fp8 too, but its rows,
        which spill at every tile, spill more with it."""
        if self.backend == "cuda":
            return int(self.arch) >= 89
        return self.arch == "gfx950"

    @property
    def register_file(self) -> int:
        """32-bit registers an SM: 65,536 on every NVIDIA architecture of the matrix (sm_80 - sm_120); 0 on AMD, where
        no launch sizes itself by them."""
        return 65536 if self.backend == "cuda" else 0

    @property
    def hopper(self) -> bool:
        """An NVIDIA sm_90 GPU (H100, H200, H20, H800): the Gluon kernel's target."""
        return self.backend == "cuda" and self.arch == 90

    @property
    def dependent_launch(self) -> bool:
        """Whether kernels may be launched as programmatic dependents (NVIDIA sm_90 and later: a kernel's programs
        start while the kernel before it finishes, and wait in ``griddepcontrol.wait`` before touching memory;
        :mod:`sparse_mla.ops.triton.dependent`)."""
        return self.backend == "cuda" and int(self.arch) >= 90

    def gpu_target(self):
        """Triton's ``GPUTarget`` for compiling to this target without a device."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


_KB = 1024
# The portability matrix: every target the library is compiled and checked for (tests/test_portability.py).
# how a target is verified (Target.verified): "runs natively on the H100" (the GPU suite); "runs lowered on the H100"
# (the GPU suite's essentials with Triton lowering as for that target: tests/test_lowerings.py); "compiles, fits"
# (every launched kernel variant cross-compiled on a CPU, within the target's shared memory / TMEM / LDS:
# tests/test_portability.py, which every target passes)
# sms, per row the first GPU's (vendor data sheets: A100 108 SMs, A10 72, L40S 142 (sm_89's largest; L4 58, RTX 4090
# 128), H100 SXM / H200 132, B200 148, RTX 5090 170; AMD, what ROCm reports per device: MI210 104 CUs (MI250 and
# MI250X are two devices of 104 / 110 CUs, 208 / 220 per package), MI300X 304, MI355X 256, and on RDNA, whose CUs
# pair into WGPs, the WGPs: RX 7900 XTX 48 (96 CUs), RX 9070 XT 32 (64 CUs))
_LOWERED = "runs lowered on the H100; compiles, fits"
# CDNA: a cache pool over 2 GiB, whose pointers ROCm's JIT specialises without tt.pointer_range 32 (a report variant)
_OVER_2GIB = ("an fp8_v4 decode over a cache pool over 2 GiB (pointers without `tt.pointer_range 32`: global loads, "
              "not buffer loads) compiles spill-free")
MATRIX: tuple[Target, ...] = (
    Target("cuda", 80, 32, 163 * _KB, sms=108, gpus="A100, A800, A30", verified=_LOWERED,
           limits="fp8 decoded by integer operations (ue8m0 tiles to bf16 in PTX); under its lowering on the H100 "
                  "the V4-Flash B 128 step takes 1.94x FlashMLA (0.99x the native lowering's time), V3.2 h 128 "
                  "decode 1.34x the native lowering's (one decode call: at most 1.39x); the fp8_v4 row's L2 prefetch "
                  "on Triton 3.6 only (3.9 spills with it in the key loop)"),
    Target("cuda", 86, 32, 99 * _KB, sms=72, gpus="A10, A40, RTX 3090, RTX A6000", verified=_LOWERED,
           limits="fp8 decoded by integer operations (ue8m0 tiles to bf16 in PTX: the V4-Flash B 128 step 2.68x "
                  "FlashMLA under its lowering on the H100); one decode call 1.43x (bf16) / 1.78x (fp8_v4) / 1.47x "
                  "(fp8_v32) / 1.89x (576-d bf16) the native lowering's time on an H200; 512-d fp8 and 576-d bf16 "
                  "in 32-key tiles (99 KB)"),
    Target("cuda", 89, 32, 99 * _KB, sms=142, gpus="L40S, L4, RTX 4090, L20", verified=_LOWERED,
           limits="V4-Flash B 128 step 1.31x (with the L2 prefetch of the next key block; 1.48x before), V3.2 h "
                  "128 decode 1.29x the native lowering's time on the H100 (one decode call: at most 1.89x, 576-d "
                  "bf16); 512-d fp8 and 576-d bf16 in 32-key tiles (99 KB)"),
    Target("cuda", 90, 32, 227 * _KB, sms=132, gpus="H100, H200, H20, H800",
           verified="runs natively on the H100; compiles, fits",
           limits="with a Triton the Gluon kernel passed the GPU tests on (`sparse-mla verify` names them), the "
                  "Gluon kernel where every scope is fp8_v4, fp8_v32 or bf16, or V4.1's formats (16-byte aligned "
                  "pages); the portable kernel elsewhere and with other Tritons, 1.96x FlashMLA on the V4-Flash B 128 "
                  "step (it spills 344-880 B, Triton 3.9's ptxas)"),
    Target("cuda", 100, 32, 227 * _KB, sms=148, tmem_columns=512, gpus="B200, B300, GB200",
           limits="not run on silicon; the portable kernel on mma.sync (no tcgen05 / tensor memory); the fp8_v4, "
                  "V4.1 and fp8-q rows spill 84-116 B, 10-19 reloads in the key loop (Triton 3.9's ptxas)"),
    Target("cuda", 120, 32, 99 * _KB, sms=170, gpus="RTX 5090, RTX PRO 6000",
           limits="not run on silicon; 512-d fp8 in 32-key tiles (99 KB), V4.1's with q read in the loop; in "
                  "the key loop the 512-d bf16 row reloads 10-20 spilled registers (Triton 3.9's ptxas; its "
                  "spill-free rows were 1.4-1.6x slower under the sm86 lowering)"),
    Target("hip", "gfx90a", 64, 64 * _KB, registers=512, sms=104, gpus="MI210, MI250",
           limits="not run on silicon; fp8 decoded by integer operations; 32 heads per program (fp8 caches) or "
                  f"16 (bf16); V4.1's decodes spill 82-201 SGPRs (tensors under 2 GiB, buffer loads); {_OVER_2GIB}"),
    Target("hip", "gfx942", 64, 64 * _KB, registers=512, sms=304, gpus="MI300X, MI325X",
           limits="not run on silicon; fp8 decoded by integer operations; 32 heads per program (fp8 caches) or "
                  f"16 (bf16); V4.1's decodes spill 90-230 SGPRs (tensors under 2 GiB, buffer loads); {_OVER_2GIB}"),
    Target("hip", "gfx950", 64, 160 * _KB, registers=512, sms=256, gpus="MI350X, MI355X",
           limits="not run on silicon; fp8 by its OCP conversion instructions; 32 heads per program (fp8 "
                  "caches) or 16 (bf16); V4.1's fp4 decodes spill 177-342 SGPRs (tensors under 2 GiB, buffer "
                  f"loads), the token order 208 SGPRs; {_OVER_2GIB}"),
    Target("hip", "gfx1100", 32, 64 * _KB, sms=48, gpus="RX 7900",
           limits="not run on silicon; the attention kernel spills 320-5,738 VGPRs and up to 374 SGPRs (slow: a "
                  "value-dim split is planned)"),
    Target("hip", "gfx1201", 32, 64 * _KB, sms=32, gpus="RX 9070",
           limits="not run on silicon; the attention kernel spills 87-1,812 VGPRs (slow: a value-dim split is "
                  "planned)"),
)
_BY_KEY = {(t.backend, t.arch): t for t in MATRIX}


# The target the CPU interpreter and device-less plans stand for: the H100's row (the tuned one).
DEFAULT = _BY_KEY[("cuda", 90)]


def override_arch() -> str | None:
    """Triton's ``TRITON_OVERRIDE_ARCH`` (``"sm80"``, ``"gfx942"``), read as Triton reads it."""
    import triton

    return triton.knobs.runtime.override_arch


def target_for(backend: str, arch: int | str) -> Target:
    """The :class:`Target` of ``(backend, arch)``: a row of :data:`MATRIX`, or for an architecture not in it the row of
    the nearest one below (CUDA; AMD: of the same family, its first where none is below; a ``ValueError`` where
    the family is unknown)."""
    known = _BY_KEY.get((backend, arch))
    if known is not None:
        return known
    if backend == "cuda":
        lower = [t for t in MATRIX if t.backend == "cuda" and t.arch <= int(arch)]
        if lower:
            return max(lower, key=lambda t: t.arch)
    elif backend == "hip":  # a family: CDNA gfx9xx, RDNA3 gfx11xx, RDNA4 gfx12xx (the name less its last 2 chars)
        family = [t for t in MATRIX if t.backend == "hip" and str(t.arch)[:-2] == str(arch)[:-2]]
        lower = [t for t in family if str(t.arch) <= str(arch)]
        if family:
            return (lower or family)[-1 if lower else 0]
    raise ValueError(f"no known GPU target for {backend} {arch!r}; supported: {', '.join(t.name for t in MATRIX)}")


def target_of(device: torch.device) -> Target:
    """The target Triton compiles for on ``device``: the vendor from ``torch.version.hip`` first, then the
    architecture (``TRITON_OVERRIDE_ARCH`` / :func:`lower_as` where set). A CPU device (Triton's interpreter) stands
    for :data:`DEFAULT`. Cached per device, vendor and override (a launch plan asks once per geometry)."""
    if device.type != "cuda":
        return DEFAULT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_target(index, bool(torch.version.hip), override_arch())


def num_sms(device: torch.device, target: Target | None = None) -> int:
    """The SMs (compute units) of ``device`` itself (a matrix row's :attr:`Target.sms` is one GPU's of that
    architecture: an L4 has 58 where sm_89's row says 142); on the CPU, ``target``'s (a plan made for that GPU, the
    portability matrix's) or 4 (the interpreter)."""
    if device.type != "cuda":
        return target.sms if target is not None else 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _device_target(index: int, hip: bool, override: str | None) -> Target:
    if hip:  # ROCm reports CDNA GPUs as capability 9.x: the capability number must never decide here
        arch = override or torch.cuda.get_device_properties(index).gcnArchName.split(":")[0]
        return target_for("hip", arch)
    if override:
        return target_for("cuda", int(override.removeprefix("sm")))
    major, minor = torch.cuda.get_device_capability(index)
    return target_for("cuda", 10 * major + minor)


@contextlib.contextmanager
def lower_as(arch: str) -> Iterator[Target]:
    """Compile every Triton kernel launched inside as for NVIDIA target ``arch`` (``"sm80"``, ``"sm86"``, ``"sm89"``)
    and run it on this (newer) NVIDIA GPU: Triton lowers as for ``arch`` (``mma.sync``, ``cp.async``, that
    target's fp8 rules, no ``wgmma`` / TMA), and ptxas assembles the result for the real GPU (``sm_90a`` on an
    H100), which runs the older instructions. The library's own choices (:func:`target_of`: dispatch, launch
    configurations) see the emulated target. Yields it.

    It checks the other target's code paths on real silicon; it does not reproduce that target's speed, memory
    bandwidth or shared-memory size (compile for the target to check those: ``tests/test_portability.py``). Enter
    it before the process launches any kernel: binaries already compiled and held by a launch are not compiled
    again (the GPU tests and benchmarks set it for their whole process)."""
    import triton
    from triton.backends.nvidia import compiler

    if not isinstance(arch, str) or not arch.startswith("sm") or not arch[2:].isdigit():
        raise ValueError(f"arch must be an NVIDIA target such as 'sm80', got {arch!r}")
    needs = f"lower_as({arch!r}) needs an NVIDIA GPU to run the lowered code on; this torch ({torch.__version__})"
    if torch.version.hip is not None:
        raise ValueError(f"{needs} is ROCm's")
    try:
        major, minor = torch.cuda.get_device_capability()
    except (AssertionError, RuntimeError):  # a CPU-only build asserts, a CUDA build without a device raises
        raise ValueError(f"{needs} sees none") from None
    real = compiler.sm_arch_from_capability(10 * major + minor)
    before_arch, before_fn = triton.knobs.runtime.override_arch, compiler.sm_arch_from_capability
    triton.knobs.runtime.override_arch = arch
    compiler.sm_arch_from_capability = lambda capability: real
    try:
        yield target_for("cuda", int(arch[2:]))
    finally:
        triton.knobs.runtime.override_arch = before_arch
        compiler.sm_arch_from_capability = before_fn
