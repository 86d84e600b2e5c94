/* gather_qmm on the CPU: every route against the fp64 reference (spec NVFP4.md section 4).
 *
 * A covering set of shapes (E, N, K, B), idx patterns, dtypes, with and without global scales.
 * Each case runs every route explicitly, and the automatic choice with the expert-batched switch
 * on and off (FP4MOE_GATHER_EXPERT_BATCHED), on the AVX2 kernels and (for the smaller cases) the
 * portable ones. Outputs are poisoned with NaN before each call; all rows are checked for
 * NaN/poison and out-of-range rows for exact zeros; the reference is computed for every row, or
 * for a random subset of rows (always including the first and the last) on the big shapes.
 *
 * Environment: FP4MOE_TEST_ROUTE=qmv|batched|dequant_gemm|auto runs one route only (used by
 * scripts/fault-check.sh, so that one failing route cannot hide another that passes);
 * FP4MOE_TEST_QUICK=1 skips the Nemotron-sized cases. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "testutil.h"

typedef struct {
    int64_t E, N, K, B;
    tu_idx_pattern pattern;
    int topk;
    int with_gs;
    fp4moe_dtype dtype;
} gq_case;

/* The covering set: every E, K, N and B of issue 2, every idx pattern, every dtype, gs on and off. */
static const gq_case k_cases[] = {
    {1, 1, 16, 1, TU_IDX_TOPK_SORTED, 1, 1, FP4MOE_F32},          /* smallest everything */
    {8, 7, 48, 6, TU_IDX_TOPK_SORTED, 6, 1, FP4MOE_BF16},         /* decode: one token, top-6 */
    {8, 7, 48, 6, TU_IDX_UNSORTED, 6, 0, FP4MOE_F32},             /* decode, unsorted, no gs */
    {8, 7, 48, 63, TU_IDX_UNSORTED, 6, 1, FP4MOE_F16},            /* just below the batched minimum */
    {8, 1, 48, 64, TU_IDX_ONE_EXPERT, 6, 1, FP4MOE_F32},          /* the batched minimum, N = 1 */
    {1, 7, 2688, 64, TU_IDX_ONE_EXPERT, 6, 0, FP4MOE_BF16},       /* E = 1 */
    {8, 1856, 48, 64, TU_IDX_DUPLICATES, 6, 0, FP4MOE_F16},       /* duplicate experts in a token */
    {8, 100, 2688, 200, TU_IDX_TOPK_SORTED, 6, 1, FP4MOE_F32},    /* K chunks, f32 in place, N % 4 */
    {128, 7, 16, 3072, TU_IDX_EMPTY_EXPERTS, 6, 1, FP4MOE_BF16},  /* empty experts first/middle/last */
    {128, 64, 1856, 3072, TU_IDX_UNSORTED, 6, 1, FP4MOE_F32},     /* big unsorted batch (qmv) */
    {128, 60, 256, 768, TU_IDX_TOPK_SORTED, 6, 1, FP4MOE_F16},    /* runs of ~6: short and panel chunks */
    {128, 7, 48, 40000, TU_IDX_OOR_TAIL, 6, 1, FP4MOE_BF16},      /* B > 32768, out-of-range tail */
    {8, 7, 48, 40000, TU_IDX_ONE_EXPERT, 6, 1, FP4MOE_F16},       /* one run of 40000 rows */
    {8, 2688, 1856, 3072, TU_IDX_OOR_TAIL, 6, 1, FP4MOE_F16},     /* down shape, 384 rows / expert */
    {128, 1856, 2688, 3072, TU_IDX_TOPK_SORTED, 6, 1, FP4MOE_BF16}, /* Nemotron up, 512 tokens */
};
#define N_CASES (sizeof k_cases / sizeof k_cases[0])

/* Rows whose reference is computed: all, or a random subset on shapes where fp64 is too slow. */
static int64_t pick_rows(const gq_case *c, tu_rng *r, int64_t *rows) {
    const double macs = (double)c->B * (double)c->N * (double)c->K;
    if (macs <= 2e8) {
        for (int64_t b = 0; b < c->B; b++) rows[b] = b;
        return c->B;
    }
    int64_t n = 0;
    rows[n++] = 0;
    for (int i = 0; i < 30; i++) rows[n++] = tu_rng_below(r, (uint32_t)c->B);
    rows[n++] = c->B - 1;
    return n;
}

static int route_applies(fp4moe_route route, const gq_case *c) {
    return route == FP4MOE_ROUTE_QMV || route == FP4MOE_ROUTE_AUTO || c->pattern != TU_IDX_UNSORTED;
}

typedef struct {
    const gq_case *c;
    const tu_weights *tw;
    const void *x;
    const uint32_t *idx;
    const int64_t *rows;
    int64_t nrows;
    const double *ref;  /* nrows x N */
    void *y, *ysub;     /* B x N, nrows x N */
} gq_run;

/* One call: poison, run, check. Returns the number of bad elements (or 1 for a failed call). */
static int64_t run_route(const gq_run *g, fp4moe_route route, const char *label) {
    const gq_case *c = g->c;
    const int sorted = c->pattern != TU_IDX_UNSORTED;
    tu_poison(g->y, c->dtype, c->B * c->N);
    const int st = fp4moe_gather_qmm_cpu_route(&g->tw->w, g->x, c->dtype, g->idx, c->B, sorted, route, g->y);
    if (st != FP4MOE_OK) {
        fprintf(stderr, "  %s: status %d: %s\n", label, st, fp4moe_last_error());
        return 1;
    }
    return tu_check_gather_output(g->y, c->dtype, g->idx, c->B, c->N, c->E, g->rows, g->nrows, g->ref,
                                  g->ysub, label);
}

static void test_case(void **state) {
    const gq_case *c = *state;
    tu_rng r;
    tu_rng_seed(&r, 1000 + (uint64_t)(c - k_cases));
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, c->E, c->N, c->K, c->with_gs, &r), 0);
    /* f16 outputs must stay below 65504: global scales in [1e-3, 1e3] / 256 (still far from 1
     * and different per expert) */
    if (c->dtype == FP4MOE_F16 && tw.gs)
        for (int64_t e = 0; e < c->E; e++) tw.gs[e] *= 1.0f / 256.0f;
    void *x = tu_random_x(c->dtype, c->B, c->K, &r);
    uint32_t *idx = tu_make_idx(c->pattern, c->B, c->E, c->topk, &r);
    int64_t *rows = malloc((size_t)c->B * sizeof *rows);
    assert_non_null(x);
    assert_non_null(idx);
    assert_non_null(rows);
    const int64_t nrows = pick_rows(c, &r, rows);
    const size_t es = fp4moe_dtype_size(c->dtype);

    /* reference for the chosen rows only */
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

    const gq_run g = {c, &tw, x, idx, rows, nrows, ref, y, ysub};
    const char *only = getenv("FP4MOE_TEST_ROUTE");
    const int big = (double)c->B * c->N * c->K > 2e9;
    int64_t failures = 0;
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    for (int isa = 0; isa < 2; isa++) {           /* 0: this machine's kernels, 1: portable C */
        if (isa == 1 && big) continue;            /* the portable kernels are slow; big shapes once */
        if (isa == 1) tu_setenv("FP4MOE_CPU_ISA", "portable");
        else tu_setenv("FP4MOE_CPU_ISA", NULL);
        for (int ro = FP4MOE_ROUTE_QMV; ro <= FP4MOE_ROUTE_DEQUANT_GEMM + 2; ro++) {
            /* QMV, BATCHED, DEQUANT_GEMM explicitly, then AUTO with the switch on and off */
            const fp4moe_route route = ro <= FP4MOE_ROUTE_DEQUANT_GEMM ? (fp4moe_route)ro : FP4MOE_ROUTE_AUTO;
            if (only && strcmp(only, fp4moe_route_name(route))) continue;
            if (!route_applies(route, c)) continue;
            if (route == FP4MOE_ROUTE_AUTO && ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2)
                tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
            else
                tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
            char label[160];
            snprintf(label, sizeof label, "E=%lld N=%lld K=%lld B=%lld %s gs=%d %s route=%s%s isa=%s",
                     (long long)c->E, (long long)c->N, (long long)c->K, (long long)c->B,
                     tu_idx_pattern_name(c->pattern), c->with_gs, fp4moe_dtype_name(c->dtype),
                     fp4moe_route_name(route),
                     route != FP4MOE_ROUTE_AUTO ? ""
                     : ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2 ? "(EXPERT_BATCHED=0)" : "(default)",
                     isa ? "portable" : "native");
            const int64_t bad = run_route(&g, route, label);
            if (bad) fprintf(stderr, "FAIL %s\n", label);
            failures += bad != 0;
        }
    }
    tu_setenv("FP4MOE_CPU_ISA", NULL);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    free(xs); free(idxs); free(ref); free(y); free(ysub); free(rows); free(idx); free(x);
    tu_weights_free(&tw);
    assert_int_equal(failures, 0);
}

int main(void) {
    struct CMUnitTest tests[N_CASES];
    static char names[N_CASES][128];
    const int quick = getenv("FP4MOE_TEST_QUICK") && !strcmp(getenv("FP4MOE_TEST_QUICK"), "1");
    size_t n = 0;
    for (size_t i = 0; i < N_CASES; i++) {
        const gq_case *c = &k_cases[i];
        if (quick && (double)c->B * c->N * c->K > 2e9) continue;
        snprintf(names[n], sizeof names[n], "E%lld_N%lld_K%lld_B%lld_%s_%s%s", (long long)c->E,
                 (long long)c->N, (long long)c->K, (long long)c->B, tu_idx_pattern_name(c->pattern),
                 fp4moe_dtype_name(c->dtype), c->with_gs ? "_gs" : "");
        tests[n] = (struct CMUnitTest){names[n], test_case, NULL, NULL, (void *)c};
        n++;
    }
    return _cmocka_run_group_tests("gather_qmm_cpu", tests, n, NULL, NULL);
}
