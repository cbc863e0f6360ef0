"""Host time of one layer call per kind and of build_step_metadata (V4-Flash decode, B 128, MTP), GPU queue busy."""
import sys
import time

import torch

from sparse_mla.layer import SparseMLAAttention
from sparse_mla.metadata import build_step_metadata
from sparse_mla.scenario import make_scenario


def host_us(fn, calls=200):
    fn()
    torch.cuda.synchronize()
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(30):
        busy @ busy  # keep the GPU queue busy so launches never wait
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / calls * 1e6


b = int(sys.argv[1]) if len(sys.argv) > 1 else 128
gen = torch.Generator().manual_seed(0)
lengths = [(int(torch.randint(4096, 32768, (1,), generator=gen)), 2) for _ in range(b)]
sc = make_scenario(lengths, window=128, topk=512, fmt="fp8_v4", decode_threshold=2, device="cuda")
q = torch.randn(sc.batch.token_capacity, 64, 512, generator=gen).to(torch.bfloat16).cuda()
sink = torch.randn(64, generator=gen).cuda()
out = torch.empty(sc.batch.token_capacity, 64, 512, dtype=torch.bfloat16, device="cuda")
res = {"build_step_metadata": host_us(lambda: build_step_metadata(sc.batch, sc.meta.spec, out=sc.meta))}
for kind in ("swa", "c4a", "c128a"):
    for inv in (False, True):
        layer = SparseMLAAttention(kind, 64, topk=512 if kind == "c4a" else None, sink=sink, batch_invariant=inv)
        picks = sc.topk_local if kind == "c4a" else None
        res[f"{kind}{' invariant' if inv else ''}"] = host_us(lambda: layer(q, sc.meta, sc.caches, picks, out=out))
        ref = sc.expected(q, kind, list(range(0, 256, 17)), sink, 512 ** -0.5)
        got = layer(q, sc.meta, sc.caches, picks, out=out)[list(range(0, 256, 17))].double().cpu()
        res[f"{kind}{' invariant' if inv else ''} rel err"] = ((got - ref).norm() / ref.norm()).item()
try:
    import flash_mla

    sched, _ = flash_mla.get_mla_metadata()
    qf = q.view(b, 2, 64, 512)
    cache = sc.caches["swa"].data.unsqueeze(2)
    idx = sc.meta.swa_indices.view(b, 2, 128)
    res["flash_mla_with_kvcache (swa)"] = host_us(lambda: flash_mla.flash_mla_with_kvcache(
        qf, cache, None, None, 512, sched, None, 512 ** -0.5, False, True, idx, sink, use_legacy=True))
except ImportError:
    pass
from sparse_mla import flash_mla as ours_fm  # noqa: E402
from sparse_mla.ops import sparse_attention_decode  # noqa: E402

ours_sched, _ = ours_fm.get_mla_metadata()
qf, cache, idx = q.view(b, 2, 64, 512), sc.caches["swa"].data.unsqueeze(2), sc.meta.swa_indices.view(b, 2, 128)
ours_call = lambda: ours_fm.flash_mla_with_kvcache(qf, cache, None, None, 512, ours_sched, None,  # noqa: E731
                                                   512 ** -0.5, False, True, idx, sink)
op_call = lambda: sparse_attention_decode(q, sc.caches["swa"].data, sc.meta.swa_indices, None,  # noqa: E731
                                          sink=sink, scale=512 ** -0.5)
res["sparse_mla.flash_mla_with_kvcache (swa)"] = host_us(ours_call)
res["sparse_attention_decode (swa)"] = host_us(op_call)
for k, v in res.items():
    print(f"{k:40s} {v:10.3g}")

if "--profile" in sys.argv:
    import cProfile
    import pstats

    from sparse_mla.ops import launch as launch_mod

    print("fast path:", launch_mod.fast_path_enabled())
    layer = SparseMLAAttention("c4a", 64, topk=512, sink=sink)
    layer(q, sc.meta, sc.caches, sc.topk_local, out=out)
    for name, fn in (("c4a layer", lambda: layer(q, sc.meta, sc.caches, sc.topk_local, out=out)),
                     ("sparse_mla.flash_mla_with_kvcache", ours_call),
                     ("build", lambda: build_step_metadata(sc.batch, sc.meta.spec, out=sc.meta))):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        print("=====", name)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
