"""Probe for issue 39 (not a product kernel): is the copy side of V3.2's 128-head decode fast enough when each
dequantised key block is shared by the two CTAs of a cluster through distributed shared memory?

    PYTHONPATH=src python3 benchmarks/probe_cluster_copy.py [--check-only] [--tokens N] [--topk K] [--runs N]

Needs a Hopper GPU, torch and CuPy (kernels compiled at run time by NVRTC). Copy side only, no attention math: per
token, 2048 fp8_v32 rows (656 B: 512 e4m3, 4 float32 scales, 64 bf16 rope dims) are gathered in blocks of 64 keys
and dequantised to bf16 (64 x 576 = 72 KB) in shared memory, double-buffered. Two CTAs per token (the two 64-head
halves), 256 threads each, one CTA per SM (as the Gluon kernel's 216 KB allow). Three kernels:

* ``per_cta`` (today's scheme): each CTA gathers and dequantises every row of every block for itself;
  ``__syncthreads`` per block.
* ``cluster_bar``: the token's two CTAs form a cluster; each dequantises half of every block (32 rows) and stores
  it into its own and its peer's shared memory (generic pointers from ``mapa``, as cooperative groups'
  ``map_shared_rank`` gives); a cluster barrier per block. Simple, but its release compiles to ``MEMBAR.ALL.GPU``.
* ``cluster_async`` (FlashMLA's mechanism): the same halves, the peer's copy written with ``st.async``, each store
  counting its bytes on the peer's mbarrier of that buffer; per block each CTA waits on its own mbarrier only.

Each thread keeps two blocks' raw rows in registers (the next loads are issued before the wait); the "consume" is
one 16-byte shared load per thread per block xor-ed into a checksum, which keeps the stores live and checks every
CTA's every block (the positions cover all 64 rows, the peer's half too). Before timing: the checksums and the last
block of token 0 (both CTAs' shared memory, dumped) against the torch dequantisation, bit for bit; exit 1 on FAIL
(kernels that pass are still timed). Timing: CUDA events around each launch, L2 flushed before each (as
``do_bench`` does), kernels alternating, median. JSON to ``$OUT/probe_cluster_copy.json`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

BLOCK_KEYS, DIM, TOKEN_BYTES = 64, 576, 656
BUF_BYTES = BLOCK_KEYS * DIM * 2  # one bf16 block in shared memory: 73,728 B
KERNELS = {"per_cta": "copy_per_cta", "cluster_bar": "copy_cluster_bar", "cluster_async": "copy_cluster_async"}
THREADS = 256  # 128 would need 20 chunks a thread in flight: per_cta spills (ptxas, sm_90a)
# Whole-kernel µs on the H100, V3.2 decode h 128, s_q 1, graph replays (BENCHMARKS.md, bench_v32-h100-v15.json),
# and the Gluon kernel's copy side alone ("math skipped", docs/history.md version 17; measured at batch 128 only).
REFERENCE_US = {64: {"flashmla": 103.0, "gluon": 134.4, "gluon_copy_only": None},
                128: {"flashmla": 190.3, "gluon": 252.3, "gluon_copy_only": 196.8}}

CUDA_SOURCE = r"""
// NT (threads per CTA) comes from -DNT. Row: [512 e4m3][4 x f32 scale][64 x bf16 rope] = 656 B = 41 x 16 B, so
// every row and both of its fields start 16-byte aligned: a row is read as 40 chunks of 16 B (32 e4m3, 8 rope).
#define TOKEN_BYTES 656
#define SCALE_OFF 512
#define ROW_BYTES 1152                 // 576 bf16 in shared memory
#define BLOCK_KEYS 64
#define CHUNKS 40
#define BUF_BYTES (BLOCK_KEYS * ROW_BYTES)
#define PEER_BYTES (BUF_BYTES / 2)     // what the peer stores into a buffer of ours per block
#define BARS_OFF (2 * BUF_BYTES)       // two mbarriers (cluster_async), then the token's topk slots
#define SIDX_OFF (BARS_OFF + 16)
#define SPREAD (BUF_BYTES / 16 / NT)   // 16-B slots of a buffer per thread for the consume

typedef unsigned int u32;

__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {  // the low 16 bits: two e4m3, byte 0 -> low half
    u32 out;
    unsigned short in = (unsigned short)(two & 0xFFFFu);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(out) : "h"(in));
    return out;
}
__device__ __forceinline__ float f16_to_f32(u32 h) {  // the low 16 bits
    float f;
    unsigned short in = (unsigned short)(h & 0xFFFFu);
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(in));
    return f;
}
__device__ __forceinline__ u32 bf16x2(float lo, float hi) {  // round to nearest even; lo -> low half
    u32 out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}
// 4 e4m3 (one word, byte 0 first) times the tile's scale -> 4 bf16. e4m3 -> f16 -> f32 is exact, the product of a
// power-of-two scale is exact, so this is the torch reference's value * scale -> bf16 bit for bit.
__device__ __forceinline__ uint2 dequant4(u32 w, float s) {
    u32 a = e4m3x2_to_f16x2(w), b = e4m3x2_to_f16x2(w >> 16);
    return make_uint2(bf16x2(f16_to_f32(a) * s, f16_to_f32(a >> 16) * s),
                      bf16x2(f16_to_f32(b) * s, f16_to_f32(b >> 16) * s));
}

__device__ __forceinline__ u32 cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
// Barrier of all threads of both CTAs: arrive releases this thread's memory operations (sm_90 SASS: MEMBAR.ALL.GPU
// first), wait acquires the others'. Every thread of every warp reaches both (.aligned).
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_sync() { cluster_arrive(); cluster_wait(); }

__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ u32 peer_addr(u32 addr, u32 rank) {  // the same offset in CTA `rank`'s shared memory
    u32 out;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
    return out;
}
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {  // release (CTA scope)
    asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" :: "r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("{ .reg .b64 state; mbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1; }"
                 :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {  // acquire (CTA scope) the phase of this parity
    asm volatile("{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// MODE 0 per CTA; 1 cluster_bar: also stored into the peer's buffer through a generic pointer (what cooperative
// groups' map_shared_rank gives), one cluster barrier per block; 2 cluster_async (FlashMLA's mechanism):
// st.async into the peer's buffer, each store counting its 16 bytes on the peer's mbarrier of that buffer.
template <int MODE> struct Dest {
    unsigned char* local;  // this CTA's shared memory
    unsigned char* peer;   // MODE 1: generic address of the peer's
    u32 peer_cl;           // MODE 2: shared::cluster address of the peer's
    __device__ __forceinline__ void put(u32 off, uint4 v, int b) const {
        *(uint4*)(local + off) = v;
        if (MODE == 1) *(uint4*)(peer + off) = v;
        if (MODE == 2)
            asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];"
                         :: "r"(peer_cl + off), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(peer_cl + BARS_OFF + 8 * b)
                         : "memory");
    }
};

// This CTA's rows [row0, row0 + rows) of block `blk`: ITEMS chunks per thread, chunk i = j * NT + tid.
template <int ITEMS>
__device__ __forceinline__ void load_block(uint4 (&raw)[ITEMS], float (&scale)[ITEMS], const unsigned char* cache,
                                           const int* sidx, int blk, int row0) {
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        int i = j * NT + threadIdx.x, row = i / CHUNKS, c = i % CHUNKS;
        const unsigned char* p = cache + (long long)sidx[blk * BLOCK_KEYS + row0 + row] * TOKEN_BYTES;
        raw[j] = *(const uint4*)(p + c * 16 + (c >= 32 ? 16 : 0));  // rope chunks skip the 16 B of scales
        scale[j] = *(const float*)(p + SCALE_OFF + 4 * min(c >> 3, 3));  // unused for rope chunks
    }
}

// Dequantise the registers' chunks into buffer b (rows from row0 on).
template <int MODE, int ITEMS>
__device__ __forceinline__ void store_block(const uint4 (&raw)[ITEMS], const float (&scale)[ITEMS],
                                            const Dest<MODE>& dst, int b, int row0) {
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
        int i = j * NT + threadIdx.x, c = i % CHUNKS;
        u32 row_off = b * BUF_BYTES + (row0 + i / CHUNKS) * ROW_BYTES;
        if (c < 32) {  // 16 e4m3 -> 32 B of bf16
            float s = scale[j];
            uint2 w0 = dequant4(raw[j].x, s), w1 = dequant4(raw[j].y, s);
            uint2 w2 = dequant4(raw[j].z, s), w3 = dequant4(raw[j].w, s);
            uint4 lo = make_uint4(w0.x, w0.y, w1.x, w1.y), hi = make_uint4(w2.x, w2.y, w3.x, w3.y);
            // A quarter-warp holds chunks 8m..8m+7 of one row (CHUNKS and NT are multiples of 8): writing the
            // high halves first on chunks 4..7 makes each 16-B store instruction cover all 32 banks once.
            bool swap = (c >> 2) & 1;
            u32 off = row_off + c * 32;
            dst.put(off + (swap ? 16 : 0), swap ? hi : lo, b);
            dst.put(off + (swap ? 0 : 16), swap ? lo : hi, b);
        } else {  // rope: bf16 bits as they are
            dst.put(row_off + 1024 + (c - 32) * 16, raw[j], b);
        }
    }
}

// Block k: store it (from registers) into buffer b = k % 2, load block k + 2 into the same registers (in flight
// across the wait), wait until buffer b is complete, read one 16-B slot of it.
// Reuse of buffer b: the readers of block k - 2 all came before the barrier of block k - 1 (its arrival, per CTA),
// which every writer of block k has passed. cluster_async: its per-CTA mbarriers order this CTA's threads; the
// peer writes block k into our buffer b only after its own wait for block k - 1, which needs the st.async bytes
// that each of our threads sends after reading block k - 2 (a round trip through both CTAs, not a formal release).
template <int MODE, int ITEMS>
__device__ __forceinline__ u32 block_step(uint4 (&raw)[ITEMS], float (&scale)[ITEMS], const Dest<MODE>& dst,
                                          const unsigned char* cache, const int* sidx, int k, int nblocks,
                                          int row0) {
    const int b = k & 1;
    const u32 bar = smem_addr(dst.local + BARS_OFF + 8 * b);
    store_block(raw, scale, dst, b, row0);
    if (MODE == 1) cluster_arrive();
    if (MODE == 2) {
        if (threadIdx.x == 0) mbar_arrive_expect_tx(bar, PEER_BYTES); else mbar_arrive(bar);
    }
    if (k + 2 < nblocks) load_block(raw, scale, cache, sidx, k + 2, row0);
    if (MODE == 0) __syncthreads();
    if (MODE == 1) cluster_wait();
    if (MODE == 2) mbar_wait(bar, (k >> 1) & 1);  // the (k / 2)-th phase of buffer b's mbarrier
    uint4 v = *(const uint4*)(dst.local + b * BUF_BYTES + (threadIdx.x * SPREAD + k % SPREAD) * 16);
    return v.x ^ v.y ^ v.z ^ v.w;
}

template <int MODE>
__device__ __forceinline__ void copy_body(const unsigned char* __restrict__ cache, const int* __restrict__ idx,
                                          int topk, u32* __restrict__ checksum, uint4* __restrict__ debug) {
    constexpr int ROWS = MODE == 0 ? BLOCK_KEYS : BLOCK_KEYS / 2;
    constexpr int ITEMS = ROWS * CHUNKS / NT;
    static_assert(ITEMS * NT == ROWS * CHUNKS, "NT must divide the chunks of a (half) block");
    // [2 x BUF_BYTES bf16 blocks][2 mbarriers][topk int32 slots]
    extern __shared__ __align__(16) unsigned char smem[];
    int* sidx = (int*)(smem + SIDX_OFF);
    const int token = blockIdx.x >> 1;  // CTAs 2t and 2t + 1 (one cluster) both serve token t
    const u32 rank = MODE == 0 ? 0 : cluster_rank();
    const int row0 = rank * (BLOCK_KEYS - ROWS);  // per CTA: 0; cluster: rank's half
    Dest<MODE> dst;
    dst.local = smem;
    dst.peer = nullptr;
    dst.peer_cl = 0;
    if (MODE == 1) {
        unsigned long long peer;
        asm volatile("mapa.u64 %0, %1, %2;" : "=l"(peer) : "l"((unsigned long long)smem), "r"(rank ^ 1));
        dst.peer = (unsigned char*)peer;
    }
    if (MODE == 2) {
        dst.peer_cl = peer_addr(smem_addr(smem), rank ^ 1);
        if (threadIdx.x == 0) {
            mbar_init(smem_addr(smem + BARS_OFF), NT);  // every thread arrives once per block
            mbar_init(smem_addr(smem + BARS_OFF + 8), NT);
            asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        }
    }

    for (int i = threadIdx.x; i < topk; i += NT) sidx[i] = idx[(long long)token * topk + i];
    // Cluster: the peer must be running (and its mbarriers initialised) before anything is written into it.
    if (MODE == 0) __syncthreads(); else cluster_sync();

    const int nblocks = topk / BLOCK_KEYS;  // even (checked by the host): blocks alternate register sets A, B
    uint4 raw_a[ITEMS], raw_b[ITEMS];
    float sc_a[ITEMS], sc_b[ITEMS];
    u32 acc = 0;
    load_block(raw_a, sc_a, cache, sidx, 0, row0);
    load_block(raw_b, sc_b, cache, sidx, 1, row0);
    for (int k = 0; k < nblocks; k += 2) {
        acc ^= block_step(raw_a, sc_a, dst, cache, sidx, k, nblocks, row0);
        acc ^= block_step(raw_b, sc_b, dst, cache, sidx, k + 1, nblocks, row0);
    }
    checksum[blockIdx.x * NT + threadIdx.x] = acc;
    if (blockIdx.x < 2)  // token 0's CTAs dump their copy of the last block (buffer 1)
        for (int i = threadIdx.x; i < BUF_BYTES / 16; i += NT)
            debug[blockIdx.x * (BUF_BYTES / 16) + i] = *(const uint4*)(smem + BUF_BYTES + i * 16);
    if (MODE != 0) cluster_sync();  // no CTA exits while its peer may still touch its shared memory
}

#define ARGS const unsigned char* __restrict__ cache, const int* __restrict__ idx, int topk, \
             u32* __restrict__ checksum, uint4* __restrict__ debug
#define CALL copy_body<MODE>(cache, idx, topk, checksum, debug)
extern "C" __global__ void __launch_bounds__(NT, 1) copy_per_cta(ARGS) { constexpr int MODE = 0; CALL; }
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NT, 1)
copy_cluster_bar(ARGS) { constexpr int MODE = 1; CALL; }
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(NT, 1)
copy_cluster_async(ARGS) { constexpr int MODE = 2; CALL; }
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=128 * 32768,
                   help="cache tokens (default: 128 contexts of 32K, 2.7 GB, far beyond the 50 MB L2)")
    p.add_argument("--context", type=int, default=32768, help="tokens per request: token t picks in its own range")
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[64, 128])
    p.add_argument("--runs", type=int, default=100, help="timed launches per kernel and batch (median reported)")
    p.add_argument("--check-only", action="store_true", help="compile and check the kernels, time nothing")
    args = p.parse_args(argv)
    if args.topk % (2 * BLOCK_KEYS) or not 0 < args.topk <= 8192:
        p.error(f"--topk must be a multiple of {2 * BLOCK_KEYS} in (0, 8192], got {args.topk}")
    if args.tokens % BLOCK_KEYS or not args.topk <= args.context <= args.tokens:
        p.error(f"need --topk <= --context <= --tokens and --tokens a multiple of {BLOCK_KEYS}")
    if args.runs < 50 or min(args.batches) < 1:
        p.error("--runs must be at least 50 and --batches positive")
    return args


def build_cache(torch, formats, tokens: int, device: str = "cuda"):
    """A random fp8_v32 cache through the library's quantiser: ``(tokens, 656)`` uint8 (pages of 64 tokens back to
    back). Values are randn times a per-token power of two, so the tiles' scales vary."""
    flat = torch.empty(tokens, TOKEN_BYTES, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    step = 4096 * BLOCK_KEYS
    for start in range(0, tokens, step):
        n = min(step, tokens - start)
        kv = torch.randn(n, DIM, device=device, generator=gen)
        kv *= torch.exp2(torch.randint(-8, 9, (n, 1), device=device, generator=gen).float())
        pages = formats.quantize_blocks(kv.to(torch.bfloat16).view(n // BLOCK_KEYS, BLOCK_KEYS, DIM), "fp8_v32")
        flat[start:start + n] = pages.view(n, TOKEN_BYTES)
    return flat


def make_picks(torch, batch: int, tokens: int, context: int, topk: int, device: str = "cuda"):
    """``(batch, topk)`` int32 slots: token t picks ``topk`` distinct random slots of its own ``context`` range
    (ranges wrap around, and overlap, when ``batch * context > tokens``)."""
    gen = torch.Generator(device=device).manual_seed(1)
    local = torch.rand(batch, context, device=device, generator=gen).argsort(dim=1)[:, :topk]
    starts = (torch.arange(batch, device=device) * context) % (tokens - context + 1)
    return (local + starts[:, None]).to(torch.int32).contiguous()


def expected(torch, formats, flat, picks):
    """The torch side: token 0's last block as bf16 bits ``(64 * 576,)`` int16 and every thread's checksum
    ``(batch, THREADS)`` int32 (the xor of the 16-B slot ``tid * spread + k % spread`` of each block k)."""
    batch, topk = picks.shape
    nblocks, slots, spread = topk // BLOCK_KEYS, BUF_BYTES // 16, BUF_BYTES // 16 // THREADS
    rows = formats.decode_records(flat[picks.reshape(-1).long()], formats.FP8_V32).to(torch.bfloat16)
    words = rows.view(torch.int32).reshape(batch, nblocks, slots, 4)
    pos = (torch.arange(THREADS, device=picks.device)[None, :] * spread
           + (torch.arange(nblocks, device=picks.device) % spread)[:, None])  # (nblocks, THREADS)
    picked = words.gather(2, pos[None, :, :, None].expand(batch, nblocks, THREADS, 4))
    acc = torch.zeros(batch, THREADS, dtype=torch.int32, device=picks.device)
    for k in range(nblocks):
        for j in range(4):
            acc ^= picked[:, k, :, j]
    last = rows.view(batch, topk, DIM)[0, -BLOCK_KEYS:].contiguous().view(torch.int16).reshape(-1)
    return last, acc


class Launcher:
    """The three kernels compiled once, launched on torch's current stream (where its events are recorded) with
    one batch's buffers: ``checksum (2B, THREADS)`` int32, ``debug (2, 64 * 576)`` int16 (bf16 bits)."""

    def __init__(self, cupy, torch, flat, topk: int):
        import numpy as np
        self.smem = 2 * BUF_BYTES + 16 + 4 * topk  # two blocks, two mbarriers, the token's slots
        # No -arch: CuPy adds the device's own (sm_90); nothing here needs sm_90a. No headers: inline PTX only.
        module = cupy.RawModule(code=CUDA_SOURCE, backend="nvrtc", options=("--std=c++17", f"-DNT={THREADS}"))
        self.kernels = {name: module.get_function(symbol) for name, symbol in KERNELS.items()}
        for fn in self.kernels.values():
            fn.max_dynamic_shared_size_bytes = self.smem  # above 48 KB needs the opt-in
        self.cupy, self.torch, self.flat, self.topk = cupy, torch, cupy.asarray(flat), np.int32(topk)
        self.stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def buffers(self, picks) -> None:
        torch, cupy = self.torch, self.cupy
        self.batch, self.picks = picks.shape[0], cupy.asarray(picks)
        self.checksum = torch.zeros(2 * self.batch, THREADS, dtype=torch.int32, device="cuda")
        self.debug = torch.zeros(2, BUF_BYTES // 2, dtype=torch.int16, device="cuda")
        self.args = (self.flat, self.picks, self.topk, cupy.asarray(self.checksum), cupy.asarray(self.debug))

    def __call__(self, name: str) -> None:
        self.kernels[name]((2 * self.batch,), (THREADS,), self.args, shared_mem=self.smem, stream=self.stream)


def check(torch, formats, launcher, flat, picks) -> dict:
    """Each kernel's result against torch: ``{kernel: {what: bool}}`` (``{"error": message}`` if it raised)."""
    want_last, want_sum = expected(torch, formats, flat, picks)
    launcher.buffers(picks)
    batch, out = picks.shape[0], {}
    for name in KERNELS:
        launcher.checksum.zero_()
        launcher.debug.zero_()
        try:
            launcher(name)
            torch.cuda.synchronize()  # a fault in the kernel raises here
        except Exception as e:  # a launch or compile error: report it, check the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"check B {batch:4d} {name:13s} FAIL {out[name]['error']}")
            continue
        sums = launcher.checksum.view(batch, 2, THREADS)
        out[name] = {"last_block_cta0": torch.equal(launcher.debug[0], want_last),
                     "last_block_cta1": torch.equal(launcher.debug[1], want_last),
                     "checksums": torch.equal(sums, want_sum[:, None].expand(-1, 2, -1))}
        print(f"check B {batch:4d} {name:13s} {'PASS' if passes(out[name]) else 'FAIL'} {out[name]}")
    return out


def passes(found: dict) -> bool:
    return "error" not in found and all(found.values())


def time_kernels(torch, launcher, picks, names: list[str], runs: int) -> dict[str, float]:
    """Median µs of each kernel, the kernels alternating, 10 warmup rounds, the L2 flushed before each launch."""
    launcher.buffers(picks)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = {name: [] for name in names}
    for run in range(runs + 10):
        for name in names:
            flush.zero_()  # also gives the host time to queue the launch behind the start event
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            launcher(name)
            end.record()
            if run >= 10:
                events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs) for name, pairs in events.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import cupy  # imported here: the script must import on machines without a GPU or CuPy (ruff, CI scans)
    import torch
    try:
        from sparse_mla import formats
    except ImportError:  # run from a checkout without PYTHONPATH=src
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from sparse_mla import formats

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 (Hopper) GPU")
        return 2
    flat = build_cache(torch, formats, args.tokens)
    picks_all = make_picks(torch, max(args.batches), args.tokens, args.context, args.topk)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cupy": cupy.__version__,
              "args": vars(args), "threads": THREADS, "checks": {}, "rows": [], "reference_us": REFERENCE_US}
    try:  # the JSON is written whatever happens (a kernel fault poisons the CUDA context: later calls raise)
        launcher = Launcher(cupy, torch, flat, args.topk)
        result["smem_bytes"] = launcher.smem
        return probe(torch, formats, launcher, flat, picks_all, args, result)
    finally:
        write_json(result)


def probe(torch, formats, launcher, flat, picks_all, args, result: dict) -> int:
    """Check every kernel at every batch, then time those that passed everywhere; 0 if all passed."""
    batches = sorted(set(args.batches))
    for batch in batches:
        result["checks"][batch] = check(torch, formats, launcher, flat, picks_all[:batch].contiguous())
    passed = [n for n in KERNELS if all(passes(result["checks"][b][n]) for b in batches)]
    status = 0 if len(passed) == len(KERNELS) else 1
    if args.check_only or not passed:
        return status

    print(f"\n{result['device']}: copy side only, {THREADS} threads, {launcher.smem} B shared memory a CTA; GB/s "
          f"counts each token's fp8 rows once: B x {args.topk} x {TOKEN_BYTES} B / time")
    print(f"{'B':>4} {'kernel':13s} {'µs':>8} {'GB/s':>7} {'/ per_cta':>9} {'/ FlashMLA':>10}")
    for batch in batches:
        times = time_kernels(torch, launcher, picks_all[:batch].contiguous(), passed, args.runs)
        flashmla = REFERENCE_US.get(batch, {}).get("flashmla")
        for name, us in times.items():
            row = {"batch": batch, "kernel": name, "us": us, "gbps": batch * args.topk * TOKEN_BYTES / us / 1e3,
                   "vs_per_cta": us / times["per_cta"] if "per_cta" in times else None,
                   "vs_flashmla_whole_kernel": us / flashmla if flashmla else None}
            result["rows"].append(row)
            ratios = [f"{row[key]:{width}.2f}" if row[key] else f"{'-':>{width}}"
                      for key, width in (("vs_per_cta", 9), ("vs_flashmla_whole_kernel", 10))]
            print(f"{batch:4d} {name:13s} {us:8.1f} {row['gbps']:7.0f} {' '.join(ratios)}")
    print("\nreference, whole kernels (H100, V3.2 h 128, s_q 1, graphs; BENCHMARKS.md), and the Gluon kernel's copy "
          "side alone (history.md version 17, math skipped):")
    for batch, ref in REFERENCE_US.items():
        copy_only = f"{ref['gluon_copy_only']} µs" if ref["gluon_copy_only"] else "not measured"
        print(f"  B {batch:4d}: FlashMLA {ref['flashmla']} µs, Gluon {ref['gluon']} µs, Gluon copy side {copy_only}")
    return status


def write_json(result: dict) -> None:
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "probe_cluster_copy.json"
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
