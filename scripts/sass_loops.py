"""The key loops of a CUDA kernel's SASS (what the report scripts read from ``cuobjdump -sass``): the bodies of the
backward branches that span over 200 instructions — an attention kernel's loops over key blocks, not its small
reduction or copy loops."""
from __future__ import annotations

import collections
import pathlib
import re
import subprocess
import tempfile

import triton

CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"  # ships with Triton


def sass_of(cubin: bytes) -> str:
    """The SASS text of a compiled kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True).stdout


def key_loops(sass: str, min_length: int = 200) -> list[collections.Counter]:
    """Opcode counts (``STL``, ``LDL``, ``HMMA`` ...) of each loop body of over ``min_length`` instructions, in
    program order."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {addr: i for i, (addr, _) in enumerate(code)}
    loops = []
    for i, (addr, text) in enumerate(code):
        branch = re.search(r"BRA(?:\.\w+)*\s.*?(0x[0-9a-f]+)", text)
        start = index.get(int(branch.group(1), 16)) if branch else None
        if start is not None and start < i and i - start > min_length:
            ops = (t.split()[1] if t.startswith("@") else t.split()[0] for _, t in code[start:i + 1])
            loops.append(collections.Counter(op.split(".")[0] for op in ops))
    return loops
