/* bench/gather_big.cuh: the expert-batched gather_qmm kernel on big tiles, warp-specialised (issue 12, item 5 of
 * docs/GPU-NOTES.md "Session 39"; session 40): a candidate measured by bench/gpu_gather_wg.cu built with
 * -DWK_BIG=1 against production (the candidate at every size). Included after src/kernels/cuda/gather_batched.cu
 * (its decode, x layout, item order and epilogue arithmetic are reused). Measured in session 40 (H100): bitwise equal to production (gpu_gather_wg's
 * checks; test_ops_gpu's tiled-layout case and test_gather_qmm_gpu PASS with it as production's 128-row path, route
 * switch hashes equal), compute-sanitizer synccheck clean - and NOT faster: up + down 2,048 tokens 0.90 / 1.05 ms
 * (uniform / skew 0.5) against production's 0.945 / 0.932, 4,096 1.96 / 1.85 against 1.67 / 1.67, 8,192 3.16 / 3.15
 * against 3.11 / 3.16, 16,384 5.99 / 5.88 against 6.02 / 6.03 (dequant_gemm 5.36 / 5.57); as production's path from
 * 80 rows an expert, prefill 2,048 44,377 against 50,722 tok/s. Nsight Compute (8,192 tokens, one call): the
 * producer is the limit - 0.27 instructions a cycle a scheduler, barrier stalls 4.85 an instruction (the consumers
 * waiting for FULL), long scoreboard 1.66 (the producer's loads, one step ahead only), shared-memory pipe 41%.
 * What would help (docs/GPU-NOTES.md "Session 40"): the producer's loads further ahead (its registers are full: 168)
 * or off its critical path - x by cp.async / TMA, which the x permutation prevents today. BG_XC=1 (written after
 * the measurement above): each consumer warpgroup stages its own 64 x rows for step s + 1 in two halves of 4 pieces
 * while its step-s wgmma run, so the producer only decodes weights (168 registers, no spills, no wgmma
 * serialisation). Measured in session 41 (H100): bitwise equal, synccheck clean, and no faster than BG_XC=0 (2,048
 * tokens 0.94 / 1.07 ms, 8,192 3.05-3.19, 16,384 5.59-5.85). Then BG_LEAD=2 (the producer's weight loads two steps
 * ahead) changed nothing and BG_KO=1 (a knock-out: no decode at all, wrong results) was no faster: Nsight Compute puts
 * the producer idle at its EMPTY barrier and the consumers waiting on their own x loads (BG_XC=1 loads and stores the
 * second x half back to back). BG_XC=2 (a knock-out, timing only: x by 16-byte cp.async a step ahead, the K
 * permutation skipped) is the bound of an x path by cp.async / TMA - what a natural-pair tiled layout would allow
 * (docs/GPU-NOTES.md "Session 41"). Measured in session 42 (H100): 0.850 ms against production's 0.95 at 2,048 tokens
 * with uniform routing, within -4% .. +3% of production skewed and at 4,096-16,384 tokens, and 3-5% slower still with
 * the decode knocked out as well - so the natural-pair layout was not built and this kernel is closed as a lead (kept
 * here as the measured record). BG_X3 (three x buffers, x two steps ahead: 224 KB) tests whether the x copies' one
 * step of lead was what remained. Measured in session 43 (H100): 0.79 ms against production's 0.95 at 2,048 tokens
 * uniform, 0.90 against 0.97 skewed, 3-7% less at 4,096 and 7-8% at 8,192 (2.93 against 3.10-3.16); Nsight Compute
 * at 8,192: L2 at 80%, and the x copies (16-byte pieces at a 64-byte stride) fetch every sector twice - 38% of all
 * global sectors. BG_XCO coalesces them (timing only as well): prepared, not run. */
#ifndef FP4MOE_BENCH_GATHER_BIG_CUH
#define FP4MOE_BENCH_GATHER_BIG_CUH

#include "gather_candidate.cuh"

/* ---- the kernel ---------------------------------------------------------------------------------------------
 * Why: the 64-row wgmma kernel (RS form: weights decoded into the A registers, 64 features a warpgroup, the rows as
 * N) decodes every weight tile once per 64 rows and runs at ~300 TFLOP/s at 2k-8k tokens, where a bf16 grouped
 * GEMM of CUTLASS's form (128 x 256 tiles, the operands in shared memory) runs at ~500. Here the roles are that
 * GEMM's: item = (expert, BG_NF = 256 features, 128 rows) in bt_item_of's order (an N-tile's row tiles adjacent: its
 * weights from L2 after the first); block = 3 warpgroups (384 threads, one block an SM), static order (block b: items
 * b, b + grid, ...: the producer runs ahead across items);
 * - warpgroup 0, the producer, each 128-K step: the x tile (128 rows, through registers, in gw_xstage's layout and K
 *   permutation) and the BG_NF x 128 weight tile, decoded as gw_step decodes (bt_dec4, one packed multiply by the
 *   block scale) and stored by stmatrix as K-major core matrices - each k16 step holding the K indices of production's
 *   mma / wgmma RS k16 step, so the products are the other kernels' (bitwise, checked); its global loads a step
 *   ahead in registers;
 * - warpgroups 1 and 2, the consumers, rows 0-63 / 64-127: 8 wgmma m64n256k16 SS a step (A = their x rows, B = the
 *   decoded weights, shared), fp32 accumulators from 0 (128 a thread); epilogue = gw_store's arithmetic (cu_out);
 * - two buffers (x + weights) a step; named barriers FULL b (the producer arrives after its stores and the proxy
 *   fence, the consumers wait) and EMPTY b (the consumers arrive once their wgmma reading b are done, the producer
 *   waits), so the producer decodes step s + 1 while the tensor cores run step s, and a consumer's epilogue overlaps
 *   the producer's next item. A consumer warpgroup without rows in an item runs its products anyway (nobody stores
 *   them): a wgmma under a branch made ptxas serialise or wait (C7518 / C7517), as did a warpgroup index the compiler
 *   could not see was warp-uniform (hence the shuffle, as CUTLASS's canonical_warp_group_idx).
 * ptxas: 168 registers, no spills; a producer step ~605 instructions a thread, a consumer step 8 HGMMA.64x256x16.
 * Two producer warpgroups (512 threads, setmaxnreg 88 / 168) did not compile: ptxas allocates the whole kernel to the
 * launch bound's 128 registers ("Insufficient registers (128) ... 154 or higher" at the 64 x 256 HGMMA). */
#ifndef BG_NF
#define BG_NF 256 /* features an item: a multiple of 64 (a producer warp decodes BG_NF / 64 16-feature tiles), <= 256 */
#endif
#define BG_MT 128
#ifndef BG_XC
#define BG_XC 0 /* 1: each consumer warpgroup stages its own 64 x rows (after issuing its wgmma), the producer only decodes */
#endif
#ifndef BG_LEAD
#define BG_LEAD 1 /* steps the producer's weight loads run ahead: 1, or 2 (BG_XC=1 only: its x registers free) */
#endif
#ifndef BG_X3
#define BG_X3 0 /* 1 (BG_XC=2 only): three x buffers, each consumer's x copies issued two steps ahead (224 KB) */
#endif
#ifndef BG_XCO
#define BG_XCO 0 /* 1 (BG_XC=2 only, timing only): x copies coalesced (a warp: 2 rows x 256 contiguous bytes) into
                  * conflict-free shared slots - the x path's best case, with no 2x sector over-fetch (session 43) */
#endif
#ifndef BG_XP
#define BG_XP 0 /* 1 (BG_XC=2): x read from a copy in the consumers' shared-memory order (bg_xp_permute: a row's 16
                 * 16-byte pieces of a 128-K step are its core-matrix rows, k16 step p / 2, matrix p % 2; K padded to
                 * a multiple of 128 with zeros), copied coalesced (a warp: 8 rows x 64 bytes) into conflict-free
                 * slots - BG_XCO's copies with production's products (bitwise, checked); session 44 */
#endif
#ifndef BG_XPS
#define BG_XPS 0 /* 1 (BG_XP): the permuted output stored as whole 16-byte pieces - lanes t and t ^ 2 of a row swap the
                  * component the other keeps (8 shuffles a row and 128 features), then each lane stores 4 pieces a
                  * row and 128 features (64 contiguous bytes a row an instruction) - instead of two scattered 2-byte
                  * stores a feature pair; features past N stored as zeros (the next projection's K padding) */
#endif
#ifndef BG_YNAT
#define BG_YNAT 0 /* 1 (BG_XP, timing only): the output in natural order even where a permuted one is asked for (its
                   * row stride kept) - what the permuted epilogue's scattered 2-byte stores cost */
#endif
#ifndef BG_KO
#define BG_KO 0 /* 1: knock-out (timing only, wrong results): the producer stores the raw code words, no decode */
#endif
#if BG_KO
#define BG_MUL(p, s) ((void)(s), (p))
#else
#define BG_MUL(p, s) cu_mul_bf16x2(p, s)
#endif
static_assert(BG_LEAD == 1 || (BG_LEAD == 2 && BG_XC), "BG_LEAD 2 needs BG_XC");
static_assert(!BG_X3 || BG_XC == 2, "BG_X3 needs BG_XC=2");
static_assert(!BG_XCO || BG_XC == 2, "BG_XCO needs BG_XC=2");
static_assert(!BG_XP || (BG_XC == 2 && !BG_XCO && !BG_KO), "BG_XP needs BG_XC=2 (and neither knock-out)");

/* The permuted copy of BG_XP: element j (0 .. 127) of a 128-K step holds natural K offset bg_xp_src(j) - j = 8 p +
 * 2 t + e, piece p = 2 ks + c (k16 step ks = 2 q + h, core matrix c): x[32 t + 8 q + 2 h + c + 4 e], the value that
 * gw_xput4 puts at byte 4 t + 2 e of that core-matrix row (lane t's pair (x_i, x_i+4)); bg_xp_dst is its inverse. */
__host__ __device__ constexpr int bg_xp_src(int j) {
    return 32 * ((j >> 1) & 3) + 8 * (j >> 5) + 2 * ((j >> 4) & 1) + ((j >> 3) & 1) + 4 * (j & 1);
}
__host__ __device__ constexpr int bg_xp_dst(int k) {
    return 8 * (2 * (2 * ((k >> 3) & 3) + ((k >> 1) & 1)) + (k & 1)) + 2 * (k >> 5) + ((k >> 2) & 1);
}
static_assert(bg_xp_dst(bg_xp_src(77)) == 77 && bg_xp_src(bg_xp_dst(77)) == 77, "inverse");
#define BG_THREADS 384
#define BG_XKS (BG_MT * 32)    /* bytes of one k16 step of the x tile: 128 rows x 16 K bf16 */
#define BG_XBYTES (8 * BG_XKS) /* one 128-K step of x */
#define BG_WKS (BG_NF * 32)    /* bytes of one k16 step of the decoded weights */
#define BG_WBYTES (8 * BG_WKS)
#define BG_XNB (BG_X3 ? 3 : 2) /* x buffers */
#define BG_SMEM (BG_XNB * BG_XBYTES + 2 * BG_WBYTES)
#define BG_TPW (BG_NF / 64) /* 16-feature tiles a producer warp */
static_assert(BG_NF % 64 == 0 && BG_NF <= 256, "BG_NF");

/* named barriers (0 is __syncthreads): FULL b = 1 + b, EMPTY b = 3 + b; all BG_THREADS threads take part in each */
__device__ __forceinline__ void bg_sync(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(BG_THREADS) : "memory"); }
__device__ __forceinline__ void bg_arrive(int id) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(BG_THREADS) : "memory"); }

/* The producer's state for one item: x pieces (rows 8 i + nlo, K offset 32 t + 8 q of the step; thread (t, nlo, q) =
 * (tid % 4, tid / 4 % 8, tid / 32)) and the code pieces of its warp's 16-feature tiles, loaded a step ahead. */
struct bg_producer {
#if !BG_XC
    uint4 xv[16];
    uint32_t xr[16]; /* source rows (gq_x_row); ~0u: past the item's rows, not staged */
#endif
    uint4 c0[BG_TPW], c1[BG_TPW];
    uint32_t sw[BG_TPW];
#if BG_LEAD == 2
    uint4 n0[BG_TPW], n1[BG_TPW]; /* step s + 1's pieces (load<true>), moved into c0 / c1 / sw by advance() */
    uint32_t nsw[BG_TPW];
    __device__ __forceinline__ void advance() {
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            c0[j] = n0[j];
            c1[j] = n1[j];
            sw[j] = nsw[j];
        }
    }
#endif
    const uint8_t *piece[BG_TPW]; /* + lane * 16 */
    int kc;

    __device__ __forceinline__ void init(const gq_args &a, const bt_item &it) {
        const int tid = threadIdx.x, lane = tid & 31, t = tid & 3, nlo = (tid >> 2) & 7, q = tid >> 5;
        kc = 32 * t + 8 * q;
#if !BG_XC
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const int r = 8 * i + nlo;
            xr[i] = r < it.rows ? (uint32_t)gq_x_row(a.xrow, a.xdiv, it.row0 + r) : ~0u;
        }
#else
        (void)nlo;
#endif
        const int64_t we = cu_weight_expert(it.e, a.E);
        const int last_tile = (a.N - 1) >> 4;
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            const int T = min(it.ntile * (BG_NF / 16) + q * BG_TPW + j, last_tile);
            piece[j] = gq_tiled_piece(a.codes, we, T, 0, a.N, a.K) + lane * 16;
        }
    }
    template <bool NEXT = false> __device__ __forceinline__ void load(const gq_args &a, int s) {
        const int k0 = s * BT_KSTEP, lane = threadIdx.x & 31;
        const bool kok = k0 + kc < a.K;
#if !BG_XC
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            xv[i] = make_uint4(0, 0, 0, 0); /* K past the end: zeros */
            if (xr[i] != ~0u && kok) xv[i] = __ldg(reinterpret_cast<const uint4 *>(x + (int64_t)xr[i] * a.K + k0 + kc));
        }
#else
        (void)kok;
#endif
        const int64_t o = (int64_t)s * GQ_TILE_PIECE;
#pragma unroll
        for (int j = 0; j < BG_TPW; j++) {
            const uint4 v0 = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o));
            const uint4 v1 = __ldg(reinterpret_cast<const uint4 *>(piece[j] + o + 512));
            const uint32_t v2 = __ldg(reinterpret_cast<const uint32_t *>(piece[j] - lane * 12 + o + 1024)); /* piece + 1024 + 4 lane */
#if BG_LEAD == 2
            if (NEXT) {
                n0[j] = v0;
                n1[j] = v1;
                nsw[j] = v2;
                continue;
            }
#endif
            c0[j] = v0;
            c1[j] = v1;
            sw[j] = v2;
        }
    }
    /* the loaded step into the buffers xs (x, gw_xoff's layout) and ws (weights: feature n of k16 step ks at
     * ks BG_WKS + (n / 8) 256 + (n % 8) 16, K-direction core matrix + 128) */
    __device__ __forceinline__ void store(uint8_t *xs, uint8_t *ws) const {
        const int tid = threadIdx.x, lane = tid & 31, t = tid & 3, nlo = (tid >> 2) & 7, q = tid >> 5;
#if !BG_XC
        uint8_t *b = xs + gw_xoff(BG_XKS, 2 * q, 0, nlo) + 4 * t;
#pragma unroll
        for (int i = 0; i < 16; i++) { /* gw_xput's stores; rows 8 i + nlo: i core-matrix row groups (256 bytes) on */
            if (xr[i] != ~0u) {
                const uint4 w = xv[i];
                gw_xput4<BG_XKS>(b + 256 * i, w);
            }
        }
#else
        (void)xs; (void)t; (void)nlo;
#endif
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
#if BG_KO /* knock-out: the raw words, no decode and no scale (wrong results) */
                for (int i = 0; i < 4; i++) { pa[i] = w0[qq]; pb[i] = w1[qq]; }
                const uint32_t s0 = 0, s1 = 0;
#else
                bt_dec4<__nv_bfloat16>::pairs_tl(w0[qq], pa);
                bt_dec4<__nv_bfloat16>::pairs_tl(w1[qq], pb);
                const uint32_t s0 = sa[qq >> 1], s1 = sb[qq >> 1];
#endif
                cand_stmatrix4(base + (2 * qq) * BG_WKS, BG_MUL(pa[0], s0), BG_MUL(pb[0], s1),
                             BG_MUL(pa[1], s0), BG_MUL(pb[1], s1));
                cand_stmatrix4(base + (2 * qq + 1) * BG_WKS, BG_MUL(pa[2], s0), BG_MUL(pb[2], s1),
                             BG_MUL(pa[3], s0), BG_MUL(pb[3], s1));
            }
        }
    }
};

/* BG_XC: a consumer warpgroup's x staging - its 64 rows (64 r + 8 i + nlo, i < 8) at K offset 32 t + 8 q of a step,
 * in two halves of 4 pieces (registers: the accumulators take 128 of the 168) */
struct bg_xc {
    uint32_t xr[8];
    uint4 xv[4];
    int kc;
    uint32_t off; /* byte offset of piece 0 in a buffer */
    int xstride; /* elements between x rows: K, or (BG_XP) the permuted copy's padded K */
    __device__ __forceinline__ void init(const gq_args &a, const bt_item &it, int r, int xs_stride) {
        const int tid = threadIdx.x & 127, t = tid & 3, nlo = (tid >> 2) & 7, q = tid >> 5;
        kc = 32 * t + 8 * q;
        off = gw_xoff(BG_XKS, 2 * q, 0, nlo + 64 * r) + 4 * t;
        xstride = xs_stride;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int row = 64 * r + 8 * i + (BG_XP ? tid & 7 : BG_XCO ? tid >> 4 : nlo);
            xr[i] = row < it.rows ? (uint32_t)gq_x_row(a.xrow, a.xdiv, it.row0 + row) : ~0u;
        }
        if (BG_XCO) kc = 8 * (tid & 15);
        if (BG_XP) kc = 8 * (4 * (tid >> 5) + ((tid >> 3) & 3)); /* piece 4 w + lane / 8 of each of 8 rows */
    }
    template <int H> __device__ __forceinline__ void load(const gq_args &a, int s) {
        const int k0 = s * BT_KSTEP;
        const bool kok = k0 + kc < a.K;
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            xv[i] = make_uint4(0, 0, 0, 0);
            if (xr[4 * H + i] != ~0u && kok)
                xv[i] = __ldg(reinterpret_cast<const uint4 *>(x + (int64_t)xr[4 * H + i] * a.K + k0 + kc));
        }
    }
    template <int H> __device__ __forceinline__ void store(uint8_t *xs) const {
        uint8_t *b = xs + off;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int ii = 4 * H + i;
            if (xr[ii] != ~0u) {
                const uint4 w = xv[i];
                gw_xput4<BG_XKS>(b + 256 * ii, w);
            }
        }
    }
    /* BG_XC=2 (knock-out, timing only: x NOT in the K permutation, results wrong): the warpgroup's x rows of step s
     * by 16-byte cp.async into its half of the buffer, no registers - what x by cp.async / TMA would cost once a
     * natural-pair layout (docs/GPU-NOTES.md "Session 41") made it possible */
    __device__ __forceinline__ void async_stage(const gq_args &a, int s, uint8_t *xs, int r) const {
        const int k0 = s * BT_KSTEP, tid = threadIdx.x & 127;
        const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
        /* piece j = 8 tid + i to the bytes this warpgroup's wgmma read: k16 step j / 128, its rows' 2 KB, 16 (j % 128) */
        const uint32_t d = bt_smem_addr(xs) + r * 2048;
#if BG_XP /* piece p of row 64 r + 8 i + (tid % 8): its core-matrix row (k16 step p / 2, matrix p % 2); 8 lanes a
           * wavefront on 8 rows' 16-byte bank groups; K padded in the copy (no K test) */
        const int p = kc >> 3;
        const uint32_t dp = d + (p >> 1) * BG_XKS + (p & 1) * 128 + (tid & 7) * 16;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (xr[i] != ~0u) bt_cp16(dp + 256 * i, x + (int64_t)xr[i] * xstride + k0 + kc, 16);
#else
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int j = BG_XCO ? 128 * i + tid : 8 * tid + i; /* BG_XCO: lanes in consecutive 16-byte slots */
            if (xr[i] != ~0u && k0 + kc < a.K)
                bt_cp16(d + (j >> 7) * BG_XKS + 16 * (j & 127), x + (int64_t)xr[i] * a.K + k0 + kc, 16);
        }
#endif
        bt_cp_commit();
    }
    /* a whole step, then the proxy fence and the warpgroup's barrier (id 5 + r) */
    __device__ __forceinline__ void stage(const gq_args &a, int s, uint8_t *xs, int r) {
        load<0>(a, s);
        store<0>(xs);
        load<1>(a, s);
        store<1>(xs);
        wg_fence_async_smem();
        asm volatile("bar.sync %0, 128;" ::"r"(5 + r) : "memory");
    }
};

__global__ void __launch_bounds__(BG_THREADS, 1)
gq_batched_big_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int xstride,
                      int ystride) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t *xbuf = smem, *wbuf = smem + BG_XNB * BG_XBYTES;
    const int wg = __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 7), 0); /* warp-uniform for the compiler */
    const int NT = (a.N + BG_NF - 1) / BG_NF, nsteps = (a.K + BT_KSTEP - 1) / BT_KSTEP;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    int64_t gs = 0; /* the block's steps so far: buffer gs & 1 */
    if (wg == 0) { /* the producer */
        bg_producer p;
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<BG_MT>(item, a.E, NT, starts, tile_off);
            p.init(a, it);
            p.load(a, 0);
#if BG_LEAD == 2
            if (nsteps > 1) p.load<true>(a, 1);
#endif
            for (int s = 0; s < nsteps; s++, gs++) {
                const int b = (int)(gs & 1);
                if (gs >= 2) bg_sync(3 + b); /* the consumers are done with step gs - 2's buffer */
                p.store(xbuf + b * BG_XBYTES, wbuf + b * BG_WBYTES);
                wg_fence_async_smem();
                bg_arrive(1 + b);
#if BG_LEAD == 2
                p.advance();
                if (s + 2 < nsteps) p.load<true>(a, s + 2);
#else
                if (s + 1 < nsteps) p.load(a, s + 1);
#endif
            }
        }
        /* the consumers' last two releases (no arrivals left pending on a barrier) */
        if (gs >= 2) bg_sync(3 + (int)((gs - 2) & 1));
        if (gs >= 1) bg_sync(3 + (int)((gs - 1) & 1));
    } else { /* the consumers: rows 64 r .. 64 r + 63 of an item */
        const int r = wg - 1, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, w = (threadIdx.x >> 5) & 3;
        const uint32_t xrows = r * 2048; /* 64 rows: 8 core-matrix row groups of 256 bytes */
#if BG_X3
        int xb3 = 0; /* the x buffer of step gs: gs % 3 */
#endif
        for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
            const bt_item it = bt_item_of<BG_MT>(item, a.E, NT, starts, tile_off);
            const int mine = it.rows - 64 * r;
            float acc[BG_NF / 2];
#pragma unroll
            for (int i = 0; i < BG_NF / 2; i++) acc[i] = 0.0f;
#if BG_X3 /* steps 0 and 1 (an empty group if there is no step 1); x buffer xb3 holds step gs's x */
            bg_xc xc;
            xc.init(a, it, r, xstride);
            xc.async_stage(a, 0, xbuf + xb3 * BG_XBYTES, r);
            if (nsteps > 1) xc.async_stage(a, 1, xbuf + (xb3 == 2 ? 0 : xb3 + 1) * BG_XBYTES, r);
            else bt_cp_commit();
#elif BG_XC == 2
            bg_xc xc;
            xc.init(a, it, r, xstride);
            xc.async_stage(a, 0, xbuf + (gs & 1) * BG_XBYTES, r);
#elif BG_XC
            bg_xc xc;
            xc.init(a, it, r, xstride);
            xc.stage(a, 0, xbuf + (gs & 1) * BG_XBYTES, r); /* free: the last item's products are done */
#endif
            for (int s = 0; s < nsteps; s++, gs++) {
                const int b = (int)(gs & 1);
#if BG_X3 /* this step's x copies (issued two steps ago) landed; step s + 1's may be in flight */
                bt_cp_wait<1>();
                wg_fence_async_smem();
                asm volatile("bar.sync %0, 128;" ::"r"(5 + r) : "memory");
#elif BG_XC == 2 /* this step's x copies (issued a step ago) landed, for the whole warpgroup and the async proxy */
                bt_cp_wait<0>();
                wg_fence_async_smem();
                asm volatile("bar.sync %0, 128;" ::"r"(5 + r) : "memory");
#endif
                bg_sync(1 + b);
#if BG_X3
                const uint32_t xa = bt_smem_addr(xbuf + xb3 * BG_XBYTES) + xrows;
#else
                const uint32_t xa = bt_smem_addr(xbuf + b * BG_XBYTES) + xrows;
#endif
                const uint32_t wa = bt_smem_addr(wbuf + b * BG_WBYTES);
                wg_fence();
#pragma unroll
                for (int ks = 0; ks < 8; ks++)
                    wg_ss<BG_NF>::mma(acc, wg_desc(xa + ks * BG_XKS, 128, 256), wg_desc(wa + ks * BG_WKS, 128, 256), 1);
                wg_commit();
#if BG_XC == 1
                if (s + 1 < nsteps) xc.load<0>(a, s + 1); /* under this step's products */
#endif
                wg_wait<1>(); /* step s - 1's products done: its buffer is free */
                if (s > 0) bg_arrive(3 + (b ^ 1));
#if BG_X3 /* step s - 1's products are done: its x buffer takes step s + 2 */
                {
                    const int xf = xb3 == 0 ? 2 : xb3 - 1;
                    if (s + 2 < nsteps) xc.async_stage(a, s + 2, xbuf + xf * BG_XBYTES, r);
                    else bt_cp_commit();
                    xb3 = xb3 == 2 ? 0 : xb3 + 1;
                }
#elif BG_XC == 2
                if (s + 1 < nsteps) xc.async_stage(a, s + 1, xbuf + (b ^ 1) * BG_XBYTES, r);
#elif BG_XC
                if (s + 1 < nsteps) { /* this warpgroup's x rows of step s + 1 into the other buffer */
                    uint8_t *xs = xbuf + (b ^ 1) * BG_XBYTES;
                    xc.store<0>(xs);
                    xc.load<1>(a, s + 1);
                    xc.store<1>(xs);
                    wg_fence_async_smem();
                    asm volatile("bar.sync %0, 128;" ::"r"(5 + r) : "memory");
                }
#endif
            }
            wg_wait<0>();
            bg_arrive(3 + (int)((gs - 1) & 1));
#pragma unroll
            for (int i = 0; i < BG_NF / 2; i++) asm volatile("" : "+f"(acc[i])::"memory"); /* read after the wait */
            if (mine > 0) { /* acc[4 i + h]: row 16 w + g + 8 (h / 2), feature 8 i + 2 t + h % 2 */
                __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
                const float mult = cu_expert_gs(a.gs, it.e) * bt_ops<__nv_bfloat16>::kUndo;
                const int nb = it.ntile * BG_NF + 2 * t;
#if BG_XPS
                if (ystride != a.N && !BG_YNAT) { /* production's permuted store (src/kernels/cuda/gather_big.cuh) */
                    static_assert(BG_NF == GB_NF, "BG_XPS: production's 256-feature items");
                    gb_store_permuted(acc, y, it.row0 + 64 * r, ystride, mine, it.ntile * BG_NF, a.N, mult, a.relu2);
                } else
#endif
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int row = 16 * w + g + 8 * hh;
                    if (row < mine) {
                        __nv_bfloat16 *yr = y + (it.row0 + 64 * r + row) * ystride;
#pragma unroll
                        for (int i = 0; i < BG_NF / 8; i++) {
                            const int f = nb + 8 * i; /* N is even: f and f + 1 both in range or both not */
                            if (f < a.N) {
                                __nv_bfloat162 v;
                                v.x = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh] * mult, a.relu2);
                                v.y = cu_out<__nv_bfloat16>(acc[4 * i + 2 * hh + 1] * mult, a.relu2);
                                if (ystride == a.N || BG_YNAT) {
                                    *reinterpret_cast<__nv_bfloat162 *>(yr + f) = v;
                                } else { /* y in the permuted copy's order (the next projection's x) */
                                    __nv_bfloat16 *yb = yr + (f & ~127);
                                    yb[bg_xp_dst(f & 127)] = v.x;
                                    yb[bg_xp_dst((f + 1) & 127)] = v.y;
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, ystride); /* (permuted: zeros all the same) */
}

/* the kernel on x of row stride xstride (BG_XP: a permuted copy) into y of row stride ystride (!= N: permuted) */
static int bg_launch_s(const gq_args *a, int xstride, int ystride, cudaStream_t st) {
    return bench_candidate_launch("gather big", gq_batched_big_kernel, BG_MT, BG_NF, BG_THREADS, BG_SMEM, a, st,
                                  [&](unsigned grid, int *starts, int *tile_off) {
                                      cu_launch(gq_batched_big_kernel, grid, BG_THREADS, BG_SMEM, st, *a, starts,
                                                tile_off, xstride, ystride);
                                  });
}

/* K rounded up to whole 128-K steps: the permuted copy's row stride */
__host__ __device__ inline int bg_xp_pad(int K) { return (K + 127) / 128 * 128; }

/* rows x K bf16 (natural) -> rows x bg_xp_pad(K) in the permuted order, zeros past K (inverse = 1: back, K columns) */
__global__ void bg_xp_permute_kernel(const uint16_t *in, uint16_t *out, int64_t rows, int K, int inverse) {
    const int Kp = bg_xp_pad(K);
    const int64_t n = rows * Kp;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t row = i / Kp;
        const int j = (int)(i % Kp), k = (j & ~127) + bg_xp_src(j & 127); /* permuted j holds natural k */
        if (!inverse) out[i] = k < K ? in[row * K + k] : (uint16_t)0;
        else if (k < K) out[row * K + k] = in[i];
    }
}
static void bg_xp_permute(const void *in, void *out, int64_t rows, int K, int inverse, cudaStream_t st) {
    const int64_t n = rows * bg_xp_pad(K);
    bg_xp_permute_kernel<<<(unsigned)((n + 255) / 256 < 8192 ? (n + 255) / 256 : 8192), 256, 0, st>>>(
        (const uint16_t *)in, (uint16_t *)out, rows, K, inverse);
}

#if BG_XP
static int bg_check_yperm; /* the checks' second form: y permuted into a scratch, then permuted back into a->y */
/* the candidate's launch on natural x and y (the checks): x permuted into a scratch copy first */
static int bg_launch(const gq_args *a, cudaStream_t st) {
    void *xp = NULL, *yp = NULL;
    const int Kp = bg_xp_pad(a->K), Np = bg_xp_pad(a->N);
    int rc = gq_scratch_alloc(&xp, (size_t)a->B * Kp * 2, st);
    if (!rc && bg_check_yperm) {
        rc = gq_scratch_alloc(&yp, (size_t)a->B * Np * 2, st);
        if (!rc) cudaMemsetAsync(yp, 0xff, (size_t)a->B * Np * 2, st); /* poison: every element must be written */
    }
    if (!rc) {
        bg_xp_permute(a->x, xp, a->B, a->K, 0, st);
        gq_args c = *a;
        c.x = xp;
        if (yp) c.y = yp;
        rc = bg_launch_s(&c, Kp, yp ? Np : a->N, st);
        if (!rc && yp) bg_xp_permute(yp, a->y, a->B, a->N, 1, st);
    }
    if (yp) gq_scratch_free(yp, st);
    if (xp) gq_scratch_free(xp, st);
    return rc;
}
#else
/* the candidate's launch: the runs with 128-row tiles, then the kernel (tiled layout, bf16) */
static int bg_launch(const gq_args *a, cudaStream_t st) { return bg_launch_s(a, a->K, a->N, st); }
#endif

#endif
