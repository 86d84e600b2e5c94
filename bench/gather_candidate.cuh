/* bench/gather_candidate.cuh: the launch and the stmatrix store shared by the expert-batched gather candidates of
 * bench/gpu_gather_wg.cu (gather_ws.cuh, gather_ss.cuh, gather_big.cuh). Included after src/kernels/cuda/gather_batched.cu. */
#ifndef FP4MOE_BENCH_GATHER_CANDIDATE_CUH
#define FP4MOE_BENCH_GATHER_CANDIDATE_CUH

/* one stmatrix.x4: the four 8 x 8 bf16 matrices of an A fragment (a0: rows 0-7, K 0-7; a1: rows 8-15, K 0-7;
 * a2: rows 0-7, K 8-15; a3: rows 8-15, K 8-15 of the warp's 16 rows), lane l giving row l % 8 of matrix l / 8 */
__device__ __forceinline__ void cand_stmatrix4(uint32_t addr, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a0), "r"(a1),
                 "r"(a2), "r"(a3)
                 : "memory");
}

/* A candidate kernel over the items (expert, nf features, mt rows): tiled layout and K % 64 == 0 required
 * (else FP4MOE_EUNSUPPORTED naming `what`); a per-call scratch of starts (E + 1 ints), tile_off (E + 1) and
 * the work counter (tile_off[E + 1]), the runs with row tile mt, a persistent grid for `kernel` (threads,
 * smem bytes), then launch(grid, starts, tile_off) issues the kernel on st. FP4MOE_OK or an error. */
template <typename K, typename L>
static int bench_candidate_launch(const char *what, K kernel, int mt, int nf, int threads, int smem, const gq_args *a,
                                  cudaStream_t st, L launch) {
    if (!a->tiled || a->K % 64)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s: tiled weights, K %% 64 == 0", what);
    int *buf = NULL;
    if (gq_scratch_alloc((void **)&buf, (2 * (size_t)a->E + 3) * sizeof(int), st)) return 1;
    int *starts = buf, *tile_off = buf + a->E + 1;
    int rc = gq_launch_runs(a, mt, starts, tile_off, st);
    if (!rc) {
        const int64_t NT = (a->N + nf - 1) / nf;
        const int64_t bound = ((int64_t)a->B / mt + 1 + (a->E < a->B ? a->E : a->B)) * NT;
        unsigned grid = 0;
        rc = persistent_grid(kernel, threads, smem, bound, &grid);
        if (!rc) {
            launch(grid, starts, tile_off);
            if (cudaGetLastError() != cudaSuccess) rc = fp4moe_set_error(FP4MOE_ECUDA, "%s: launch failed", what);
        }
    }
    gq_scratch_free(buf, st);
    return rc;
}

#endif
