"""Compile the attention kernel for sm_90 on this machine (no GPU needed): registers, spills, key loop.

    python3 scripts/sm90_report.py [--fmt fp8_v4|fp8_v32|bf16] [--dim 512|576] [--heads 64] [--block-n 64]
                                   [--kernel triton|gluon] [--persistent] [--tail] [--narrow]
                                   [--warps 8] [--stages 1] [--dump DIR]

Triton compiles for a GPUTarget without a device (every time, not from its cache); its own ptxas run, with
Triton's options, gives the register count and spill bytes an H100 would see, and the SASS gives the instruction count of one key block (the body of
the first key loop) by opcode. ``--dump`` writes the TTGIR, PTX, SASS and ptxas log for reading.
For the Gluon kernel the registers are the launch's (the warpgroups then re-allocate: see
``sparse_mla.ops.gluon.LOGITS_REGS`` / ``VALUES_REGS``) and the key loop is math warpgroup 0's loop over one
pair of key blocks.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import pathlib
import re

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from sass_loops import key_loops, sass_of  # noqa: E402  (this script's folder is first on sys.path)
from sparse_mla.formats import FORMAT_CODES  # noqa: E402
from sparse_mla.ops import launch_configs, targets  # noqa: E402
from sparse_mla.ops.triton import attention as ta, rows  # noqa: E402



def _signature(kernel, constexprs: dict, cache_type: str) -> tuple[dict, dict]:
    """Types for the kernel's runtime arguments: pointers, then 32-bit ints (stride-like: div by 16)."""
    pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "lse_ptr": "*fp32", "part_o_ptr": "*fp32",
                "part_lse_ptr": "*fp32", "sink_ptr": "*fp32", "order_ptr": "*i32", "c0_ptr": cache_type, "c1_ptr": cache_type,
                "i0_ptr": "*i32", "i1_ptr": "*i32", "l0_ptr": "*i32", "l1_ptr": "*i32", "kv_scale_ptr": "*fp32",
                "q_scale_ptr": "*fp32"}
    floats = {"qk_scale"}
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if "stride" in name:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=64)
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--fmt", choices=["fp8_v4", "fp8_v32", "fp8_v41", "fp8_v41_planar", "fp4_v41", "fp4_v41_planar", "bf16"], default="fp8_v4", help="cache format of both scopes")
    parser.add_argument("--extra-fmt", help="the second scope's format (default: --fmt; gluon: V4.1's fp8 beside fp4)")
    parser.add_argument("--dim", type=int, choices=[512, 576],
                        help="latent dims: 512 (V4), 576 (V3.2); default: fp8_v32's 576, else 512")
    parser.add_argument("--kernel", choices=["triton", "gluon"], default="triton",
                        help="gluon: the Hopper kernel of sparse_mla.ops.gluon (needs a Triton with Gluon)")
    parser.add_argument("--persistent", action="store_true", help="gluon: the persistent programs' variant")
    parser.add_argument("--tail", action="store_true",
                        help="gluon: the last tokens' lists cut in 4 pieces, the others' whole (TAIL)")
    parser.add_argument("--narrow", action="store_true",
                        help="gluon, fp8: the narrow items' variant (HEADS_N, at most 16 heads)")
    parser.add_argument("--dump", type=pathlib.Path)
    args = parser.parse_args()
    fixed_dim = None if args.fmt == "bf16" else 576 if args.fmt == "fp8_v32" else 512  # bf16 takes either width
    if args.dim is None:
        args.dim = fixed_dim or 512
    if fixed_dim and args.dim != fixed_dim:
        parser.error(f"{args.fmt} tokens are {fixed_dim}-d")
    pa, pb, pc, v_has_rope = rows.latent_pieces(args.dim)
    kernel = ta._sparse_mla_kernel
    source_type = ASTSource
    heads_n = 0
    if args.kernel.startswith("gluon"):
        from triton.experimental.gluon._runtime import GluonASTSource

        from sparse_mla.ops import gluon
        from sparse_mla.ops.gluon.kernel import _attention_kernel

        kernel, source_type = _attention_kernel, GluonASTSource
        args.warps = gluon.PARTITION_WARPS  # of the default partition; the kernel adds two more groups
        heads_n = gluon.NARROW_HEADS if args.narrow else 0
    fmt = FORMAT_CODES[args.fmt]
    fmt1 = FORMAT_CODES[args.extra_fmt or args.fmt]
    constexprs = dict(FMT0=fmt, FMT1=fmt1, BS0=256, BS1=64, HAS_EXTRA=True, HAS_SINK=True, HAS_ORDER=True, PA=pa,
                      PB=pb, PC=pc, V_HAS_ROPE=v_has_rope, H_BLOCK=args.heads, BLOCK_N=args.block_n, SPLITS=1,
                      SPLIT_BLOCKS=0, DOT=tl.bfloat16, Q_FP8=False, RAGGED0=False, RAGGED1=False, COMBINED=False,
                      PERSISTENT=args.persistent, TAIL=args.tail)
    if args.tail:
        constexprs["SPLITS"] = 4
    constexprs.update(FMT=fmt, D_QK=args.dim, HEADS_N=heads_n)  # the Gluon kernel's format, q·k width, narrow heads
    # the portable kernel's strategy flags as the launch-config table sets them for sm_90 (NATIVE_FP8, Q_IN_LOOP, ...)
    row = launch_configs.attention_config(targets.target_for("cuda", 90), args.dim, frozenset({args.fmt}), args.heads,
                                          False, False)
    constexprs.update({k: v for k, v in row.constexprs.items() if k not in ("H_BLOCK", "BLOCK_N")})
    constexprs = {k: v for k, v in constexprs.items() if k in kernel.arg_names}
    sig, attrs = _signature(kernel, constexprs, "*bf16" if args.fmt == "bf16" else "*u8")
    src = source_type(kernel, sig, {(kernel.arg_names.index(k),): v for k, v in constexprs.items()}, attrs)
    # ptxas' log of Triton's own compile (its options: 3.9 adds --regAllocOptLevel=2, which changes the spills), so
    # compiled every time: a cached compile runs no ptxas
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": args.warps, "num_stages": args.stages})
    log = printed.getvalue()
    sass = sass_of(compiled.asm["cubin"])
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    print(f"registers {regs.group(1) if regs else '?'}  spill stores {spill.group(1) if spill else '?'} B  "
          f"spill loads {spill.group(2) if spill else '?'} B  shared {compiled.metadata.shared} B  "
          f"(Triton {triton.__version__})")
    ops = next(iter(key_loops(sass)), collections.Counter())  # the first key loop
    print(f"key loop: {sum(ops.values())} instructions per warp per block; "
          + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
        (args.dump / "kernel.ttgir").write_text(compiled.asm["ttgir"])
        (args.dump / "kernel.ptx").write_text(compiled.asm["ptx"])
        (args.dump / "ptxas.log").write_text(log)
        (args.dump / "kernel.sass").write_text(sass)


if __name__ == "__main__":
    main()
