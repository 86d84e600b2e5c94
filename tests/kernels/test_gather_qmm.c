/* gather_qmm on the CPU: every route against the fp64 reference (spec NVFP4.md section 4).
 *
 * A covering set of shapes (E, N, K, B), idx patterns, dtypes, with and without global scales.
 * Each case runs every route explicitly, and the automatic choice with the expert-batched switch
 * on and off (FP4MOE_GATHER_EXPERT_BATCHED), on the AVX2 kernels and (for the smaller cases) the
 * portable ones. Outputs are poisoned with NaN before each call; all rows are checked for
 * NaN/poison and out-of-range rows for exact zeros; the reference is computed for every row, or
 * for a random subset of rows (always including the first and the last) on the big shapes.
 *
 * Environment: FP4MOE_TEST_ROUTE=qmv|batched|dequant_gemm|auto runs one route only and
 * FP4MOE_TEST_ACT=float|q8 one activation mode only (used by scripts/fault-check.sh, so that one
 * failing route cannot hide another that passes);
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
    const double *ref8; /* nrows x N: the W4A8 formula */
    const double *bound8; /* nrows x N: the bound of its activation rounding */
    void *y, *ysub;     /* B x N, nrows x N */
} gq_run;

/* The W4A8 mode against the unquantized fp64 reference, with the bound of the activation rounding
 * (|q*d - x| <= d/2 = max|x over the 16-block| / 254 per element):
 *   |y - ref| <= sum_k |w_k| * max|x|_block(k) / 254  (+ the usual tolerance of the output dtype).
 * bound8 holds that sum, computed by the fp64 reference on |w| and the per-block max|x| / 254. */
/* One call: poison, run, check. w4a8: the W4A8 entry point, checked against its own fp64 formula
 * (ref8, the usual tolerance) and against the plain reference (bound8). Returns the number of
 * bad elements (or 1 for a failed call). */
static int64_t run_route(const gq_run *g, fp4moe_route route, int w4a8, const char *label) {
    const gq_case *c = g->c;
    const int sorted = c->pattern != TU_IDX_UNSORTED;
    tu_poison(g->y, c->dtype, c->B * c->N);
    const int st = w4a8 ? fp4moe_gather_qmm_cpu_w4a8(&g->tw->w, g->x, c->dtype, g->idx, c->B, sorted, route, g->y)
                        : fp4moe_gather_qmm_cpu_route(&g->tw->w, g->x, c->dtype, g->idx, c->B, sorted, route, g->y);
    if (st != FP4MOE_OK) {
        fprintf(stderr, "  %s: status %d: %s\n", label, st, fp4moe_last_error());
        return 1;
    }
    int64_t bad = tu_check_gather_output(g->y, c->dtype, g->idx, c->B, c->N, c->E, g->rows, g->nrows,
                                         w4a8 ? g->ref8 : g->ref, g->ysub, label);
    if (!w4a8) return bad;
    for (int64_t i = 0; i < g->nrows; i++) {
        double m = 0.0;
        for (int64_t n = 0; n < c->N; n++) m = fmax(m, fabs(g->ref[i * c->N + n]));
        for (int64_t n = 0; n < c->N; n++) {
            const double e = fabs(tu_load_elem(g->ysub, c->dtype, i * c->N + n) - g->ref[i * c->N + n]);
            const double lim = g->bound8[i * c->N + n] + tu_rtol(c->dtype) * m + tu_atol(c->dtype);
            if (e > lim) {
                if (bad < 3) fprintf(stderr, "  %s: y[%lld][%lld]: W4A8 error %g > bound %g\n", label,
                                     (long long)g->rows[i], (long long)n, e, lim);
                bad++;
            }
        }
    }
    return bad;
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
    double *ref8 = malloc((size_t)(nrows * c->N) * sizeof *ref8);
    assert_non_null(ref8);
    assert_int_equal(fp4moe_gather_qmm_ref_w4a8_f64(&tw.w, xs, c->dtype, idxs, nrows, ref8), FP4MOE_OK);

    /* bound8 = ref(|w|, max|x| per block / 254): codes without their sign bit, scales and gs > 0 */
    double *bound8 = malloc((size_t)(nrows * c->N) * sizeof *bound8);
    float *xmax = malloc((size_t)(nrows * c->K) * sizeof *xmax);
    uint8_t *abs_codes = malloc((size_t)(c->E * c->N * c->K / 2));
    assert_true(bound8 && xmax && abs_codes);
    for (int64_t i = 0; i < c->E * c->N * c->K / 2; i++) abs_codes[i] = tw.codes[i] & 0x77;
    for (int64_t i = 0; i < nrows * c->K; i += 16) {
        double m = 0.0;
        for (int k = 0; k < 16; k++) m = fmax(m, fabs(tu_load_elem(xs, c->dtype, i + k)));
        for (int k = 0; k < 16; k++) xmax[i + k] = (float)(m / 254.0 * (1.0 + 1e-6));
    }
    fp4moe_nvfp4_weights wabs = tw.w;
    wabs.codes = abs_codes;
    assert_int_equal(fp4moe_gather_qmm_ref_f64(&wabs, xmax, FP4MOE_F32, idxs, nrows, bound8), FP4MOE_OK);
    free(xmax);
    free(abs_codes);

    const gq_run g = {c, &tw, x, idx, rows, nrows, ref, ref8, bound8, y, ysub};
    const char *only = getenv("FP4MOE_TEST_ROUTE"), *act = getenv("FP4MOE_TEST_ACT");
    const int big = (double)c->B * c->N * c->K > 2e9;
    int64_t failures = 0;
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    /* every kernel table this machine has (avx512, avx2, portable), each once */
    static const char *const isas[] = {"avx512", "avx2", "portable"};
    char done[3][16] = {{0}};
    for (int isa = 0; isa < 3; isa++) {
        if (isa == 2 && big) continue;            /* the portable kernels are slow; big shapes once */
        tu_setenv("FP4MOE_CPU_ISA", isas[isa]);
        const char *name = fp4moe_gather_cpu_isa(); /* a table the CPU lacks falls back */
        int seen = 0;
        for (int i = 0; i < isa; i++) seen |= !strcmp(done[i], name);
        snprintf(done[isa], sizeof done[isa], "%s", name);
        if (seen) continue;
        if (big && isa == 1 && strcmp(done[0], "avx512")) continue; /* big shapes: the best table */
        for (int w4a8 = 0; w4a8 < 2; w4a8++)
            for (int ro = FP4MOE_ROUTE_QMV; ro <= FP4MOE_ROUTE_DEQUANT_GEMM + 2; ro++) {
                /* QMV, BATCHED, DEQUANT_GEMM explicitly, then AUTO with the switch on and off;
                 * W4A8: QMV, BATCHED and AUTO */
                const fp4moe_route route = ro <= FP4MOE_ROUTE_DEQUANT_GEMM ? (fp4moe_route)ro : FP4MOE_ROUTE_AUTO;
                if (only && strcmp(only, fp4moe_route_name(route))) continue;
                if (act && strcmp(act, w4a8 ? "q8" : "float")) continue;
                if (!route_applies(route, c)) continue;
                if (w4a8 && (route == FP4MOE_ROUTE_DEQUANT_GEMM || ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2)) continue;
                if (route == FP4MOE_ROUTE_AUTO && ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2)
                    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
                else
                    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
                char label[192];
                snprintf(label, sizeof label, "E=%lld N=%lld K=%lld B=%lld %s gs=%d %s route=%s%s%s isa=%s",
                         (long long)c->E, (long long)c->N, (long long)c->K, (long long)c->B,
                         tu_idx_pattern_name(c->pattern), c->with_gs, fp4moe_dtype_name(c->dtype),
                         fp4moe_route_name(route),
                         route != FP4MOE_ROUTE_AUTO ? ""
                         : ro == FP4MOE_ROUTE_DEQUANT_GEMM + 2 ? "(EXPERT_BATCHED=0)" : "(default)",
                         w4a8 ? " w4a8" : "", name);
                const int64_t bad = run_route(&g, route, w4a8, label);
                if (bad) fprintf(stderr, "FAIL %s\n", label);
                failures += bad != 0;
            }
    }
    tu_setenv("FP4MOE_CPU_ISA", NULL);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    free(xs); free(idxs); free(ref); free(ref8); free(bound8); free(y); free(ysub); free(rows); free(idx); free(x);
    tu_weights_free(&tw);
    assert_int_equal(failures, 0);
}

/* A NaN or infinite activation: in the W4A8 mode (the CPU's default) as in float mode, every output of its row is
 * non-finite - q8: NaN (a max / round of the block would hide it: the q8 quantizer returns a NaN block scale), on every kernel table
 * and route (float mode: NaN or an infinity); the other rows are bitwise those of the same call without the bad rows,
 * out-of-range rows zeros. */
static void test_nonfinite_activations(void **state) {
    (void)state;
    const int64_t E = 6, N = 40, K = 192, B = 37;
    tu_rng r;
    tu_rng_seed(&r, 77);
    tu_weights tw;
    assert_int_equal(tu_weights_random(&tw, E, N, K, 1, &r), 0);
    float *x = tu_random_x(FP4MOE_F32, B, K, &r), *xbad = malloc((size_t)(B * K) * sizeof *xbad);
    uint32_t *idx = tu_make_idx(TU_IDX_OOR_TAIL, B, E, 1, &r);
    float *y = malloc((size_t)(B * N) * sizeof *y), *yclean = malloc((size_t)(B * N) * sizeof *yclean);
    assert_true(x && xbad && idx && y && yclean);
    memcpy(xbad, x, (size_t)(B * K) * sizeof *x);
    const int64_t bad_rows[3] = {2, 11, 20};
    xbad[bad_rows[0] * K + 37] = NAN;
    xbad[bad_rows[1] * K + 150] = INFINITY;
    xbad[bad_rows[2] * K + 0] = -INFINITY;
    static const char *const isas[] = {"avx512", "avx2", "portable"};
    static const fp4moe_route routes[] = {FP4MOE_ROUTE_QMV, FP4MOE_ROUTE_BATCHED, FP4MOE_ROUTE_AUTO};
    int checked = 0;
    for (int isa = 0; isa < 3; isa++) {
        tu_setenv("FP4MOE_CPU_ISA", isas[isa]);
        for (int w4a8 = 0; w4a8 < 2; w4a8++)
            for (int ri = 0; ri < 3; ri++) {
                int st[2];
                for (int pass = 0; pass < 2; pass++) {
                    float *out = pass ? y : yclean;
                    tu_poison(out, FP4MOE_F32, B * N);
                    const float *in = pass ? xbad : x;
                    st[pass] = w4a8 ? fp4moe_gather_qmm_cpu_w4a8(&tw.w, in, FP4MOE_F32, idx, B, 1, routes[ri], out)
                                    : fp4moe_gather_qmm_cpu_route(&tw.w, in, FP4MOE_F32, idx, B, 1, routes[ri], out);
                }
                
                assert_int_equal(st[0], FP4MOE_OK);
                assert_int_equal(st[1], FP4MOE_OK);
                for (int64_t b = 0; b < B; b++) {
                    const int is_bad = b == bad_rows[0] || b == bad_rows[1] || b == bad_rows[2];
                    for (int64_t n = 0; n < N; n++) {
                        const float v = y[b * N + n];
                        if (idx[b] >= (uint32_t)E) {
                            if (v != 0.0f) fail_msg("isa %s %s route %s: out-of-range row %lld not zero", isas[isa],
                                                    w4a8 ? "q8" : "float", fp4moe_route_name(routes[ri]), (long long)b);
                        } else if (is_bad) {
                            if (isfinite(v)) fail_msg("isa %s %s route %s: row %lld (a non-finite activation) gave %g "
                                                      "at column %lld: finite", isas[isa], w4a8 ? "q8" : "float",
                                                    fp4moe_route_name(routes[ri]), (long long)b, v, (long long)n);
                        } else if (memcmp(&v, &yclean[b * N + n], sizeof v)) {
                            fail_msg("isa %s %s route %s: row %lld column %lld differs from the clean call", isas[isa],
                                     w4a8 ? "q8" : "float", fp4moe_route_name(routes[ri]), (long long)b, (long long)n);
                        }
                    }
                }
                checked++;
            }
    }
    tu_setenv("FP4MOE_CPU_ISA", NULL);
    assert_true(checked >= 4);
    free(x); free(xbad); free(idx); free(y); free(yclean);
    tu_weights_free(&tw);
}

int main(void) {
    struct CMUnitTest tests[N_CASES + 1];
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
    if (!getenv("FP4MOE_TEST_ROUTE")) /* the fault check's per-route runs: the cases above */
        tests[n++] = (struct CMUnitTest){"nonfinite_activations", test_nonfinite_activations, NULL, NULL, NULL};
    return _cmocka_run_group_tests("gather_qmm_cpu", tests, n, NULL, NULL);
}
