"""The compressor kernels' launches cross-compiled for one target, on this CPU (run by
tests/test_compressor_portability.py in a child process: compiling needs the interpreter off):

    python tests/compressor_compile.py --target sm_80

Prints one JSON row per launch (``scripts/portability_report.py``'s ``Row``). The launches are the library's own,
recorded on CPU tensors: the compressor of each V4 / V4.1 case (V4-Flash's c4a and its indexer, c128a; V4.1's c2a
and c1a; bf16 projections), its state update, and the indexer key insert (fp8 and bf16, with and without the rope).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from portability_report import compile_launch, recorded_launches  # noqa: E402  (sets TRITON_INTERPRET=0 first)

import torch  # noqa: E402

from compress_feed import Feeder, make_params  # noqa: E402
from sparse_mla.compressor import KVCompressor  # noqa: E402
from sparse_mla.ops import targets  # noqa: E402
from sparse_mla.ops.triton import compress, index_cache  # noqa: E402

CASES = [(4, 512), (4, 128), (128, 512), (2, 512), (1, 512)]


def launches(target: targets.Target) -> list[tuple[str, list]]:
    out = []
    for ratio, dim in CASES:
        feeder = Feeder([300, 5], ratio, dtype=torch.bfloat16)
        weight, ape = make_params(ratio, dim)
        comp = KVCompressor(feeder.pool, dim, weight, 1e-6, ape=ape, backend="reference")
        _, _, meta = feeder.step([(0, 300), (1, 5)])
        kv = torch.zeros(305, comp.width, dtype=torch.bfloat16)
        latent = torch.zeros(305, dim, dtype=torch.bfloat16)
        with recorded_launches(target) as calls:
            compress.compress(kv, None if ratio == 1 else kv.clone(), comp.ape, comp.norm_weight, comp.eps,
                              comp.inv_freq, meta, feeder.pool.layers[comp.layer], latent, latent.clone())
        out.append((f"compress r{ratio} d{dim}", calls))
    for fp8 in (True, False):
        data = torch.zeros(4, 64, 132 if fp8 else 128, dtype=torch.uint8 if fp8 else torch.bfloat16)
        keys, slots = torch.zeros(16, 128, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.int32)
        for rope in (False, True):
            with recorded_launches(target) as calls:
                index_cache.insert_index_keys(keys, data, fp8, slots, slots if rope else None,
                                              torch.ones(32) if rope else None)
            out.append((f"index keys {'fp8' if fp8 else 'bf16'}{' rope' if rope else ''}", calls))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True, choices=[t.name for t in targets.MATRIX])
    target = next(t for t in targets.MATRIX if t.name == parser.parse_args().target)
    for variant, calls in launches(target):
        for launched in calls:
            print(json.dumps(asdict(compile_launch(target, variant, launched))), flush=True)


if __name__ == "__main__":
    main()
