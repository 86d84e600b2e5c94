/* The expert-batched gather_qmm on big tiles (128 rows x 256 features an item, warp-specialised), for a MoE layer's up
 * and down projections when its expert runs are long (gq_launch_moe_big; issue 12). Included by gather_batched.cu,
 * whose decode, tiled weight layout, item order and epilogue arithmetic it reuses: its products and outputs are
 * bitwise those of the 64-row wgmma kernel (test_ops_gpu test_moe_big). The measured record of its variants and of
 * why this form won is bench/gather_big.cuh and docs/GPU-NOTES.md, sessions 39-45.
 *
 * Why: the 64-row wgmma kernel (RS form: weights decoded into the A registers, the rows as N) decodes every weight
 * tile once per 64 rows and runs at ~300 TFLOP/s at 2k-8k tokens; here the roles are those of a CUTLASS-style
 * grouped GEMM (operands in shared memory, 128 x 256 tiles):
 * - item = (expert, 256 features, 128 rows) in bt_item_of's order; block = 3 warpgroups (384 threads, one block an
 *   SM); a block's items from the work counter as it finishes them (gb_fetch), or in the static order;
 * - warpgroup 0, the producer, each 128-K step: the 256 x 128 weight tile, decoded as the other kernels decode it
 *   (bt_dec4, one packed multiply by the block scale) and stored by stmatrix as K-major core matrices, each k16 step
 *   holding the K indices of the other kernels' k16 step (so the products are theirs); its loads a step ahead;
 * - warpgroups 1 and 2, the consumers, rows 0-63 / 64-127: their own x rows by 16-byte cp.async two steps ahead
 *   (three x buffers), then 8 wgmma m64n256k16 SS a step, fp32 accumulators from 0; the epilogue is gw_store's
 *   arithmetic (cu_out).
 * - a run's remainder of <= 64 rows (past its whole 128-row tiles; 65-127 rows stay a big item) goes to the 64-row
 *   wgmma kernel (gq_launch_runs_split, launch_wg with SKIP 128; FP4MOE_CUDA_MOE_BIG=all: not split): as a big item it
 *   would cost a full one, the producer's decode of 256 x 128 weights a step bounding it with one consumer idle
 *   (session 46: "half items", both consumers on the same 64 rows with 128 features each, were no faster), where the
 *   64-row kernel's 16 warps decode. The synthetic 30B-A3B model's skewed routing leaves 65-80 of 128 experts such a
 *   remainder (~33 rows on average) at 2,048-8,192 tokens. Session 47 (H100, end to end): 4,096 tokens +1.6%, 8,192
 *   +0.4% against every row on big tiles.
 * - FULL / EMPTY named barriers per weight buffer (two): the producer decodes step s + 1 while the tensor cores run
 *   step s.
 * x must be in the "permuted" order (gb_perm_src): a row's 128-K step holds, at element j, natural K gb_perm_src(j)
 * - the order in which the other kernels put x into their wgmma's shared memory - so that a consumer warp's copies
 * are 8 rows x 64 contiguous bytes into 8 different 16-byte bank groups; rows padded with zeros to whole steps
 * (gb_pad). The up projection's input is permuted by gb_permute_kernel; its output h is written permuted (and
 * padded) by the epilogue for the down projection, as whole 16-byte pieces after one shuffle between lanes t and
 * t ^ 2. Measured (H100): docs/PERFORMANCE.md, sessions 45 (bench/gpu_gather_wg) and 46 (end to end: the threshold,
 * GQ_BIG_ROWS_PER_EXPERT, and the work counter). */
#ifndef FP4MOE_KERNELS_CUDA_GATHER_BIG_CUH
#define FP4MOE_KERNELS_CUDA_GATHER_BIG_CUH

#define GB_NF 256     /* features an item */
#define GB_MT 128     /* rows an item */
#define GB_THREADS 384
#define GB_TPW (GB_NF / 64)    /* 16-feature tiles a producer warp decodes */
#define GB_XKS (GB_MT * 32)    /* bytes of one k16 step of the x tile: 128 rows x 16 K bf16 */
#define GB_XBYTES (8 * GB_XKS) /* one 128-K step of x */
#define GB_WKS (GB_NF * 32)    /* bytes of one k16 step of the decoded weights */
#define GB_WBYTES (8 * GB_WKS)
#define GB_SMEM (3 * GB_XBYTES + 2 * GB_WBYTES) /* 224 KB */

/* The permuted order: element j (0 .. 127) of a 128-K step holds natural K offset gb_perm_src(j). With j = 8 p + 2 t
 * + e and piece p = 2 ks + c (k16 step ks = 2 q + h, core matrix c): x[32 t + 8 q + 2 h + c + 4 e] - the value that
 * gw_xput4 puts at byte 4 t + 2 e of that core-matrix row. gb_perm_dst is its inverse. */
__host__ __device__ constexpr int gb_perm_src(int j) {
    return 32 * ((j >> 1) & 3) + 8 * (j >> 5) + 2 * ((j >> 4) & 1) + ((j >> 3) & 1) + 4 * (j & 1);
}
__host__ __device__ constexpr int gb_perm_dst(int k) {
    return 8 * (2 * (2 * ((k >> 3) & 3) + ((k >> 1) & 1)) + (k & 1)) + 2 * (k >> 5) + ((k >> 2) & 1);
}
static_assert(gb_perm_dst(gb_perm_src(77)) == 77 && gb_perm_src(gb_perm_dst(77)) == 77, "inverse");
/* K rounded up to whole 128-K steps: a permuted row's length */
__host__ __device__ constexpr int gb_pad(int K) { return (K + 127) / 128 * 128; }

/* named barriers (0 is __syncthreads): FULL b = 1 + b, EMPTY b = 3 + b (all 384 threads); 5 + r: consumer r's own;
 * 7: the producer's own (gb_fetch) */
__device__ __forceinline__ void gb_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(GB_THREADS) : "memory"); }
__device__ __forceinline__ void gb_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(GB_THREADS) : "memory"); }

/* one stmatrix.x4: the four 8 x 8 bf16 matrices of an A fragment, lane l giving row l % 8 of matrix l / 8 */
__device__ __forceinline__ void gb_stmatrix4(uint32_t addr, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a0), "r"(a1),
                 "r"(a2), "r"(a3)
                 : "memory");
}

/* The producer's state for one item: the code pieces of its warp's GB_TPW 16-feature tiles, loaded a step ahead */
struct gb_producer {
    uint4 c0[GB_TPW], c1[GB_TPW];
    uint32_t sw[GB_TPW];
    const uint8_t *piece[GB_TPW]; /* + lane * 16 */

    __device__ __forceinline__ void init(const gq_args &a, const bt_item &it) {
        const int lane = threadIdx.x & 31, q = threadIdx.x >> 5;
        const int64_t we = cu_weight_expert(it.e, a.E);
        const int last_tile = (a.N - 1) >> 4;
#pragma unroll
        for (int j = 0; j < GB_TPW; j++) {
            const int T = min(it.ntile * (GB_NF / 16) + q * GB_TPW + j, last_tile);
            piece[j] = gq_tiled_piece(a.codes, we, T, 0, a.N, a.K) + lane * 16;
        }
    }
    __device__ __forceinline__ void load(int s) {
        const int lane = threadIdx.x & 31;
        const int64_t o = (int64_t)s * GQ_TILE_PIECE;
#pragma unroll
        for (int j = 0; j < GB_TPW; j++) {
            c0[j] = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o));
            c1[j] = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o + 512));
            sw[j] = __ldg(reinterpret_cast<const uint32_t *>(piece[j] - lane * 12 + o + 1024)); /* piece + 1024 + 4 lane */
        }
    }
    /* the loaded step into ws: feature n of k16 step ks at ks GB_WKS + (n / 8) 256 + (n % 8) 16, K-direction core
     * matrix + 128 */
    __device__ __forceinline__ void store(uint8_t *ws) const {
        const int lane = threadIdx.x & 31, q = threadIdx.x >> 5;
        const uint32_t lane_off = ((lane >> 3) & 1) * 256 + (lane >> 4) * 128 + (lane & 7) * 16;
#pragma unroll
        for (int j = 0; j < GB_TPW; j++) {
            const int ft = q * GB_TPW + j; /* the tile's 16 features: rows 16 ft .. of the weight buffer */
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
                gb_stmatrix4(base + (2 * qq) * GB_WKS, cu_mul_bf16x2(pa[0], s0), cu_mul_bf16x2(pb[0], s1),
                             cu_mul_bf16x2(pa[1], s0), cu_mul_bf16x2(pb[1], s1));
                gb_stmatrix4(base + (2 * qq + 1) * GB_WKS, cu_mul_bf16x2(pa[2], s0), cu_mul_bf16x2(pb[2], s1),
                             cu_mul_bf16x2(pa[3], s0), cu_mul_bf16x2(pb[3], s1));
            }
        }
    }
};

/* A consumer warpgroup's x copies: rows 64 r + 8 i + (tid % 8), i < 8, piece p = 4 w + lane / 8 (16 bytes) of each
 * step - its core-matrix row (k16 step p / 2, matrix p % 2); a warp's 8 lanes of a wavefront on 8 rows' 16-byte bank
 * groups; no K test (the permuted rows are padded) */
struct gb_xcopy {
    uint32_t xr[8]; /* source rows (gq_x_row); ~0u: past the item's rows, not copied */
    int kc;
    __device__ __forceinline__ void init(const gq_args &a, const bt_item &it, int rb) { /* rows rb .. rb + 63 */
        const int tid = threadIdx.x & 127;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int row = rb + 8 * i + (tid & 7);
            xr[i] = row < it.rows ? (uint32_t)gq_x_row(a.xrow, a.xdiv, it.row0 + row) : ~0u;
        }
        kc = 8 * (4 * (tid >> 5) + ((tid >> 3) & 3));
    }
    __device__ __forceinline__ void issue(const gq_args &a, int s, uint8_t *xs, int r, int xstride) const {
        const int tid = threadIdx.x & 127, p = kc >> 3;
#ifdef FP4MOE_INJECT_FAULT_BIG_XCOPY /* deliberate fault (tests must catch it): core matrices 0 and 1 swapped */
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x) + s * BT_KSTEP + (kc ^ 8);
#else
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x) + s * BT_KSTEP + kc;
#endif
        const uint32_t dp = bt_smem_addr(xs) + r * 2048 + (p >> 1) * GB_XKS + (p & 1) * 128 + (tid & 7) * 16;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (xr[i] != ~0u) bt_cp16(dp + 256 * i, x + (int64_t)xr[i] * xstride, 16);
        bt_cp_commit();
    }
};

/* The order of a block's items. Static (ctr NULL, FP4MOE_CUDA_GATHER_SCHED=static): block b takes items b, b + grid,
 * ...; dynamic (ctr = tile_off + E + 1, zeroed by the runs kernel): its first item is blockIdx.x and each next one
 * grid + the counter's next value, as bt_sched (why: there). The producer warpgroup, which runs up to two steps ahead
 * of the consumers, fetches item j + 1 when it starts item j: thread 0 puts it in next_item[(j + 1) % 4] before a
 * producer-only barrier (named barrier 7) and before its arrival on the FULL barrier of item j's step 0, after
 * which the consumers read it (gb_steps). The slot is written again at item j + 4, which the producer can only
 * start after the consumers finished item j + 1's first step (the two weight buffers): four slots are enough. The
 * fetch that returns total - 1 is the call's last and sets the counter back to 0 (the down projection's launch uses
 * the same runs). */
__device__ __forceinline__ int64_t gb_fetch(int *ctr, int *next_item, int64_t j, int64_t item, int64_t total) {
    if (!ctr) return item + gridDim.x;
    if (threadIdx.x == 0) {
        const int v = atomicAdd(ctr, 1);
        next_item[(j + 1) & 3] = v;
#ifndef FP4MOE_INJECT_FAULT_BIG_SCHED /* deliberate fault (tests must catch it): the counter left at total */
        if ((int64_t)v == total - 1) atomicExch(ctr, 0);
#endif
    }
    asm volatile("bar.sync 7, 128;" ::: "memory");
    return (int64_t)gridDim.x + next_item[(j + 1) & 3];
}

/* A consumer warpgroup's epilogue (gw_store's arithmetic, cu_out): acc[4 i + h] = the product of row row0 + 16 w + g +
 * 8 (h / 2), feature fb0 + 8 i + 2 t + h % 2 (w: the warp in the warpgroup, g = lane / 4, t = lane % 4); rows below
 * `mine` stored, features below N. bench/gather_big.cuh's variants store through the same two functions. */
/* y in the permuted order (rows of ystride = gb_pad(N), zeros past N: the next projection's x) */
__device__ __forceinline__ void gb_store_permuted(const float (&acc)[GB_NF / 2], __nv_bfloat16 *y, int64_t row0,
                                  int ystride, int mine, int fb0, int N, float mult, int relu2) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = (threadIdx.x >> 5) & 3;
    /* permuted: piece (Q, h, c) of a row's 128 features holds component c of feature groups 4 T + Q (T =
     * 0..3) from lanes t = h (e = 0) and t = h + 2 (e = 1); lanes t and t ^ 2 swap the component the
     * other keeps, then each lane stores 4 whole pieces a row (Q = 0..3, h = t % 2, c = t / 2) */
    const int cm = t >> 1, hq = t & 1;
    const __nv_bfloat16 zero = __float2bfloat16(0.0f);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = 16 * w + g + 8 * hh;
        __nv_bfloat16 *yr = y + (row0 + row) * ystride;
#pragma unroll
        for (int bb = 0; bb < GB_NF / 128; bb++) {
            uint32_t own[8], got[8];
#pragma unroll
            for (int m = 0; m < 8; m++) { /* groups 16 bb + 2 m, + 1: this lane's component cm kept */
                uint32_t pr[2];
#pragma unroll
                for (int cc = 0; cc < 2; cc++) {
                    const int i0 = 16 * bb + 2 * m, f0 = fb0 + 8 * i0 + 2 * t + cc;
                    __nv_bfloat162 v;
                    v.x = f0 < N ? cu_out<__nv_bfloat16>(acc[4 * i0 + 2 * hh + cc] * mult, relu2) : zero;
                    v.y = f0 + 8 < N ? cu_out<__nv_bfloat16>(acc[4 * i0 + 4 + 2 * hh + cc] * mult, relu2)
                                       : zero;
                    pr[cc] = *reinterpret_cast<const uint32_t *>(&v);
                }
                own[m] = cm ? pr[1] : pr[0];
                got[m] = __shfl_xor_sync(0xffffffffu, cm ? pr[0] : pr[1], 2); /* lane t ^ 2's component cm */
            }
            const int fblk = fb0 + 128 * bb;
            if (row < mine && fblk < N) {
#pragma unroll
                for (int Q = 0; Q < 4; Q++) {
                    uint32_t wv[4];
#pragma unroll
                    for (int T = 0; T < 4; T++) {
                        const int m = 2 * T + (Q >> 1);
                        const uint32_t e0 = cm ? got[m] : own[m], e1 = cm ? own[m] : got[m];
                        wv[T] = __byte_perm(e0, e1, (Q & 1) ? 0x7632 : 0x5410);
                    }
    #ifdef FP4MOE_INJECT_FAULT_BIG_YPERM /* deliberate fault (tests must catch it): pieces c = 0 and 1 swapped */
                    const int p = 2 * (2 * Q + hq) + (cm ^ 1);
    #else
                    const int p = 2 * (2 * Q + hq) + cm;
    #endif
                    *reinterpret_cast<uint4 *>(yr + fblk + 8 * p) = make_uint4(wv[0], wv[1], wv[2], wv[3]);
                }
            }
        }
    }
}
/* y in the natural order (rows of ystride elements) */
__device__ __forceinline__ void gb_store_natural(const float (&acc)[GB_NF / 2], __nv_bfloat16 *y, int64_t row0,
                                 int ystride, int mine, int fb0, int N, float mult, int relu2) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = (threadIdx.x >> 5) & 3;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int row = 16 * w + g + 8 * hh;
        if (row < mine) {
            __nv_bfloat16 *yr = y + (row0 + row) * ystride;
#pragma unroll
            for (int i = 0; i < GB_NF / 8; i++) {
                const int f = fb0 + 2 * t + 8 * i; /* N is even: f and f + 1 both in range or both not */
                if (f < N) {
                    __nv_bfloat162 v;
                    v.x = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh] * mult, relu2);
                    v.y = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh + 1] * mult, relu2);
                    *reinterpret_cast<__nv_bfloat162 *>(yr + f) = v;
                }
            }
        }
    }
}

/* A consumer's K loop over one item, from the x copies of steps 0 and 1 already issued; `next` from the dynamic
 * order's slot (NULL: static) after step 0's FULL barrier */
__device__ __forceinline__ void gb_steps(float (&acc)[GB_NF / 2], const gq_args &a, const gb_xcopy &xc, uint8_t *xbuf,
                                         uint8_t *wbuf, int r, int xstride, int nsteps, int64_t &gs, int &xb,
                                         int64_t &next, const int *slot) {
    for (int s = 0; s < nsteps; s++, gs++) {
        const int b = (int)(gs & 1);
        bt_cp_wait<1>(); /* this step's x copies landed (step s + 1's may be in flight) */
        wg_fence_async_smem();
        asm volatile("bar.sync %0, 128;" ::"r"(5 + r) : "memory");
        gb_sync(1 + b);
        if (s == 0 && slot) next = (int64_t)gridDim.x + *slot; /* (written before step 0's FULL arrival) */
        const uint32_t xa = bt_smem_addr(xbuf + xb * GB_XBYTES) + r * 2048;
        const uint32_t wa = bt_smem_addr(wbuf + b * GB_WBYTES);
        wg_fence();
#pragma unroll
        for (int ks = 0; ks < 8; ks++)
            wg_ss<GB_NF>::mma(acc, wg_desc(xa + ks * GB_XKS, 128, 256), wg_desc(wa + ks * GB_WKS, 128, 256), 1);
        wg_commit();
        wg_wait<1>(); /* step s - 1's products done: its buffers are free */
        if (s > 0) gb_arrive(3 + (b ^ 1));
        const int xf = xb == 0 ? 2 : xb - 1; /* step s - 1's x buffer takes step s + 2 */
        if (s + 2 < nsteps) xc.issue(a, s + 2, xbuf + xf * GB_XBYTES, r, xstride);
        else bt_cp_commit();
        xb = xb == 2 ? 0 : xb + 1;
    }
}

/* y (bf16) = the items' products; x rows of xstride elements (permuted, padded); y rows of ystride elements: yperm 0:
 * N, natural order; yperm 1: gb_pad(N), permuted order, zeros past N (the next projection's x). Rows past starts[E]:
 * zeros. */
__global__ void __launch_bounds__(GB_THREADS, 1)
gq_big_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int xstride, int ystride,
              int yperm, int *ctr) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int next_item[4]; /* the dynamic order's ring (gb_fetch) */
    uint8_t *xbuf = smem, *wbuf = smem + 3 * GB_XBYTES;
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0); /* warp-uniform for the compiler */
    const int NT = (a.N + GB_NF - 1) / GB_NF, nsteps = (a.K + BT_KSTEP - 1) / BT_KSTEP;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    int64_t gs = 0; /* the block's steps so far: weight buffer gs & 1 */
    if (wg == 0) { /* the producer */
        gb_producer p;
        int64_t next = 0;
        for (int64_t item = blockIdx.x, j = 0; item < total; item = next, j++) {
            next = gb_fetch(ctr, next_item, j, item, total);
            const bt_item it = bt_item_of<GB_MT>(item, a.E, NT, starts, tile_off);
            p.init(a, it);
            p.load(0);
            for (int s = 0; s < nsteps; s++, gs++) {
                const int b = (int)(gs & 1);
                if (gs >= 2) gb_sync(3 + b); /* the consumers are done with step gs - 2's buffer */
                p.store(wbuf + b * GB_WBYTES);
                wg_fence_async_smem();
                gb_arrive(1 + b);
                if (s + 1 < nsteps) p.load(s + 1);
            }
        }
        /* the consumers' last two releases (no arrivals left pending on a barrier) */
        if (gs >= 2) gb_sync(3 + (int)((gs - 2) & 1));
        if (gs >= 1) gb_sync(3 + (int)((gs - 1) & 1));
    } else { /* the consumers: rows 64 r .. 64 r + 63 of an item */
        const int r = wg - 1;
        int xb = 0; /* the x buffer of step gs: gs % 3 */
        int64_t next = 0;
        for (int64_t item = blockIdx.x, j = 0; item < total; item = next, j++) {
            const bt_item it = bt_item_of<GB_MT>(item, a.E, NT, starts, tile_off);
            const int rb = 64 * r, mine = it.rows - rb;
            float acc[GB_NF / 2];
#pragma unroll
            for (int i = 0; i < GB_NF / 2; i++) acc[i] = 0.0f;
            gb_xcopy xc; /* steps 0 and 1 (an empty group if there is no step 1) */
            xc.init(a, it, rb);
            xc.issue(a, 0, xbuf + xb * GB_XBYTES, r, xstride);
            if (nsteps > 1) xc.issue(a, 1, xbuf + (xb == 2 ? 0 : xb + 1) * GB_XBYTES, r, xstride);
            else bt_cp_commit();
            /* the next item: the static one, or the dynamic order's slot, read after step 0's FULL barrier */
            next = item + gridDim.x;
            const int *slot = ctr ? next_item + ((j + 1) & 3) : nullptr;
            gb_steps(acc, a, xc, xbuf, wbuf, r, xstride, nsteps, gs, xb, next, slot);
            wg_wait<0>();
            gb_arrive(3 + (int)((gs - 1) & 1));
#pragma unroll
            for (int i = 0; i < GB_NF / 2; i++) asm volatile("" : "+f"(acc[i])::"memory"); /* read after the wait */
            if (mine <= 0) continue;
            /* acc[4 i + h]: row rb + 16 w + g + 8 (h / 2), feature fb0 + 8 i + 2 t + h % 2 */
            __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
            const float mult = cu_expert_gs(a.gs, it.e) * bt_ops<__nv_bfloat16>::kUndo;
            const int fb0 = it.ntile * GB_NF;
            if (yperm) gb_store_permuted(acc, y, it.row0 + rb, ystride, mine, fb0, a.N, mult, a.relu2);
            else gb_store_natural(acc, y, it.row0 + rb, ystride, mine, fb0, a.N, mult, a.relu2);
        }
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, ystride);
}

/* out (rows x gb_pad(K) bf16) = in (rows x K bf16) in the permuted order, zeros past K. A thread writes one 16-byte
 * piece: its 8 elements are natural K base + {0, 4, 32, 36, 64, 68, 96, 100} of the piece's 128-K step. */
__global__ void gb_permute_kernel(const uint16_t *__restrict__ in, int64_t rows, int K, uint16_t *__restrict__ out) {
    cu_pdl_entry();
    const int Kp = gb_pad(K), pr = Kp / 8; /* pieces a row */
    const int64_t n = rows * pr;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / pr;
        const int pc = (int)(i % pr), k0 = (pc >> 4) * 128, j0 = 8 * (pc & 15);
        const uint16_t *src = in + row * K;
        uint32_t v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int ka = k0 + gb_perm_src(j0 + 2 * e), kb = k0 + gb_perm_src(j0 + 2 * e + 1);
            const uint32_t lo = ka < K ? src[ka] : 0u, hi = kb < K ? src[kb] : 0u;
            v[e] = lo | hi << 16;
        }
        *reinterpret_cast<uint4 *>(out + i * 8) = make_uint4(v[0], v[1], v[2], v[3]);
    }
}

/* gq_big_kernel on a (x: rows of xstride, permuted; y: permuted rows of gb_pad(N) where yperm, else natural rows of
 * N) with the runs starts / tile_off of 128-row tiles */
static int launch_big(const gq_args *a, const int *starts, const int *tile_off, int xstride, int yperm,
                      cudaStream_t st) {
    const int ystride = yperm ? gb_pad(a->N) : a->N;
    const int64_t NT = (a->N + GB_NF - 1) / GB_NF;
    const int64_t bound = ((int64_t)a->B / GB_MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
    unsigned grid = 0;
    const int rc = persistent_grid(gq_big_kernel, GB_THREADS, GB_SMEM, bound, &grid);
    if (rc) return rc;
    cu_launch(gq_big_kernel, grid, GB_THREADS, GB_SMEM, st, *a, starts, tile_off, xstride, ystride, yperm,
              sched_counter(a, tile_off));
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-batched kernel (big tiles)");
    return FP4MOE_OK;
}

bool gq_moe_big_fits(const gq_args *u, const gq_args *d) {
    const bool al = ((uintptr_t)u->codes & 15) == 0 && ((uintptr_t)d->codes & 15) == 0 && ((uintptr_t)u->x & 15) == 0;
    return u->tiled && d->tiled && al && u->K % 64 == 0 && d->K % 64 == 0 && u->N % 2 == 0 && d->N % 2 == 0 &&
           d->K == u->N && u->E == d->E && u->B == d->B && u->idx == d->idx && !d->xrow;
}

int gq_launch_moe_big(const gq_args *u, const gq_args *d, int64_t T, bool split, cudaStream_t st) {
    if (!gq_moe_big_fits(u, d) || T < 1 || (!u->xrow && T != u->B))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe, big tiles): not two tiled calls of one "
                                "layer (K %% 64, N even, down K = up N)");
    const int Kp = gb_pad(u->K), Np = gb_pad(u->N);
    /* starts (E + 1), tile_off (E + 2), rem_off (E + 2) */
    const size_t runs_b = (3 * (size_t)u->E + 5) * sizeof(int), xp_b = (size_t)T * Kp * 2, hp_b = (size_t)u->B * Np * 2;
    uint8_t *buf = NULL;
    const size_t bytes = (runs_b + 255) / 256 * 256 + xp_b + hp_b;
    int rc = gq_scratch_alloc((void **)&buf, bytes, st);
    if (rc) { /* (an allocation failure: not sticky) the caller's two calls need no scratch */
        (void)cudaGetLastError();
        char why[256];
        snprintf(why, sizeof why, "%s", fp4moe_last_error());
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe, big tiles): no %.1f MB of scratch (%s)",
                                bytes / 1e6, why);
    }
    int *starts = (int *)buf, *tile_off = starts + u->E + 1, *rem_off = tile_off + u->E + 2;
    uint16_t *xp = (uint16_t *)(buf + (runs_b + 255) / 256 * 256), *hp = xp + (size_t)T * Kp;
    rc = split ? gq_launch_runs_split(u, GB_MT, starts, tile_off, rem_off, st)
               : gq_launch_runs(u, GB_MT, starts, tile_off, st);
    if (!rc) {
        const int64_t pieces = T * (Kp / 8);
        cu_launch(gb_permute_kernel, (unsigned)((pieces + 255) / 256 < 4096 ? (pieces + 255) / 256 : 4096), 256, 0, st,
                  static_cast<const uint16_t *>(u->x), T, u->K, xp);
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the x permutation (big tiles)");
        gq_args up = *u, dn = *d;
        up.x = xp;
        up.y = hp;
        dn.x = hp;
        /* split: the short remainders (<= 64 rows) on the 64-row wgmma kernel, whose 16 warps decode an item's
         * weights where the big tiles' 4 producer warps would decode them for half a tile of rows (u's x through
         * xrow, h in the caller's natural rows; the same products, so y is the same bits) */
        rc = launch_big(&up, starts, tile_off, Kp, 1, st);
        if (!rc && split) rc = launch_wg<64, true, (GW_WGS > 2 ? 1 : 2), GB_MT>(u, starts, rem_off, st);
        if (!rc) rc = launch_big(&dn, starts, tile_off, Np, 0, st);
        if (!rc && split) rc = launch_wg<64, true, (GW_WGS > 2 ? 1 : 2), GB_MT>(d, starts, rem_off, st);
    }
    const int rc2 = gq_scratch_free(buf, st);
    return rc ? rc : rc2;
}

#endif
