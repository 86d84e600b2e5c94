/* bench/gather_ss.cuh: the expert-batched gather_qmm kernel with its decoded weights in shared memory
 * (wgmma SS form; issue 12, a candidate measured by bench/gpu_gather_wg.cu built with -DWK_SS=1 against
 * production). Included after src/kernels/cuda/gather_batched.cu (its decode, x layout, item order and
 * epilogue are reused). Written in session 21, run in session 22: bitwise equal to production on every
 * check, not faster (2,048 tokens 1.00x, 8,192 1.10x, 512 1.6x): bound by the shared-memory pipe (Nsight
 * Compute: L1 84.6% busy) - the SS form reads A and B from shared memory for every k16 product, as much
 * as the tensor work at N = 64 and more at N = 32 (docs/PERFORMANCE.md session 22). Kept as measured.
 *
 * Why: the production wgmma kernel (RS form) decodes each weight tile once per 64-row tile and waits for
 * a step's products before the next decode (its A registers are the products' operands); at 2,048 tokens
 * (runs of ~96 rows an expert) it decodes most weights twice and its tensor pipe is ~25% busy.
 * Here:
 * - item = (expert, 128 features, up to 128 rows) (bt_item_of<128>, the dynamic order of bt_sched);
 *   block = 4 warpgroups (512 threads, one block an SM): warpgroup (f, r) = (wg & 1, wg >> 1) computes
 *   features 64 f .. 64 f + 63 of rows 64 r .. 64 r + 63 (wgmma m64nNk16, N = its rows rounded up to 8);
 * - the two warpgroups of a feature half f share one decoded A tile in shared memory: warpgroup (f, r)
 *   decodes K half r of each 128-K step (k16 steps 4r .. 4r + 3: code words 2r, 2r + 1 of each thread's
 *   16 bytes, the scale of block 2t + r), with the production decode (bt_dec4, one packed multiply by the
 *   block scale), and stores each k16 step's A fragment (the registers production hands to wgmma RS)
 *   with one stmatrix.x4 into the K-major core-matrix layout (8 rows x 16 bytes; K neighbour +128 = LBO,
 *   next 8 rows +256 = SBO). So every k16 step holds the same K indices as production's and the SS
 *   products are expected to give the same bits;
 * - the x tile (128 rows x 128 K) as production's gw_xstage stores it (the same K permutation), staged
 *   through registers by all 512 threads, loaded one step ahead;
 * - double-buffered A and x: step s decodes into buffer s & 1 while the wgmma of step s - 1 (buffer
 *   (s - 1) & 1) run; then wait_group 0 (step s - 1's products done), the proxy fence and ONE block
 *   barrier, then step s's 8 wgmma. Buffer s & 1 was last read by step s - 2's wgmma, which every
 *   warpgroup waited for before step s - 1's barrier.
 * Tiled layout, bf16 x and y, K % 64 == 0 only. */
#ifndef FP4MOE_BENCH_GATHER_SS_CUH
#define FP4MOE_BENCH_GATHER_SS_CUH

#include "gather_candidate.cuh"

#define SS_MT 128                     /* rows an item */
#define SS_NF 128                     /* features an item */
#define SS_THREADS 512
#define SS_ABYTES (8 * 2048)          /* one feature half's A tile of a step: 64 features x 128 K bf16 */
#define SS_XBYTES (8 * SS_MT * 32)    /* the x tile of a step: 128 rows x 128 K bf16 (gw_cfg<128>::XBYTES) */
#define SS_XKS (SS_MT * 32)           /* bytes of one k16 step of the x tile */
#ifndef SS_STAGES
#define SS_STAGES 4 /* weight ring: 3 steps ahead */
#endif

/* a thread's weight copies of one step: 8 code bytes of rows g and g + 8 (words 2r, 2r + 1), the scale word */
struct ss_slot {
    uint2 c0, c1;
    uint32_t s;
    uint32_t pad;
};
#define SS_SMEM (2 * 2 * SS_ABYTES + 2 * SS_XBYTES + SS_STAGES * SS_THREADS * (int)sizeof(ss_slot))

__device__ __forceinline__ void ss_cp8(uint32_t dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
}

/* the x tile of a step by 512 threads: thread (t, nlo, q, nhi) = (tid % 4, tid / 4 % 8, tid / 32 % 4, tid / 128)
 * moves the pieces of rows 32 i + 8 nhi + nlo (i < 4) at K offset 32 t + 8 q, stored as gw_xstage does */
struct ss_xstage {
    const __nv_bfloat16 *src[4];
    uint4 v[4];
    int kc;
    __device__ __forceinline__ void init(const __nv_bfloat16 *x, int64_t row0, int rows, int rows_pad, int K,
                                         const uint32_t *xrow, int xdiv) {
        const int tid = threadIdx.x, t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, nhi = tid >> 7;
        kc = 32 * t + 8 * q;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = i * 32 + nhi * 8 + nlo, rr = r < rows ? r : rows - 1;
            src[i] = r < rows_pad ? x + gq_x_row(xrow, xdiv, row0 + rr) * K + kc : nullptr;
        }
    }
    __device__ __forceinline__ void load(int k0, int K) {
        const bool kok = k0 + kc < K;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[i] = make_uint4(0, 0, 0, 0);
            if (src[i] && kok) v[i] = __ldg(reinterpret_cast<const uint4 *>(src[i] + k0));
        }
    }
    __device__ __forceinline__ void store(uint8_t *xs) const {
        const int tid = threadIdx.x, t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, nhi = tid >> 7;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (src[i]) {
                const uint4 w = v[i];
                const int n = i * 32 + nhi * 8 + nlo;
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(SS_XKS, 2 * q, 0, n) + 4 * t) = __byte_perm(w.x, w.z, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(SS_XKS, 2 * q, 1, n) + 4 * t) = __byte_perm(w.x, w.z, 0x7632);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(SS_XKS, 2 * q + 1, 0, n) + 4 * t) = __byte_perm(w.y, w.w, 0x5410);
                *reinterpret_cast<uint32_t *>(xs + gw_xoff(SS_XKS, 2 * q + 1, 1, n) + 4 * t) = __byte_perm(w.y, w.w, 0x7632);
            }
        }
    }
};

/* One item for a warpgroup whose rows round up to N (0: no rows - it decodes and stages, issues no wgmma).
 * f, r: the warpgroup's feature and row halves; nw: the warp's first feature (item's first + 64 f + 16 wq). */
template <int N>
__device__ __forceinline__ void ss_item(const gq_args &a, int e, int64_t row0, int rows, int nw, int r, uint8_t *smem) {
    constexpr int NA = N > 0 ? N / 2 : 1;
    const int tid = threadIdx.x, lane = tid & 31, wq = (tid >> 5) & 3, f = (tid >> 7) & 1;
    uint8_t *abuf = smem;                          /* [buffer][f] A tiles */
    uint8_t *xbuf = smem + 4 * SS_ABYTES;          /* [buffer] x tiles */
    ss_slot *ring = reinterpret_cast<ss_slot *>(xbuf + 2 * SS_XBYTES) + tid;
    const int NF = a.N, K = a.K, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int64_t we = cu_weight_expert(e, a.E);
    const uint8_t *tp = gq_tiled_piece(a.codes, we, min(nw >> 4, (NF - 1) >> 4), 0, NF, K);
    const uint32_t a_lane = (uint32_t)((2 * wq + ((lane >> 3) & 1)) * 256 + (lane >> 4) * 128 + (lane & 7) * 16);

    float acc[NA];
#pragma unroll
    for (int i = 0; i < NA; i++) acc[i] = 0.0f;
    ss_xstage xr;
    xr.init(static_cast<const __nv_bfloat16 *>(a.x), row0, rows, (rows + 7) & ~7, K, a.xrow, a.xdiv); /* rows read: < round8(rows) */
    auto issue = [&](int step) {
        if (step < nsteps) {
            const uint8_t *p = tp + (int64_t)step * GQ_TILE_PIECE;
            ss_slot *sl = ring + (step % SS_STAGES) * SS_THREADS;
            ss_cp8(bt_smem_addr(&sl->c0), p + lane * 16 + 8 * r);
            ss_cp8(bt_smem_addr(&sl->c1), p + 512 + lane * 16 + 8 * r);
            bt_cp4(bt_smem_addr(&sl->s), p + 1024 + lane * 4, 4);
        }
        bt_cp_commit();
    };
#pragma unroll
    for (int p = 0; p < SS_STAGES - 1; p++) issue(p);
    xr.load(0, K);

    for (int s = 0; s < nsteps; s++) {
        uint8_t *ab = abuf + (s & 1) * 2 * SS_ABYTES, *xb = xbuf + (s & 1) * SS_XBYTES;
        /* 1. this step's weights: decode K half r and store the A fragments (buffer s & 1, feature half f) */
        bt_cp_wait<SS_STAGES - 2>();
        const ss_slot *sl = ring + (s % SS_STAGES) * SS_THREADS;
        const uint2 c0 = sl->c0, c1 = sl->c1;
        const uint32_t sw = sl->s;
        issue(s + SS_STAGES - 1);
        uint32_t sa[2], sb[2];
        bt_scales4<__nv_bfloat16, true>(sw & 0xffffu, sw >> 16, sa, sb);
        const uint32_t s0 = r ? sa[1] : sa[0], s1 = r ? sb[1] : sb[0]; /* block 2t + r */
        const uint32_t abase = bt_smem_addr(ab + f * SS_ABYTES) + a_lane;
#pragma unroll
        for (int j = 0; j < 2; j++) { /* word 2r + j: k16 steps 4r + 2j, 4r + 2j + 1 */
            uint32_t pa[4], pb[4];
            bt_dec4<__nv_bfloat16>::pairs_tl(j ? c0.y : c0.x, pa);
            bt_dec4<__nv_bfloat16>::pairs_tl(j ? c1.y : c1.x, pb);
            const int ks = 4 * r + 2 * j;
            cand_stmatrix4(abase + ks * 2048, cu_mul_bf16x2(pa[0], s0), cu_mul_bf16x2(pb[0], s1), cu_mul_bf16x2(pa[1], s0),
                         cu_mul_bf16x2(pb[1], s1));
            cand_stmatrix4(abase + (ks + 1) * 2048, cu_mul_bf16x2(pa[2], s0), cu_mul_bf16x2(pb[2], s1),
                         cu_mul_bf16x2(pa[3], s0), cu_mul_bf16x2(pb[3], s1));
        }
        /* 2. this step's x tile (loaded during the last step) */
        xr.store(xb);
        if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K);
        /* 3. step s - 1's products done (its buffers free for step s + 1), writes visible to wgmma, barrier */
        if constexpr (N > 0) wg_wait<0>();
        wg_fence_async_smem();
        __syncthreads();
        /* 4. step s's products */
        if constexpr (N > 0) {
            const uint32_t aa = bt_smem_addr(ab + f * SS_ABYTES), xa = bt_smem_addr(xb) + r * 2048;
            wg_fence();
#pragma unroll
            for (int ks = 0; ks < 8; ks++)
                wg_ss<N>::mma(acc, wg_desc(aa + ks * 2048, 128, 256), wg_desc(xa + ks * SS_XKS, 128, 256), 1);
            wg_commit();
        }
    }
    if constexpr (N > 0) {
        wg_wait<0>();
#pragma unroll
        for (int i = 0; i < NA; i++) asm volatile("" : "+f"(acc[i])::"memory");
        gw_store<N>(a, e, row0 + 64 * r, rows - 64 * r, nw, acc);
    }
    __syncthreads(); /* the buffers and the ring are reused by the next item */
}

__global__ void __launch_bounds__(SS_THREADS, 1)
gq_batched_ss_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int next_item[2];
    const int warp = threadIdx.x >> 5, wg = warp >> 2, wq = warp & 3, f = wg & 1, r = wg >> 1;
    const int NT = (a.N + SS_NF - 1) / SS_NF;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    bt_sched sch = {ctr, 0};
    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item, total);
        const bt_item it = bt_item_of<SS_MT>(item, a.E, NT, starts, tile_off);
        const int nw = it.ntile * SS_NF + f * 64 + wq * 16;
        const int mine = min(64, max(0, it.rows - 64 * r)); /* this warpgroup's rows */
        /* features all past N: no products (uniform in the warpgroup), as gw_item */
        const int n8 = (nw & ~63) < a.N ? (mine + 7) >> 3 : 0;
#define SS_CASE(n) case n: ss_item<8 * n>(a, it.e, it.row0, it.rows, nw, r, smem); break
        switch (n8) {
        SS_CASE(0); SS_CASE(1); SS_CASE(2); SS_CASE(3); SS_CASE(4); SS_CASE(5); SS_CASE(6); SS_CASE(7);
        default: ss_item<64>(a, it.e, it.row0, it.rows, nw, r, smem); break;
        }
#undef SS_CASE
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, a.N);
}

/* the candidate's launch: the runs with 128-row tiles, then the kernel (tiled layout, bf16) */
static int ss_launch(const gq_args *a, cudaStream_t st) {
    return bench_candidate_launch("gather ss", gq_batched_ss_kernel, SS_MT, SS_NF, SS_THREADS, SS_SMEM, a, st,
                                  [&](unsigned grid, int *starts, int *tile_off) {
                                      cu_launch(gq_batched_ss_kernel, grid, SS_THREADS, SS_SMEM, st, *a, starts,
                                                tile_off, tile_off + a->E + 1);
                                  });
}

#endif
