/* The fused CUDA ops of the model (issue 12) against the CPU ops they replace, on random data:
 *  - cuda_moe_route (router logits, top-k and the sort by expert in one call - the sort by many blocks
 *    from 2,048 rows, fault SORT_BASE; two kernels of its own
 *    for T <= 16, cuBLAS + router + sort above): the logits within fp32 rounding of an fp64 dot
 *    product; then ids, weights (bitwise) equal to the CPU router (op_router_topk) run on the GPU's
 *    own logits (ids exact, weights within 4e-7: the device's expf), and row_of / idx / pos_of
 *    (exact) equal to op_sort_by_expert of those ids; where the sort is a block sort (> 32 rows), the
 *    expert runs it writes for the gathers (gq_runs: starts, tile offsets for the row tile, the counter
 *    0) equal to those of idx (fault SORT_RUNS). T from 1
 *    to 40 (the warp sort <= 32 rows, the block sort above, the cuBLAS path), E = 128 top-6 with a
 *    correction bias, E = 8 top-2 with 4 groups (2 kept), H not a multiple of 4 (cuBLAS path); the
 *    one-group top-k in registers (E <= 256) with E = 40 / 96 / 200 / 256, k = E, exact ties (zero
 *    weights: every score 0.5, lowest ids first) with and without a bias, and E = 300 (the
 *    shared-memory top-k). Fault `route_tie` (ties to the higher id) must fail it.
 *  - cuda_rmsnorm with the residual add folded in: h + (a + b) bitwise equal to the CPU's (the same
 *    fp32 operations), y within one bf16 step of the CPU's op_rmsnorm (the fp64 sum of squares runs
 *    in another order), y32 the same values as y; H = 2688, 4100 (a row longer than the kept
 *    registers) and 7; T = 1, 3, 64, 300 (from 64 rows the 256-thread form); with a, with a and b,
 *    without; rows of a many-row call bitwise equal to the same rows normalised alone.
 *  - the relu^2 epilogue of gather_qmm (gather_qmm_cuda_ex): bitwise equal to gather_qmm then
 *    cuda_relu2 on every route and row count that fuses it (qmv decode kernel, qmv fp32-FMA kernel,
 *    batched, qmv tiled), and it reports "not fused" for dequant_gemm (the caller applies relu2).
 *  - gather_qmm_cuda_rows (the up projection reading x through the sort's row_of, no gathered copy):
 *    bitwise equal to gather_qmm_cuda_ex on the gathered copy at 8-, 32- (both kernels) and 64-row
 *    tiles, both layouts, relu^2 on and off, k = 6 and 1, route qmv (tiled by 8 rows); x has a NaN row
 *    outside the map; decode-sized calls and dequant_gemm refused; argument errors. Fault `xrow`
 *    (each row reads the previous sorted row's source) must fail it. The same calls on expert runs
 *    made beforehand (gq_runs, as the router's sort makes them), three in a row on one work counter:
 *    the same bits, the counter back at 0 (fault SCHED_RESET: it stays at the call's item count).
 *  - cuda_moe_combine (1024-thread rows for T <= 64, 256 above; 8-byte loads of 4 elements above 64 rows
 *    when H % 4 == 0) bitwise equal to op_moe_combine's
 *    fp32 arithmetic (sum over the slots in order) rounded to bf16.
 *  - cuda_linear_forward on a plain NVFP4 linear (E = 1) with the session's dense dequant scratch:
 *    from 256 rows the dense dequant_gemm form (no runs, no host synchronisation), below the
 *    batched kernel; within the suite's tolerance of the fp64 gather_qmm reference, with and
 *    without a global scale, awkward N and K, the scratch grown between calls; relu^2 applied after
 *    it (bitwise equal to cuda_relu2 of the plain output); a CUDA-graph capture and replay of the
 *    call bitwise equal to the eager call.
 * Outputs are poisoned (NaN) before every call. Needs a CUDA device; exits 77 (skipped) without. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "gpu_testutil.h"
#include "kernels/cpu/ops.h"
#include "kernels/cuda/ops_cuda.h"
#include "testutil.h"

static float bf16_to_f32(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_bf16(float f) { /* round to nearest even (the kernels' rounding; no NaN here) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float *randf(tu_rng *r, int64_t n, double sigma) {
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(sigma * tu_rng_normal(r));
    return v;
}
static uint16_t *randb(tu_rng *r, int64_t n, double sigma) {
    uint16_t *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; i < n; i++) v[i] = f32_to_bf16((float)(sigma * tu_rng_normal(r)));
    return v;
}

typedef struct {
    cudaStream_t stream;
    void *ws;
    cuda_ops ops;
    gq_dense_scratch dq;
} gpu_ctx;

static void ctx_make(gpu_ctx *g) {
    memset(g, 0, sizeof *g);
    GT_CHECK(cudaStreamCreate(&g->stream));
    g->ws = gt_upload(NULL, 32u << 20);
    void *blas = NULL;
    assert_int_equal(cuda_blas_create(g->stream, g->ws, 32u << 20, &blas), FP4MOE_OK);
    g->ops.stream = g->stream;
    g->ops.blas = blas;
    g->ops.route = FP4MOE_ROUTE_AUTO;
    g->ops.split_n = (int64_t)MM_SPLIT_ROWS * 300; /* the router's split-K form, up to 300 experts */
    g->ops.split_ws = gt_upload(NULL, (size_t)g->ops.split_n * 4);
}
static void ctx_free(gpu_ctx *g) {
    cuda_blas_destroy(g->ops.blas);
    gt_free(g->ops.split_ws);
    if (g->dq.p) GT_CHECK(cudaFree(g->dq.p));
    gt_free(g->ws);
    GT_CHECK(cudaStreamDestroy(g->stream));
}

/* ---- cuda_moe_route ------------------------------------------------------------------------ */

/* The expert runs of a sorted idx as gq_runs lays them out (starts[E + 1], tile_off[E + 1] for row tile mt, the
 * counter 0): what the sort makes and the gathers read. */
static int *cpu_runs(const uint32_t *idx, int64_t B, int64_t E, int mt) {
    int *r = calloc((size_t)(2 * E + 3), sizeof *r), *starts = r, *tile_off = r + E + 1;
    assert_non_null(r);
    for (int64_t e = 0, b = 0; e <= E; e++) {
        while (b < B && idx[b] < (uint32_t)e) b++;
        starts[e] = (int)b;
    }
    for (int64_t e = 0; e < E; e++) tile_off[e + 1] = tile_off[e] + (starts[e + 1] - starts[e] + mt - 1) / mt;
    return r;
}

/* x3: the prefill logits on bf16 tensor cores (cuda_matmul_bf16x3_planes, summed by the top-k kernel: x rounded
 * to bf16 values, W in three planes) */
static void route_case_w(gpu_ctx *g, int64_t T, int64_t E, int64_t k, int64_t G, int64_t TG, int64_t H, int bias,
                         uint64_t seed, double wscale, int x3) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    float *x = randf(&r, T * H, 1.0), *W = randf(&r, E * H, wscale), *b = bias ? randf(&r, E, 0.5) : NULL;
    const int64_t B = T * k;
    uint16_t *xb = NULL, *dxb = NULL, *dW3 = NULL;
    if (x3) {
        xb = malloc((size_t)(T * H) * 2);
        for (int64_t i = 0; i < T * H; i++) {
            xb[i] = f32_to_bf16(x[i]);
            x[i] = bf16_to_f32(xb[i]);
        }
        dxb = gt_upload(xb, (size_t)(T * H) * 2);
    }
    float *dx = gt_upload(x, (size_t)(T * H) * 4), *dW = gt_upload(W, (size_t)(E * H) * 4);
    if (x3) {
        dW3 = gt_upload(NULL, (size_t)(3 * E * H) * 2);
        gt_poison(dW3, (size_t)(3 * E * H) * 2);
        assert_int_equal(cuda_split_bf16x3(g->stream, dW, E * H, dW3), FP4MOE_OK);
    }
    float *db = b ? gt_upload(b, (size_t)E * 4) : NULL;
    float *dlg = gt_upload(NULL, (size_t)(T * E) * 4), *dw = gt_upload(NULL, (size_t)B * 4);
    int32_t *dids = gt_upload(NULL, (size_t)B * 4);
    uint32_t *drow = gt_upload(NULL, (size_t)B * 4), *didx = gt_upload(NULL, (size_t)B * 4),
             *dpos = gt_upload(NULL, (size_t)B * 4);
    gt_poison(dlg, (size_t)(T * E) * 4);
    gt_poison(dw, (size_t)B * 4);
    gt_poison(dids, (size_t)B * 4);
    gt_poison(drow, (size_t)B * 4);
    gt_poison(didx, (size_t)B * 4);
    gt_poison(dpos, (size_t)B * 4);
    const cuda_router_cfg rc = {E, k, G, TG, 1, 2.5f, db};
    /* the expert runs of block sorts (gq_runs), into a poisoned buffer with room for E experts */
    const size_t rbytes = (size_t)(2 * E + 3) * 4;
    gq_runs runs = {gt_upload(NULL, rbytes), E, (const uint32_t *)&runs, 0, 0, 0, NULL, 0, NULL, 0};
    gt_poison(runs.buf, rbytes);
    assert_int_equal(cuda_moe_route(&g->ops, &rc, dx, dxb, T, dW, dW3, H, dlg, dids, dw, drow, didx, dpos, &runs),
                     FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    float *lg = malloc((size_t)(T * E) * 4), *w = malloc((size_t)B * 4), *wc = malloc((size_t)B * 4);
    int32_t *ids = malloc((size_t)B * 4), *idsc = malloc((size_t)B * 4);
    uint32_t *row = malloc((size_t)B * 4), *idx = malloc((size_t)B * 4), *pos = malloc((size_t)B * 4);
    uint32_t *rowc = malloc((size_t)B * 4), *idxc = malloc((size_t)B * 4), *posc = malloc((size_t)B * 4);
    gt_download(lg, dlg, (size_t)(T * E) * 4);
    gt_download(w, dw, (size_t)B * 4);
    gt_download(ids, dids, (size_t)B * 4);
    gt_download(row, drow, (size_t)B * 4);
    gt_download(idx, didx, (size_t)B * 4);
    gt_download(pos, dpos, (size_t)B * 4);
    /* the logits: fp32 sums of H products against fp64 (bound: H ulps of the sum of |products|) */
    int bad = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) {
            double ref = 0.0, mag = 0.0;
            for (int64_t i = 0; i < H; i++) {
                ref += (double)x[t * H + i] * W[e * H + i];
                mag += fabs((double)x[t * H + i] * W[e * H + i]);
            }
            const double err = fabs(lg[t * E + e] - ref);
            if (!(err <= (double)H * 0x1p-24 * mag + 1e-30)) { /* the fp32 summation bound */
                if (bad++ < 3) fprintf(stderr, "T=%lld E=%lld H=%lld: logit[%lld][%lld] %.9g vs %.9g\n", (long long)T,
                                       (long long)E, (long long)H, (long long)t, (long long)e, lg[t * E + e], ref);
            }
        }
    assert_int_equal(bad, 0);
    /* top-k and sort: the CPU ops on the GPU's logits */
    const op_router_cfg oc = {E, k, G, TG, 1, 2.5f, b};
    assert_int_equal(op_router_topk(&oc, lg, T, idsc, wc), FP4MOE_OK);
    assert_memory_equal(ids, idsc, (size_t)B * 4);
    for (int64_t i = 0; i < B; i++) /* the device's expf may differ from libm's by an ulp */
        if (!(fabsf(w[i] - wc[i]) <= 4e-7f * fabsf(wc[i]))) fail_msg("T=%lld: weight %lld %.9g vs %.9g", (long long)T,
                                                                    (long long)i, w[i], wc[i]);
    assert_int_equal(op_sort_by_expert(idsc, B, E, rowc, idxc, posc), FP4MOE_OK);
    assert_memory_equal(row, rowc, (size_t)B * 4);
    assert_memory_equal(idx, idxc, (size_t)B * 4);
    assert_memory_equal(pos, posc, (size_t)B * 4);
    if (B > 32 && E > 1) { /* the runs of the sorted idx for the gathers' row tile, the counter 0 */
        const int mt = gather_qmm_cuda_row_tile(B, E);
        assert_ptr_equal(runs.idx, didx);
        assert_true(runs.B == B && runs.E == E && runs.mt == mt);
        int *want = cpu_runs(idxc, B, E, mt), *got = malloc(rbytes);
        gt_download(got, runs.buf, rbytes);
        if (memcmp(want, got, rbytes))
            fail_msg("route T=%lld E=%lld k=%lld: the sort's expert runs (row tile %d) differ from idx's", (long long)T,
                     (long long)E, (long long)k, mt);
        free(want); free(got);
    } else {
        assert_null(runs.idx); /* a warp sort: no runs */
    }
    gt_free(runs.buf);
    free(x); free(W); free(b); free(lg); free(w); free(wc); free(ids); free(idsc);
    free(row); free(idx); free(pos); free(rowc); free(idxc); free(posc);
    gt_free(dx); gt_free(dW); gt_free(db); gt_free(dlg); gt_free(dw); gt_free(dids);
    gt_free(drow); gt_free(didx); gt_free(dpos);
    free(xb);
    if (x3) {
        gt_free(dxb);
        gt_free(dW3);
    }
}

static void route_case(gpu_ctx *g, int64_t T, int64_t E, int64_t k, int64_t G, int64_t TG, int64_t H, int bias,
                       uint64_t seed) {
    route_case_w(g, T, E, k, G, TG, H, bias, seed, 0.05, 0);
}

/* cuda_split_bf16x3: p0 + p1 + p2 == w exactly (sums in fp64), on random weights of many magnitudes and
 * on special values */
static void test_split_bf16x3(void **state) {
    gpu_ctx *g = *state;
    tu_rng r;
    tu_rng_seed(&r, 77);
    const int64_t n = 100003;
    float *w = malloc((size_t)n * 4);
    for (int64_t i = 0; i < n; i++) w[i] = (float)(tu_rng_normal(&r) * ldexp(1.0, (int)tu_rng_below(&r, 160) - 90));
    const float sp[] = {0.0f, -0.0f, 1.0f / 3.0f, -3.0e38f, 1.0e-30f, 0x1.fffffep0f, -0x1.000002p-3f};
    memcpy(w, sp, sizeof sp);
    float *dw = gt_upload(w, (size_t)n * 4);
    uint16_t *dp = gt_upload(NULL, (size_t)(3 * n) * 2), *p = malloc((size_t)(3 * n) * 2);
    gt_poison(dp, (size_t)(3 * n) * 2);
    assert_int_equal(cuda_split_bf16x3(g->stream, dw, n, dp), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(p, dp, (size_t)(3 * n) * 2);
    for (int64_t i = 0; i < n; i++) {
        const double s = (double)bf16_to_f32(p[i]) + (double)bf16_to_f32(p[n + i]) + (double)bf16_to_f32(p[2 * n + i]);
        if (s != (double)w[i]) fail_msg("split_bf16x3: w[%lld] = %a, planes sum to %a", (long long)i, w[i], s);
    }
    free(w); free(p);
    gt_free(dw); gt_free(dp);
}

static void test_moe_route(void **state) {
    gpu_ctx *g = *state;
    /* one group, the register top-k (E <= 256): E not a multiple of 32, 8 experts a lane, ties (zero
     * weights: every score 0.5, the lowest ids win; with a bias the bias decides), k = E; and the
     * shared-memory top-k beyond 256 experts */
    route_case(g, 1, 200, 8, 1, 1, 64, 1, 400);
    route_case(g, 3, 256, 6, 1, 1, 64, 0, 401);
    route_case_w(g, 2, 128, 6, 1, 1, 64, 0, 402, 0.0, 0);
    route_case_w(g, 2, 96, 6, 1, 1, 64, 1, 403, 0.0, 0);
    route_case(g, 1, 40, 40, 1, 1, 32, 1, 404);
    route_case(g, 17, 300, 6, 1, 1, 64, 1, 405);
    route_case_w(g, 1, 300, 6, 1, 1, 64, 0, 406, 0.0, 0);
    const int64_t Ts[] = {1, 2, 5, 6, 11, 16, 17, 40};
    for (size_t i = 0; i < sizeof Ts / sizeof Ts[0]; i++) {
        route_case(g, Ts[i], 128, 6, 1, 1, 2688, 1, 100 + i); /* Nemotron: warp sort to T = 5 */
        route_case(g, Ts[i], 8, 2, 4, 2, 96, 0, 200 + i);      /* groups, no bias */
    }
    route_case(g, 3, 128, 6, 1, 1, 2690, 1, 300); /* H % 4 != 0: the cuBLAS path */
    /* the cuBLAS path's split-K form (cuda_matmul_f32: 16 parts of K up to 512 rows, 8 at 1,024, none
     * above or for K % 8 != 0) against the fp64 logits: a batched decode step, a 512-token prefill,
     * 1,024 rows, 2,048 rows (no split) */
    route_case(g, 64, 128, 6, 1, 1, 2688, 1, 301);
    route_case(g, 512, 128, 6, 1, 1, 2688, 1, 302);
    route_case(g, 1024, 128, 6, 1, 1, 2688, 1, 303);
    route_case(g, 2048, 128, 6, 1, 1, 2688, 1, 305);
    route_case(g, 100, 40, 4, 1, 1, 200, 0, 304);   /* K = 200: 10 parts of 20 */
    /* the many-block sort (from 2,048 rows; 512, 1,024 and 2,048 tokens above take it too): E not a
     * multiple of 32; every row on experts 0-5 (zero weights: ties); 64 blocks of more than 1,024 rows */
    route_case(g, 400, 300, 6, 1, 1, 32, 1, 306);
    route_case_w(g, 500, 128, 6, 1, 1, 32, 0, 307, 0.0, 0);
    route_case(g, 12000, 128, 6, 1, 1, 32, 1, 308);
    /* the prefill logits on bf16 tensor cores (cuda_matmul_bf16x3_planes, summed by the top-k kernel) against the
     * fp64 logits of the same bf16 x: the Nemotron shapes (512, 2,048 tokens), E not a multiple of 32, K = 32 and
     * 64 (where a plane's error is far above the bound), zero weights (ties), two parts of rows (12,000 >
     * split_n / 3E = 6,400: the top-k's register path; 3,000 > 2,730 at E = 300: its general path) */
    route_case_w(g, 17, 300, 6, 1, 1, 64, 1, 310, 0.05, 1);
    route_case_w(g, 512, 128, 6, 1, 1, 2688, 1, 311, 0.05, 1);
    route_case_w(g, 2048, 128, 6, 1, 1, 2688, 1, 312, 0.05, 1);
    route_case_w(g, 400, 300, 6, 1, 1, 32, 1, 313, 0.05, 1);
    route_case_w(g, 500, 128, 6, 1, 1, 32, 0, 314, 0.0, 1);
    route_case_w(g, 12000, 128, 6, 1, 1, 64, 1, 315, 0.05, 1);
    route_case_w(g, 3000, 300, 6, 1, 1, 64, 1, 316, 0.05, 1);
}

/* ---- cuda_rmsnorm with the residual folded in -------------------------------------------------- */

static void norm_case(gpu_ctx *g, int64_t T, int64_t H, int na, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    float *h = randf(&r, T * H, 3.0), *w = randf(&r, H, 1.0);
    uint16_t *a = randb(&r, T * H, 1.0), *b = randb(&r, T * H, 1.0);
    float *dh = gt_upload(h, (size_t)(T * H) * 4), *dw = gt_upload(w, (size_t)H * 4);
    uint16_t *da = gt_upload(a, (size_t)(T * H) * 2), *db = gt_upload(b, (size_t)(T * H) * 2);
    uint16_t *dy = gt_upload(NULL, (size_t)(T * H) * 2);
    float *dy32 = gt_upload(NULL, (size_t)(T * H) * 4);
    gt_poison(dy, (size_t)(T * H) * 2);
    gt_poison(dy32, (size_t)(T * H) * 4);
    assert_int_equal(cuda_rmsnorm(g->stream, dh, na ? da : NULL, na > 1 ? db : NULL, dw, T, H, 1e-5f, dy, dy32),
                     FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    float *gh = malloc((size_t)(T * H) * 4), *gy32 = malloc((size_t)(T * H) * 4), *ref = malloc((size_t)(T * H) * 4);
    uint16_t *gy = malloc((size_t)(T * H) * 2);
    gt_download(gh, dh, (size_t)(T * H) * 4);
    gt_download(gy, dy, (size_t)(T * H) * 2);
    gt_download(gy32, dy32, (size_t)(T * H) * 4);
    for (int64_t i = 0; i < T * H; i++) { /* the CPU residual: h + (a + b) */
        float o = bf16_to_f32(a[i]);
        if (na > 1) o += bf16_to_f32(b[i]);
        if (na) h[i] += o;
    }
    assert_memory_equal(gh, h, (size_t)(T * H) * 4);
    op_rmsnorm(h, w, T, H, 1e-5f, ref);
    int bad = 0;
    for (int64_t i = 0; i < T * H; i++) {
        const float cpu = bf16_to_f32(f32_to_bf16(ref[i])), gpu = bf16_to_f32(gy[i]);
        const float step = fabsf(cpu) * 0x1p-7f + 1e-30f;
        if (!(fabsf(gpu - cpu) <= step) || gy32[i] != gpu) {
            if (bad++ < 3) fprintf(stderr, "rmsnorm T=%lld H=%lld na=%d: [%lld] gpu %g (y32 %g) cpu %g\n", (long long)T,
                                   (long long)H, na, (long long)i, gpu, gy32[i], cpu);
        }
    }
    assert_int_equal(bad, 0);
    /* every row bitwise equal to the same row normalised alone (the many-row form computes the
     * one-row kernel's arithmetic): rows 0, one in the middle and the last */
    const int64_t pick[3] = {0, T / 2, T - 1};
    for (int p = 0; p < 3; p++) {
        const int64_t t = pick[p];
        float *h1 = gt_upload(h + t * H, (size_t)H * 4); /* h already holds the residual sum */
        uint16_t *y1 = gt_upload(NULL, (size_t)H * 2);
        gt_poison(y1, (size_t)H * 2);
        assert_int_equal(cuda_rmsnorm(g->stream, h1, NULL, NULL, dw, 1, H, 1e-5f, y1, NULL), FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        uint16_t *o1 = malloc((size_t)H * 2);
        gt_download(o1, y1, (size_t)H * 2);
        if (memcmp(o1, gy + t * H, (size_t)H * 2))
            fail_msg("rmsnorm T=%lld H=%lld na=%d: row %lld differs from the row normalised alone", (long long)T,
                     (long long)H, na, (long long)t);
        free(o1);
        gt_free(h1);
        gt_free(y1);
    }
    free(h); free(w); free(a); free(b); free(gh); free(gy32); free(ref); free(gy);
    gt_free(dh); gt_free(dw); gt_free(da); gt_free(db); gt_free(dy); gt_free(dy32);
}

static void test_rmsnorm_residual(void **state) {
    gpu_ctx *g = *state;
    const int64_t Hs[] = {2688, 4100, 7, 4096, 96}, Ts[] = {1, 3, 64, 300}; /* >= 64 rows: the 256-thread forms */
    uint64_t seed = 1;
    for (size_t i = 0; i < sizeof Hs / sizeof Hs[0]; i++)
        for (size_t j = 0; j < 4; j++)
            for (int na = 0; na <= 2; na++) norm_case(g, Ts[j], Hs[i], na, seed++);
}

/* ---- relu^2 in the gather_qmm epilogue ---------------------------------------------------------- */

static void relu2_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t B, tu_idx_pattern pat, fp4moe_route route,
                       int expect_fused, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, E, N, K, 1, &r), 0);
    fp4moe_nvfp4_weights w = tw.w;
    w.codes = gt_upload(tw.codes, (size_t)(E * N * K / 2));
    w.scales = gt_upload(tw.scales, (size_t)(E * N * K / 16));
    w.global_scale = gt_upload(tw.gs, (size_t)E * 4);
    void *x = tu_random_x(FP4MOE_BF16, B, K, &r);
    uint32_t *idx = tu_make_idx(pat, B, E, 6, &r);
    void *dx = gt_upload(x, (size_t)(B * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4);
    uint16_t *y1 = gt_upload(NULL, (size_t)(B * N) * 2), *y2 = gt_upload(NULL, (size_t)(B * N) * 2);
    gt_poison(y1, (size_t)(B * N) * 2);
    gt_poison(y2, (size_t)(B * N) * 2);
    const int sorted = pat != TU_IDX_UNSORTED;
    int fused = -1, plain = -1;
    assert_int_equal(gather_qmm_cuda_ex(&w, 0, dx, FP4MOE_BF16, didx, B, sorted, route, 1, y1, g->stream, &fused, NULL),
                     FP4MOE_OK);
    assert_int_equal(gather_qmm_cuda_ex(&w, 0, dx, FP4MOE_BF16, didx, B, sorted, route, 0, y2, g->stream, &plain, NULL),
                     FP4MOE_OK);
    assert_int_equal(plain, 0);
    assert_int_equal(fused, expect_fused);
    if (!fused) assert_int_equal(cuda_relu2(g->stream, y1, B * N), FP4MOE_OK);
    assert_int_equal(cuda_relu2(g->stream, y2, B * N), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    uint16_t *h1 = malloc((size_t)(B * N) * 2), *h2 = malloc((size_t)(B * N) * 2);
    gt_download(h1, y1, (size_t)(B * N) * 2);
    gt_download(h2, y2, (size_t)(B * N) * 2);
    int64_t nan = 0, neg = 0;
    for (int64_t i = 0; i < B * N; i++) {
        const float v = bf16_to_f32(h1[i]);
        nan += isnan(v);
        neg += v < 0.0f;
    }
    assert_int_equal(nan, 0);
    assert_int_equal(neg, 0);
    if (memcmp(h1, h2, (size_t)(B * N) * 2))
        fail_msg("relu2 epilogue (route %s, B=%lld, N=%lld, K=%lld) differs from gather_qmm + relu2",
                 fp4moe_route_name(route), (long long)B, (long long)N, (long long)K);
    free(h1); free(h2); free(x); free(idx);
    gt_free(dx); gt_free(didx); gt_free(y1); gt_free(y2);
    gt_free((void *)w.codes); gt_free((void *)w.scales); gt_free((void *)w.global_scale);
    tu_weights_free(&tw);
}

static void test_relu2_epilogue(void **state) {
    gpu_ctx *g = *state;
    relu2_case(g, 128, 1856, 2688, 6, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 1);  /* qmv decode kernel */
    relu2_case(g, 8, 100, 48, 29, TU_IDX_UNSORTED, FP4MOE_ROUTE_AUTO, 1, 2);         /* fp32-FMA qmv (K % 32) */
    relu2_case(g, 8, 100, 64, 48, TU_IDX_UNSORTED, FP4MOE_ROUTE_QMV, 1, 3);          /* qmv, 48 rows */
    relu2_case(g, 128, 1856, 2688, 3072, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 1, 4);
    relu2_case(g, 128, 100, 64, 3072, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_QMV, 1, 5);      /* qmv tiled */
    relu2_case(g, 8, 100, 64, 3072, TU_IDX_DUPLICATES, FP4MOE_ROUTE_DEQUANT_GEMM, 0, 6);
}

/* ---- the tiled weight layout (cuda_nvfp4_relayout_tiled) ------------------------------------------ */

/* gather_qmm on the same weights in the checkpoint layout and re-laid (tiled): bitwise equal
 * outputs (the kernels read the same values into the same registers). kind 0: gather_qmm_cuda_ex
 * (route), 1: the f32-out form, 2: the plain-linear form (E = 1, idx 0: dequant_gemm from 256 rows),
 * 3: a call no kernel can take on the tiled layout (unsorted, > 32 rows): FP4MOE_EUNSUPPORTED,
 * 4 / 5: the plain-linear form against the same with the weights dequantized once beforehand
 * (cuda_nvfp4_dequant_bf16, the load-time copy; from the tiled layout for 4, from the checkpoint
 * layout for 5), every code and scale poisoned before the second call (it must read the copy).
 * The weights are poisoned between the two calls' uploads so that the tiled call cannot read them. */
static int g_tiled_wide;                         /* 1: scale bytes over the whole finite range (test_tiled_scales) */
static fp4moe_dtype g_tiled_xt = FP4MOE_BF16;    /* x of kind 0 */
static void tiled_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t B, tu_idx_pattern pat, fp4moe_route route,
                       int kind, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, E, N, K, 1, &r), 0);
    if (g_tiled_wide) /* every byte but the NaNs 0x7F / 0xFF: +-0, negatives, subnormals, 448 */
        for (size_t i = 0; i < (size_t)(E * N * K / 16); i++) {
            const uint32_t u = tu_rng_below(&r, 254);
            tw.scales[i] = (uint8_t)(u >= 0x7f ? u + 1 : u);
        }
    const fp4moe_dtype xt = kind == 0 ? g_tiled_xt : FP4MOE_BF16;
    fp4moe_nvfp4_weights w = tw.w, wt;
    w.codes = gt_upload(tw.codes, (size_t)(E * N * K / 2));
    w.scales = gt_upload(tw.scales, (size_t)(E * N * K / 16));
    w.global_scale = gt_upload(tw.gs, (size_t)E * 4);
    const size_t tb = (size_t)(E * cuda_nvfp4_tiled_expert_bytes(N, K));
    uint8_t *dt = gt_upload(NULL, tb);
    gt_poison(dt, tb);
    assert_int_equal(cuda_nvfp4_relayout_tiled(g->stream, w.codes, w.scales, E, N, K, dt), FP4MOE_OK);
    wt = w;
    wt.codes = dt;
    wt.scales = dt;
    void *x = tu_random_x(xt, B, K, &r);
    uint32_t *idx = kind == 2 || kind >= 4 ? calloc((size_t)B, 4) : tu_make_idx(pat, B, E, 6, &r);
    void *dx = gt_upload(x, (size_t)(B * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4);
    const size_t yb = (size_t)(B * N) * (kind == 1 ? 4 : 2);
    void *y1 = gt_upload(NULL, yb), *y2 = gt_upload(NULL, yb);
    gt_poison(y1, yb);
    gt_poison(y2, yb);
    const int sorted = pat != TU_IDX_UNSORTED;
    int f1 = -1, f2 = -1;
    void *wb = NULL;
    if (kind == 3) {
        assert_int_equal(gather_qmm_cuda_ex(&wt, 1, dx, FP4MOE_BF16, didx, B, sorted, route, 0, y2, g->stream, &f2, NULL),
                         FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "tiled weights"));
        fp4moe_clear_error();
        GT_CHECK(cudaMemcpy(y1, y2, yb, cudaMemcpyDeviceToDevice)); /* nothing to compare */
    } else if (kind == 0) {
        assert_int_equal(gather_qmm_cuda_ex(&w, 0, dx, xt, didx, B, sorted, route, 1, y1, g->stream, &f1, NULL), FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        gt_poison((void *)w.codes, (size_t)(E * N * K / 2));
        assert_int_equal(gather_qmm_cuda_ex(&wt, 1, dx, xt, didx, B, sorted, route, 1, y2, g->stream, &f2, NULL),
                         FP4MOE_OK);
        assert_int_equal(f1, f2);
    } else if (kind == 1) {
        assert_int_equal(gather_qmm_cuda_bf16_f32out(&w, 0, dx, didx, B, y1, g->stream), FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        gt_poison((void *)w.codes, (size_t)(E * N * K / 2));
        assert_int_equal(gather_qmm_cuda_bf16_f32out(&wt, 1, dx, didx, B, y2, g->stream), FP4MOE_OK);
    } else {
        assert_int_equal(gather_qmm_cuda_linear(&w, 0, dx, FP4MOE_BF16, didx, B, route, 0, y1, g->stream, g->ops.blas,
                                                &g->dq, NULL, (const float *)(const void *)didx, NULL, &f1),
                         FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        if (kind >= 4) {
            const size_t wbb = (size_t)(N * K) * 2;
            wb = gt_upload(NULL, wbb);
            gt_poison(wb, wbb);
            assert_int_equal(cuda_nvfp4_dequant_bf16(g->stream, kind == 4 ? dt : w.codes, w.scales, kind == 4, N, K, wb),
                             FP4MOE_OK);
            GT_CHECK(cudaStreamSynchronize(g->stream));
            gt_poison(dt, tb);
            gt_poison((void *)w.scales, (size_t)(E * N * K / 16));
        }
        gt_poison((void *)w.codes, (size_t)(E * N * K / 2));
        assert_int_equal(gather_qmm_cuda_linear(&wt, 1, dx, FP4MOE_BF16, didx, B, route, 0, y2, g->stream, g->ops.blas,
                                                &g->dq, wb, (const float *)(const void *)didx, NULL, &f2),
                         FP4MOE_OK);
    }
    GT_CHECK(cudaStreamSynchronize(g->stream));
    uint8_t *h1 = malloc(yb), *h2 = malloc(yb);
    gt_download(h1, y1, yb);
    gt_download(h2, y2, yb);
    if (memcmp(h1, h2, yb))
        fail_msg("tiled layout (kind %d, route %s, E=%lld N=%lld K=%lld B=%lld, x %s%s) differs from the checkpoint layout",
                 kind, fp4moe_route_name(route), (long long)E, (long long)N, (long long)K, (long long)B,
                 xt == FP4MOE_F16 ? "f16" : "bf16", g_tiled_wide ? ", every scale byte" : "");
    free(h1); free(h2); free(x); free(idx);
    gt_free(dx); gt_free(didx); gt_free(y1); gt_free(y2); gt_free(dt);
    if (wb) gt_free(wb);
    gt_free((void *)w.codes); gt_free((void *)w.scales); gt_free((void *)w.global_scale);
    tu_weights_free(&tw);
}

/* The tiled layout's scale codes (src/kernels/tiled_codes.h: the scale's sign and zero folded into the codes) with
 * every finite scale byte - +-0, negatives, subnormals, 448 - on each kernel that reads them, bitwise against the
 * checkpoint layout (signed zeros included). Fault: FP4MOE_INJECT_FAULT_TILED_SIGN in gather_qmv.cu's relayout. */
static void test_tiled_scales(void **state) {
    gpu_ctx *g = *state;
    g_tiled_wide = 1;
    tiled_case(g, 8, 72, 128, 6, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 0, 31);      /* qmv (tensor cores) */
    tiled_case(g, 8, 72, 128, 48, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 0, 32);  /* 32-row tiles (w32) */
    tiled_case(g, 4, 100, 256, 900, TU_IDX_ONE_EXPERT, FP4MOE_ROUTE_BATCHED, 0, 33); /* 64-row tiles (wgmma) */
    tiled_case(g, 16, 200, 320, 600, TU_IDX_DUPLICATES, FP4MOE_ROUTE_QMV, 0, 34);    /* qmv, tiled by 8 rows */
    tiled_case(g, 6, 90, 192, 700, TU_IDX_EMPTY_EXPERTS, FP4MOE_ROUTE_DEQUANT_GEMM, 0, 35);
    tiled_case(g, 1, 300, 384, 5, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 36);     /* f32 out, qmv */
    tiled_case(g, 1, 2048, 256, 48, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 37);   /* linear of 33-64 rows (kg) */
    tiled_case(g, 1, 136, 448, 300, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 4, 38);   /* load-time copy (tiled) */
    g_tiled_xt = FP4MOE_F16;
    tiled_case(g, 8, 72, 128, 48, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 0, 39);  /* f16: 32-row tiles */
    tiled_case(g, 4, 100, 256, 900, TU_IDX_ONE_EXPERT, FP4MOE_ROUTE_BATCHED, 0, 40); /* f16: 64-row tiles */
    g_tiled_xt = FP4MOE_BF16;
    g_tiled_wide = 0;
}

static void test_tiled_layout(void **state) {
    gpu_ctx *g = *state;
    /* N % 16 != 0, K % 128 == 64, several experts, rows out of range, one expert, duplicates */
    tiled_case(g, 5, 40, 192, 13, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_AUTO, 0, 1);         /* qmv (tensor cores) */
    tiled_case(g, 128, 1856, 2688, 6, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 0, 2);   /* decode shape */
    tiled_case(g, 8, 72, 128, 48, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 0, 3);    /* 48 rows: 32-row tiles (w32) */
    tiled_case(g, 8, 72, 128, 40, TU_IDX_UNSORTED, FP4MOE_ROUTE_QMV, 3, 12);          /* unsorted > 32 rows: refused */
    tiled_case(g, 16, 200, 320, 600, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_BATCHED, 0, 4);    /* 32-row tiles */
    tiled_case(g, 3, 136, 256, 117, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 0, 19); /* runs of ~39: a full and a partial w32 item */
    tiled_case(g, 4, 100, 256, 900, TU_IDX_ONE_EXPERT, FP4MOE_ROUTE_BATCHED, 0, 5);   /* 64-row tiles */
    tiled_case(g, 8, 200, 320, 3072, TU_IDX_EMPTY_EXPERTS, FP4MOE_ROUTE_BATCHED, 0, 13); /* 64-row tiles, K % 128 = 64 */
    tiled_case(g, 16, 200, 320, 600, TU_IDX_DUPLICATES, FP4MOE_ROUTE_QMV, 0, 6);      /* qmv, tiled by 8 rows */
    tiled_case(g, 6, 90, 192, 700, TU_IDX_EMPTY_EXPERTS, FP4MOE_ROUTE_DEQUANT_GEMM, 0, 7);
    tiled_case(g, 1, 300, 384, 5, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 8);       /* f32 out, qmv */
    tiled_case(g, 1, 300, 384, 70, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 9);      /* f32 out, batched */
    tiled_case(g, 1, 136, 448, 300, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 10);    /* dense dequant_gemm */
    tiled_case(g, 1, 136, 448, 70, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 11);     /* linear, 70 rows */
    /* plain linears of longer K: 64-row tiles with K % 128 = 64 (17 steps), f32 out, relu^2 on the qmv
     * route's 8-row tiles */
    tiled_case(g, 1, 136, 2112, 100, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 18);
    tiled_case(g, 1, 300, 1024, 70, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 19);
    tiled_case(g, 1, 200, 2048, 64, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_QMV, 0, 20);
    tiled_case(g, 1, 136, 448, 300, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 4, 14);    /* load-time copy (tiled) */
    tiled_case(g, 1, 200, 320, 257, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 5, 15);    /* load-time copy (checkpoint) */
    /* plain linears on the qmv (E = 1: each warp's first piece read before the PDL wait, qmma_pdl_entry):
     * 16-warp blocks with 36 K steps (pieces after the preloaded ones, rows out of range), and 8-warp
     * blocks over 513 tiles with 21 steps (3 a warp) */
    tiled_case(g, 1, 40, 4608, 9, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_AUTO, 0, 16);
    tiled_case(g, 1, 8200, 2688, 1, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 17);
    /* sorted calls of 33-63 rows on the qmv route (a prefill's last chunk of 33-63 tokens): one kernel for
     * both layouts (the 8-row tiles; the fp32 qmv kernel on the checkpoint layout was not bitwise equal,
     * found in session 19 by test_model_gpu tiled_layout); experts, and a plain linear */
    tiled_case(g, 8, 1000, 2048, 44, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 0, 18);
    tiled_case(g, 1, 2000, 2048, 63, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 19);
    /* the row-tile rules of session 23: <= 4 rows an expert on the batched route's 8-row tiles (E > 1), and
     * fp32 output of a 64-row plain linear with N <= 8,192 (8-row tiles, E = 1) */
    tiled_case(g, 8, 72, 320, 24, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_BATCHED, 0, 21);
    tiled_case(g, 1, 300, 1024, 64, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 1, 22);
    /* gq_dense_kg_kernel (plain linears of 33-64 rows with N >= 2,048): both layouts on each route, rows out of
     * range, N % 64 = 56, K % 128 = 64, relu^2; the linear form at 64 rows */
    tiled_case(g, 1, 2104, 320, 37, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_AUTO, 0, 23);
    tiled_case(g, 1, 2104, 320, 37, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_BATCHED, 0, 24);
    tiled_case(g, 1, 2048, 2688, 64, TU_IDX_TOPK_SORTED, FP4MOE_ROUTE_AUTO, 2, 25);
    tiled_case(g, 1, 2104, 320, 24, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_AUTO, 0, 26);    /* 17-32 rows: see KG_MIN_ROWS */
    tiled_case(g, 1, 2104, 320, 24, TU_IDX_OOR_TAIL, FP4MOE_ROUTE_BATCHED, 0, 27);
}

/* Random NVFP4 weights (E, N, K; per-expert global scales) on the device; tiled: w reads the tiled
 * layout (cuda_nvfp4_relayout_tiled), else the checkpoint layout. */
typedef struct {
    tu_weights tw;
    fp4moe_nvfp4_weights w;
    uint8_t *dc, *ds, *dt;
} dev_weights;

static void dev_weights_make(gpu_ctx *g, dev_weights *d, int64_t E, int64_t N, int64_t K, int tiled, tu_rng *r) {
    assert_int_equal(tu_weights_random(&d->tw, E, N, K, 1, r), 0);
    d->w = d->tw.w;
    d->dc = gt_upload(d->tw.codes, (size_t)(E * N * K / 2));
    d->ds = gt_upload(d->tw.scales, (size_t)(E * N * K / 16));
    d->w.codes = d->dc;
    d->w.scales = d->ds;
    d->w.global_scale = gt_upload(d->tw.gs, (size_t)E * 4);
    d->dt = NULL;
    if (tiled) {
        d->dt = gt_upload(NULL, (size_t)(E * cuda_nvfp4_tiled_expert_bytes(N, K)));
        assert_int_equal(cuda_nvfp4_relayout_tiled(g->stream, d->dc, d->ds, E, N, K, d->dt), FP4MOE_OK);
        d->w.codes = d->dt;
        d->w.scales = d->dt;
    }
}

static void dev_weights_free(dev_weights *d) {
    if (d->dt) gt_free(d->dt);
    gt_free(d->dc);
    gt_free(d->ds);
    gt_free((void *)d->w.global_scale);
    tu_weights_free(&d->tw);
}

/* ---- one token's routed experts without gathered rows (gather_qmm_cuda_x1) -------------------------
 * The same call as gather_qmm_cuda_ex on B copies of one x row (route auto, sorted): bitwise equal
 * outputs (outputs poisoned before each call); x holds a second, different row after the first, so a
 * kernel reading any other row than row 0 differs. want_ok = 0: a call the function must refuse
 * (FP4MOE_EUNSUPPORTED; the caller then gathers). */
static void x1_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t B, int tiled, int relu2, int want_ok,
                    uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    dev_weights dw;
    dev_weights_make(g, &dw, E, N, K, tiled, &r);
    const fp4moe_nvfp4_weights w = dw.w;
    uint16_t *x = tu_random_x(FP4MOE_BF16, 2, K, &r); /* row 0, and a row 1 no call may read */
    uint16_t *xs = malloc((size_t)(B * K) * 2);
    assert_non_null(xs);
    for (int64_t b = 0; b < B; b++) memcpy(xs + b * K, x, (size_t)K * 2);
    uint32_t *idx = tu_make_idx(TU_IDX_TOPK_SORTED, B, E, 6, &r);
    void *dx = gt_upload(x, (size_t)(2 * K) * 2), *dxs = gt_upload(xs, (size_t)(B * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4);
    const size_t yb = (size_t)(B * N) * 2;
    void *y1 = gt_upload(NULL, yb), *y2 = gt_upload(NULL, yb);
    gt_poison(y1, yb);
    gt_poison(y2, yb);
    const int st = gather_qmm_cuda_x1(&w, tiled, dx, didx, B, FP4MOE_ROUTE_AUTO, relu2, y2, g->stream);
    if (!want_ok) {
        assert_int_equal(st, FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "x1"));
        fp4moe_clear_error();
    } else {
        assert_int_equal(st, FP4MOE_OK);
        int fused = 0;
        assert_int_equal(gather_qmm_cuda_ex(&w, tiled, dxs, FP4MOE_BF16, didx, B, 1, FP4MOE_ROUTE_AUTO, relu2, y1,
                                            g->stream, &fused, NULL),
                         FP4MOE_OK);
        assert_int_equal(fused, relu2 ? 1 : 0);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        uint8_t *h1 = malloc(yb), *h2 = malloc(yb);
        gt_download(h1, y1, yb);
        gt_download(h2, y2, yb);
        if (memcmp(h1, h2, yb))
            fail_msg("x1 (E=%lld N=%lld K=%lld B=%lld tiled %d relu2 %d) differs from the gathered rows' call", (long long)E,
                     (long long)N, (long long)K, (long long)B, tiled, relu2);
        free(h1); free(h2);
    }
    free(x); free(xs); free(idx);
    gt_free(dx); gt_free(dxs); gt_free(didx); gt_free(y1); gt_free(y2);
    dev_weights_free(&dw);
}

static void test_linear_gather_x1(void **state) {
    gpu_ctx *g = *state;
    x1_case(g, 128, 1856, 2688, 6, 1, 1, 1, 31);  /* the 30B-A3B up projection of a decode token */
    x1_case(g, 128, 2688, 1856, 6, 0, 0, 1, 32);  /* checkpoint layout, no epilogue */
    x1_case(g, 4, 40, 96, 6, 1, 1, 1, 33);        /* E < k: segments of several rows; N % 16, K % 128 */
    x1_case(g, 8, 72, 160, 1, 0, 1, 1, 34);       /* one row */
    x1_case(g, 16, 200, 320, 32, 1, 0, 1, 35);    /* 32 rows: more segments than slots */
    x1_case(g, 16, 200, 320, 64, 1, 0, 0, 36);    /* 64 rows: the expert-batched route - refused */
    x1_case(g, 4, 40, 80, 6, 0, 0, 0, 37);        /* K % 32 != 0: no tensor-core qmv - refused */
}

/* ---- gather_qmm_cuda_rows: the up projection reading x through the sort's row_of -------------------- */

/* T tokens with k random experts each (duplicates allowed), sorted stably by expert on the host (row_of,
 * idx as the sort makes them); gather_qmm_cuda_rows on x (T rows plus a NaN row no call may read)
 * against gather_qmm_cuda_ex on the gathered copy xs[p] = x[row_of[p] / k]: bitwise equal, or the
 * refusal (want_ok 0: FP4MOE_EUNSUPPORTED naming "rows"). */
static void rows_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t T, int64_t k, int tiled, int relu2,
                      fp4moe_route route, int want_ok, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    dev_weights dw;
    dev_weights_make(g, &dw, E, N, K, tiled, &r);
    const fp4moe_nvfp4_weights w = dw.w;
    const int64_t B = T * k;
    uint16_t *x = tu_random_x(FP4MOE_BF16, T + 1, K, &r);
    for (int64_t i = 0; i < K; i++) x[T * K + i] = 0x7fc0; /* row T: NaN, outside the map */
    uint32_t *ids = malloc((size_t)B * 4), *row_of = malloc((size_t)B * 4), *idx = malloc((size_t)B * 4);
    uint16_t *xs = malloc((size_t)(B * K) * 2);
    assert_true(ids && row_of && idx && xs);
    for (int64_t b = 0; b < B; b++) ids[b] = tu_rng_below(&r, (uint32_t)E);
    int64_t p = 0;
    for (uint32_t e = 0; e < (uint32_t)E; e++) /* stable counting sort by expert */
        for (int64_t b = 0; b < B; b++)
            if (ids[b] == e) {
                row_of[p] = (uint32_t)b;
                idx[p] = e;
                memcpy(xs + p * K, x + (b / k) * K, (size_t)K * 2);
                p++;
            }
    void *dx = gt_upload(x, (size_t)((T + 1) * K) * 2), *dxs = gt_upload(xs, (size_t)(B * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4), *drow = gt_upload(row_of, (size_t)B * 4);
    const size_t yb = (size_t)(B * N) * 2;
    void *y1 = gt_upload(NULL, yb), *y2 = gt_upload(NULL, yb);
    gt_poison(y1, yb);
    gt_poison(y2, yb);
    const int st = gather_qmm_cuda_rows(&w, tiled, dx, T, drow, k, didx, B, route, relu2, y2, g->stream, NULL);
    if (!want_ok) {
        assert_int_equal(st, FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "rows"));
        fp4moe_clear_error();
    } else {
        assert_int_equal(st, FP4MOE_OK);
        int fused = 0;
        assert_int_equal(gather_qmm_cuda_ex(&w, tiled, dxs, FP4MOE_BF16, didx, B, 1, route, relu2, y1, g->stream, &fused,
                                            NULL),
                         FP4MOE_OK);
        assert_int_equal(fused, relu2 ? 1 : 0);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        uint16_t *h1 = malloc(yb), *h2 = malloc(yb);
        gt_download(h1, y1, yb);
        gt_download(h2, y2, yb);
        for (size_t i = 0; i < yb / 2; i++)
            if ((h1[i] & 0x7fff) > 0x7f80) fail_msg("rows: the gathered call left a NaN at %zu", i);
        if (memcmp(h1, h2, yb))
            fail_msg("rows (E=%lld N=%lld K=%lld T=%lld k=%lld tiled %d relu2 %d route %s) differs from the gathered "
                     "rows' call", (long long)E, (long long)N, (long long)K, (long long)T, (long long)k, tiled, relu2,
                     fp4moe_route_name(route));
        /* the same calls on runs made beforehand (gq_runs, as the router's sort makes them: the runs kernel
         * skipped), three in a row on one counter - each must leave it at 0 for the next (the up and down
         * projections share it) - the same bits */
        if (E > 1) {
            int *hr = cpu_runs(idx, B, E, gather_qmm_cuda_row_tile(B, E));
            const size_t rbytes = (size_t)(2 * E + 3) * 4;
            gq_runs runs = {gt_upload(hr, rbytes), E, didx, B, E, gather_qmm_cuda_row_tile(B, E), NULL, 0, NULL, 0};
            for (int rep = 0; rep < 3; rep++) {
                gt_poison(y2, yb);
                if (rep == 1)
                    assert_int_equal(gather_qmm_cuda_ex(&w, tiled, dxs, FP4MOE_BF16, didx, B, 1, route, relu2, y2,
                                                        g->stream, &fused, &runs), FP4MOE_OK);
                else
                    assert_int_equal(gather_qmm_cuda_rows(&w, tiled, dx, T, drow, k, didx, B, route, relu2, y2, g->stream,
                                                          &runs), FP4MOE_OK);
                GT_CHECK(cudaStreamSynchronize(g->stream));
                gt_download(h2, y2, yb);
                if (memcmp(h1, h2, yb))
                    fail_msg("rows (E=%lld N=%lld K=%lld T=%lld k=%lld tiled %d route %s) on runs made beforehand, call "
                             "%d: differs", (long long)E, (long long)N, (long long)K, (long long)T, (long long)k, tiled,
                             fp4moe_route_name(route), rep + 1);
            }
            int ctr = -1;
            gt_download(&ctr, runs.buf + 2 * E + 2, 4);
            assert_int_equal(ctr, 0);
            free(hr);
            gt_free(runs.buf);
        }
        free(h1); free(h2);
    }
    free(x); free(xs); free(ids); free(row_of); free(idx);
    gt_free(dx); gt_free(dxs); gt_free(didx); gt_free(drow); gt_free(y1); gt_free(y2);
    dev_weights_free(&dw);
}

/* The MoE cases' inputs: x (T + 1 rows of K bf16, row T NaN: outside the map) and B = T k rows of random experts
 * (`skew` 1: expert draws weighted (e + 1)^-1 so some runs span several tiles; 2: runs of chosen lengths around the
 * 64- and 128-row tile bounds, expert e taking kLens[e % 12] rows, the last expert the rest, in a random order; the
 * last `oor` rows out of range, idx E), sorted on the host: row_of[p] = the unsorted row b (token b / k) of sorted
 * row p, idx[p] its expert. */
static void moe_case_inputs(tu_rng *r, int64_t E, int64_t K, int64_t T, int64_t k, int skew, int64_t oor,
                            uint16_t **x, uint32_t **ids, uint32_t **row_of, uint32_t **idx) {
    const int64_t B = T * k;
    *x = tu_random_x(FP4MOE_BF16, T + 1, K, r);
    for (int64_t i = 0; i < K; i++) (*x)[T * K + i] = 0x7fc0;
    *ids = malloc((size_t)B * 4), *row_of = malloc((size_t)B * 4), *idx = malloc((size_t)B * 4);
    assert_true(*ids && *row_of && *idx);
    for (int64_t b = 0; b < B; b++) {
        uint32_t e = tu_rng_below(r, (uint32_t)E);
        if (skew == 1 && tu_rng_below(r, 2)) e = tu_rng_below(r, 1 + e); /* more rows on the low experts */
        (*ids)[b] = b >= B - oor ? (uint32_t)E : e;                      /* the last oor rows: out of range */
    }
    if (skew == 2) {
        static const int64_t kLens[12] = {0, 1, 64, 65, 128, 192, 63, 129, 300, 320, 127, 200};
        int64_t b = 0;
        for (int64_t e = 0; e < E; e++)
            for (int64_t n = e == E - 1 ? B - oor - b : kLens[e % 12]; n > 0 && b < B - oor; n--) (*ids)[b++] = (uint32_t)e;
        for (int64_t i = B - oor - 1; i > 0; i--) { /* a random order of the in-range rows */
            const uint32_t j = tu_rng_below(r, (uint32_t)(i + 1)), t = (*ids)[i];
            (*ids)[i] = (*ids)[j];
            (*ids)[j] = t;
        }
    }
    int64_t p = 0;
    for (uint32_t e = 0; e <= (uint32_t)E; e++)
        for (int64_t b = 0; b < B; b++)
            if ((*ids)[b] == e) {
                (*row_of)[p] = (uint32_t)b;
                (*idx)[p++] = e;
            }
    assert_int_equal(p, B);
}

/* ---- gather_qmm_cuda_moe_rows: a MoE layer's up and down projections in one launch ------------------------------
 * T tokens, k experts each (duplicates allowed; `skew`: expert draws weighted (e + 1)^-1 so some runs span several
 * 32-row tiles), sorted on the host; the fused call against gather_qmm_cuda_rows (up, relu^2) then
 * gather_qmm_cuda_ex (down) on runs made beforehand (cpu_runs with row tile 32, done counters of
 * cuda_moe_done_ints): h and y bitwise equal, outputs poisoned first, three calls in a row (the done counters and
 * the work counter must come back to 0 after each), then a call with FP4MOE_CUDA_MOE_FUSED=0 and one on 8-row runs:
 * both refused (FP4MOE_EUNSUPPORTED). want_ok 0: the call itself must be refused. */
static void moe_pair_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t N2, int64_t T, int64_t k, int skew,
                          int want_ok, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    dev_weights du, dd;
    dev_weights_make(g, &du, E, N, K, 1, &r);
    dev_weights_make(g, &dd, E, N2, N, 1, &r);
    const int64_t B = T * k;
    uint16_t *x;
    uint32_t *ids, *row_of, *idx;
    moe_case_inputs(&r, E, K, T, k, skew, 0, &x, &ids, &row_of, &idx);
    void *dx = gt_upload(x, (size_t)((T + 1) * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4), *drow = gt_upload(row_of, (size_t)B * 4);
    const size_t hb = (size_t)(B * N) * 2, yb = (size_t)(B * N2) * 2;
    void *h1 = gt_upload(NULL, hb), *h2 = gt_upload(NULL, hb), *y1 = gt_upload(NULL, yb), *y2 = gt_upload(NULL, yb);
    const int mt = gather_qmm_cuda_row_tile(B, E);
    int *hr = cpu_runs(idx, B, E, mt);
    const size_t rbytes = (size_t)(2 * E + 3) * 4;
    const int64_t nd = cuda_moe_done_ints(B, E);
    gq_runs runs = {gt_upload(hr, rbytes), E, didx, B, E, mt, NULL, 0, gt_upload(NULL, (size_t)nd * 4), nd};
    GT_CHECK(cudaMemset(runs.done, 0, (size_t)nd * 4));
    const fp4moe_route A = FP4MOE_ROUTE_AUTO;
    if (!want_ok) {
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  &runs),
                         FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "moe pair"));
        fp4moe_clear_error();
    } else {
        uint16_t *a = malloc(yb > hb ? yb : hb), *b = malloc(yb > hb ? yb : hb);
        assert_true(a && b);
        int fused = 0;
        gt_poison(h1, hb);
        gt_poison(y1, yb);
        assert_int_equal(gather_qmm_cuda_rows(&du.w, 1, dx, T, drow, k, didx, B, A, 1, h1, g->stream, &runs), FP4MOE_OK);
        assert_int_equal(gather_qmm_cuda_ex(&dd.w, 1, h1, FP4MOE_BF16, didx, B, 1, A, 0, y1, g->stream, &fused, &runs),
                         FP4MOE_OK);
        for (int rep = 0; rep < 3; rep++) {
            gt_poison(h2, hb);
            gt_poison(y2, yb);
            assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                      &runs),
                             FP4MOE_OK);
            GT_CHECK(cudaStreamSynchronize(g->stream));
            for (int o = 0; o < 2; o++) {
                const size_t nb = o ? yb : hb;
                gt_download(a, o ? y1 : h1, nb);
                gt_download(b, o ? y2 : h2, nb);
                size_t bad = 0, first = 0;
                for (size_t i = 0; i < nb / 2; i++)
                    if (a[i] != b[i] && !bad++) first = i;
                if (bad)
                    fail_msg("moe pair (E=%lld %lld->%lld->%lld T=%lld k=%lld skew %d) call %d: %s differs in %zu of %zu "
                             "elements (first %zu: %04x vs %04x)", (long long)E, (long long)K, (long long)N,
                             (long long)N2, (long long)T, (long long)k, skew, rep + 1, o ? "y" : "h", bad, nb / 2, first,
                             a[first], b[first]);
            }
            int *dn = malloc((size_t)nd * 4), ctr = -1;
            assert_non_null(dn);
            gt_download(dn, runs.done, (size_t)nd * 4);
            for (int64_t i = 0; i < nd; i++)
                if (dn[i]) fail_msg("moe pair call %d: done counter %lld left at %d", rep + 1, (long long)i, dn[i]);
            gt_download(&ctr, runs.buf + 2 * E + 2, 4);
            assert_int_equal(ctr, 0);
            free(dn);
        }
        /* switched off: refused, the caller makes the two calls */
        tu_setenv("FP4MOE_CUDA_MOE_FUSED", "0");
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  &runs),
                         FP4MOE_EUNSUPPORTED);
        assert_non_null(strstr(fp4moe_last_error(), "FP4MOE_CUDA_MOE_FUSED"));
        fp4moe_clear_error();
        tu_setenv("FP4MOE_CUDA_MOE_FUSED", NULL);
        /* runs of another row tile, or no done counters: refused */
        runs.mt = 8;
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  &runs),
                         FP4MOE_EUNSUPPORTED);
        fp4moe_clear_error();
        runs.mt = mt;
        int *keep = runs.done;
        runs.done = NULL;
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  &runs),
                         FP4MOE_EUNSUPPORTED);
        fp4moe_clear_error();
        runs.done = keep;
        free(a); free(b);
    }
    free(hr); free(x); free(ids); free(row_of); free(idx);
    gt_free(runs.buf); gt_free(runs.done);
    gt_free(dx); gt_free(didx); gt_free(drow); gt_free(h1); gt_free(h2); gt_free(y1); gt_free(y2);
    dev_weights_free(&du);
    dev_weights_free(&dd);
}

static void test_moe_pair(void **state) {
    gpu_ctx *g = *state;
    moe_pair_case(g, 16, 320, 448, 200, 100, 6, 0, 1, 61);  /* 600 rows, 32-row tiles; up N % 128 = 64, down N % 128 = 72 */
    moe_pair_case(g, 16, 320, 448, 200, 100, 6, 1, 1, 62);  /* skewed: runs of several tiles */
    moe_pair_case(g, 128, 1856, 2688, 2688, 512, 6, 1, 1, 63); /* the 30B-A3B layer at 512 tokens */
    moe_pair_case(g, 2, 64, 128, 192, 20, 4, 0, 1, 64);     /* 80 rows of 2 experts: 12 items, all at once */
    moe_pair_case(g, 4, 256, 256, 128, 40, 6, 0, 0, 65);    /* 240 rows of 4 experts: 64-row tiles, below the big tiles'
                                                             * 80 an expert - refused (900 rows take the big tiles) */
    moe_pair_case(g, 2, 320, 128, 192, 1000, 6, 0, 0, 69);  /* 6,000 rows of 2 experts: dequant_gemm - refused */
    moe_pair_case(g, 64, 128, 128, 64, 40, 6, 0, 0, 66);    /* 240 rows of 64 experts: 8-row tiles - refused */
}

/* ---- gather_qmm_cuda_moe_rows on 128 x 256 tiles (gq_launch_moe_big: runs of 128+ rows an expert) ------------------
 * As moe_pair_case, with `oor` rows of idx E at the sorted tail (out of range: y rows of zeros): y bitwise equal to
 * gather_qmm_cuda_rows (up, relu^2) then gather_qmm_cuda_ex (down) - the 64-row wgmma kernel -, y poisoned first,
 * three calls in a row, with FP4MOE_CUDA_MOE_BIG=1 (runs' remainders of <= 64 rows on the 64-row tiles: h has those
 * rows) and =all (every row on the big tiles: h left as it was); each element of h either still poisoned or the
 * reference's. Then FP4MOE_CUDA_MOE_BIG=0: refused (no 32-row runs given), the caller makes the two calls. want_big
 * 0: the call itself must be refused (a shape the big tiles do not take). */
static void moe_big_case(gpu_ctx *g, int64_t E, int64_t N, int64_t K, int64_t N2, int64_t T, int64_t k, int skew,
                         int64_t oor, int want_big, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    dev_weights du, dd;
    dev_weights_make(g, &du, E, N, K, 1, &r);
    dev_weights_make(g, &dd, E, N2, N, 1, &r);
    const int64_t B = T * k;
    uint16_t *x;
    uint32_t *ids, *row_of, *idx;
    moe_case_inputs(&r, E, K, T, k, skew, oor, &x, &ids, &row_of, &idx);
    void *dx = gt_upload(x, (size_t)((T + 1) * K) * 2);
    uint32_t *didx = gt_upload(idx, (size_t)B * 4), *drow = gt_upload(row_of, (size_t)B * 4);
    const size_t hb = (size_t)(B * N) * 2, yb = (size_t)(B * N2) * 2;
    void *h1 = gt_upload(NULL, hb), *h2 = gt_upload(NULL, hb), *y1 = gt_upload(NULL, yb), *y2 = gt_upload(NULL, yb);
    const fp4moe_route A = FP4MOE_ROUTE_AUTO;
    gt_poison(h2, hb);
    if (!want_big) {
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  NULL),
                         FP4MOE_EUNSUPPORTED);
        fp4moe_clear_error();
    } else {
        const size_t big = yb > hb ? yb : hb;
        uint16_t *a = malloc(big), *b = malloc(big);
        assert_true(a && b);
        int fused = 0;
        gt_poison(h1, hb);
        gt_poison(y1, yb);
        assert_int_equal(gather_qmm_cuda_rows(&du.w, 1, dx, T, drow, k, didx, B, A, 1, h1, g->stream, NULL), FP4MOE_OK);
        assert_int_equal(gather_qmm_cuda_ex(&dd.w, 1, h1, FP4MOE_BF16, didx, B, 1, A, 0, y1, g->stream, &fused, NULL),
                         FP4MOE_OK);
        gt_download(a, y1, yb);
        for (int64_t i = (B - oor) * N2; i < B * N2; i++) /* the reference's out-of-range rows: zeros */
            if (a[i]) fail_msg("moe big: reference y element %lld = %04x, not 0", (long long)i, a[i]);
        uint16_t *href = malloc(hb);
        assert_true(href != NULL);
        gt_download(href, h1, hb);
        for (int rep = 0; rep < 4; rep++) {
            const char *mode = rep < 3 ? "1" : "all";
            tu_setenv("FP4MOE_CUDA_MOE_BIG", mode);
            gt_poison(y2, yb);
            gt_poison(h2, hb);
            assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                      NULL),
                             FP4MOE_OK);
            GT_CHECK(cudaStreamSynchronize(g->stream));
            gt_download(b, y2, yb);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < yb / 2; i++)
                if (a[i] != b[i] && !bad++) first = i;
            if (bad)
                fail_msg("moe big (E=%lld %lld->%lld->%lld T=%lld k=%lld skew %d oor %lld, FP4MOE_CUDA_MOE_BIG=%s) call "
                         "%d: y differs in %zu of %zu elements (first %zu: row %zu, %04x vs %04x)", (long long)E,
                         (long long)K, (long long)N, (long long)N2, (long long)T, (long long)k, skew, (long long)oor,
                         mode, rep + 1, bad, yb / 2, first, first / (size_t)N2, a[first], b[first]);
            gt_download(b, h2, hb);
            size_t written = 0;
            for (size_t i = 0; i < hb / 2; i++) {
                if (b[i] == 0xffff) continue;
                written++;
                if (b[i] != href[i])
                    fail_msg("moe big (FP4MOE_CUDA_MOE_BIG=%s): h element %zu (row %zu) %04x, reference %04x", mode, i,
                             i / (size_t)N, b[i], href[i]);
            }
            if (!strcmp(mode, "all") && written)
                fail_msg("moe big (FP4MOE_CUDA_MOE_BIG=all): %zu elements of h written", written);
        }
        free(href);
        /* switched off: the 64-row tiles are not the fused pair's, so refused (the caller makes the two calls) */
        tu_setenv("FP4MOE_CUDA_MOE_BIG", "0");
        assert_int_equal(gather_qmm_cuda_moe_rows(&du.w, 1, &dd.w, 1, dx, T, drow, k, didx, B, A, h2, y2, g->stream,
                                                  NULL),
                         FP4MOE_EUNSUPPORTED);
        fp4moe_clear_error();
        tu_setenv("FP4MOE_CUDA_MOE_BIG", NULL);
        free(a);
        free(b);
    }
    free(x); free(ids); free(row_of); free(idx);
    gt_free(dx); gt_free(didx); gt_free(drow); gt_free(h1); gt_free(h2); gt_free(y1); gt_free(y2);
    dev_weights_free(&du);
    dev_weights_free(&dd);
}

static void test_moe_big(void **state) {
    gpu_ctx *g = *state;
    /* (runs of 300+ rows an expert: above the big tiles' threshold, GQ_BIG_ROWS_PER_EXPERT) */
    moe_big_case(g, 16, 320, 448, 200, 800, 6, 0, 0, 1, 71);  /* 4,800 rows (300 an expert); K 3.5 steps, N % 256 = 64 */
    moe_big_case(g, 16, 320, 448, 200, 800, 6, 1, 37, 1, 72); /* skewed (runs of many 128-row tiles), 37 out of range */
    moe_big_case(g, 4, 256, 192, 128, 250, 6, 0, 5, 1, 73);   /* 375 an expert; down N < 256, up K 1.5 steps */
    moe_big_case(g, 2, 64, 128, 192, 330, 2, 0, 3, 1, 74);    /* up N 64 (half a 128-feature block), down K 0.5 step */
    if (!getenv("FP4MOE_TEST_SANITIZE")) /* (compute-sanitizer runs: the small shapes) */
        moe_big_case(g, 128, 1856, 2688, 2688, 8192, 6, 1, 0, 1, 75); /* the 30B-A3B layer at 8,192 tokens, skewed */
    moe_big_case(g, 16, 320, 448, 202, 800, 6, 0, 0, 1, 76);  /* down N 202 */
    /* runs of 0, 1, 63, 64, 65, 127-129, 192, 200, 300, 320 rows: remainders on both sides of the split (64 rows) */
    moe_big_case(g, 16, 320, 448, 200, 800, 6, 2, 5, 1, 81);
    /* more items than blocks (H100 / H200: 132 an SM; 640 up, 480 down items): the dynamic order's counter and its
     * reset between the up and the down launch, then the static order */
    moe_big_case(g, 32, 1024, 448, 768, 1600, 6, 0, 0, 1, 78);
    tu_setenv("FP4MOE_CUDA_GATHER_SCHED", "static");
    moe_big_case(g, 32, 1024, 448, 768, 1600, 6, 0, 0, 1, 79);
    tu_setenv("FP4MOE_CUDA_GATHER_SCHED", NULL);
    moe_big_case(g, 16, 320, 416, 200, 800, 6, 0, 0, 0, 77);  /* up K % 64 = 32: refused */
    moe_big_case(g, 16, 320, 448, 200, 40, 6, 0, 0, 0, 80);   /* 15 rows an expert: below the threshold, refused */
    moe_big_case(g, 16, 320, 448, 200, 1024, 2, 0, 0, 1, 82); /* 128 rows an expert on average: the threshold, taken */
    moe_big_case(g, 16, 320, 448, 200, 1016, 2, 0, 0, 0, 83); /* 127: refused */
}

static void test_linear_gather_rows(void **state) {
    gpu_ctx *g = *state;
    const fp4moe_route A = FP4MOE_ROUTE_AUTO;
    rows_case(g, 16, 200, 320, 100, 6, 1, 1, A, 1, 41);   /* 600 rows, E = 16: 32-row tiles (32 features a warp) */
    rows_case(g, 16, 200, 320, 100, 6, 0, 0, A, 1, 42);   /* the same, checkpoint layout (16 features a warp) */
    rows_case(g, 4, 100, 256, 150, 6, 1, 1, A, 1, 43);    /* 900 rows, E = 4: 64-row tiles (wgmma) */
    rows_case(g, 4, 100, 256, 150, 6, 0, 1, A, 1, 44);
    rows_case(g, 64, 72, 128, 40, 6, 1, 0, A, 1, 45);     /* 240 rows, E = 64: 8-row tiles */
    rows_case(g, 16, 200, 320, 100, 6, 1, 1, FP4MOE_ROUTE_QMV, 1, 46); /* qmv, tiled by 8 rows */
    rows_case(g, 8, 40, 192, 70, 1, 1, 0, A, 1, 47);      /* k = 1 */
    rows_case(g, 1, 2104, 320, 24, 2, 1, 1, A, 1, 50);    /* E = 1, 48 rows, N >= 2,048: gq_dense_kg_kernel */
    rows_case(g, 1, 2104, 320, 24, 2, 0, 0, A, 1, 51);
    rows_case(g, 8, 40, 192, 5, 6, 1, 1, A, 0, 48);       /* 30 rows: the tensor-core qmv - refused */
    rows_case(g, 8, 40, 192, 100, 6, 0, 0, FP4MOE_ROUTE_DEQUANT_GEMM, 0, 49); /* dequant_gemm - refused */
    /* argument errors */
    fp4moe_nvfp4_weights w = {0};
    w.E = 2; w.N = 16; w.K = 32;
    uint8_t *c = gt_upload(NULL, 2 * 16 * 16 + 2 * 16 * 2);
    w.codes = c; w.scales = c + 2 * 16 * 16;
    void *x = gt_upload(NULL, 64 * 32 * 2), *y = gt_upload(NULL, 64 * 16 * 2);
    uint32_t *ix = gt_upload(NULL, 64 * 4);
    GT_CHECK(cudaMemset(ix, 0, 64 * 4));
    assert_int_equal(gather_qmm_cuda_rows(&w, 0, x, 64, ix, 0, ix, 64, A, 0, y, g->stream, NULL), FP4MOE_EINVAL); /* k = 0 */
    fp4moe_clear_error();
    assert_int_equal(gather_qmm_cuda_rows(&w, 0, x, 64, NULL, 1, ix, 64, A, 0, y, g->stream, NULL), FP4MOE_EINVAL);
    fp4moe_clear_error();
    assert_int_equal(gather_qmm_cuda_rows(&w, 0, x, 0, ix, 1, ix, 64, A, 0, y, g->stream, NULL), FP4MOE_EINVAL); /* T = 0 */
    fp4moe_clear_error();
    gt_free(c); gt_free(x); gt_free(y); gt_free(ix);
}

/* ---- cuda_moe_combine ------------------------------------------------------------------------------ */

static void combine_case(gpu_ctx *g, int64_t T, int64_t H, int64_t k, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    const int64_t B = T * k;
    uint16_t *ys = randb(&r, B * H, 1.0);
    float *w = randf(&r, B, 1.0), *ysf = malloc((size_t)(B * H) * 4), *ref = malloc((size_t)(T * H) * 4);
    uint32_t *pos = malloc((size_t)B * 4);
    for (int64_t i = 0; i < B; i++) pos[i] = (uint32_t)i;
    for (int64_t i = B - 1; i > 0; i--) { /* a random permutation: the sorted positions */
        const uint32_t j = tu_rng_below(&r, (uint32_t)(i + 1)), t = pos[i];
        pos[i] = pos[j];
        pos[j] = t;
    }
    for (int64_t i = 0; i < B * H; i++) ysf[i] = bf16_to_f32(ys[i]);
    uint16_t *dys = gt_upload(ys, (size_t)(B * H) * 2), *dout = gt_upload(NULL, (size_t)(T * H) * 2);
    uint32_t *dpos = gt_upload(pos, (size_t)B * 4);
    float *dw = gt_upload(w, (size_t)B * 4);
    gt_poison(dout, (size_t)(T * H) * 2);
    assert_int_equal(cuda_moe_combine(g->stream, dys, H, dpos, dw, T, k, dout), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    uint16_t *out = malloc((size_t)(T * H) * 2);
    gt_download(out, dout, (size_t)(T * H) * 2);
    for (int64_t t = 0; t < T; t++) /* op_moe_combine's order, no contraction into an FMA */
        for (int64_t i = 0; i < H; i++) {
            float o = 0.0f;
            for (int64_t j = 0; j < k; j++) {
                volatile float p = w[t * k + j] * ysf[(int64_t)pos[t * k + j] * H + i];
                o = o + p;
            }
            ref[t * H + i] = o;
        }
    int64_t bad = 0;
    for (int64_t i = 0; i < T * H; i++) bad += out[i] != f32_to_bf16(ref[i]);
    if (bad) fail_msg("combine T=%lld H=%lld k=%lld: %lld elements differ", (long long)T, (long long)H, (long long)k,
                      (long long)bad);
    free(ys); free(w); free(ysf); free(ref); free(pos); free(out);
    gt_free(dys); gt_free(dout); gt_free(dpos); gt_free(dw);
}

/* ---- cuda_rmsnorm_gated ------------------------------------------------------------------------------
 * Against an fp64 reference (out within 2^-7 of it, relative: bf16 output), and bitwise per row
 * against the same row alone (a row's result must not depend on the call's other rows: batched ==
 * solo; calls of >= 64 rows take the warp-per-item kernel, a row alone the block kernel, so this also
 * holds the two kernels to the same bits). Groups of 512 (nemotron_h), 64, 24 (fewer channels than
 * threads) and 1,000 channels (the second pass of the warp form); z rows with a stride > D. */
static void gated_case(gpu_ctx *g, int64_t T, int64_t D, int64_t G, int64_t zs, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    const int64_t gsz = D / G;
    float *y = malloc((size_t)(T * D) * 4), *w = malloc((size_t)D * 4);
    uint16_t *z = malloc((size_t)(T * zs) * 2), *out = malloc((size_t)(T * D) * 2), *one = malloc((size_t)D * 2);
    assert_true(y && w && z && out && one);
    for (int64_t i = 0; i < T * D; i++) y[i] = (float)(2.0 * tu_rng_uniform(&r) - 1.0);
    for (int64_t i = 0; i < T * zs; i++) z[i] = fp4moe_f32_to_bf16((float)(6.0 * tu_rng_uniform(&r) - 3.0));
    for (int64_t i = 0; i < D; i++) w[i] = (float)(0.5 + tu_rng_uniform(&r));
    float *dy = gt_upload(y, (size_t)(T * D) * 4), *dw = gt_upload(w, (size_t)D * 4);
    uint16_t *dz = gt_upload(z, (size_t)(T * zs) * 2), *dout = gt_upload(NULL, (size_t)(T * D) * 2),
             *done = gt_upload(NULL, (size_t)D * 2);
    gt_poison(dout, (size_t)(T * D) * 2);
    const float eps = 1e-5f;
    assert_int_equal(cuda_rmsnorm_gated(g->stream, dy, dz, zs, dw, T, D, G, eps, dout), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(out, dout, (size_t)(T * D) * 2);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < G; k++) {
            double ss = 0.0, *gg = malloc((size_t)gsz * sizeof(double));
            assert_non_null(gg);
            for (int64_t i = 0; i < gsz; i++) {
                const double zv = fp4moe_bf16_to_f32(z[t * zs + k * gsz + i]);
                gg[i] = y[t * D + k * gsz + i] * (zv / (1.0 + exp(-zv)));
                ss += gg[i] * gg[i];
            }
            const double rr = 1.0 / sqrt(ss / (double)gsz + eps);
            for (int64_t i = 0; i < gsz; i++) {
                const double ref = gg[i] * rr * w[k * gsz + i], v = fp4moe_bf16_to_f32(out[t * D + k * gsz + i]);
                if (!(fabs(v - ref) <= 0x1p-7 * fabs(ref) + 1e-6))
                    fail_msg("rmsnorm_gated T=%lld D=%lld G=%lld: [%lld][%lld] %.6g vs %.6g", (long long)T, (long long)D,
                             (long long)G, (long long)t, (long long)(k * gsz + i), v, ref);
            }
            free(gg);
        }
    const int64_t rows[3] = {0, T / 2, T - 1};
    for (int j = 0; j < 3; j++) { /* the same row alone: the block form */
        const int64_t t = rows[j];
        gt_poison(done, (size_t)D * 2);
        assert_int_equal(cuda_rmsnorm_gated(g->stream, dy + t * D, dz + t * zs, zs, dw, 1, D, G, eps, done), FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        gt_download(one, done, (size_t)D * 2);
        if (memcmp(one, out + t * D, (size_t)D * 2))
            fail_msg("rmsnorm_gated T=%lld D=%lld G=%lld: row %lld of the call differs from the row alone", (long long)T,
                     (long long)D, (long long)G, (long long)t);
    }
    free(y); free(w); free(z); free(out); free(one);
    gt_free(dy); gt_free(dw); gt_free(dz); gt_free(dout); gt_free(done);
}

static void test_rmsnorm_gated(void **state) {
    gpu_ctx *g = *state;
    gated_case(g, 40, 4096, 8, 4200, 61);  /* nemotron_h: 8 groups of 512 */
    gated_case(g, 3, 4096, 8, 4096, 62);
    gated_case(g, 300, 512, 8, 520, 63);   /* groups of 64 */
    gated_case(g, 130, 48, 2, 50, 64);     /* groups of 24: fewer channels than threads */
    gated_case(g, 257, 1000, 1, 1000, 65); /* one group of 1,000 channels */
    gated_case(g, 100, 4096, 8, 4200, 66); /* >= 64 rows of nemotron_h's groups: the 16-byte warp form */
    gated_case(g, 70, 1024, 4, 1024, 67);  /* groups of 256 */
    gated_case(g, 65, 384, 3, 388, 68);    /* groups of 128 */
}

/* ---- cuda_argmax_rows_f32 ---------------------------------------------------------------------------
 * Against the host rule (a number beats NaN, the larger wins, equal values: the lower index): random
 * rows with a planted maximum, ties of the maximum (the lower index must win), NaNs (ignored), an
 * all-NaN row (index 0), n % 4 != 0 (the scalar path), and the 131,072-logit decode row; each case one
 * block a row (ws NULL) and split (a zeroed scratch, <= 8 rows of >= 8,192 logits), the split form run
 * twice on new data (its counters must be back at 0 for the next call, as in a graph's next replay). */
static int32_t host_argmax(const float *x, int64_t n) {
    int32_t bi = -1;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) continue;
        if (bi < 0 || x[i] > x[bi]) bi = (int32_t)i;
    }
    return bi < 0 ? 0 : bi;
}

static void argmax_run(gpu_ctx *g, int64_t rows, int64_t n, tu_rng *rp, void *ws, const char *form) {
    tu_rng r = *rp;
    float *x = malloc((size_t)(rows * n) * 4);
    int32_t *got = malloc((size_t)rows * 4);
    assert_true(x && got);
    for (int64_t i = 0; i < rows * n; i++) x[i] = (float)(20.0 * tu_rng_uniform(&r) - 10.0);
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * n;
        switch (t % 4) {
        case 1: { /* a tie of the maximum: the lower index wins */
            const int64_t a = tu_rng_below(&r, (uint32_t)n), b = tu_rng_below(&r, (uint32_t)n);
            xr[a] = xr[b] = 11.0f;
            break;
        }
        case 2: /* NaNs everywhere but one number; a NaN ahead of it */
            for (int64_t i = 0; i < n; i++) xr[i] = __builtin_nanf("");
            xr[n - 1] = -5.0f;
            break;
        case 3: /* all NaN */
            for (int64_t i = 0; i < n; i++) xr[i] = __builtin_nanf("");
            break;
        default: xr[tu_rng_below(&r, (uint32_t)n)] = 12.0f; /* a planted maximum */
        }
    }
    *rp = r;
    float *dx = gt_upload(x, (size_t)(rows * n) * 4);
    int32_t *dout = gt_upload(NULL, (size_t)rows * 4);
    gt_poison(dout, (size_t)rows * 4);
    assert_int_equal(cuda_argmax_rows_f32(g->stream, dx, rows, n, dout, ws), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(got, dout, (size_t)rows * 4);
    for (int64_t t = 0; t < rows; t++) {
        const int32_t want = host_argmax(x + t * n, n);
        if (got[t] != want)
            fail_msg("argmax rows=%lld n=%lld (%s): row %lld gives %d, not %d", (long long)rows, (long long)n, form,
                     (long long)t, got[t], want);
    }
    free(x); free(got);
    gt_free(dx); gt_free(dout);
}

static void argmax_case(gpu_ctx *g, int64_t rows, int64_t n, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    argmax_run(g, rows, n, &r, NULL, "one block a row");
    void *ws = gt_upload(NULL, cuda_argmax_ws_bytes());
    GT_CHECK(cudaMemset(ws, 0, cuda_argmax_ws_bytes()));
    GT_CHECK(cudaDeviceSynchronize());
    argmax_run(g, rows, n, &r, ws, "split");
    argmax_run(g, rows, n, &r, ws, "split, second call");
    gt_free(ws);
}

static void test_argmax_rows(void **state) {
    gpu_ctx *g = *state;
    argmax_case(g, 1, 131072, 71);  /* the decode row: 64 parts of 2,048 */
    argmax_case(g, 8, 131072, 72);  /* ties, NaNs, all NaN (a number only in the last part) */
    argmax_case(g, 9, 131072, 75);  /* too many rows to split */
    argmax_case(g, 3, 131075, 76);  /* n % 4 != 0: the scalar path, split (43 parts of 3,072; the last short) */
    argmax_case(g, 2, 8192, 77);    /* the smallest split row: 8 parts */
    argmax_case(g, 2, 100000, 78);  /* 49 parts of 2,048, the last of 1,696 */
    argmax_case(g, 5, 1001, 73);    /* n % 4 != 0: the scalar path */
    argmax_case(g, 4, 7, 74);       /* fewer elements than threads */
}

static void test_combine(void **state) {
    gpu_ctx *g = *state;
    combine_case(g, 1, 2688, 6, 1);
    combine_case(g, 5, 2688, 6, 2);
    combine_case(g, 100, 2688, 6, 3); /* 256-thread rows, 4 elements a load */
    combine_case(g, 80, 1000, 11, 6); /* 4 elements a load, two slot batches */
    combine_case(g, 70, 1002, 6, 7);  /* H % 4 != 0: 2-byte loads */
    combine_case(g, 3, 5000, 11, 4);  /* k > 8: two slot batches; H > one batch */
    combine_case(g, 2, 7, 1, 5);
}

/* ---- cuda_linear_forward: the dense dequant_gemm form ---------------------------------------------- */

static void dense_case(gpu_ctx *g, int64_t N, int64_t K, int64_t T, int with_gs, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, 1, N, K, with_gs, &r), 0);
    cuda_linear lin;
    memset(&lin, 0, sizeof lin);
    lin.E = 1;
    lin.N = N;
    lin.K = K;
    lin.nvfp4 = 1;
    lin.q = tw.w;
    lin.q.codes = gt_upload(tw.codes, (size_t)(N * K / 2));
    lin.q.scales = gt_upload(tw.scales, (size_t)(N * K / 16));
    lin.q.global_scale = tw.gs ? gt_upload(tw.gs, 4) : NULL;
    uint16_t *x = tu_random_x(FP4MOE_BF16, T, K, &r);
    uint32_t *zeros = calloc((size_t)T, 4);
    double *ref = malloc((size_t)(T * N) * sizeof *ref);
    int64_t *rows = malloc((size_t)T * sizeof *rows);
    uint16_t *y = malloc((size_t)(T * N) * 2), *ysub = malloc((size_t)(T * N) * 2), *y2 = malloc((size_t)(T * N) * 2);
    assert_true(x && zeros && ref && rows && y && ysub && y2);
    for (int64_t t = 0; t < T; t++) rows[t] = t;
    assert_int_equal(fp4moe_gather_qmm_ref_f64(&tw.w, x, FP4MOE_BF16, zeros, T, ref), FP4MOE_OK);
    uint16_t *dx = gt_upload(x, (size_t)(T * K) * 2), *dy = gt_upload(NULL, (size_t)(T * N) * 2);
    uint16_t *dy2 = gt_upload(NULL, (size_t)(T * N) * 2);
    uint32_t *dz = gt_upload(zeros, (size_t)T * 4);
    cuda_ops o = g->ops;
    o.zero_idx = dz;
    o.zero_n = T;
    o.dq = &g->dq;
    char label[96];
    snprintf(label, sizeof label, "dense linear N=%lld K=%lld T=%lld gs=%d", (long long)N, (long long)K, (long long)T,
             with_gs);
    /* eager */
    gt_poison(dy, (size_t)(T * N) * 2);
    assert_int_equal(cuda_linear_forward(&o, &lin, dx, T, 0, dy), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(y, dy, (size_t)(T * N) * 2);
    if (tu_check_gather_output(y, FP4MOE_BF16, zeros, T, N, 1, rows, T, ref, ysub, label))
        fail_msg("%s: differs from the fp64 reference", label);
    { /* the runs {0, T} from the pair table (cuda_ops.e1_runs, as the backend gives them; no runs kernel): the same
         bits (fault E1_RUNS: the last row left out) */
        int *tab = NULL;
        assert_int_equal(cuda_e1_runs_table(g->stream, T + 3, &tab), FP4MOE_OK);
        cuda_ops o1 = o;
        o1.e1_runs = tab;
        gt_poison(dy2, (size_t)(T * N) * 2);
        assert_int_equal(cuda_linear_forward(&o1, &lin, dx, T, 0, dy2), FP4MOE_OK);
        GT_CHECK(cudaStreamSynchronize(g->stream));
        gt_download(y2, dy2, (size_t)(T * N) * 2);
        if (memcmp(y, y2, (size_t)(T * N) * 2)) fail_msg("%s: with the runs table: differs", label);
        GT_CHECK(cudaFree(tab));
    }
    /* relu^2 after it: bitwise cuda_relu2 of the plain output */
    gt_poison(dy2, (size_t)(T * N) * 2);
    assert_int_equal(cuda_linear_forward(&o, &lin, dx, T, 1, dy2), FP4MOE_OK);
    assert_int_equal(cuda_relu2(g->stream, dy, T * N), FP4MOE_OK);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(y, dy, (size_t)(T * N) * 2);
    gt_download(y2, dy2, (size_t)(T * N) * 2);
    if (memcmp(y, y2, (size_t)(T * N) * 2)) fail_msg("%s: relu2 differs from cuda_relu2 of the output", label);
    /* a graph capture of the call (the scratch is already there), replayed */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    gt_poison(dy2, (size_t)(T * N) * 2);
    GT_CHECK(cudaStreamSynchronize(g->stream));
    GT_CHECK(cudaStreamBeginCapture(g->stream, cudaStreamCaptureModeRelaxed));
    const int rc = cuda_linear_forward(&o, &lin, dx, T, 1, dy2);
    GT_CHECK(cudaStreamEndCapture(g->stream, &graph));
    assert_int_equal(rc, FP4MOE_OK);
    GT_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    GT_CHECK(cudaGraphLaunch(exec, g->stream));
    GT_CHECK(cudaStreamSynchronize(g->stream));
    gt_download(y2, dy2, (size_t)(T * N) * 2);
    if (memcmp(y, y2, (size_t)(T * N) * 2)) fail_msg("%s: the graph replay differs from the eager call", label);
    GT_CHECK(cudaGraphExecDestroy(exec));
    GT_CHECK(cudaGraphDestroy(graph));
    free(x); free(zeros); free(ref); free(rows); free(y); free(ysub); free(y2);
    gt_free(dx); gt_free(dy); gt_free(dy2); gt_free(dz);
    gt_free((void *)lin.q.codes); gt_free((void *)lin.q.scales); gt_free((void *)lin.q.global_scale);
    tu_weights_free(&tw);
}

static void test_dense_linear(void **state) {
    gpu_ctx *g = *state;
    dense_case(g, 100, 48, 300, 0, 1);      /* no global scale: host alpha */
    dense_case(g, 1856, 2688, 512, 1, 2);   /* the scratch grows */
    dense_case(g, 7, 16, 256, 1, 3);        /* the smallest dense call */
    dense_case(g, 2688, 1856, 255, 1, 4);   /* one row below: the batched kernel */
    dense_case(g, 300, 256, 100, 1, 6);     /* 64-row tiles of a plain linear */
    dense_case(g, 2688, 1856, 40, 1, 7);    /* gq_dense_kg_kernel (no runs) */
    dense_case(g, 4104, 2688, 257, 1, 5);   /* grows again */
    /* decode-sized calls: the tensor-core qmv, with and without the runs table (bench/patches/qmv-idx-gs.diff's
       fault E1_IDX: with it, those rows taken as expert 1, i.e. zeros) */
    dense_case(g, 2688, 4096, 1, 1, 8);     /* out_proj of one decode token */
    dense_case(g, 3712, 2688, 3, 1, 9);     /* the shared expert's up projection, 3 sequences */
    dense_case(g, 100, 256, 2, 0, 10);      /* N % 16 != 0, no global scale */
}

static int setup(void **state) {
    gpu_ctx *g = malloc(sizeof *g);
    ctx_make(g);
    *state = g;
    return 0;
}
static int teardown(void **state) {
    ctx_free(*state);
    free(*state);
    return 0;
}

int main(void) {
    gt_require_gpu("test_ops_gpu");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_route),
        cmocka_unit_test(test_split_bf16x3),
        cmocka_unit_test(test_rmsnorm_residual),
        cmocka_unit_test(test_relu2_epilogue),
        cmocka_unit_test(test_tiled_layout),
        cmocka_unit_test(test_tiled_scales),
        cmocka_unit_test(test_linear_gather_x1),
        cmocka_unit_test(test_linear_gather_rows),
        cmocka_unit_test(test_moe_pair),
        cmocka_unit_test(test_moe_big),
        cmocka_unit_test(test_combine),
        cmocka_unit_test(test_rmsnorm_gated),
        cmocka_unit_test(test_argmax_rows),
        cmocka_unit_test(test_dense_linear),
    };
    /* FP4MOE_TEST_FILTER: the tests whose names start with it (a fault build run with only the test
     * that must catch it) */
    const char *filter = getenv("FP4MOE_TEST_FILTER");
    static char pattern[128];
    if (filter && *filter) {
        snprintf(pattern, sizeof pattern, "%s*", filter);
        cmocka_set_test_filter(pattern);
    }
    return cmocka_run_group_tests(tests, setup, teardown);
}
