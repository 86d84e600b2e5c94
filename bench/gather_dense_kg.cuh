/* bench/gather_dense_kg.cuh: a candidate for the plain linears (E = 1) of a decode-batch step (B <= 64 rows,
 * bf16, tiled layout), written in session 23 without device time (bench/gpu_dense_b64.cu measures it).
 *
 * Why: Nsight Compute of the 64-sequence decode step (docs/PERFORMANCE.md, session 23) found production's
 * 64-row form on these calls latency-bound - N / 64 items of 4 warps, one block on most SMs, 1.31 active and
 * 0.35 eligible warps a scheduler, issue slots 22.8% (Mamba in_proj, N = 10,304: 40.6 us cold) - and its
 * 8-row form at 8x the decode work (every weight decoded once per 8 rows). A global split of K lost (bench/
 * patches/dense-ksplit.diff: partial planes, more registers in the shared kernel).
 *
 * This kernel: one block an item of 64 rows x 64 features, KG groups of 4 warps (128 * KG threads). Group g
 * runs production's 64-row step (the same ring of weight copies, decode, mma order within a step and x tile)
 * over the 128-K steps g, g + KG, g + 2 KG, ... with its own x buffers, ring and named barrier; at the end the
 * groups' fp32 accumulators are summed in group order (0 + 1 + ... , fixed) in shared memory and group 0 runs
 * production's epilogue. So a weight is decoded once per item as in the 64-row form, with KG x its warps. The
 * sums differ from production's by the order over K (KG partial chains): not bitwise equal, hence a new
 * contract if it went to production (both routes and both layouts would run it for these calls).
 * Limits: 168 registers a thread (the 64-row form's) allow 3 groups an SM (384 threads); shared memory
 * KG x (36,864 + 20,480) bytes; the partials of groups 1.. must fit group 0's x buffers, so KG <= 3. B <= 64,
 * every row of expert 0 (idx not read: no out-of-range rows), no row map, tiled layout, K % 64 == 0. */
#ifndef KG_GROUPS
#define KG_GROUPS 3
#endif
#define KG_MT 64
#define KG_GT 128 /* threads a group */
#define KG_XB (2 * KG_MT * BT_XROW)
#define KG_RB (BT_STAGES * KG_GT * BT_SLOT_BYTES)
#define KG_SMEM (KG_GROUPS * (KG_XB + KG_RB))

__device__ __forceinline__ void kg_bar(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(KG_GT) : "memory"); }

__global__ void __launch_bounds__(KG_GROUPS * KG_GT, 1) gq_dense_kg_kernel(gq_args a) {
    cu_pdl_entry();
    extern __shared__ __align__(16) uint8_t smem[];
    const int grp = threadIdx.x / KG_GT, tid = threadIdx.x % KG_GT;
    const int lane = threadIdx.x & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    uint8_t *base = smem + grp * (KG_XB + KG_RB);
    uint8_t *xs0 = base, *xs1 = base + KG_MT * BT_XROW;
    const auto ring = bt_slot_soa<BT_STAGES * KG_GT>::at(base + KG_XB, tid);
    const int N = a.N, K = a.K, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int rows = a.B, ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
    const int NT = (N + 63) / 64;
    const int nj = grp < nsteps ? (nsteps - grp + KG_GROUPS - 1) / KG_GROUPS : 0; /* this group's steps */
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    float *red = reinterpret_cast<float *>(smem); /* after the K loop: groups 1.. partials (in group 0's x) */
    static_assert((KG_GROUPS - 1) * 32 * KG_GT * 4 <= KG_XB, "the partials fit group 0's x buffers");

    for (int item = blockIdx.x; item < NT; item += gridDim.x) {
        const int nw = item * 64 + warp * 16;
        const uint8_t *tpiece = gq_tiled_piece(a.codes, 0, min(nw >> 4, (N - 1) >> 4), 0, N, K);
        const bt_wstream<true> ws = {nullptr, nullptr, nullptr, nullptr, tpiece, t, lane, K >> 4};
        float acc[KG_MT / 8][4];
#pragma unroll
        for (int i = 0; i < KG_MT / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
        bt_xstage<__nv_bfloat16, KG_MT, KG_GT, 4> xr; /* staged by the group's threads */
        xr.init_tid(tid, x, 0, rows, rows_pad, K);
#pragma unroll
        for (int p = 0; p < BT_STAGES - 1; p++) {
            ws.issue(ring + p * KG_GT, grp + KG_GROUPS * p, nsteps);
            bt_cp_commit();
        }
        if (nj > 0) {
            xr.load(grp * BT_KSTEP, K);
            xr.store(xs0);
        }
        kg_bar(1 + grp);
        for (int j = 0; j < nj; j++) {
            const int s = grp + KG_GROUPS * j;
            uint32_t w0[4], w1[4], sa[2], sb[2], sw0, sw1;
            bt_cp_wait<BT_STAGES - 2>();
            ws.read(ring + (j % BT_STAGES) * KG_GT, w0, w1, sw0, sw1);
            bt_scales4<__nv_bfloat16>(sw0, sw1, sa, sb);
            const int nxt = j + BT_STAGES - 1;
            ws.issue(ring + (nxt % BT_STAGES) * KG_GT, grp + KG_GROUPS * nxt, nsteps);
            bt_cp_commit();
            if (j + 1 < nj) xr.load((s + KG_GROUPS) * BT_KSTEP, K);
            bt_step_ntv<__nv_bfloat16, KG_MT, 4>(ntv, acc, w0, w1, sa, sb, ((j & 1) ? xs1 : xs0) + xoff);
            if (j + 1 < nj) xr.store((j & 1) ? xs0 : xs1);
            kg_bar(1 + grp);
        }
        __syncthreads(); /* every group is past its K loop: group 0's x buffers hold the partials now */
        if (grp > 0) {
#pragma unroll
            for (int i = 0; i < KG_MT / 8; i++)
#pragma unroll
                for (int c = 0; c < 4; c++) red[((grp - 1) * 32 + i * 4 + c) * KG_GT + tid] = acc[i][c];
        }
        __syncthreads();
        if (grp == 0) {
#pragma unroll
            for (int q = 1; q < KG_GROUPS; q++)
#pragma unroll
                for (int i = 0; i < KG_MT / 8; i++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[i][c] += red[((q - 1) * 32 + i * 4 + c) * KG_GT + tid];
            bt_store_tile<__nv_bfloat16, KG_MT>(acc, static_cast<__nv_bfloat16 *>(a.y), 0, rows, ntv, nw, N, g, t,
                                                cu_expert_gs(a.gs, 0) * bt_ops<__nv_bfloat16>::kUndo, a.relu2);
        }
        __syncthreads(); /* the next item's x tile overwrites the partials */
    }
}

/* the candidate's launch: E = 1, B <= 64, tiled bf16 (else FP4MOE_EUNSUPPORTED) */
static int kg_launch(const gq_args *a, cudaStream_t st) {
    if (a->E != 1 || a->B < 1 || a->B > KG_MT || !a->tiled || a->K % 64 || a->xrow || ((uintptr_t)a->codes & 15))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gq_dense_kg: E=%d B=%d tiled=%d K=%d (or a row map, or codes "
                                "not 16-byte aligned)", a->E, a->B, a->tiled, a->K);
    static bool attr = false;
    if (!attr) {
        FP4MOE_CUDA_TRY("gq_dense_kg", cudaFuncSetAttribute(gq_dense_kg_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                           KG_SMEM), "cudaFuncSetAttribute");
        attr = true;
    }
    int dev = 0, sms = 0;
    FP4MOE_CUDA_TRY("gq_dense_kg", cudaGetDevice(&dev), "cudaGetDevice");
    FP4MOE_CUDA_TRY("gq_dense_kg", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "SM count");
    const int NT = (a->N + 63) / 64;
    const unsigned grid = (unsigned)(NT < sms ? NT : sms);
    cu_launch(gq_dense_kg_kernel, grid, KG_GROUPS * KG_GT, KG_SMEM, st, *a);
    FP4MOE_CUDA_TRY("gq_dense_kg", cudaGetLastError(), "launch");
    return FP4MOE_OK;
}
