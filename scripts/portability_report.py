"""The portability matrix: compile every kernel variant the library launches for each GPU target, on this CPU.

    python scripts/portability_report.py [--target sm_80 ...] [--variants formats ...] [--json] [--support]

No GPU is needed: Triton cross-compiles for a ``GPUTarget`` (``targets.Target.gpu_target()``). The variants are
not hand-written: the library's own host code (the attention plan made for the target, the cache ops, the step
index builders, the token order, the index forms, the merge, the compressors and the indexer) runs on CPU tensors
with Triton's launch replaced by a recorder, so each compile is exactly a launch the library would make on that GPU —
its kernel, constexprs, launch options and argument types. Plans count the target's SMs (``Target.sms``, its first
GPU's), so a decode's key lists are split as on that GPU and the combine kernel compiles with them.

Per variant it prints registers (CUDA: ptxas ``-v`` of Triton's own compile, compiled every time so that a warm
Triton cache gives a cold one's numbers; AMD: the amdgcn ``.vgpr_count``, arguments specialised by ROCm's backend,
``tt.pointer_range 32`` included), spills (CUDA: spill store / load bytes; AMD: spilled VGPRs / SGPRs), shared
memory (LDS) against the target's limit, on sm_100 the tensor-memory columns used (Triton's
``metadata.tmem_size``, the PTX's ``tcgen05.alloc``) and whether the body is a ``trap``, and the attention launches'
splits. A case the target cannot run is listed with the ``ValueError`` a user gets
(:func:`sparse_mla.ops.launch_configs.unsupported`).
``--json`` prints one JSON object per row instead (``tests/test_portability.py`` reads them); ``--support`` prints
the README support table (:func:`sparse_mla.verify.support_markdown`); ``--ranges`` ends with each target's range
of the attention kernel's spills over every variant compiled (what its ``Target.limits`` quotes).

Variants (every launch of the library's kernels; ``--variants`` picks groups, CI compiles a subset):

* ``formats``: a V4 decode step (8 tokens of 64 heads, SWA + compressed scope, sink, token order; split at the
  target's SM count, its combine kernel too) over each cache format (bf16, fp8_v4, fp8_e4m3 at 512 dims; bf16,
  fp8_v32 at 576 dims: V3.2's), fp8 q over fp8_e4m3 caches, and V4.1's formats: an fp8_v41 window with an fp4_v41
  compressed scope (FlashMLA's pairing), and each page-planar layout.
* ``shared``: the variants that need the most shared memory (the pipelined bf16 ones): the bf16 decodes at 512
  and 576 dims and the prefill over a bf16 workspace at 512 and 576 dims (128 heads, one scope, no order).
* ``forms``: ragged and combined index lists over bf16 and fp8_v4 caches, one token's long list (the most splits:
  up to 32) and, on AMD, an fp8_v4 decode over a cache pool larger than 2 GiB: ROCm's JIT then gives its pointers
  no ``tt.pointer_range 32``, so the cache is read with global loads and 64-bit offsets instead of buffer loads.
* ``cache``: insert and gather, each format (bf16 at 512 and 576 dims; V4.1's four names: each page layout).
* ``index``: the step's index lists, the compressed picks, the token order, a scope's ragged form
  (``index_forms``' ``_ragged_kernel``) and the merge of context-parallel partials (``ops/merge.py``).
* ``pipeline``: the sparse-index pipeline (``tests/compressor_compile.py`` records it): the compressor of each
  V4 / V4.1 ratio, its state update, the indexer key insert, the indexer's scores, query prep and top-k select.

The whole matrix (every group, 11 targets, about 800 compiles) took 32 CPU minutes with Triton 3.9 (76 minutes of
wall time, target by target, on a 2-core machine shared with other jobs), 19 of them gfx1100's: its fp8 decodes
spill thousands of VGPRs and take 2-4 CPU minutes each to compile (other attention variants: 1-13 CPU seconds).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import pathlib
import re
import resource
import sys
from dataclasses import asdict, dataclass

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels (before any kernel module is imported)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default, the GPU's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: E402

from sass_loops import key_loops, sass_of  # noqa: E402  (this script's folder is first on sys.path)
# the kernel modules whose launches are recorded here without a public op in between (their one import)
from sparse_mla.ops import targets, triton_cache, triton_index  # noqa: E402

GROUPS = ("formats", "shared", "forms", "cache", "index", "pipeline")
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "waves_per_eu", "matrix_instr_nonkdim", "kpack",
            "enable_fp_fusion")


@dataclass
class Launched:
    """One recorded launch: the JIT kernel, its runtime arguments and its keyword arguments (constexprs, options)."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    over_2gib: tuple[str, ...] = ()  # pointer parameters standing for tensors over 2 GiB (see _source)


@dataclass
class Row:
    """One cell of the matrix. status: ``"ok"``, ``"unsupported"`` (``error``: the user's ValueError) or
    ``"failed"`` (``error``: why: a compile error, or a limit it does not fit). spill_stores / spill_loads: CUDA,
    ptxas' spill store / load bytes; AMD, the spilled VGPRs / SGPRs. loop_spills: CUDA, the spill instructions
    (``STL`` / ``LDL``) inside the kernel's key loops (:func:`sass_loops.key_loops`; None on AMD). cpu_seconds: the
    compile's CPU time (this process and its children: ptxas, ld.lld). splits: the attention and combine kernels'
    ``SPLITS`` (the pieces each key list is cut into at the target's SM count). dependent: CUDA, whether the PTX waits
    in ``griddepcontrol.wait`` (a kernel launched as a programmatic dependent, ``ops/triton/dependent.py``)."""

    target: str
    variant: str
    kernel: str
    status: str
    error: str = ""
    shared: int | None = None
    shared_limit: int | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    loop_spills: int | None = None
    tmem_columns: int | None = None
    splits: int | None = None
    dependent: bool | None = None
    cpu_seconds: float = 0.0


@contextlib.contextmanager
def recorded_launches(target: targets.Target):
    """Inside, a JIT kernel launch (``kernel[grid](...)``, and the library's :class:`Launch` on CPU tensors) records
    a :class:`Launched` in the yielded list instead of compiling and running, and the library's host code sees
    ``target`` as every device's (``targets.target_of``: its per-target choices, e.g. the fp8 decode)."""
    calls: list[Launched] = []
    original, target_of = JITFunction.run, targets.target_of

    def record(self, *args, grid, warmup, **kwargs):
        calls.append(Launched(self, args, kwargs))

    JITFunction.run, targets.target_of = record, lambda device: target
    try:
        yield calls
    finally:
        JITFunction.run, targets.target_of = original, target_of


def _source(launched: Launched, target: targets.Target) -> tuple[ASTSource, dict]:
    """The ``ASTSource`` and options of a recorded launch, each runtime argument specialised as Triton's JIT does
    on ``target``'s backend (its own ``native_specialize_impl`` and the backend's attributes: typed pointers, ints
    equal to 1 as constants, 16-divisibility; on AMD also ``tt.pointer_range 32`` for a tensor under 2 GiB, as every
    test-sized tensor is, which lets ROCm's compiler use buffer loads; not for ``launched.over_2gib``'s, as ROCm's JIT
    specialises a tensor whose storage exceeds 2**31 - 1 bytes), the constexprs as given (their declared defaults
    where not)."""
    backend = type(make_backend(target.gpu_target()))
    kernel = launched.kernel
    options = {k: v for k, v in launched.kwargs.items() if k in _OPTIONS}
    values = dict(zip(kernel.arg_names, launched.args))
    values.update({k: v for k, v in launched.kwargs.items() if k not in _OPTIONS})
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(kernel.params):
        value = values.get(p.name, p.default)
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, key = native_specialize_impl(backend, value, p.is_const, not p.do_not_specialize, True)
        if p.name in launched.over_2gib:
            key = key.replace("S", "")  # "S": HIP's mark of a tensor within 2 GiB (HIPBackend.is_within_2gb)
        signature[p.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = key
        elif isinstance(key, str) and backend.parse_attr(key):
            attrs[(i,)] = backend.parse_attr(key)
    return ASTSource(kernel, signature, constexprs, attrs), options


def _ptxas_numbers(log: str) -> tuple[int | None, int | None, int | None]:
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None,
            int(spill.group(2)) if spill else None)


def _amd_number(asm: str, key: str) -> int | None:
    found = re.search(rf"\.{key}:\s+(\d+)", asm)
    return int(found.group(1)) if found else None


def _cpu_time() -> float:
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


def _message(error: BaseException) -> str:
    """The telling line of a compile error: Triton's message, or for a CompilationError (the source with a caret
    under the failing spot, caused by another error) the innermost failing source line and the root cause."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    caret = next((i for i, line in enumerate(lines) if line.strip() == "^"), None)
    cause = error.__cause__
    if cause is not None and (caret is not None or not lines):
        inner = _message(cause)
        spot = lines[caret - 1].strip() if caret else ""
        return inner if " -- " in inner or not spot else f"{spot} -- {type(cause).__name__}: {inner}"
    return lines[caret - 1].strip() if caret else (lines[-1] if lines else type(error).__name__)


# rows already compiled in this process, by what decides the binary (target, the kernel's source and
# specialisation, options): several variants launch the same binary (the combine kernel after every split decode,
# the cache kernels of formats that share a layout), which is compiled once and its numbers repeated
_COMPILED: dict[tuple, Row] = {}


@functools.lru_cache(maxsize=None)
def _backend_options(target: targets.Target) -> frozenset[str]:
    """The launch options ``target``'s Triton backend takes (its options dataclass's fields)."""
    return frozenset(vars(make_backend(target.gpu_target()).parse_options({})))


def compile_launch(target: targets.Target, variant: str, launched: Launched) -> Row:
    """Compile one recorded launch for ``target`` and check it fits: its :class:`Row` (a launch whose binary this
    process compiled already for another variant: that row's numbers, under this variant's name, 0 CPU seconds).
    A launch passing a keyword that is neither the kernel's parameter nor an option of ``target``'s backend fails
    here, as Triton's JIT fails it at launch (``triton.compile`` would drop it quietly: ``maxnreg`` on AMD)."""
    unknown = sorted(set(launched.kwargs) - set(launched.kernel.arg_names) - _backend_options(target))
    if unknown:
        return Row(target.name, variant, launched.kernel.__name__, "failed",
                   error=f"keyword arguments {unknown} unrecognised by {target.backend}'s launch options")
    source, options = _source(launched, target)
    key = (repr(target.gpu_target()), source.hash(), tuple(sorted(options.items())))
    done = _COMPILED.get(key)
    if done is not None:
        return Row(**{**asdict(done), "variant": variant, "cpu_seconds": 0.0})
    row = _COMPILED[key] = _compile(target, variant, launched, source, options)
    return row


def _compile(target: targets.Target, variant: str, launched: Launched, source: ASTSource, options: dict) -> Row:
    """:func:`compile_launch`'s compile of ``source`` with ``options`` and its checks."""
    row = Row(target.name, variant, launched.kernel.__name__, "ok", shared_limit=target.shared_bytes,
              splits=launched.kwargs.get("SPLITS"))
    start = _cpu_time()
    log = io.StringIO()
    try:
        # compiled every time, never taken from Triton's cache: ptxas' log (registers, spills) is then always the
        # real compile's, with Triton's own ptxas options (3.9: --regAllocOptLevel=2), and a warm cache gives the
        # numbers a cold one does (a re-run of ptxas with other options did not: issue 47)
        with contextlib.redirect_stdout(log):
            triton.knobs.nvidia.dump_ptxas_log = True
            triton.knobs.compilation.always_compile = True
            compiled = triton.compile(source, target=target.gpu_target(), options=options)
    except Exception as error:  # a compile error is the cell's result
        row.status, row.error = "failed", f"{type(error).__name__}: {_message(error)}"
        row.cpu_seconds = round(_cpu_time() - start, 1)
        return row
    finally:
        triton.knobs.nvidia.dump_ptxas_log = False
        triton.knobs.compilation.always_compile = False
    row.shared = compiled.metadata.shared
    problems = []
    if row.shared > target.shared_bytes:
        problems.append(f"shared memory {row.shared} B > {target.shared_bytes} B")
    if target.backend == "cuda":
        ptx = compiled.asm["ptx"]
        row.dependent = "griddepcontrol.wait" in ptx
        row.registers, row.spill_stores, row.spill_loads = _ptxas_numbers(log.getvalue())
        if row.registers is None:
            problems.append("no ptxas log from the compile")
        # a spill inside the key loop costs every key block
        row.loop_spills = sum(ops["STL"] + ops["LDL"] for ops in key_loops(sass_of(compiled.asm["cubin"])))
        # tensor-memory columns: Triton's count (metadata.tmem_size, Triton 3.9) and the PTX's allocations
        tmem = [int(n) for n in re.findall(r"tcgen05\.alloc[^;]*?,\s*(\d+);", ptx)]
        tmem.append(getattr(compiled.metadata, "tmem_size", 0) or 0)
        row.tmem_columns = max(tmem) if target.tmem_columns else None
        if row.tmem_columns and row.tmem_columns > target.tmem_columns:
            problems.append(f"{row.tmem_columns} tensor-memory columns > {target.tmem_columns}")
        if re.search(r"^\s*trap;", ptx, re.M) and target.tmem_columns:
            problems.append("the kernel body compiles to a trap (tensor memory does not fit)")
    else:
        asm = compiled.asm["amdgcn"]
        row.registers = _amd_number(asm, "vgpr_count")
        row.spill_stores = _amd_number(asm, "vgpr_spill_count")
        row.spill_loads = _amd_number(asm, "sgpr_spill_count")
    if problems:
        row.status, row.error = "failed", "; ".join(problems)
    row.cpu_seconds = round(_cpu_time() - start, 1)
    return row


# ---- the library's launches, recorded ----------------------------------------------------------------------------

def _attention_cases() -> dict[str, list[tuple[str, dict]]]:
    """Per group, ``(variant, decode / prefill arguments)``: see the module docstring."""
    decode = {f"decode {fmt} d{dim}": dict(fmt=fmt, dim=dim) for fmt, dim in
              (("bf16", 512), ("fp8_v4", 512), ("fp8_e4m3", 512), ("bf16", 576), ("fp8_v32", 576))}
    decode["decode fp8 q, fp8_e4m3 d512"] = dict(fmt="fp8_e4m3", dim=512, q_fp8=True)
    decode["decode fp8_v41+fp4_v41 d512"] = dict(fmt="fp8_v41", extra_fmt="fp4_v41", dim=512)
    decode.update({f"decode {fmt} d512": dict(fmt=fmt, dim=512) for fmt in ("fp8_v41_planar", "fp4_v41_planar")})
    shared = {name: decode[name] for name in ("decode bf16 d512", "decode bf16 d576")}
    shared.update({f"prefill bf16 workspace d{dim}": dict(fmt="bf16", dim=dim, prefill=True) for dim in (512, 576)})
    forms = {f"{form} {fmt} d512": dict(fmt=fmt, dim=512, form=form)
             for form in ("ragged", "combined") for fmt in ("bf16", "fp8_v4")}
    # the most splits: one token's 4096-key compressed list (c128a at 512K tokens) cut to fill the SMs
    forms["decode bf16 d512, 1 token"] = dict(fmt="bf16", dim=512, tokens=1, extra_width=4096)
    forms["decode fp8_v4 d512, pool > 2 GiB"] = dict(fmt="fp8_v4", dim=512, over_2gib=True)
    return {"formats": decode, "shared": shared, "forms": forms}


def _attention_args(fmt: str, dim: int, q_fp8: bool = False, form: str = "padded", prefill: bool = False,
                    extra_fmt: str | None = None, tokens: int = 8, extra_width: int = 512, **_):
    """Checked arguments of one call on CPU tensors, shaped like a V4-Flash decode step (``tokens`` tokens of 64
    heads, a 128-key SWA scope of ``fmt`` and an ``extra_width``-key compressed one of ``extra_fmt``, default
    ``fmt``) or a
    prefill chunk over a bf16 workspace (16 tokens of 128 heads, 1152 keys)."""
    from sparse_mla.cache import PagedCache
    from sparse_mla.ops.validate import decode_args, prefill_args

    tokens, heads = (16, 128) if prefill else (tokens, 64)
    i32 = dict(dtype=torch.int32)
    q = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
    if prefill:
        kv = torch.zeros(1024, dim, dtype=torch.bfloat16)
        return prefill_args(q, kv, torch.zeros(tokens, 1152, **i32), torch.full((tokens,), 1152, **i32),
                            sink=torch.zeros(heads), check_ranges=False)
    swa, extra = PagedCache(4, 64, fmt, dim), PagedCache(64, 64, extra_fmt or fmt, dim)
    # the caches' format named where one name covers both (a page-planar V4.1 pool's tensor reads as its other layout)
    kw = dict(sink=torch.zeros(heads), order=torch.arange(tokens, **i32), check_ranges=False,
              fmt=None if extra_fmt else fmt)
    if fmt == "fp8_e4m3":
        kw["kv_scale"] = torch.ones(1)
    if q_fp8:
        q, kw["q_scale"] = q.to(torch.float8_e4m3fn), torch.ones(1)
    if form == "ragged":
        indptr = torch.arange(tokens + 1, **i32) * 128
        return decode_args(q, swa.data, torch.zeros(tokens, 128, **i32), None, extra.data,
                           torch.zeros(tokens * 512, **i32), None, extra_indptr=indptr * 4, **kw)
    if form == "combined":
        return decode_args(q, swa.data, torch.zeros(tokens, 640, **i32), torch.full((tokens,), 640, **i32),
                           extra.data, combined_window=128, **kw)
    return decode_args(q, swa.data, torch.zeros(tokens, 128, **i32), torch.full((tokens,), 128, **i32), extra.data,
                       torch.zeros(tokens, extra_width, **i32), torch.full((tokens,), extra_width, **i32), **kw)


def attention_launches(target: targets.Target, groups: tuple[str, ...]) -> list[tuple[str, list[Launched] | str]]:
    """Per attention variant of ``groups``, the attention plan's launches for ``target`` (the plan made as
    :func:`~sparse_mla.ops.attention_plan.plan_for` makes it, for that target: at its SM count,
    :attr:`~sparse_mla.ops.targets.Target.sms`, which decides the split decodes and their combine kernel), or the
    ``ValueError`` it raises. The pool over 2 GiB: AMD targets only (on CUDA its compile is the smaller pool's)."""
    from sparse_mla.ops import attention_plan

    cases = {name: case for group, named in _attention_cases().items() if group in groups
             for name, case in named.items() if not case.get("over_2gib") or target.backend == "hip"}
    out = []
    for name, case in cases.items():
        args = _attention_args(**case)
        positional, keywords = attention_plan.plan_geometry(args)
        try:
            plan = attention_plan.AttentionPlan(*positional, **keywords, target=target)
        except ValueError as error:
            out.append((name, str(error)))
            continue
        with recorded_launches(target) as calls:
            plan(*attention_plan.call_arguments(args))
        if case.get("over_2gib"):  # the caches' pointers (c0_ptr, c1_ptr) stand for pools over 2 GiB
            calls = [Launched(c.kernel, c.args, c.kwargs, ("c0_ptr", "c1_ptr") if i == 0 else ())
                     for i, c in enumerate(calls)]
        out.append((name, calls))
    return out


def cache_launches(target: targets.Target) -> list[tuple[str, list[Launched]]]:
    """Insert and gather over each cache format (through the public ops, on CPU tensors)."""
    from sparse_mla.cache import PagedCache
    from sparse_mla.ops.validate import gather_args, insert_args

    out = []
    for fmt, dim in (("bf16", 512), ("bf16", 576), ("fp8_v4", 512), ("fp8_v32", 576), ("fp8_e4m3", 512),
                     ("fp8_v41", 512), ("fp8_v41_planar", 512), ("fp4_v41", 512), ("fp4_v41_planar", 512)):
        cache = PagedCache(4, 64, fmt, dim)
        scale = torch.ones(1) if fmt == "fp8_e4m3" else None
        slots = torch.arange(32, dtype=torch.int32)
        with recorded_launches(target) as calls:
            kv, paged, f, slot_mapping, kv_scale = insert_args(torch.zeros(32, dim, dtype=torch.bfloat16), cache.data,
                                                               slots, fmt, check_values=False, kv_scale=scale)
            triton_cache.quantize_and_insert(kv, paged, f, slot_mapping, kv_scale)
            paged, f, kv_scale = gather_args(cache.data, slots, fmt, False, scale)
            triton_cache.dequantize_and_gather(paged, f, kv_scale, slots)
        out += [(f"insert {fmt} d{dim}", calls[:1]), (f"gather {fmt} d{dim}", calls[1:])]
    return out


def index_launches(target: targets.Target) -> list[tuple[str, list[Launched]]]:
    """The step's index lists (every V4 kind), the compressed picks, the token order, a scope's ragged form and the
    merge of context-parallel partials."""
    from sparse_mla import metadata
    from sparse_mla.batch import Request, StepBatchBuilder, blocks_needed
    from sparse_mla.config import V4_KINDS
    from sparse_mla.ops.merge import merge_partials

    sizes = {"swa": 64, "c4a": 64, "c128a": 2}
    builder = StepBatchBuilder(64, 4, 4096, V4_KINDS, block_sizes=sizes, decode_threshold=2)
    batch = builder.build([Request(seq, new, {k: list(range(first, first + blocks_needed(seq, k, sizes[k])))
                                              for k in V4_KINDS})
                           for seq, new, first in ((1000, 1, 0), (300, 24, 1000))])
    meta = metadata.allocate_metadata(batch, metadata.MetadataSpec(128, 512))
    i32 = dict(dtype=torch.int32)
    cap = batch.token_capacity
    with recorded_launches(target) as lists:
        metadata._step_lists_triton(batch, meta)
    with recorded_launches(target) as picks:
        triton_index.compressed_picks(batch.positions, batch.token_to_req, batch.block_tables["c4a"], 64, 4,
                                      torch.zeros(cap, 512, **i32), torch.zeros(cap, 512, **i32),
                                      torch.zeros(cap, **i32), torch.zeros(cap, 512, **i32))
    with recorded_launches(target) as order:
        triton_index.longest_first(torch.zeros(cap, **i32), torch.zeros(cap, **i32), 64, torch.zeros(cap, **i32))
    with recorded_launches(target) as ragged:  # a padded scope's ragged form (index_forms.ragged_from_padded)
        triton_index.ragged_from_padded(torch.zeros(cap, 512, **i32), torch.zeros(cap, **i32),
                                        torch.zeros(cap + 1, **i32), torch.zeros(cap * 512, **i32))
    with recorded_launches(target) as merged, _cpu_tensors_pass_triton_checks():
        # context parallelism's merge of 2 ranks' partials (64 heads, bf16 rows of 512 values, a sink)
        merge_partials(torch.zeros(2, 4, 64, 512, dtype=torch.bfloat16), torch.zeros(2, 4, 64), torch.zeros(64),
                       backend="triton")
    return [("step lists", lists), ("compressed picks", picks), ("token order", order), ("ragged form", ragged),
            ("merge partials", merged)]


@contextlib.contextmanager
def _cpu_tensors_pass_triton_checks():
    """Inside, an op called with ``backend="triton"`` accepts CPU tensors (as under Triton's interpreter), so that its
    launch is recorded: the ops refuse the Triton backend for CPU tensors otherwise."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read by dispatch.interpreting() only: the kernels are already built
    try:
        yield
    finally:
        os.environ["TRITON_INTERPRET"] = before if before is not None else "0"


def pipeline_launches(target: targets.Target) -> list[tuple[str, list[Launched]]]:
    """The sparse-index pipeline's kernels: the compressors, their state update, the indexer key insert and the
    indexer's scores, query prep and select (recorded by ``tests/compressor_compile.py``, whose tests
    cross-compile them too)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
    sys.modules.setdefault("portability_report", sys.modules[__name__])  # run as a script: this module, not a copy
    try:
        import compressor_compile
    finally:
        sys.path.pop(0)
    return compressor_compile.launches(target) + compressor_compile.indexer_launches(target)


def matrix(target: targets.Target, groups: tuple[str, ...] = GROUPS) -> list[Row]:
    """Every variant of ``groups`` compiled for ``target``."""
    launches = attention_launches(target, groups)
    if "cache" in groups:
        launches += cache_launches(target)
    if "index" in groups:
        launches += index_launches(target)
    if "pipeline" in groups:
        launches += pipeline_launches(target)
    rows = []
    for variant, calls in launches:
        if isinstance(calls, str):
            rows.append(Row(target.name, variant, "attention", "unsupported", calls, shared_limit=target.shared_bytes))
            continue
        if not calls:
            rows.append(Row(target.name, variant, "?", "failed", "the library launched nothing"))
        rows += [compile_launch(target, variant, launched) for launched in calls]
    return rows


def table(rows: list[Row]) -> str:
    """A compact text table of ``rows`` (spills: CUDA bytes stored / loaded; AMD spilled VGPRs ``v`` / SGPRs ``s``)."""
    head = (f"{'target':8} {'variant':28} {'kernel':18} {'regs':>5} {'spills':>11} {'in loop':>7} {'shared KB':>9} "
            f"{'tmem':>4} {'splits':>6} {'cpu s':>5}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        spills = ("" if r.spill_stores is None else f"{r.spill_stores}/{r.spill_loads}" if r.target.startswith("sm")
                  else f"{r.spill_stores}v/{r.spill_loads}s")
        shared = "" if r.shared is None else f"{r.shared / 1024:.0f}/{r.shared_limit // 1024}"
        status = r.status + (f": {r.error}" if r.error else "")
        loop = "" if r.loop_spills is None else str(r.loop_spills)
        lines.append(f"{r.target:8} {r.variant[:28]:28} {r.kernel[:18]:18} {r.registers or '':>5} {spills:>11} "
                     f"{loop:>7} {shared:>9} {r.tmem_columns or '':>4} {r.splits or '':>6} {r.cpu_seconds:5.1f}  "
                     f"{status}")
    return "\n".join(lines)


def spill_ranges(rows: list[Row]) -> list[str]:
    """Per target of ``rows``, the range of the attention kernel's spills over its compiled variants (AMD: spilled
    VGPRs and SGPRs; CUDA: spill-store bytes), and in how many of them: the numbers ``Target.limits`` quotes."""
    lines = []
    for name in dict.fromkeys(r.target for r in rows):
        attention = [r for r in rows if r.target == name and r.kernel == "_sparse_mla_kernel" and r.status == "ok"]
        kinds = ((("spilled VGPRs", "spill_stores"), ("spilled SGPRs", "spill_loads")) if not name.startswith("sm")
                 else (("spill-store bytes", "spill_stores"),))
        parts = []
        for label, field in kinds:
            spilled = sorted((getattr(r, field), r.variant) for r in attention if getattr(r, field))
            if spilled:
                parts.append(f"{label} {spilled[0][0]:,}-{spilled[-1][0]:,} in {len(spilled)} of {len(attention)} "
                             f"(least: {spilled[0][1]}; most: {spilled[-1][1]})")
        lines.append(f"{name}: " + ("; ".join(parts) or f"no spills in {len(attention)} attention variants"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", action="append", choices=[t.name for t in targets.MATRIX],
                        help="a target (repeatable); default: all of targets.MATRIX")
    parser.add_argument("--variants", action="append", choices=GROUPS, help="variant groups (default: all)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--support", action="store_true", help="print the README support table and exit")
    parser.add_argument("--ranges", action="store_true", help="end with each target's attention spill ranges")
    args = parser.parse_args(argv)
    if args.support:
        from sparse_mla.verify import support_markdown

        print(support_markdown())
        return 0
    chosen = [t for t in targets.MATRIX if not args.target or t.name in args.target]
    all_rows = []
    for target in chosen:
        rows = matrix(target, tuple(args.variants or GROUPS))
        all_rows += rows
        for row in rows:
            if args.json:
                print(json.dumps(asdict(row)), flush=True)
    if not args.json:
        print(table(all_rows))
    if args.ranges:
        print("\n".join(spill_ranges(all_rows)))
    return 0 if all(r.status != "failed" for r in all_rows) else 1


if __name__ == "__main__":
    sys.exit(main())
