/* bench/gather_big.cuh: the expert-batched gather_qmm kernel on big tiles, warp-specialised (issue 12, item 5 of
 * docs/GPU-NOTES.md "Session 39": long runs, 2,048+ tokens; a candidate measured by bench/gpu_gather_wg.cu built
 * with -DWK_BIG=1 against production). Included after src/kernels/cuda/gather_batched.cu (its decode, x layout,
 * item order and epilogue arithmetic are reused).
 *
 * Why: production's wgmma kernel (RS form: the weights decoded into the A registers, m64 = 64 features a
 * warpgroup, N = the rows, up to 64) decodes every weight tile once per 64-row tile and runs at ~300 TFLOP/s at
 * 2k-8k tokens (runs of 96-384 rows an expert), where torch's bf16 grouped GEMM (CUTLASS, 128 x 256 tiles on bf16
 * weights) runs at ~500. Here the roles are those of such a GEMM:
 * - item = (expert, BG_NF features, 128 rows) (bt_item_of<128>: the row tiles of an N-tile adjacent, so their
 *   weight tile is read from L2); block = 3 warpgroups (384 threads, one block an SM);
 * - warpgroup 0, the producer: each 128-K step it stages the x tile (128 rows, production's K permutation:
 *   gw_xoff's layout) and decodes the BG_NF x 128 weight tile (bt_dec4, one packed multiply by the block scale,
 *   as production) into shared memory with stmatrix (K-major core matrices, the layout gather_ss.cuh measured
 *   bitwise equal to production), its global loads one step ahead in registers;
 * - warpgroups 1 and 2, the consumers: rows 0-63 and 64-127 of the item; 8 wgmma m64nBG_NFk16 SS a step (A = their
 *   64 x rows, B = the decoded weights, shared by both), fp32 accumulators (BG_NF / 2 registers a thread);
 * - two buffers (x + weights) a step; named barriers FULL[b] (producer arrives after its stores and the proxy
 *   fence, consumers wait) and EMPTY[b] (consumers arrive once their wgmma of the buffer are done, producer
 *   waits), so the producer decodes step s + 1 while the tensor cores run step s; a consumer's epilogue
 *   (y = bf16(acc x gs x kUndo), relu^2: cu_out as gw_store) overlaps the producer's next item.
 * Every k16 product covers the K indices production's mma / wgmma RS k16 step covers (the same x and weight
 * permutation), so the outputs are expected to be bitwise production's; expected, not promised (a different
 * operand order in the tensor core). Tiled layout, bf16 x and y, K % 64 == 0 only. Static item order (block b:
 * items b, b + grid, ...): the producer runs ahead across items. */
#ifndef FP4MOE_BENCH_GATHER_BIG_CUH
#define FP4MOE_BENCH_GATHER_BIG_CUH

#include "gather_candidate.cuh"
#include "wgmma_ss_big.cuh"

#ifndef BG_NF
#define BG_NF 256 /* features an item: a multiple of 64 (each producer warp decodes BG_NF / 64 16-feature tiles) */
#endif
#define BG_MT 128
#define BG_THREADS 384
#define BG_XKS (BG_MT * 32)    /* bytes of one k16 step of the x tile: 128 rows x 16 K bf16 */
#define BG_XBYTES (8 * BG_XKS) /* one 128-K step of x */
#define BG_WKS (BG_NF * 32)    /* bytes of one k16 step of the decoded weights */
#define BG_WBYTES (8 * BG_WKS)
#define BG_SMEM (2 * (BG_XBYTES + BG_WBYTES))
#define BG_TPW (BG_NF / 64) /* 16-feature tiles a producer warp */
static_assert(BG_NF % 64 == 0 && BG_NF <= 256, "BG_NF");

/* named barriers (0 is __syncthreads): FULL b = 1 + b, EMPTY b = 3 + b; all 384 threads take part in each */
__device__ __forceinline__ void bg_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(BG_THREADS) : "memory"); }
__device__ __forceinline__ void bg_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(BG_THREADS) : "memory"); }

__device__ __forceinline__ void bg_stmatrix4(uint32_t addr, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a0), "r"(a1),
                 "r"(a2), "r"(a3)
                 : "memory");
}

/* The producer's state for one item: x pieces (rows 8 i + nlo, K offset 32 t + 8 q of the step; thread (t, nlo, q) =
 * (tid % 4, tid / 4 % 8, tid / 32)) and the code pieces of its warp's tiles, loaded a step ahead. */
struct bg_producer {
    uint4 xv[16];
    uint32_t xr[16]; /* source rows (gq_x_row); ~0u: past the item's rows, not staged */
    uint4 c0[BG_TPW], c1[BG_TPW];
    uint32_t sw[BG_TPW];
    const uint8_t *piece[BG_TPW];
    int kc;

    __device__ __forceinline__ void init(const gq_args &a, const bt_item &it) {
        const int tid = threadIdx.x, lane = tid & 31, t = tid & 3, nlo = (tid >> 2) & 7, q = tid >> 5;
        kc = 32 * t + 8 * q;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = 8 * i + nlo;
            xr[i] = r < it.rows ? (uint32_t)gq_x_row(a.xrow, a.xdiv, it.row0 + r) : ~0u;
        }
        const int64_t we = cu_weight_expert(it.e, a.E);
        const int last_tile = (a.N - 1) >> 4;
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            const int T = min(it.ntile * (BG_NF / 16) + q * BG_TPW + j, last_tile);
            piece[j] = gq_tiled_piece(a.codes, we, T, 0, a.N, a.K) + lane * 16;
        }
    }
    __device__ __forceinline__ void load(const gq_args &a, int s) {
        const int k0 = s * BT_KSTEP;
        const bool kok = k0 + kc < a.K;
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            xv[i] = make_uint4(0, 0, 0, 0);
            if (xr[i] != ~0u && kok) xv[i] = __ldg(reinterpret_cast<const uint4 *>(x + (int64_t)xr[i] * a.K + k0 + kc));
        }
        const int64_t o = (int64_t)s * GQ_TILE_PIECE;
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            c0[j] = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o));
            c1[j] = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o + 512));
            const int lane = threadIdx.x & 31;
            sw[j] = __ldg(reinterpret_cast<const uint32_t *>(piece[j] - lane * 16 + o + 1024 + lane * 4));
        }
    }
    /* the loaded step into buffer (xs, ws) */
    __device__ __forceinline__ void store(uint8_t *xs, uint8_t *ws) const {
        const int tid = threadIdx.x, lane = tid & 31, t = tid & 3, nlo = (tid >> 2) & 7, q = tid >> 5;
        uint8_t *b = xs + gw_xoff(BG_XKS, 2 * q, 0, nlo) + 4 * t;
#pragma unroll
        for (int i = 0; i < 16; i++) { /* as gw_xput: rows 8 i + nlo are i core-matrix row groups (256 bytes) on */
            if (xr[i] != ~0u) {
                const uint4 w = xv[i];
                *reinterpret_cast<uint32_t *>(b + 256 * i) = __byte_perm(w.x, w.z, 0x5410);
                *reinterpret_cast<uint32_t *>(b + 256 * i + 128) = __byte_perm(w.x, w.z, 0x7632);
                *reinterpret_cast<uint32_t *>(b + 256 * i + BG_XKS) = __byte_perm(w.y, w.w, 0x5410);
                *reinterpret_cast<uint32_t *>(b + 256 * i + BG_XKS + 128) = __byte_perm(w.y, w.w, 0x7632);
            }
        }
        const uint32_t lane_off = ((lane >> 3) & 1) * 256 + (lane >> 4) * 128 + (lane & 7) * 16;
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            const int ft = q * BG_TPW + j; /* the tile's 16 features: rows 16 ft .. of the weight buffer */
            const uint32_t base = bt_smem_addr(ws) + ft * 512 + lane_off;
            uint32_t sa[2], sb[2];
            bt_scales4<__nv_bfloat16, true>(sw[j] & 0xffffu, sw[j] >> 16, sa, sb);
            const uint32_t w0[4] = {c0[j].x, c0[j].y, c0[j].z, c0[j].w}, w1[4] = {c1[j].x, c1[j].y, c1[j].z, c1[j].w};
#pragma unroll
            for (int qq = 0; qq < 4; qq++) { /* word qq: k16 steps 2 qq, 2 qq + 1 (gw_step's A registers) */
                uint32_t pa[4], pb[4];
                bt_dec4<__nv_bfloat16>::pairs_tl(w0[qq], pa);
                bt_dec4<__nv_bfloat16>::pairs_tl(w1[qq], pb);
                const uint32_t s0 = sa[qq >> 1], s1 = sb[qq >> 1];
                bg_stmatrix4(base + (2 * qq) * BG_WKS, cu_mul_bf16x2(pa[0], s0), cu_mul_bf16x2(pb[0], s1),
                             cu_mul_bf16x2(pa[1], s0), cu_mul_bf16x2(pb[1], s1));
                bg_stmatrix4(base + (2 * qq + 1) * BG_WKS, cu_mul_bf16x2(pa[2], s0), cu_mul_bf16x2(pb[2], s1),
                             cu_mul_bf16x2(pa[3], s0), cu_mul_bf16x2(pb[3], s1));
            }
        }
    }
};

__global__ void __launch_bounds__(BG_THREADS, 1)
gq_batched_big_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t *xbuf = smem, *wbuf = smem + 2 * BG_XBYTES;
    /* the warpgroup index made warp-uniform for the compiler (a shuffle, as CUTLASS's canonical_warp_group_idx): the
     * wgmma in the consumers' branch are then not serialised (ptxas C7518) */
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0);
    const int NT = (a.N + BG_NF - 1) / BG_NF, nsteps = (a.K + BT_KSTEP - 1) / BT_KSTEP;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    int64_t gs = 0; /* global step count of this block: buffer gs & 1 */
    if (wg == 0) { /* producer */
        bg_producer p;
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<BG_MT>(item, a.E, NT, starts, tile_off);
            p.init(a, it);
            p.load(a, 0);
            for (int s = 0; s < nsteps; s++, gs++) {
                const int b = (int)(gs & 1);
                if (gs >= 2) bg_sync(3 + b); /* the consumers are done with step gs - 2's buffer */
                p.store(xbuf + b * BG_XBYTES, wbuf + b * BG_WBYTES);
                wg_fence_async_smem();
                bg_arrive(1 + b);
                if (s + 1 < nsteps) p.load(a, s + 1);
            }
        }
        /* the consumers' last two releases (no arrivals left pending on a barrier) */
        if (gs >= 2) bg_sync(3 + (int)((gs - 2) & 1));
        if (gs >= 1) bg_sync(3 + (int)((gs - 1) & 1));
    } else { /* consumers: rows 64 r .. 64 r + 63 of the item */
        const int r = wg - 1, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = (threadIdx.x >> 5) & 3;
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<BG_MT>(item, a.E, NT, starts, tile_off);
            const int mine = it.rows - 64 * r;
            float acc[BG_NF / 2];
#pragma unroll
            for (int i = 0; i < BG_NF / 2; i++) acc[i] = 0.0f;
            for (int s = 0; s < nsteps; s++, gs++) {
                const int b = (int)(gs & 1);
                bg_sync(1 + b);
                /* a warpgroup without rows in the item runs its products too (on rows nobody stores): a wgmma
                 * under a condition made ptxas insert waits (C7517) */
                const uint32_t xa = bt_smem_addr(xbuf + b * BG_XBYTES) + r * 2048;
                const uint32_t wa = bt_smem_addr(wbuf + b * BG_WBYTES);
                wg_fence();
#pragma unroll
                for (int ks = 0; ks < 8; ks++)
                    wg_ss<BG_NF>::mma(acc, wg_desc(xa + ks * BG_XKS, 128, 256), wg_desc(wa + ks * BG_WKS, 128, 256), 1);
                wg_commit();
                wg_wait<1>(); /* step s - 1's products done */
                if (s > 0) bg_arrive(3 + (b ^ 1));
            }
            wg_wait<0>();
            bg_arrive(3 + (int)((gs - 1) & 1));
#pragma unroll
            for (int i = 0; i < BG_NF / 2; i++) asm volatile("" : "+f"(acc[i])::"memory");
            if (mine > 0) { /* acc[4 i + h]: row 16 w + g + 8 (h / 2), feature 8 i + 2 t + h % 2 */
                __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
                const float mult = cu_expert_gs(a.gs, it.e) * bt_ops<__nv_bfloat16>::kUndo;
                const int nb = it.ntile * BG_NF + 2 * t;
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = 16 * w + g + 8 * hh;
                    if (row < mine) {
                        __nv_bfloat16 *yr = y + (it.row0 + 64 * r + row) * a.N;
#pragma unroll
                        for (int i = 0; i < BG_NF / 8; i++) {
                            const int f = nb + 8 * i;
                            if (f < a.N) {
                                __nv_bfloat162 v;
                                v.x = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh] * mult, a.relu2);
                                v.y = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh + 1] * mult, a.relu2);
                                *reinterpret_cast<__nv_bfloat162 *>(yr + f) = v;
                            }
                        }
                    }
                }
            }
        }
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, a.N);
}

/* the candidate's launch: the runs with 128-row tiles, then the kernel (tiled layout, bf16) */
static int bg_launch(const gq_args *a, cudaStream_t st) {
    return bench_candidate_launch("gather big", gq_batched_big_kernel, BG_MT, BG_NF, BG_THREADS, BG_SMEM, a, st,
                                  [&](unsigned grid, int *starts, int *tile_off) {
                                      cu_launch(gq_batched_big_kernel, grid, BG_THREADS, BG_SMEM, st, *a, starts,
                                                tile_off);
                                  });
}

#endif
