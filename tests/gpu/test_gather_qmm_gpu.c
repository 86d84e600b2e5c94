/* gather_qmm on CUDA: every route against the CPU fp64 reference (spec NVFP4.md section 4), with
 * the suite's one tolerance (tu_check_close). Needs a CUDA device; exits 77 (skipped) without one.
 *
 * Cases: E = 128 and 8; sorted B in {64, 3072, 40000}, unsorted B in {1, 6, 48}; idx patterns with
 * empty experts (first, middle, last), one hot expert, duplicates, an out-of-range tail; global
 * scales on (far from 1, different per expert) and off; f32/f16/bf16; (N, K) in {(1856, 2688),
 * (2688, 1856), (100, 48), (7, 16)} and, for the bf16 decode kernel (B <= 32), K in {32, 96, 160}; plain
 * linears (E = 1) of 64-255 rows. Each case runs qmv, batched, dequant_gemm (sorted cases) and
 * the automatic choice with FP4MOE_GATHER_EXPERT_BATCHED unset and =0. Outputs are poisoned (NaN)
 * on the device before every call; every row is checked for NaN and out-of-range rows for exact
 * zeros; the reference covers all rows, or a random subset (first and last included) on big shapes;
 * inputs are checked unmodified. Plus the argument errors of the CUDA entry point.
 *
 * Route switch determinism (issue 6): on sorted input with B >= FP4MOE_BATCHED_MIN_ROWS, route qmv
 * ("qmv, tiled by 8 rows" for f16/bf16; the fp32 FMA kernel for f32, which the f32 batched route
 * runs too), route batched and the automatic choice with FP4MOE_GATHER_EXPERT_BATCHED=0 must give
 * BITWISE identical outputs (memcmp, not the tolerance): greedy decoding must not depend on the
 * switch. The same bitwise check holds between the expert-batched kernels' dynamic item order and
 * FP4MOE_CUDA_GATHER_SCHED=static.
 *
 * The automatic route's thresholds (route_choice, host-only: it runs without a device too, and is then the only
 * test): qmv for unsorted or < 64 rows, dequant_gemm for plain linears from 256 rows and for experts from 1,024 rows
 * an expert on average (512 with FP4MOE_CUDA_MOE_BIG=0; the 8,192-token MoE step, 384 an expert, stays batched:
 * docs/PERFORMANCE.md sessions 38 and 47),
 * FP4MOE_GATHER_EXPERT_BATCHED=0 replacing batched by qmv and nothing else; fault ROUTE_ROWS must fail it.
 *
 * Environment: FP4MOE_TEST_ROUTE=qmv|batched|dequant_gemm|auto runs one route only (fault check);
 * FP4MOE_TEST_QUICK=1 skips the biggest cases; FP4MOE_TEST_SANITIZE=1 runs only the small cases
 * marked for compute-sanitizer (scripts/gpu-check.sh); FP4MOE_TEST_FILTER=PREFIX only the tests whose names start
 * with PREFIX (fault builds). */
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
#include "kernels/cuda/ops_cuda.h"
#include "testutil.h"

typedef struct {
    int64_t E, N, K, B;
    tu_idx_pattern pattern;
    int with_gs;
    fp4moe_dtype dtype;
    int small; /* run under compute-sanitizer */
} gg_case;

static const gg_case k_cases[] = {
    {8, 7, 16, 1, TU_IDX_UNSORTED, 1, FP4MOE_F32, 1},                /* smallest, unsorted B = 1 */
    {8, 100, 48, 6, TU_IDX_UNSORTED, 1, FP4MOE_BF16, 1},             /* decode, K = 16*3 (8-byte path) */
    {8, 100, 48, 6, TU_IDX_TOPK_SORTED, 0, FP4MOE_F16, 0},           /* one token's top-6, sorted */
    {128, 1856, 2688, 6, TU_IDX_UNSORTED, 1, FP4MOE_BF16, 0},        /* Nemotron decode, up */
    {128, 2688, 1856, 6, TU_IDX_UNSORTED, 0, FP4MOE_F16, 0},         /* Nemotron decode, down */
    {8, 100, 48, 48, TU_IDX_UNSORTED, 1, FP4MOE_F32, 0},             /* unsorted 48, some idx >= E */
    {128, 7, 16, 48, TU_IDX_UNSORTED, 1, FP4MOE_F16, 0},
    {8, 100, 48, 64, TU_IDX_TOPK_SORTED, 1, FP4MOE_BF16, 1},         /* the batched minimum */
    {8, 7, 16, 64, TU_IDX_ONE_EXPERT, 1, FP4MOE_F16, 1},             /* N < 16, K = 16 */
    {8, 100, 48, 64, TU_IDX_OOR_TAIL, 1, FP4MOE_F32, 1},
    {128, 100, 48, 3072, TU_IDX_EMPTY_EXPERTS, 1, FP4MOE_BF16, 0},   /* empty first/middle/last */
    {128, 7, 16, 3072, TU_IDX_DUPLICATES, 0, FP4MOE_F32, 0},
    {128, 1856, 2688, 3072, TU_IDX_TOPK_SORTED, 1, FP4MOE_BF16, 0},  /* Nemotron up, 512 tokens */
    {128, 2688, 1856, 3072, TU_IDX_OOR_TAIL, 1, FP4MOE_F16, 0},      /* Nemotron down, OOR tail */
    {128, 1856, 2688, 3072, TU_IDX_EMPTY_EXPERTS, 0, FP4MOE_F16, 0},
    {128, 2688, 1856, 3072, TU_IDX_DUPLICATES, 1, FP4MOE_F32, 0},
    {8, 2688, 1856, 3072, TU_IDX_TOPK_SORTED, 1, FP4MOE_BF16, 0},    /* 384 rows/expert: 64-row tiles */
    {8, 1856, 2688, 3072, TU_IDX_ONE_EXPERT, 1, FP4MOE_F16, 0},      /* one hot expert, long run */
    {128, 100, 48, 40000, TU_IDX_OOR_TAIL, 1, FP4MOE_BF16, 0},       /* B > 32768 */
    {8, 7, 16, 40000, TU_IDX_ONE_EXPERT, 1, FP4MOE_F16, 0},          /* one run of 40000 rows */
    {8, 1856, 2688, 40000, TU_IDX_TOPK_SORTED, 1, FP4MOE_BF16, 0},
    {128, 100, 48, 40000, TU_IDX_DUPLICATES, 0, FP4MOE_F32, 0},
    /* more cases for the bitwise route-switch check: gs off, E = 128 at B = 64, K % 64 != 0 */
    {8, 100, 48, 64, TU_IDX_TOPK_SORTED, 0, FP4MOE_F16, 1},
    {128, 100, 48, 64, TU_IDX_EMPTY_EXPERTS, 0, FP4MOE_BF16, 1},
    {128, 1856, 2688, 64, TU_IDX_TOPK_SORTED, 1, FP4MOE_F16, 0},
    {128, 2688, 1856, 3072, TU_IDX_TOPK_SORTED, 0, FP4MOE_BF16, 0},
    {8, 100, 2000, 3072, TU_IDX_DUPLICATES, 0, FP4MOE_BF16, 0},       /* K = 16*125: 8-byte path */
    {8, 2688, 1856, 3072, TU_IDX_ONE_EXPERT, 0, FP4MOE_F16, 0},
    /* bf16 64-row tiles (the wgmma kernel): N % 128 = 72, K % 128 = 64, empty experts, part tiles */
    {8, 200, 320, 3072, TU_IDX_EMPTY_EXPERTS, 1, FP4MOE_BF16, 1},
    {3, 136, 192, 700, TU_IDX_OOR_TAIL, 0, FP4MOE_BF16, 1},
    {4, 200, 320, 40000, TU_IDX_EMPTY_EXPERTS, 1, FP4MOE_BF16, 0},    /* many items a block */
    /* qmv v5 (bf16, B <= 32, K % 32 == 0, tensor cores): K % 128 != 0 (a part step), N % 16 != 0
     * (a part tile), segments of 8 rows (one expert), B = 1 with E = 1 (a decode linear), the
     * smallest K (one 32-code chunk), rows out of range, 32 rows in 4 slots */
    {128, 2688, 1856, 6, TU_IDX_TOPK_SORTED, 1, FP4MOE_BF16, 0},
    {8, 100, 2688, 32, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 1},
    {1, 1856, 2688, 1, TU_IDX_ONE_EXPERT, 0, FP4MOE_BF16, 0},
    {8, 7, 32, 5, TU_IDX_UNSORTED, 1, FP4MOE_BF16, 1},
    {8, 100, 96, 29, TU_IDX_UNSORTED, 1, FP4MOE_BF16, 1},
    {8, 40, 160, 19, TU_IDX_DUPLICATES, 0, FP4MOE_BF16, 1},
    /* plain linears (E = 1) of 64-255 rows: the 64-sequence decode's shape (bf16: gq_dense_kg_kernel on both
     * routes since session 24), K % 128 = 64 with rows out of range at 100 rows, the slow path (K % 64 != 0) at
     * 100 rows (64-row tiles on the batched route), 255 rows (4 row tiles), and 64 f16 rows with N > 8,192 (the
     * batched route's 64-row tile): there the bitwise check compares route qmv's 8-row tiles against the
     * batched route's 64-row tiles */
    {1, 2688, 2688, 64, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 0},
    {1, 136, 2112, 100, TU_IDX_OOR_TAIL, 0, FP4MOE_F16, 1},
    {1, 100, 2000, 100, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 1},
    {1, 200, 1024, 255, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 0},
    {1, 8208, 320, 64, TU_IDX_ONE_EXPERT, 1, FP4MOE_F16, 1}, /* 64 rows with N > 8,192: one 64-row tile */
    /* gq_dense_kg_kernel (bf16 plain linears of 33-64 rows, N >= 2,048, K % 64 == 0: K over 3 warp groups, on
     * every route): rows out of range (zeros), N % 64 = 56, K % 128 = 64; one K step (groups 1, 2 idle); half
     * a step; the decode-batch shapes */
    {1, 2104, 320, 37, TU_IDX_OOR_TAIL, 1, FP4MOE_BF16, 1},
    {1, 2048, 128, 33, TU_IDX_ONE_EXPERT, 0, FP4MOE_BF16, 1},
    {1, 2064, 64, 64, TU_IDX_OOR_TAIL, 1, FP4MOE_BF16, 1},
    {1, 4096, 2688, 48, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 0},
    /* the same shapes at 17-32 rows (qmv v5, or gq_dense_kg_kernel where KG_MIN_ROWS is lower) */
    {1, 2104, 320, 20, TU_IDX_OOR_TAIL, 1, FP4MOE_BF16, 1},
    {1, 3712, 2688, 32, TU_IDX_ONE_EXPERT, 1, FP4MOE_BF16, 0},
};
#define N_CASES (sizeof k_cases / sizeof k_cases[0])

static int is_big(const gg_case *c) { return (double)c->B * c->N * c->K > 2e9; }

static int64_t pick_rows(const gg_case *c, tu_rng *r, int64_t *rows) {
    if ((double)c->B * c->N * c->K <= 2e8) {
        for (int64_t b = 0; b < c->B; b++) rows[b] = b;
        return c->B;
    }
    int64_t n = 0;
    rows[n++] = 0;
    for (int i = 0; i < 40; i++) rows[n++] = tu_rng_below(r, (uint32_t)c->B);
    rows[n++] = c->B - 1;
    return n;
}

typedef struct {
    const gg_case *c;
    fp4moe_nvfp4_weights dw; /* device weights */
    void *dx, *dy;
    uint32_t *didx;
    const uint32_t *idx;
    const int64_t *rows;
    int64_t nrows;
    const double *ref;
    void *y, *ysub; /* host copies */
} gg_run;

static float elem(const void *y, fp4moe_dtype dtype, int64_t i) {
    switch (dtype) {
    case FP4MOE_F32: return ((const float *)y)[i];
    case FP4MOE_F16: return fp4moe_f16_to_f32(((const uint16_t *)y)[i]);
    default: return fp4moe_bf16_to_f32(((const uint16_t *)y)[i]);
    }
}

/* Elements of y (n of es bytes) that differ bitwise from want; prints the first. */
static int64_t bitwise_diff(const void *y, const void *want, const gg_case *c, size_t es, const char *label,
                            const char *what) {
    int64_t diff = 0, first = -1;
    for (int64_t i = 0; i < c->B * c->N; i++)
        if (memcmp((const char *)y + i * es, (const char *)want + i * es, es)) {
            if (first < 0) first = i;
            diff++;
        }
    if (diff)
        fprintf(stderr, "FAIL %s: %lld elements differ bitwise from %s (first: y[%lld][%lld] %.9g vs %.9g)\n", label,
                (long long)diff, what, (long long)(first / c->N), (long long)(first % c->N), elem(y, c->dtype, first),
                elem(want, c->dtype, first));
    else fprintf(stderr, "ok   %s: bitwise equal to %s\n", label, what);
    return diff;
}

/* One call on the device: poison, run, copy back, check. Returns the number of bad elements. */
static int64_t run_route(const gg_run *g, fp4moe_route route, const char *label) {
    const gg_case *c = g->c;
    const size_t es = fp4moe_dtype_size(c->dtype);
    const int sorted = c->pattern != TU_IDX_UNSORTED;
    gt_poison(g->dy, (size_t)(c->B * c->N) * es);
    GT_CHECK(cudaDeviceSynchronize());
    const int st = fp4moe_gather_qmm_cuda_route(&g->dw, g->dx, c->dtype, g->didx, c->B, sorted, route, g->dy, NULL);
    const cudaError_t ce = cudaDeviceSynchronize();
    if (st != FP4MOE_OK || ce != cudaSuccess) {
        fprintf(stderr, "  %s: status %d (%s), cuda %s\n", label, st, fp4moe_last_error(), cudaGetErrorString(ce));
        return 1;
    }
    gt_download(g->y, g->dy, (size_t)(c->B * c->N) * es);
    return tu_check_gather_output(g->y, c->dtype, g->idx, c->B, c->N, c->E, g->rows, g->nrows, g->ref,
                                  g->ysub, label);
}

static void test_case(void **state) {
    const gg_case *c = *state;
    tu_rng r;
    tu_rng_seed(&r, 7000 + (uint64_t)(c - k_cases));
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, c->E, c->N, c->K, c->with_gs, &r), 0);
    if (c->dtype == FP4MOE_F16 && tw.gs) /* keep f16 outputs below 65504; still far from 1 */
        for (int64_t e = 0; e < c->E; e++) tw.gs[e] *= 1.0f / 256.0f;
    const size_t es = fp4moe_dtype_size(c->dtype);
    void *x = tu_random_x(c->dtype, c->B, c->K, &r);
    uint32_t *idx = tu_make_idx(c->pattern, c->B, c->E, 6, &r);
    int64_t *rows = malloc((size_t)(c->B > 42 ? c->B : 42) * sizeof *rows); /* (pick_rows: 42 of a big case) */
    assert_true(x && idx && rows);
    const int64_t nrows = pick_rows(c, &r, rows);

    void *xs = malloc((size_t)(nrows * c->K) * es);
    uint32_t *idxs = malloc((size_t)nrows * sizeof *idxs);
    double *ref = malloc((size_t)(nrows * c->N) * sizeof *ref);
    void *y = malloc((size_t)(c->B * c->N) * es), *ysub = malloc((size_t)(nrows * c->N) * es);
    assert_true(xs && idxs && ref && y && ysub);
    for (int64_t i = 0; i < nrows; i++) {
        memcpy((char *)xs + i * c->K * es, (const char *)x + rows[i] * c->K * es, c->K * es);
        idxs[i] = idx[rows[i]];
    }
    assert_int_equal(fp4moe_gather_qmm_ref_f64(&tw.w, xs, c->dtype, idxs, nrows, ref), FP4MOE_OK);

    /* device copies */
    const size_t ncodes = (size_t)(c->E * c->N * c->K / 2), nscales = (size_t)(c->E * c->N * c->K / 16);
    gg_run g = {c, tw.w, NULL, NULL, NULL, idx, rows, nrows, ref, y, ysub};
    g.dw.codes = gt_upload(tw.codes, ncodes);
    g.dw.scales = gt_upload(tw.scales, nscales);
    g.dw.global_scale = tw.gs ? gt_upload(tw.gs, (size_t)c->E * sizeof(float)) : NULL;
    g.dx = gt_upload(x, (size_t)(c->B * c->K) * es);
    g.didx = gt_upload(idx, (size_t)c->B * sizeof(uint32_t));
    g.dy = gt_upload(NULL, (size_t)(c->B * c->N) * es);

    const char *only = getenv("FP4MOE_TEST_ROUTE");
    const int sorted = c->pattern != TU_IDX_UNSORTED;
    int64_t failures = 0;
    /* bitwise checks: route batched == route qmv (sorted, B >= 64: the same mma arithmetic, 8-row
     * tiles), and auto with FP4MOE_GATHER_EXPERT_BATCHED=0 == auto with the switch unset (always) */
    const int bitwise = sorted && c->B >= FP4MOE_BATCHED_MIN_ROWS && !only;
    const size_t ybytes = (size_t)(c->B * c->N) * es;
    void *yqmv = malloc(ybytes), *yauto = malloc(ybytes), *ybat = malloc(ybytes);
    assert_true(yqmv && yauto && ybat);
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    for (int ro = FP4MOE_ROUTE_QMV; ro <= FP4MOE_ROUTE_DEQUANT_GEMM + 2; ro++) {
        /* QMV, BATCHED, DEQUANT_GEMM explicitly, then AUTO with the switch unset and = 0 */
        const fp4moe_route route = ro <= FP4MOE_ROUTE_DEQUANT_GEMM ? (fp4moe_route)ro : FP4MOE_ROUTE_AUTO;
        if (only && strcmp(only, fp4moe_route_name(route))) continue;
        if (!sorted && (route == FP4MOE_ROUTE_BATCHED || route == FP4MOE_ROUTE_DEQUANT_GEMM)) continue;
        const int off = ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2;
        if (off) tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
        else tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
        char label[160];
        snprintf(label, sizeof label, "E=%lld N=%lld K=%lld B=%lld %s gs=%d %s route=%s%s", (long long)c->E,
                 (long long)c->N, (long long)c->K, (long long)c->B, tu_idx_pattern_name(c->pattern), c->with_gs,
                 fp4moe_dtype_name(c->dtype), fp4moe_route_name(route),
                 route != FP4MOE_ROUTE_AUTO ? "" : off ? "(EXPERT_BATCHED=0)" : "(default)");
        const int64_t bad = run_route(&g, route, label);
        fprintf(stderr, "%s %s\n", bad ? "FAIL" : "ok  ", label);
        failures += bad != 0;
        if (route == FP4MOE_ROUTE_QMV) memcpy(yqmv, y, ybytes);
        if (route == FP4MOE_ROUTE_AUTO && !off) memcpy(yauto, y, ybytes);
        if (route == FP4MOE_ROUTE_BATCHED) memcpy(ybat, y, ybytes);
        const int vs_qmv = bitwise && route == FP4MOE_ROUTE_BATCHED, vs_auto = !only && off;
        if (vs_qmv || vs_auto)
            failures += bitwise_diff(y, vs_qmv ? yqmv : yauto, c, es, label, vs_qmv ? "route qmv" : "auto with the switch unset") != 0;
    }
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    if (bitwise) { /* the expert-batched kernels' static item order gives the same bits as the dynamic one */
        tu_setenv("FP4MOE_CUDA_GATHER_SCHED", "static");
        char label[160];
        snprintf(label, sizeof label, "E=%lld N=%lld K=%lld B=%lld %s gs=%d %s route=batched(SCHED=static)",
                 (long long)c->E, (long long)c->N, (long long)c->K, (long long)c->B, tu_idx_pattern_name(c->pattern),
                 c->with_gs, fp4moe_dtype_name(c->dtype));
        const int64_t bad = run_route(&g, FP4MOE_ROUTE_BATCHED, label);
        fprintf(stderr, "%s %s\n", bad ? "FAIL" : "ok  ", label);
        failures += bad != 0;
        failures += bitwise_diff(y, ybat, c, es, label, "the dynamic order") != 0;
        tu_setenv("FP4MOE_CUDA_GATHER_SCHED", NULL);
    }
    free(ybat);
    free(yqmv);
    free(yauto);

    /* inputs unmodified */
    void *xback = malloc((size_t)(c->B * c->K) * es);
    uint32_t *idxback = malloc((size_t)c->B * sizeof *idxback);
    assert_true(xback && idxback);
    gt_download(xback, g.dx, (size_t)(c->B * c->K) * es);
    gt_download(idxback, g.didx, (size_t)c->B * sizeof *idxback);
    assert_memory_equal(xback, x, (size_t)(c->B * c->K) * es);
    assert_memory_equal(idxback, idx, (size_t)c->B * sizeof *idxback);
    free(xback);
    free(idxback);

    gt_free((void *)g.dw.codes);
    gt_free((void *)g.dw.scales);
    gt_free((void *)g.dw.global_scale);
    gt_free(g.dx);
    gt_free(g.didx);
    gt_free(g.dy);
    free(xs); free(idxs); free(ref); free(y); free(ysub); free(rows); free(idx); free(x);
    tu_weights_free(&tw);
    assert_int_equal(failures, 0);
}

/* Bad arguments come back as errors with messages, never as a crash or a launch. */
static void test_errors(void **state) {
    (void)state;
    tu_rng r;
    tu_rng_seed(&r, 99);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, 2, 4, 32, 1, &r), 0);
    fp4moe_nvfp4_weights dw = tw.w;
    dw.codes = gt_upload(tw.codes, 2 * 4 * 16);
    dw.scales = gt_upload(tw.scales, 2 * 4 * 2);
    dw.global_scale = gt_upload(tw.gs, 2 * sizeof(float));
    char *dx = gt_upload(NULL, 256), *dy = gt_upload(NULL, 256);
    uint32_t *didx = gt_upload(NULL, 64);
    GT_CHECK(cudaMemset(didx, 0, 64));

    fp4moe_nvfp4_weights bad = dw;
    bad.K = 24; /* not a multiple of 16 */
    assert_int_equal(fp4moe_gather_qmm_cuda(&bad, dx, FP4MOE_F32, didx, 1, 1, dy, NULL), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "K"));
    assert_int_equal(fp4moe_gather_qmm_cuda(NULL, dx, FP4MOE_F32, didx, 1, 1, dy, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_gather_qmm_cuda(&dw, NULL, FP4MOE_F32, didx, 1, 1, dy, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_gather_qmm_cuda(&dw, dx, (fp4moe_dtype)7, didx, 1, 1, dy, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_gather_qmm_cuda_route(&dw, dx, FP4MOE_BF16, didx, 1, 0, FP4MOE_ROUTE_BATCHED, dy, NULL),
                     FP4MOE_EINVAL); /* batched needs sorted */
    assert_int_equal(fp4moe_gather_qmm_cuda(&dw, dx + 4, FP4MOE_F32, didx, 1, 1, dy, NULL), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "aligned"));
    assert_int_equal(fp4moe_gather_qmm_cuda(&dw, dx, FP4MOE_F32, didx, 0, 1, dy, NULL), FP4MOE_OK); /* B = 0 */
    assert_int_equal(fp4moe_gather_qmm_cuda(&dw, dx, FP4MOE_F32, didx, -1, 1, dy, NULL), FP4MOE_EINVAL);
    GT_CHECK(cudaDeviceSynchronize());
    gt_free((void *)dw.codes);
    gt_free((void *)dw.scales);
    gt_free((void *)dw.global_scale);
    gt_free(dx);
    gt_free(dy);
    gt_free(didx);
    tu_weights_free(&tw);
}

/* gather_qmm_cuda_auto_route against the rule, with the route environment cleared (and put back) */
static void test_route_choice(void **state) {
    (void)state;
    static const char *names[3] = {"FP4MOE_GATHER_ROUTE", "FP4MOE_GATHER_EXPERT_BATCHED", "FP4MOE_CUDA_MOE_BIG"};
    char *keep[3];
    for (int j = 0; j < 3; j++) keep[j] = getenv(names[j]) ? strdup(getenv(names[j])) : NULL;
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    /* big: 0: FP4MOE_CUDA_MOE_BIG=0 (the experts' dequant_gemm from 512 rows an expert, not 1,024) */
    static const struct { int64_t B, E; int sorted, off, big; fp4moe_route want; } k[] = {
        {6, 128, 1, 0, 1, FP4MOE_ROUTE_QMV},                  /* a decode token */
        {1000, 128, 0, 0, 1, FP4MOE_ROUTE_QMV},               /* unsorted */
        {63, 8, 1, 0, 1, FP4MOE_ROUTE_QMV},                   /* below FP4MOE_BATCHED_MIN_ROWS */
        {64, 8, 1, 0, 1, FP4MOE_ROUTE_BATCHED},
        {6 * 512, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},        /* 512-token MoE step */
        {256 * 128, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},      /* 256 rows an expert: batched since session 38 */
        {6 * 8192, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},       /* 8,192-token MoE step, 384 an expert */
        {512 * 128, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},      /* 512 an expert: the big tiles' (session 47) */
        {6 * 16384, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},      /* 16,384-token MoE step, 768 an expert */
        {1024 * 128 - 1, 128, 1, 0, 1, FP4MOE_ROUTE_BATCHED},
        {1024 * 128, 128, 1, 0, 1, FP4MOE_ROUTE_DEQUANT_GEMM}, /* 1,024 an expert */
        {6 * 32768, 128, 1, 0, 1, FP4MOE_ROUTE_DEQUANT_GEMM},
        {512 * 128 - 1, 128, 1, 0, 0, FP4MOE_ROUTE_BATCHED},  /* big tiles off: 512 an expert */
        {512 * 128, 128, 1, 0, 0, FP4MOE_ROUTE_DEQUANT_GEMM},
        {3072, 8, 1, 0, 1, FP4MOE_ROUTE_BATCHED},             /* the cases above: 384 an expert */
        {40000, 8, 1, 0, 1, FP4MOE_ROUTE_DEQUANT_GEMM},
        {255, 1, 1, 0, 1, FP4MOE_ROUTE_BATCHED},              /* plain linears: 256 rows (big tiles or not) */
        {256, 1, 1, 0, 1, FP4MOE_ROUTE_DEQUANT_GEMM},
        {256, 1, 1, 0, 0, FP4MOE_ROUTE_DEQUANT_GEMM},
        {6 * 8192, 128, 1, 1, 1, FP4MOE_ROUTE_QMV},           /* the switch off: batched -> qmv only */
        {512 * 128, 128, 1, 1, 1, FP4MOE_ROUTE_QMV},
        {1024 * 128, 128, 1, 1, 1, FP4MOE_ROUTE_DEQUANT_GEMM},
        {512 * 128, 128, 1, 1, 0, FP4MOE_ROUTE_DEQUANT_GEMM},
        {256, 1, 1, 1, 1, FP4MOE_ROUTE_DEQUANT_GEMM},
        {255, 1, 1, 1, 1, FP4MOE_ROUTE_QMV},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", k[i].off ? "0" : NULL);
        tu_setenv("FP4MOE_CUDA_MOE_BIG", k[i].big ? NULL : "0");
        const fp4moe_route got = gather_qmm_cuda_auto_route(k[i].B, k[i].E, k[i].sorted);
        if (got != k[i].want) {
            fprintf(stderr, "route_choice: B=%lld E=%lld %s%s%s: %s, expected %s\n", (long long)k[i].B,
                    (long long)k[i].E, k[i].sorted ? "sorted" : "unsorted", k[i].off ? " EXPERT_BATCHED=0" : "",
                    k[i].big ? "" : " MOE_BIG=0", fp4moe_route_name(got), fp4moe_route_name(k[i].want));
            bad++;
        }
    }
    for (int j = 0; j < 3; j++) {
        tu_setenv(names[j], keep[j]);
        free(keep[j]);
    }
    assert_int_equal(bad, 0);
}

int main(void) {
    if (!fp4moe_cuda_available()) { /* the host-only test still runs */
        fprintf(stderr, "test_gather_qmm_gpu: no CUDA device visible: only route_choice runs\n");
        const struct CMUnitTest host[] = {{"route_choice", test_route_choice, NULL, NULL, NULL}};
        return cmocka_run_group_tests_name("gather_qmm_gpu (host only)", host, NULL, NULL);
    }
    struct CMUnitTest tests[N_CASES + 2];
    static char names[N_CASES][128];
    const char *q = getenv("FP4MOE_TEST_QUICK"), *sz = getenv("FP4MOE_TEST_SANITIZE");
    const int quick = q && !strcmp(q, "1"), sanitize = sz && !strcmp(sz, "1");
    size_t n = 0;
    tests[n++] = (struct CMUnitTest){"route_choice", test_route_choice, NULL, NULL, NULL};
    tests[n++] = (struct CMUnitTest){"errors", test_errors, NULL, NULL, NULL};
    for (size_t i = 0; i < N_CASES; i++) {
        const gg_case *c = &k_cases[i];
        if ((quick && is_big(c)) || (sanitize && !c->small)) continue;
        snprintf(names[i], sizeof names[i], "E%lld_N%lld_K%lld_B%lld_%s_%s%s", (long long)c->E, (long long)c->N,
                 (long long)c->K, (long long)c->B, tu_idx_pattern_name(c->pattern), fp4moe_dtype_name(c->dtype),
                 c->with_gs ? "_gs" : "");
        tests[n++] = (struct CMUnitTest){names[i], test_case, NULL, NULL, (void *)c};
    }
    /* FP4MOE_TEST_FILTER: only the tests whose names start with it (a fault build's run, scripts/gpu-staged-check.sh) */
    const char *filter = getenv("FP4MOE_TEST_FILTER");
    if (filter && *filter) {
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            if (!strncmp(tests[i].name, filter, strlen(filter))) tests[m++] = tests[i];
        n = m;
    }
    return _cmocka_run_group_tests("gather_qmm_gpu", tests, n, NULL, NULL);
}
