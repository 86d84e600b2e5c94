/* bench/gather_xperm.cuh: production's 32-features-a-warp gather kernel (gq_batched_w32_kernel) with its x tile
 * staged by cp.async from an x that its producer already wrote in the kernel's permuted order (issue 12; a
 * candidate measured by bench/gpu_gather_wg.cu built with -DWK_XPERM=1 against production). Included after
 * src/kernels/cuda/gather_batched.cu: the weight stream, decode, mma order, item order and epilogue are
 * production's, so the outputs are expected to be bitwise equal. Written in session 28 (no device lent), not
 * yet run.
 *
 * Why (docs/GPU-NOTES.md session 27): production loads each 16-byte x piece into registers (4 a thread a step),
 * permutes it into (x0,x4) (x1,x5) (x2,x6) (x3,x7) pairs with 4 byte permutes, and stores it to shared memory
 * after the step's products; ~6% of the kernel's stall samples are the permutes waiting for those loads and
 * ~6% the step's barrier, and the x path costs ~30 of the ~460 instructions of a 32-row step (LDG, PRMT, STS
 * and their addresses). If x is already in the permuted order in global memory (piece p of a row holds
 * elements 8p + {0,4,1,5,2,6,3,7}), a piece goes to shared memory by one cp.async: no registers, no permutes,
 * and its latency hides behind two steps.
 * Producers (not written yet, only if this wins): the MoE input norm writes a permuted copy for the up
 * projection (the router and the shared expert keep the natural one); the up projection's epilogue writes its
 * output permuted (XP_YPERM: 8 consecutive features of a row are one piece, so the store pattern is the same
 * 16 bytes a row, permuted within), which only the down projection reads.
 *
 * XP_MT = 40: items of up to 40 rows (ntv <= 5). At 512 tokens most runs are 17-40 rows; with 32-row items every
 * run of 33+ rows is split and its weights decoded once more. A simulation of the routing (top-6 of 128, 20 draws):
 * 512 tokens uniform 134 -> 128 items (n8 tiles 439 either way), Zipf 0.5 skew (the synthetic model's gather time,
 * session 19) 155 -> 144 (64-row items: 133); at ~412 instructions a warp-step besides ~16 an n8 tile that is
 * -4% / -6% of the instructions. Costs 8 accumulators more and a fifth x piece a thread.
 * Pipeline (XP_XBUF = 3): one cp.async group a step, G(s) = {x of step s + 2 into x buffer (s + 2) % 3, weights of
 * step s + 2 into ring slot (s + 2) % 3}; the prologue commits P0 = {x 0, weights 0} and P1 = {x 1, weights 1}.
 * Step s: wait_group 1 (all but the newest group: P0 / P1 / G(s - 2) hold step s's x and weights), ONE block
 * barrier (every thread's x copies of step s visible; every warp done with step s - 1, whose x buffer (s + 2) % 3
 * and ring slot the next group refills), issue G(s), then the step's decode and products (production's bw_step).
 * Shared memory: 3 x buffers (27,648 bytes) + a 3-slot ring (30,720) = 58,368 bytes, about production's 59,392
 * (2 x buffers, 4 slots): 3 blocks an SM. XP_XBUF = 2: x one step ahead (G(s) = {x s + 1 into buffer (s + 1) % 2,
 * weights s + 2}, P1 without x, wait_group 0), 49,152 bytes: with XP_MINB=4 (128 registers), 4 blocks an SM. */
#ifndef FP4MOE_BENCH_GATHER_XPERM_CUH
#define FP4MOE_BENCH_GATHER_XPERM_CUH

#include "gather_candidate.cuh"

#ifndef XP_MINB
#define XP_MINB 3
#endif
#ifndef XP_XBUF
#define XP_XBUF 3 /* x buffers: x copied XP_XBUF - 1 steps ahead (2 or 3) */
#endif
#define XP_XA (XP_XBUF - 1)
#ifndef XP_MT
#define XP_MT 32 /* rows an item: 32 (production's) or 40 (fewer split runs: see the top) */
#endif
static_assert(XP_MT % 8 == 0 && XP_MT * 16 % BW_THREADS == 0 && XP_MT <= 64, "row tile");
#define XP_STAGES 3
#define XP_XBYTES (XP_XBUF * XP_MT * BT_XROW)
#define XP_SMEM (XP_XBYTES + XP_STAGES * BW_THREADS * 2 * BT_SLOT_BYTES)

/* position of element j (0..7) of a piece in the permuted order: (x0,x4) (x1,x5) (x2,x6) (x3,x7) */
__host__ __device__ __forceinline__ int xp_pos(int j) { return (j & 3) * 2 + (j >> 2); }

/* The x tile's copies: thread tid stages the 16-byte pieces c = tid % 16 of rows tid / 16 + 8 i (i < 4) into
 * production's shared-memory places (bt_xstage::dst); rows past the last n8 tile are not staged, rows of a
 * partial n8 tile copy the run's last row, K past the end is zeros (src_bytes 0). */
struct xp_xcopy {
    static constexpr int NP = XP_MT * 16 / BW_THREADS;
    const __nv_bfloat16 *src[NP];
    int kc, dst;
    __device__ __forceinline__ void init(const __nv_bfloat16 *x, int64_t row0, int rows, int rows_pad, int K,
                                         const uint32_t *xrow, int xdiv) {
        const int tid = threadIdx.x, c = tid & 15, grp = c >> 2;
        kc = c * 8;
        dst = (tid >> 4) * BT_XROW + grp * 64 + (grp >> 1) * 16 + (c & 3) * 16;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int r = (tid >> 4) + i * (BW_THREADS / 16);
            const int rr = r < rows ? r : rows - 1;
            src[i] = r < rows_pad ? x + gq_x_row(xrow, xdiv, row0 + rr) * K + kc : nullptr;
        }
    }
    __device__ __forceinline__ void issue(const uint8_t *xs, int k0, int K) const {
        const int nb = k0 + kc < K ? 16 : 0;
        const uint32_t base = bt_smem_addr(xs + dst);
#pragma unroll
        for (int i = 0; i < NP; i++)
            if (src[i]) bt_cp16(base + i * (BW_THREADS / 16) * BT_XROW, nb ? src[i] + k0 : src[i], nb);
    }
};

/* bt_store_tile of production with the output written permuted (YP) or not */
template <bool YP>
__device__ __forceinline__ void xp_store_tile(const float (&acc)[XP_MT / 8][4], __nv_bfloat16 *y, int64_t row0,
                                              int rows, int ntv, int nw, int N, int g, int t, float mult, int relu2) {
    const int na = nw + g, nb = nw + g + 8;
    const int pa = YP ? (na & ~7) | xp_pos(na & 7) : na, pb = YP ? (nb & ~7) | xp_pos(nb & 7) : nb;
#pragma unroll
    for (int nt = 0; nt < XP_MT / 8; nt++) {
        if (nt < ntv) {
            const int r = nt * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (r + h < rows) {
                    __nv_bfloat16 *yr = y + (row0 + r + h) * N;
                    if (na < N) yr[pa] = cu_out<__nv_bfloat16>(acc[nt][h] * mult, relu2);
                    if (nb < N) yr[pb] = cu_out<__nv_bfloat16>(acc[nt][2 + h] * mult, relu2);
                }
            }
        }
    }
}

/* production's bw_step / bw_step_ntv with XP_MT / 8 n8 tiles (the same products in the same order) */
template <int NTV>
__device__ __forceinline__ void xp_step(float (&aa)[XP_MT / 8][4], float (&ab)[XP_MT / 8][4], const uint32_t (&a0)[4],
                                        const uint32_t (&a1)[4], const uint32_t (&b0)[4], const uint32_t (&b1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], const uint32_t (&ta)[2],
                                        const uint32_t (&tb)[2], const uint8_t *xb) {
    typedef bt_ops<__nv_bfloat16> ops;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t pa[4], pb[4], qa[4], qb[4];
        bt_dec4<__nv_bfloat16>::pairs_tl(a0[q], pa);
        bt_dec4<__nv_bfloat16>::pairs_tl(a1[q], pb);
        bt_dec4<__nv_bfloat16>::pairs_tl(b0[q], qa);
        bt_dec4<__nv_bfloat16>::pairs_tl(b1[q], qb);
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1], u0 = ta[q >> 1], u1 = tb[q >> 1];
        const uint32_t ra0 = ops::mul2(pa[0], s0), ra1 = ops::mul2(pa[1], s0), ra2 = ops::mul2(pa[2], s0),
                       ra3 = ops::mul2(pa[3], s0);
        const uint32_t rb0 = ops::mul2(pb[0], s1), rb1 = ops::mul2(pb[1], s1), rb2 = ops::mul2(pb[2], s1),
                       rb3 = ops::mul2(pb[3], s1);
        const uint32_t va0 = ops::mul2(qa[0], u0), va1 = ops::mul2(qa[1], u0), va2 = ops::mul2(qa[2], u0),
                       va3 = ops::mul2(qa[3], u0);
        const uint32_t vb0 = ops::mul2(qb[0], u1), vb1 = ops::mul2(qb[1], u1), vb2 = ops::mul2(qb[2], u1),
                       vb3 = ops::mul2(qb[3], u1);
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            const uint4 xf = *reinterpret_cast<const uint4 *>(xb + nt * 8 * BT_XROW + q * 16);
            ops::mma(aa[nt], ra0, rb0, ra1, rb1, xf.x, xf.y);
            ops::mma(aa[nt], ra2, rb2, ra3, rb3, xf.z, xf.w);
            ops::mma(ab[nt], va0, vb0, va1, vb1, xf.x, xf.y);
            ops::mma(ab[nt], va2, vb2, va3, vb3, xf.z, xf.w);
        }
    }
}
__device__ __forceinline__ void xp_step_ntv(int ntv, float (&aa)[XP_MT / 8][4], float (&ab)[XP_MT / 8][4],
                                            const uint32_t (&a0)[4], const uint32_t (&a1)[4], const uint32_t (&b0)[4],
                                            const uint32_t (&b1)[4], const uint32_t (&sa)[2], const uint32_t (&sb)[2],
                                            const uint32_t (&ta)[2], const uint32_t (&tb)[2], const uint8_t *xb) {
#define XP_CASE(n) case n: if constexpr (n <= XP_MT / 8) xp_step<n>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break
    switch (ntv) {
    XP_CASE(1); XP_CASE(2); XP_CASE(3); XP_CASE(4); XP_CASE(5); XP_CASE(6); XP_CASE(7);
    default: xp_step<XP_MT / 8>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    }
#undef XP_CASE
}

/* x: permuted pieces (see the top); y: permuted when YP. Otherwise gq_batched_w32_kernel's contract. */
template <bool YP>
__global__ void __launch_bounds__(BW_THREADS, XP_MINB)
gq_w32_xperm_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    __shared__ int next_item[2];
    bt_sched sch = {ctr, 0};
    extern __shared__ __align__(16) uint8_t smem[];
    const auto ring = bt_slot_soa<XP_STAGES * 2 * BW_THREADS>::at(smem + XP_XBYTES, threadIdx.x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int N = a.N, K = a.K, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int NT = (N + BW_NTILE - 1) / BW_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    const int last_tile = (N - 1) >> 4;

    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item, total);
        const bt_item it = bt_item_of<XP_MT>(item, a.E, NT, starts, tile_off);
        const int e = it.e, rows = it.rows;
        const int64_t row0 = it.row0;
        const int ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
        const int nw = it.ntile * BW_NTILE + warp * 32;
        const int64_t we = cu_weight_expert(e, a.E);
        const uint8_t *pa = gq_tiled_piece(a.codes, we, min(nw >> 4, last_tile), 0, N, K);
        const uint8_t *pb = gq_tiled_piece(a.codes, we, min((nw >> 4) + 1, last_tile), 0, N, K);
        bt_tstream wa = bt_tstream::of(pa, lane), wb = bt_tstream::of(pb, lane);

        float aa[XP_MT / 8][4], ab[XP_MT / 8][4];
#pragma unroll
        for (int i = 0; i < XP_MT / 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) aa[i][j] = ab[i][j] = 0.0f;

        xp_xcopy xc;
        xc.init(x, row0, rows, rows_pad, K, a.xrow, a.xdiv);
#pragma unroll
        for (int p = 0; p < 2; p++) { /* P0, P1 */
            if (p < XP_XA && p < nsteps) xc.issue(smem + p * XP_MT * BT_XROW, p * BT_KSTEP, K);
            wa.issue_next(ring + p * 2 * BW_THREADS, p, nsteps);
            wb.issue_next(ring + p * 2 * BW_THREADS + BW_THREADS, p, nsteps);
            bt_cp_commit();
        }
        for (int s = 0; s < nsteps; s++) {
            uint32_t a0[4], a1[4], b0[4], b1[4], sa[2], sb[2], ta[2], tb[2], swa0, swa1, swb0, swb1;
            bt_cp_wait<XP_XA - 1>(); /* this thread's copies of step s (x and weights) have landed */
            __syncthreads(); /* everyone's: x of step s visible; step s - 1 done by every warp */
            const int nxt = s + 2, sl_n = nxt % XP_STAGES, nx = s + XP_XA;
            if (nx < nsteps) xc.issue(smem + (nx % XP_XBUF) * XP_MT * BT_XROW, nx * BT_KSTEP, K);
            wa.issue_next(ring + sl_n * 2 * BW_THREADS, nxt, nsteps);
            wb.issue_next(ring + sl_n * 2 * BW_THREADS + BW_THREADS, nxt, nsteps);
            bt_cp_commit();
            const auto sl = ring + (s % XP_STAGES) * 2 * BW_THREADS;
            wa.read(sl, a0, a1, swa0, swa1);
            wb.read(sl + BW_THREADS, b0, b1, swb0, swb1);
            bt_scales4<__nv_bfloat16, true>(swa0, swa1, sa, sb);
            bt_scales4<__nv_bfloat16, true>(swb0, swb1, ta, tb);
            xp_step_ntv(ntv, aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, smem + (s % XP_XBUF) * XP_MT * BT_XROW + xoff);
        }
        __syncthreads(); /* every warp done with the item's last x buffers before the next item's prologue */
        const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
        xp_store_tile<YP>(aa, y, row0, rows, ntv, nw, N, g, t, mult, a.relu2);
        xp_store_tile<YP>(ab, y, row0, rows, ntv, nw + 16, N, g, t, mult, a.relu2);
    }
    bt_zero_tail(y, starts, a.E, a.B, N);
}

/* The candidate's launch: bf16 x (permuted) and y (permuted when yperm), tiled weights, E > 1, K % 64 == 0,
 * N % 8 == 0 when yperm. */
static int xp_launch(const gq_args *a, int yperm, cudaStream_t st) {
    if (yperm && a->N % 8) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "xperm: N %% 8 == 0 for a permuted y");
    if (yperm)
        return bench_candidate_launch("xperm", gq_w32_xperm_kernel<true>, XP_MT, BW_NTILE, BW_THREADS, XP_SMEM, a, st,
                                      [&](unsigned grid, const int *starts, const int *tile_off) {
                                          cu_launch(gq_w32_xperm_kernel<true>, grid, BW_THREADS, XP_SMEM, st, *a,
                                                    starts, tile_off, sched_counter(a, tile_off));
                                      });
    return bench_candidate_launch("xperm", gq_w32_xperm_kernel<false>, XP_MT, BW_NTILE, BW_THREADS, XP_SMEM, a, st,
                                  [&](unsigned grid, const int *starts, const int *tile_off) {
                                      cu_launch(gq_w32_xperm_kernel<false>, grid, BW_THREADS, XP_SMEM, st, *a, starts,
                                                tile_off, sched_counter(a, tile_off));
                                  });
}

/* rows x n bf16 (n % 8 == 0): out = in with each 8-element piece permuted (inverse: back to the natural order) */
__global__ void xp_permute_kernel(const uint16_t *in, uint16_t *out, int64_t pieces, int inverse) {
    for (int64_t p = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; p < pieces; p += (int64_t)gridDim.x * blockDim.x)
        for (int j = 0; j < 8; j++) {
            if (inverse) out[p * 8 + j] = in[p * 8 + xp_pos(j)];
            else out[p * 8 + xp_pos(j)] = in[p * 8 + j];
        }
}
static void xp_permute(const void *in, void *out, int64_t rows, int n, int inverse, cudaStream_t st) {
    const int64_t pieces = rows * (n / 8);
    xp_permute_kernel<<<(unsigned)((pieces + 255) / 256 < 4096 ? (pieces + 255) / 256 : 4096), 256, 0, st>>>(
        (const uint16_t *)in, (uint16_t *)out, pieces, inverse);
}

#endif
