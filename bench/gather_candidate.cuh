/* bench/gather_candidate.cuh: the launch shared by the expert-batched gather candidates of
 * bench/gpu_gather_wg.cu (gather_ws.cuh, gather_ss.cuh). Included after src/kernels/cuda/gather_batched.cu. */
#ifndef FP4MOE_BENCH_GATHER_CANDIDATE_CUH
#define FP4MOE_BENCH_GATHER_CANDIDATE_CUH

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
