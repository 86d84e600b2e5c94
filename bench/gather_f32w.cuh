/* bench/gather_f32w.cuh: the expert-batched gather_qmm kernel with 32 output features a warp (issue 12;
 * a candidate, measured by bench/gpu_gather_wg.cu built with -DWK_F32W=1 against production). Included
 * after src/kernels/cuda/gather_batched.cu (it reuses its decode, x staging, cp.async ring and item walk).
 *
 * Why (docs/GPU-NOTES.md session 17): the production mma.sync kernel (32-row tiles, 8 warps of 16
 * features) issues about as many instructions per 128-K step for the x fragments, the x staging, the
 * scale conversion and the cp.async addressing as for the E2M1 decode, at 52% issue and 25% occupancy.
 * Here a warp owns two 16-feature tiles (rows g, g + 8 of tile A and of tile B): every x fragment
 * load from shared memory feeds 4 mma instead of 2, and a block of 4 warps covers the same 128
 * features as production's 8, so the x tile is staged by half the threads.
 * Per element the arithmetic is production's: the same decode (bt_dec4), the same block-scale
 * products, the same k16 order of mma into an fp32 accumulator from 0, the same epilogue - so the
 * outputs must be bitwise equal (the harness prints "bitwise n/n").
 * Tiled layout, bf16 x and y, 32-row tiles only (the harness's tiled checks; its checkpoint-layout
 * rows are skipped: WK_TL0 = 1). Macro: WF_MINB (blocks an SM in the launch bounds; 3 -> 168
 * registers a thread, 12 warps an SM; 4 -> 128 registers, 16 warps).
 * Written in session 17, not yet run on the device. */
#ifndef FP4MOE_BENCH_GATHER_F32W_CUH
#define FP4MOE_BENCH_GATHER_F32W_CUH

#ifndef WF_MINB
#define WF_MINB 3
#endif

#define WF_MT 32
#define WF_WARPS 4
#define WF_THREADS (WF_WARPS * 32)
#define WF_NTILE (WF_WARPS * 32) /* features of an item: 128, as production's 32-row tiles */
#define WF_XBYTES (2 * WF_MT * BT_XROW)
#define WF_SMEM (WF_XBYTES + BT_STAGES * WF_THREADS * 2 * (int)sizeof(bt_slot))

/* One 128-K step of a warp: tiles A and B (16 features each) x (8 * NTV) token rows; each x fragment
 * load feeds both tiles. */
template <int NTV>
__device__ __forceinline__ void wf_step(float (&aa)[WF_MT / 8][4], float (&ab)[WF_MT / 8][4], const uint32_t (&a0)[4],
                                        const uint32_t (&a1)[4], const uint32_t (&b0)[4], const uint32_t (&b1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], const uint32_t (&ta)[2],
                                        const uint32_t (&tb)[2], const uint8_t *xb) {
    typedef bt_ops<__nv_bfloat16> ops;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t pa[4], pb[4], qa[4], qb[4];
        bt_dec4<__nv_bfloat16>::pairs(a0[q], pa);
        bt_dec4<__nv_bfloat16>::pairs(a1[q], pb);
        bt_dec4<__nv_bfloat16>::pairs(b0[q], qa);
        bt_dec4<__nv_bfloat16>::pairs(b1[q], qb);
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
            ops::mma(aa[nt], ra0, rb0, ra1, rb1, xf.x, xf.y); /* tile A, k16 step 2q */
            ops::mma(aa[nt], ra2, rb2, ra3, rb3, xf.z, xf.w); /* tile A, k16 step 2q+1 */
            ops::mma(ab[nt], va0, vb0, va1, vb1, xf.x, xf.y); /* tile B */
            ops::mma(ab[nt], va2, vb2, va3, vb3, xf.z, xf.w);
        }
    }
}

__device__ __forceinline__ void wf_step_ntv(int ntv, float (&aa)[WF_MT / 8][4], float (&ab)[WF_MT / 8][4],
                                            const uint32_t (&a0)[4], const uint32_t (&a1)[4], const uint32_t (&b0)[4],
                                            const uint32_t (&b1)[4], const uint32_t (&sa)[2], const uint32_t (&sb)[2],
                                            const uint32_t (&ta)[2], const uint32_t (&tb)[2], const uint8_t *xb) {
    switch (ntv) {
    case 1: wf_step<1>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    case 2: wf_step<2>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    case 3: wf_step<3>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    default: wf_step<4>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    }
}

/* the epilogue of one 16-feature tile (features nw .. nw + 15), as gq_batched_kernel's */
__device__ __forceinline__ void wf_store(const float (&acc)[WF_MT / 8][4], __nv_bfloat16 *y, int64_t row0, int rows,
                                         int ntv, int nw, int N, int g, int t, float mult, int relu2) {
    const int na = nw + g, nb = nw + g + 8;
#pragma unroll
    for (int nt = 0; nt < WF_MT / 8; nt++) {
        if (nt < ntv) {
            const int r = nt * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (r + h < rows) {
                    __nv_bfloat16 *yr = y + (row0 + r + h) * N;
                    if (na < N) yr[na] = cu_out<__nv_bfloat16>(acc[nt][h] * mult, relu2);
                    if (nb < N) yr[nb] = cu_out<__nv_bfloat16>(acc[nt][2 + h] * mult, relu2);
                }
            }
        }
    }
}

__global__ void __launch_bounds__(WF_THREADS, WF_MINB)
gq_batched_f32w_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off) {
    cu_pdl_entry();
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *xs0 = smem, *xs1 = smem + WF_MT * BT_XROW;
    /* the thread's two ring slots of a stage: tile A at stage * 2 * THREADS + tid, tile B + THREADS */
    bt_slot *ring = reinterpret_cast<bt_slot *>(smem + WF_XBYTES) + threadIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int N = a.N, K = a.K, KB = K >> 4, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int NT = (N + WF_NTILE - 1) / WF_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    const int last_tile = (N - 1) >> 4;

    for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
        const bt_item it = bt_item_of<WF_MT>(item, a.E, NT, starts, tile_off);
        const int e = it.e, rows = it.rows;
        const int64_t row0 = it.row0;
        const int ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
        const int nw = it.ntile * WF_NTILE + warp * 32; /* tile A: nw .. nw + 15, tile B: nw + 16 .. */
        const int64_t we = cu_weight_expert(e, a.E);
        const uint8_t *pa = gq_tiled_piece(a.codes, we, min(nw >> 4, last_tile), 0, N, K);
        const uint8_t *pb = gq_tiled_piece(a.codes, we, min((nw >> 4) + 1, last_tile), 0, N, K);
        const bt_wstream<true> wa = {nullptr, nullptr, nullptr, nullptr, pa, t, lane, KB};
        const bt_wstream<true> wb = {nullptr, nullptr, nullptr, nullptr, pb, t, lane, KB};

        float aa[WF_MT / 8][4], ab[WF_MT / 8][4];
#pragma unroll
        for (int i = 0; i < WF_MT / 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) aa[i][j] = ab[i][j] = 0.0f;

        bt_xstage<__nv_bfloat16, WF_MT, WF_THREADS, 4> xr;
        xr.init(x, row0, rows, rows_pad, K);
#pragma unroll
        for (int p = 0; p < BT_STAGES - 1; p++) {
            wa.issue(ring + p * 2 * WF_THREADS, p, nsteps);
            wb.issue(ring + p * 2 * WF_THREADS + WF_THREADS, p, nsteps);
            bt_cp_commit();
        }
        xr.load(0, K);
        xr.store(xs0);
        __syncthreads();

        for (int s = 0; s < nsteps; s++) {
            uint32_t a0[4], a1[4], b0[4], b1[4], sa[2], sb[2], ta[2], tb[2], swa0, swa1, swb0, swb1;
            bt_cp_wait<BT_STAGES - 2>();
            const bt_slot *sl = ring + (s % BT_STAGES) * 2 * WF_THREADS;
            wa.read(sl, a0, a1, swa0, swa1);
            wb.read(sl + WF_THREADS, b0, b1, swb0, swb1);
            bt_scales4<__nv_bfloat16>(swa0, swa1, sa, sb);
            bt_scales4<__nv_bfloat16>(swb0, swb1, ta, tb);
            const int nxt = s + BT_STAGES - 1;
            wa.issue(ring + (nxt % BT_STAGES) * 2 * WF_THREADS, nxt, nsteps);
            wb.issue(ring + (nxt % BT_STAGES) * 2 * WF_THREADS + WF_THREADS, nxt, nsteps);
            bt_cp_commit();
            if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K);
            wf_step_ntv(ntv, aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, ((s & 1) ? xs1 : xs0) + xoff);
            if (s + 1 < nsteps) xr.store((s & 1) ? xs0 : xs1);
            __syncthreads();
        }
        const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
        wf_store(aa, y, row0, rows, ntv, nw, N, g, t, mult, a.relu2);
        wf_store(ab, y, row0, rows, ntv, nw + 16, N, g, t, mult, a.relu2);
    }
    bt_zero_tail(y, starts, a.E, a.B, N);
}

/* the candidate: the runs with 32-row tiles, then the kernel (tiled layout, bf16, K % 64 == 0) */
static int f32w_launch(const gq_args *a, cudaStream_t st) {
    if (!a->tiled || (a->K % 64) != 0) {
        fprintf(stderr, "f32w: tiled layout with K %% 64 == 0 only\n");
        return 1;
    }
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, 2 * ((size_t)a->E + 1) * sizeof(int), st)) return 1;
    int *starts = buf, *tile_off = buf + a->E + 1;
    int rc = gq_launch_runs(a, WF_MT, starts, tile_off, st);
    if (!rc) {
        const int64_t NT = (a->N + WF_NTILE - 1) / WF_NTILE;
        const int64_t bound = ((int64_t)a->B / WF_MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
        unsigned grid = 0;
        rc = persistent_grid(gq_batched_f32w_kernel, WF_THREADS, WF_SMEM, bound, &grid);
        if (!rc) {
            cu_launch(gq_batched_f32w_kernel, grid, WF_THREADS, WF_SMEM, st, *a, starts, tile_off);
            rc = cudaGetLastError() != cudaSuccess;
        }
    }
    gq_scratch_free(buf, st);
    return rc;
}

#endif
