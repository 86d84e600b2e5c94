/* bench/gather_ws.cuh: the expert-batched gather_qmm kernel warp-specialised (issue 12; a candidate,
 * measured by bench/gpu_gather_wg.cu built with -DWK_WS=1 against production's wgmma kernel). Included
 * after src/kernels/cuda/gather_batched.cu (it reuses its decode, wgmma step and epilogue).
 *
 * Why (docs/PERFORMANCE.md, session 11: Nsight Compute of the production wgmma kernel): issue slots
 * 40% busy, 0.86 eligible warps a scheduler, tensor pipe 25% active - every warp loads, decodes and
 * multiplies in turn, and the two warpgroups of a block meet at a __syncthreads every 128-K step.
 * Here (FlashAttention-3's structure, as attn_prefill_wg_kernel in ops_attention.cu):
 * - block = 1 producer warpgroup + WS_NC consumer warpgroups (64 features each, 64-row tiles), an
 *   item = (expert row tile of <= 64 rows, WS_NC x 64 features), persistent over the items;
 * - a ring of WS_STAGES slots; a slot = one 128-K step: the x tile (64 rows x 128 K, bf16, in the
 *   production kernel's permuted core-matrix layout, gw_xoff) and the consumer warps' tiled weight
 *   pieces (GQ_TILE_PIECE bytes each, 4 a consumer warpgroup);
 * - the producer: per step, waits "empty", cp.async of the pieces (completion counted on "full" by
 *   cp.async.mbarrier.arrive.noinc), x through registers (ldg, byte-permute, st.shared, proxy fence)
 *   and an arrival on "full"; the pipeline runs on across items (one global step counter);
 * - a consumer warpgroup: per step, waits "full", reads its 36 bytes a thread, decodes and issues the
 *   8 wgmma of gw_step, waits for them and arrives on "empty" (every thread: no divergent path
 *   among the wgmma, ptxas C7520); the epilogue of gw_item.
 * Same decode, same wgmma with the same N (rows rounded up to 8) and the same K order as
 * gq_batched_wg_kernel: bitwise equal outputs expected. Tiled layout, bf16 x and y only.
 * Macros: WS_NC (consumer warpgroups, 2 or 4), WS_STAGES (ring slots), WS_MINB (blocks an SM). */
#ifndef FP4MOE_BENCH_GATHER_WS_CUH
#define FP4MOE_BENCH_GATHER_WS_CUH

#include "kernels/cuda/mbarrier.cuh"
#include "gather_candidate.cuh"

#ifndef WS_NC
#define WS_NC 2
#endif
#ifndef WS_STAGES
#define WS_STAGES 4
#endif
#ifndef WS_MINB
#define WS_MINB 1
#endif
#define WS_MT 64
#define WS_NF (64 * WS_NC)                          /* features an item */
#define WS_THREADS (128 * (WS_NC + 1))
#define WS_KS (WS_MT * 32)                          /* bytes of one k16 sub-step of the x tile */
#define WS_XBYTES (8 * WS_KS)                       /* the x tile of a step: 16 KB */
#define WS_PIECES (4 * WS_NC)                       /* weight pieces a step */
#define WS_SLOT (WS_XBYTES + WS_PIECES * GQ_TILE_PIECE)
#define WS_SMEM (WS_STAGES * WS_SLOT + 2 * WS_STAGES * 8)
static_assert(WS_SLOT % 128 == 0, "slots keep 128-byte alignment");

/* One consumer warpgroup's share of an item with N = rows rounded up to 8: nsteps steps from global
 * step *g on, then the epilogue (gw_item's). */
template <int N>
__device__ __forceinline__ void ws_consume(const gq_args &a, int e, int64_t row0, int rows, int nw, int pw,
                                           uint32_t sbase, uint32_t bars, const uint8_t *smem, int nsteps, int &g) {
    const int lane = threadIdx.x & 31;
    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
    for (int s = 0; s < nsteps; s++, g++) {
        const int slot = g % WS_STAGES;
        cu_mbar_wait(bars + 8 * slot, (g / WS_STAGES) & 1);
        wg_fence_async_smem();
        const uint8_t *wp = smem + slot * WS_SLOT + WS_XBYTES + pw * GQ_TILE_PIECE;
        const uint4 c0 = *reinterpret_cast<const uint4 *>(wp + lane * 16);
        const uint4 c1 = *reinterpret_cast<const uint4 *>(wp + 512 + lane * 16);
        const uint32_t s0 = *reinterpret_cast<const uint32_t *>(wp + 1024 + lane * 4);
        const uint32_t w0[4] = {c0.x, c0.y, c0.z, c0.w}, w1[4] = {c1.x, c1.y, c1.z, c1.w};
        uint32_t sa[2], sb[2];
        bt_scales4<__nv_bfloat16, true>(s0 & 0xffffu, s0 >> 16, sa, sb);
        gw_step<N, WS_KS, true>(acc, w0, w1, sa, sb, gw_desc_lo(sbase + slot * WS_SLOT));
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
        cu_mbar_arrive(bars + 8 * (WS_STAGES + slot)); /* every thread: the slot may be refilled */
    }
    gw_store<N>(a, e, row0, rows, nw, acc);
}

/* The producer's step s of an item into ring slot `slot`: the pieces by cp.async, the x tile through
 * registers (gw_xstage's permutation, 128 threads: rows 8 i + nlo, K offset 32 t + 8 q). */
__device__ __forceinline__ void ws_produce(const gq_args &a, const bt_item &it, int s, uint32_t sbase, uint32_t bars,
                                           uint8_t *smem, int slot) {
    const int tid = threadIdx.x; /* 0 .. 127 */
    const int K = a.K, NF = a.N, NT16 = (NF + 15) / 16;
    const int64_t nst = gq_tiled_nsteps(K), we = cu_weight_expert(it.e, a.E);
    const uint32_t wdst = sbase + slot * WS_SLOT + WS_XBYTES;
    for (int i = tid; i < WS_PIECES * (GQ_TILE_PIECE / 16); i += 128) {
        const int p = i / (GQ_TILE_PIECE / 16), off = (i % (GQ_TILE_PIECE / 16)) * 16;
        const int tile = min(it.ntile * (WS_NF / 16) + p, NT16 - 1); /* past N: a valid piece, outputs masked */
        const uint8_t *src = a.codes + ((we * NT16 + tile) * nst + s) * GQ_TILE_PIECE + off;
        bt_cp16(wdst + p * GQ_TILE_PIECE + off, src, 16);
    }
    cu_mbar_arrive_cp_async(bars + 8 * slot);
    const int t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, kc = 32 * t + 8 * q, k0 = s * BT_KSTEP;
    const int npad = (it.rows + 7) & ~7;
    const bool kok = k0 + kc < K;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    uint8_t *xs = smem + slot * WS_SLOT;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        uint4 v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = 8 * (4 * half + i) + nlo, rr = r < it.rows ? r : it.rows - 1;
            v[i] = make_uint4(0, 0, 0, 0);
            if (r < npad && kok) v[i] = __ldg(reinterpret_cast<const uint4 *>(x + (it.row0 + rr) * K + k0 + kc));
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int n = 8 * (4 * half + i) + nlo;
            if (n < npad) {
                const uint4 w = v[i];
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(WS_KS, 2 * q, 0, n) + 4 * t) = __byte_perm(w.x, w.z, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(WS_KS, 2 * q, 1, n) + 4 * t) = __byte_perm(w.x, w.z, 0x7632);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(WS_KS, 2 * q + 1, 0, n) + 4 * t) = __byte_perm(w.y, w.w, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(WS_KS, 2 * q + 1, 1, n) + 4 * t) = __byte_perm(w.y, w.w, 0x7632);
            }
        }
    }
    wg_fence_async_smem(); /* the x tile is read by wgmma (the async proxy) */
    cu_mbar_arrive(bars + 8 * slot);
}

__global__ void __launch_bounds__(WS_THREADS, WS_MINB)
gq_batched_ws_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off) {
    cu_pdl_entry();
    extern __shared__ __align__(1024) uint8_t ws_smem[];
    const uint32_t sbase = bt_smem_addr(ws_smem), bars = sbase + WS_STAGES * WS_SLOT;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3;
    const int NT = (a.N + WS_NF - 1) / WS_NF, nsteps = (a.K + BT_KSTEP - 1) / BT_KSTEP;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    /* full: 128 cp.async arrivals + 128 arrivals after the x stores; empty: every consumer thread */
    if (threadIdx.x == 0)
        for (int i = 0; i < 2 * WS_STAGES; i++) cu_mbar_init(bars + 8 * i, i < WS_STAGES ? 256 : 128 * WS_NC);
    __syncthreads();
    int g = 0; /* the global step counter: slot g % WS_STAGES, phase g / WS_STAGES */
    if (wg == 0) {
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<WS_MT>(item, a.E, NT, starts, tile_off);
            for (int s = 0; s < nsteps; s++, g++) {
                const int slot = g % WS_STAGES;
                if (g >= WS_STAGES) cu_mbar_wait(bars + 8 * (WS_STAGES + slot), (g / WS_STAGES - 1) & 1);
                ws_produce(a, it, s, sbase, bars, ws_smem, slot);
            }
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
    } else {
        const int c = wg - 1;
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<WS_MT>(item, a.E, NT, starts, tile_off);
            const int nw = it.ntile * WS_NF + c * 64 + warp * 16, pw = c * 4 + warp;
#define WS_CASE(n) case n: ws_consume<8 * n>(a, it.e, it.row0, it.rows, nw, pw, sbase, bars, ws_smem, nsteps, g); break
            switch ((it.rows + 7) >> 3) {
            WS_CASE(1); WS_CASE(2); WS_CASE(3); WS_CASE(4); WS_CASE(5); WS_CASE(6); WS_CASE(7);
            default: ws_consume<64>(a, it.e, it.row0, it.rows, nw, pw, sbase, bars, ws_smem, nsteps, g); break;
            }
#undef WS_CASE
        }
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, a.N);
}

/* the candidate's launch: the runs with 64-row tiles, then the kernel (tiled layout, bf16) */
static int ws_launch(const gq_args *a, cudaStream_t st) {
    return bench_candidate_launch("gather ws", gq_batched_ws_kernel, WS_MT, WS_NF, WS_THREADS, WS_SMEM, a, st,
                                  [&](unsigned grid, int *starts, int *tile_off) {
                                      cu_launch(gq_batched_ws_kernel, grid, WS_THREADS, WS_SMEM, st, *a, starts, tile_off);
                                  });
}

#endif
