/* bench/gather_w32bulk.cuh: production's gq_batched_w32_kernel with its weight pieces copied by
 * cp.async.bulk (issue 12; a candidate, measured by bench/gpu_gather_wg.cu built with -DWK_BULK=1 against
 * production). Included after src/kernels/cuda/gather_batched.cu (its x staging, decode, step and epilogue
 * are reused unchanged). Written and measured in session 22: bitwise equal to production on every check,
 * memcheck clean, but 1.02-1.05x production's w32 time at 512 tokens (docs/PERFORMANCE.md session 22): the
 * per-step mbarrier wait and lane 0's copies after a __syncwarp cost more than the 6 cp.async they replace.
 *
 * Why (docs/GPU-NOTES.md, session 22, call 9): in the w32 kernel each thread copies its 16 + 16 code bytes
 * and its scale word of both tiles with 6 cp.async a step (LDGSTS.128 / .32); Nsight Compute counts 12
 * shared wavefronts (ideal 4) and 32 L2 sectors (ideal 16) for each LDGSTS.128, and the kernel is issue-bound
 * (issue slots 54%). In the tiled layout a warp's step of one 16-feature tile is ONE contiguous 1,152-byte
 * piece (codes of rows g for lanes 0..31, codes of rows g + 8, scale words), so one lane can copy the warp's
 * two pieces with two bulk copies into a ring slot of the same layout, completing on the slot's mbarrier
 * (expect_tx 2 x 1,152 bytes); the lanes then read their 16 + 16 bytes and scale word at lane x 16,
 * 512 + lane x 16, 1,024 + lane x 4 (consecutive cells: no bank conflicts).
 * Ring: BT_STAGES slots a warp, 2 pieces each; one mbarrier a slot (arrival count 1: lane 0's
 * arrive.expect_tx). The phase of a slot flips each time it is filled; the warp counts the steps it has
 * consumed across items (gs), so slot = gs % BT_STAGES, parity = (gs / BT_STAGES) & 1. A slot is refilled
 * (step s + BT_STAGES - 1 into the slot of step s - 1) after a __syncwarp, i.e. after every lane has read
 * step s - 1's values into registers. Same values into the same registers as production: the same bits. */
#ifndef FP4MOE_BENCH_GATHER_W32BULK_CUH
#define FP4MOE_BENCH_GATHER_W32BULK_CUH

#include "kernels/cuda/mbarrier.cuh"
#include "gather_candidate.cuh"

#define WB_PIECES_BYTES (2 * GQ_TILE_PIECE)                       /* a warp's slot: tiles A and B */
#define WB_RING (BW_WARPS * BT_STAGES * WB_PIECES_BYTES)          /* bytes of the weight ring */
#define WB_SMEM (BW_XBYTES + WB_RING + BW_WARPS * BT_STAGES * 8) /* + the mbarriers */

__device__ __forceinline__ void wb_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void wb_bulk(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

__global__ void __launch_bounds__(BW_THREADS, BW_MINB)
gq_batched_w32bulk_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    __shared__ int next_item[2];
    bt_sched sch = {ctr, 0};
    extern __shared__ __align__(128) uint8_t smem[];
    uint8_t *xs0 = smem, *xs1 = smem + BW_MT * BT_XROW;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint32_t ring = bt_smem_addr(smem + BW_XBYTES) + warp * BT_STAGES * WB_PIECES_BYTES;
    const uint32_t bars = bt_smem_addr(smem + BW_XBYTES + WB_RING) + warp * BT_STAGES * 8;
    if (lane < BT_STAGES) cu_mbar_init(bars + 8 * lane, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    __syncthreads();
    const int N = a.N, K = a.K, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int NT = (N + BW_NTILE - 1) / BW_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    const int last_tile = (N - 1) >> 4;
    uint32_t gs = 0; /* steps this warp has consumed (all items) */

    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item);
        const bt_item it = bt_item_of<BW_MT>(item, a.E, NT, starts, tile_off);
        const int e = it.e, rows = it.rows;
        const int64_t row0 = it.row0;
        const int ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
        const int nw = it.ntile * BW_NTILE + warp * 32;
        const int64_t we = cu_weight_expert(e, a.E);
        const uint8_t *pa = gq_tiled_piece(a.codes, we, min(nw >> 4, last_tile), 0, N, K);
        const uint8_t *pb = gq_tiled_piece(a.codes, we, min((nw >> 4) + 1, last_tile), 0, N, K);
        /* step s of this item into the slot of global step gs + s (lane 0) */
        auto issue = [&](int s) {
            if (lane == 0 && s < nsteps) {
                const uint32_t slot = (gs + s) % BT_STAGES, dst = ring + slot * WB_PIECES_BYTES, bar = bars + 8 * slot;
                wb_expect_tx(bar, WB_PIECES_BYTES);
                wb_bulk(dst, pa + (int64_t)s * GQ_TILE_PIECE, GQ_TILE_PIECE, bar);
                wb_bulk(dst + GQ_TILE_PIECE, pb + (int64_t)s * GQ_TILE_PIECE, GQ_TILE_PIECE, bar);
            }
        };

        float aa[BW_MT / 8][4], ab[BW_MT / 8][4];
#pragma unroll
        for (int i = 0; i < BW_MT / 8; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) aa[i][j] = ab[i][j] = 0.0f;

        bt_xstage<__nv_bfloat16, BW_MT, BW_THREADS, 4> xr;
        xr.init(x, row0, rows, rows_pad, K, a.xrow, a.xdiv);
#pragma unroll
        for (int p = 0; p < BT_STAGES - 1; p++) issue(p);
        xr.load(0, K);
        xr.store(xs0);
        __syncthreads();

        for (int s = 0; s < nsteps; s++) {
            uint32_t a0[4], a1[4], b0[4], b1[4], sa[2], sb[2], ta[2], tb[2];
            const uint32_t slot = (gs + s) % BT_STAGES, src = ring + slot * WB_PIECES_BYTES;
            cu_mbar_wait(bars + 8 * slot, ((gs + s) / BT_STAGES) & 1);
            {
                const uint4 c0 = bt_lds16(src + lane * 16), c1 = bt_lds16(src + 512 + lane * 16);
                const uint4 d0 = bt_lds16(src + GQ_TILE_PIECE + lane * 16), d1 = bt_lds16(src + GQ_TILE_PIECE + 512 + lane * 16);
                const uint32_t swa = bt_lds4(src + 1024 + lane * 4), swb = bt_lds4(src + GQ_TILE_PIECE + 1024 + lane * 4);
                a0[0] = c0.x; a0[1] = c0.y; a0[2] = c0.z; a0[3] = c0.w;
                a1[0] = c1.x; a1[1] = c1.y; a1[2] = c1.z; a1[3] = c1.w;
                b0[0] = d0.x; b0[1] = d0.y; b0[2] = d0.z; b0[3] = d0.w;
                b1[0] = d1.x; b1[1] = d1.y; b1[2] = d1.z; b1[3] = d1.w;
                bt_scales4<__nv_bfloat16>(swa & 0xffffu, swa >> 16, sa, sb);
                bt_scales4<__nv_bfloat16>(swb & 0xffffu, swb >> 16, ta, tb);
            }
            __syncwarp(); /* every lane has read step s - 1's slot (and this one) */
            issue(s + BT_STAGES - 1);
            if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K);
            bw_step_ntv(ntv, aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, ((s & 1) ? xs1 : xs0) + xoff);
            if (s + 1 < nsteps) xr.store((s & 1) ? xs0 : xs1);
            __syncthreads();
        }
        gs += nsteps;
        const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
        bt_store_tile<__nv_bfloat16, BW_MT>(aa, y, row0, rows, ntv, nw, N, g, t, mult, a.relu2);
        bt_store_tile<__nv_bfloat16, BW_MT>(ab, y, row0, rows, ntv, nw + 16, N, g, t, mult, a.relu2);
    }
    bt_zero_tail(y, starts, a.E, a.B, N);
}

/* the candidate's launch: the runs with 32-row tiles, then the kernel (tiled layout, bf16) */
static int w32bulk_launch(const gq_args *a, cudaStream_t st) {
    return bench_candidate_launch("gather w32 bulk", gq_batched_w32bulk_kernel, BW_MT, BW_NTILE, BW_THREADS, WB_SMEM, a,
                                  st, [&](unsigned grid, int *starts, int *tile_off) {
                                      cu_launch(gq_batched_w32bulk_kernel, grid, BW_THREADS, WB_SMEM, st, *a, starts,
                                                tile_off, tile_off + a->E + 1);
                                  });
}

#endif
