/* The dense CPU ops of the forward pass (src/kernels/cpu/ops.h) against straightforward fp64
 * references on random data, the router's contract (correction bias for choice only, group
 * masking, deterministic ties, normalisation, routed scaling), the stable expert sort, state
 * carry-over of the conv and the scan, the FP8 KV cache's rows, and the sampler. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fp4moe/model.h"
#include "kernels/cpu/ops.h"
#include "testutil.h"

static float *rnd(tu_rng *r, int64_t n, double scale) {
    float *p = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) p[i] = (float)(scale * tu_rng_normal(r));
    return p;
}

static float *poison(int64_t n) {
    float *p = malloc((size_t)n * sizeof(float));
    tu_poison(p, FP4MOE_F32, n);
    return p;
}

/* |y - ref| <= rtol * max|ref| + atol, elementwise over n. */
static void close_f64(const float *y, const double *ref, int64_t n, double rtol, const char *what) {
    double mx = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++)
        if (!(fabs(y[i] - ref[i]) <= rtol * mx + 1e-30)) fail_msg("%s[%lld] = %g, ref %g", what, (long long)i, y[i], ref[i]);
}

/* ---- router ----------------------------------------------------------------------------------- */

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

/* fp64 reference router with the same rules. */
static void router_ref(const op_router_cfg *c, const float *logit, int32_t *ids, double *w) {
    const int64_t E = c->E, per = E / c->n_group;
    double *ch = malloc((size_t)E * sizeof *ch);
    for (int64_t e = 0; e < E; e++) ch[e] = sigm(logit[e]) + (c->bias ? c->bias[e] : 0);
    if (c->n_group > 1) {
        double gs[64];
        int keep[64] = {0};
        for (int64_t g = 0; g < c->n_group; g++) {
            double a = -INFINITY, b = -INFINITY;
            for (int64_t i = 0; i < per; i++) {
                const double v = ch[g * per + i];
                if (v > a) { b = a; a = v; } else if (v > b) b = v;
            }
            gs[g] = a + b;
        }
        for (int64_t j = 0; j < c->topk_group; j++) {
            int64_t best = -1;
            for (int64_t g = 0; g < c->n_group; g++)
                if (!keep[g] && (best < 0 || gs[g] > gs[best])) best = g;
            keep[best] = 1;
        }
        for (int64_t e = 0; e < E; e++)
            if (!keep[e / per]) ch[e] = -INFINITY;
    }
    double sum = 0;
    for (int64_t j = 0; j < c->k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || ch[e] > ch[best])) best = e;
        }
        ids[j] = (int32_t)best;
        w[j] = sigm(logit[best]);
        sum += w[j];
    }
    for (int64_t j = 0; j < c->k; j++) w[j] = (c->norm_topk_prob ? w[j] / (sum + 1e-20) : w[j]) * c->scaling;
    free(ch);
}

static void test_router_ties_and_bias(void **state) {
    float logits[8] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
    int32_t ids[3];
    float w[3];
    op_router_cfg c = {8, 3, 1, 1, 1, 2.5f, NULL};
    assert_int_equal(op_router_topk(&c, logits, 1, ids, w), FP4MOE_OK);
    assert_int_equal(ids[0], 0);                 /* all equal: lowest ids first */
    assert_int_equal(ids[1], 1);
    assert_int_equal(ids[2], 2);
    assert_true(fabsf(w[0] - 2.5f / 3) < 1e-6f);
    /* the bias chooses expert 7 but its weight is its sigmoid score, not the choice score */
    const float bias[8] = {0, 0, 0, 0, 0, 0, 0, 1.0f};
    float lg2[8] = {2.0f, 1.0f, 0.0f, -1.0f, -2.0f, -3.0f, -4.0f, -5.0f};
    op_router_cfg c2 = {8, 2, 1, 1, 0, 2.0f, bias};
    assert_int_equal(op_router_topk(&c2, lg2, 1, ids, w), FP4MOE_OK);
    assert_int_equal(ids[0], 7);                 /* sigmoid(-5) + 1 = 1.0067 > sigmoid(2) = 0.88 */
    assert_int_equal(ids[1], 0);
    assert_true(fabs(w[0] - 2.0 * sigm(-5)) < 1e-6);
    assert_true(fabs(w[1] - 2.0 * sigm(2)) < 1e-6);
    /* groups: expert 0 is the best single score, but group 0's top-2 sum loses */
    float lg3[8] = {3.0f, -6.0f, 1.0f, 1.0f, 1.2f, 1.1f, -6.0f, -6.0f};
    op_router_cfg c3 = {8, 2, 4, 2, 1, 1.0f, NULL};
    assert_int_equal(op_router_topk(&c3, lg3, 1, ids, w), FP4MOE_OK);
    assert_int_equal(ids[0], 4);
    assert_int_equal(ids[1], 5);
    assert_true(fabs(w[0] + w[1] - 1.0) < 1e-6);
}

static void test_router_random(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 7);
    const int64_t E = 32, T = 50;
    float *bias = rnd(&r, E, 0.05);
    const op_router_cfg cfgs[] = {{E, 6, 1, 1, 1, 2.5f, bias}, {E, 4, 4, 2, 0, 1.5f, bias},
                                  {E, 3, 8, 3, 1, 1.0f, NULL}};
    for (size_t ci = 0; ci < 3; ci++) {
        const op_router_cfg *c = &cfgs[ci];
        float *lg = rnd(&r, T * E, 1.5);
        int32_t *ids = malloc((size_t)(T * c->k) * 4), rid[8];
        float *w = poison(T * c->k);
        double rw[8];
        assert_int_equal(op_router_topk(c, lg, T, ids, w), FP4MOE_OK);
        for (int64_t t = 0; t < T; t++) {
            router_ref(c, lg + t * E, rid, rw);
            for (int64_t j = 0; j < c->k; j++) {
                assert_int_equal(ids[t * c->k + j], rid[j]);
                assert_true(fabs(w[t * c->k + j] - rw[j]) <= 1e-6 * fabs(rw[j]));
            }
        }
        free(lg);
        free(ids);
        free(w);
    }
    free(bias);
}

static void test_sort_and_combine(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 11);
    const int64_t T = 37, k = 3, E = 9, B = T * k, H = 5;
    int32_t ids[37 * 3];
    for (int64_t b = 0; b < B; b++) ids[b] = (int32_t)tu_rng_below(&r, (uint32_t)E);
    uint32_t row_of[37 * 3], idx[37 * 3], pos_of[37 * 3];
    assert_int_equal(op_sort_by_expert(ids, B, E, row_of, idx, pos_of), FP4MOE_OK);
    for (int64_t p = 0; p < B; p++) {
        assert_int_equal(idx[p], ids[row_of[p]]);
        assert_int_equal(pos_of[row_of[p]], p);
        if (p) {
            assert_true(idx[p - 1] <= idx[p]);
            if (idx[p - 1] == idx[p]) assert_true(row_of[p - 1] < row_of[p]);   /* stable */
        }
    }
    float *ys = rnd(&r, B * H, 1.0), *w = rnd(&r, B, 1.0), *out = poison(T * H);
    double ref[37 * 5];
    op_moe_combine(ys, H, pos_of, w, T, k, out);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < H; h++) {
            ref[t * H + h] = 0;
            for (int64_t j = 0; j < k; j++) ref[t * H + h] += (double)w[t * k + j] * ys[pos_of[t * k + j] * H + h];
        }
    close_f64(out, ref, T * H, 1e-6, "combine");
    free(ys);
    free(w);
    free(out);
}

/* ---- Mamba ops ------------------------------------------------------------------------------ */

static void test_conv1d_state(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 3);
    const int64_t T = 11, C = 6, Kc = 4, xs = 9;    /* x rows have stride 9 > C */
    float *x = rnd(&r, T * xs, 1.0), *w = rnd(&r, C * Kc, 1.0), *b = rnd(&r, C, 1.0);
    float *st = calloc((size_t)((Kc - 1) * C), 4), *st2 = calloc((size_t)((Kc - 1) * C), 4);
    float *y = poison(T * C), *y2 = poison(T * C);
    double ref[11 * 6];
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = 0; c < C; c++) {
            double a = b[c];
            for (int64_t j = 0; j < Kc; j++) {
                const int64_t s = t - (Kc - 1) + j;
                if (s >= 0) a += (double)w[c * Kc + j] * x[s * xs + c];
            }
            ref[t * C + c] = a;
        }
    op_conv1d_causal(x, xs, T, C, w, b, Kc, st, y);
    close_f64(y, ref, T * C, 1e-6, "conv whole");
    /* the same sequence in pieces of 1, 2 and 8 tokens through the state */
    op_conv1d_causal(x, xs, 1, C, w, b, Kc, st2, y2);
    op_conv1d_causal(x + 1 * xs, xs, 2, C, w, b, Kc, st2, y2 + 1 * C);
    op_conv1d_causal(x + 3 * xs, xs, 8, C, w, b, Kc, st2, y2 + 3 * C);
    close_f64(y2, ref, T * C, 1e-6, "conv pieces");
    assert_memory_equal(st, st2, (size_t)((Kc - 1) * C) * 4);
    for (int64_t i = 0; i < Kc - 1; i++)                   /* state = the last Kc-1 inputs */
        for (int64_t c = 0; c < C; c++) assert_true(st[i * C + c] == x[(T - (Kc - 1) + i) * xs + c]);
    free(x); free(w); free(b); free(st); free(st2); free(y); free(y2);
}

static double softplus_d(double v) { return v > 20 ? v : log1p(exp(v)); }

static void test_ssm_scan(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 5);
    const int64_t T = 9, nh = 4, hd = 3, S = 5, G = 2, xs = 20, bcs = 2 * G * S + 1, dts = 7;
    float *x = rnd(&r, T * xs, 1.0), *bc = rnd(&r, T * bcs, 1.0), *dt = rnd(&r, T * dts, 1.0);
    float *dtb = rnd(&r, nh, 1.0), *A = malloc(nh * 4), *D = rnd(&r, nh, 1.0);
    for (int64_t h = 0; h < nh; h++) A[h] = -expf((float)tu_rng_uniform(&r) * 2.0f);
    dtb[0] = -9.0f;                                         /* head 0 hits the lower dt limit */
    dtb[1] = 3.0f;                                          /* head 1 the upper one */
    const float dt_lo = 0.01f, dt_hi = 2.5f;
    double *ref = calloc((size_t)(T * nh * hd), 8), *sref = calloc((size_t)(nh * hd * S), 8);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nh; h++) {
            const int64_t g = h / (nh / G);
            double d = softplus_d((double)dt[t * dts + h] + dtb[h]);
            if (d < dt_lo) d = dt_lo;
            if (d > dt_hi) d = dt_hi;
            const double dA = exp(d * A[h]);
            for (int64_t p = 0; p < hd; p++) {
                double y = 0;
                for (int64_t n = 0; n < S; n++) {
                    double *s = &sref[(h * hd + p) * S + n];
                    *s = dA * *s + d * x[t * xs + h * hd + p] * bc[t * bcs + g * S + n];
                    y += *s * bc[t * bcs + G * S + g * S + n];
                }
                ref[t * nh * hd + h * hd + p] = y + (double)D[h] * x[t * xs + h * hd + p];
            }
        }
    float *st = calloc((size_t)(nh * hd * S), 4), *y = poison(T * nh * hd);
    op_ssm_args a = {T, nh, hd, S, G, x, xs, bc, bc + G * S, bcs, dt, dts, dtb, A, D, dt_lo, dt_hi, st, y};
    op_ssm_scan(&a);
    close_f64(y, ref, T * nh * hd, 1e-5, "scan whole");
    /* token by token from a zero state gives the same outputs */
    float *st2 = calloc((size_t)(nh * hd * S), 4), *y2 = poison(T * nh * hd);
    for (int64_t t = 0; t < T; t++) {
        op_ssm_args b = {1, nh, hd, S, G, x + t * xs, xs, bc + t * bcs, bc + t * bcs + G * S, bcs,
                         dt + t * dts, dts, dtb, A, D, dt_lo, dt_hi, st2, y2 + t * nh * hd};
        op_ssm_scan(&b);
    }
    close_f64(y2, ref, T * nh * hd, 1e-5, "scan token by token");
    for (int64_t i = 0; i < nh * hd * S; i++) assert_true(fabs(st2[i] - sref[i]) <= 1e-5 * (1 + fabs(sref[i])));
    free(x); free(bc); free(dt); free(dtb); free(A); free(D); free(ref); free(sref);
    free(st); free(y); free(st2); free(y2);
}

static void test_rmsnorm_gated(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 9);
    const int64_t T = 3, D = 12, G = 3, ys = 15, zs = 20;
    float *y = rnd(&r, T * ys, 1.0), *z = rnd(&r, T * zs, 1.0), *w = rnd(&r, D, 1.0), *out = poison(T * D);
    double ref[3 * 12];
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            double v[4], ss = 0;
            for (int64_t i = 0; i < 4; i++) {
                const double zz = z[t * zs + g * 4 + i];
                v[i] = y[t * ys + g * 4 + i] * zz / (1 + exp(-zz));
                ss += v[i] * v[i];
            }
            for (int64_t i = 0; i < 4; i++) ref[t * D + g * 4 + i] = v[i] / sqrt(ss / 4 + 1e-5) * w[g * 4 + i];
        }
    op_rmsnorm_gated(y, ys, z, zs, w, T, D, G, 1e-5f, out);
    close_f64(out, ref, T * D, 1e-5, "gated rmsnorm");
    free(y); free(z); free(w); free(out);
}

/* ---- attention ------------------------------------------------------------------------------ */

/* The FP8 KV cache's rows (op_kv_fp8_*): per (token, kv head) scale max|x| / 448, every value within
 * half an E4M3 step of the original (2^-4 relative in the normal range, 2^-10 s below it), the max
 * exactly representable, heads of widely different magnitudes kept apart, an all-zero head exact, a
 * NaN making its own head NaN only, odd head_dim (padding) and the row size. */
static void test_kv_fp8_rows(void **state) {
    (void)state;
    tu_rng r;
    tu_rng_seed(&r, 29);
    const int64_t dims[] = {64, 128, 5};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int64_t nkv = 4, dh = dims[di], n = nkv * dh;
        assert_int_equal(op_kv_fp8_row_bytes(nkv, dh), (size_t)((n + 3) / 4 * 4 + 4 * nkv));
        float *x = rnd(&r, n, 1.0), *y = poison(n);
        for (int64_t i = 0; i < dh; i++) x[dh + i] *= 1e-6f;          /* head 1: tiny */
        for (int64_t i = 0; i < dh; i++) x[2 * dh + i] = 0.0f;        /* head 2: zeros */
        x[3 * dh] = 3e4f;                                             /* head 3: one outlier */
        uint8_t *row = malloc(op_kv_fp8_row_bytes(nkv, dh));
        memset(row, 0xAB, op_kv_fp8_row_bytes(nkv, dh));
        op_kv_fp8_store(x, nkv, dh, row);
        op_kv_fp8_load(row, nkv, dh, y);
        for (int64_t h = 0; h < nkv; h++) {
            double amax = 0;
            for (int64_t i = 0; i < dh; i++) amax = fmax(amax, fabs(x[h * dh + i]));
            const double s = amax > 0 ? amax / 448.0 : 1.0;
            for (int64_t i = 0; i < dh; i++) {
                const double a = x[h * dh + i], b = y[h * dh + i];
                if (!(fabs(a - b) <= 0.0625 * fabs(a) + s * (1.0 / 1024) * 1.0001))
                    fail_msg("dh %lld head %lld [%lld]: %g -> %g (scale %g)", (long long)dh, (long long)h, (long long)i,
                             a, b, s);
                if (fabs(a) == amax && fabs(fabs(b) - amax) > 1e-6 * amax)
                    fail_msg("dh %lld head %lld: the max %g came back as %g", (long long)dh, (long long)h, a, b);
            }
        }
        for (int64_t i = 0; i < dh; i++) assert_true(y[2 * dh + i] == 0.0f);
        x[dh + 1] = NAN;                                              /* a NaN: its head only */
        op_kv_fp8_store(x, nkv, dh, row);
        op_kv_fp8_load(row, nkv, dh, y);
        for (int64_t i = 0; i < n; i++) assert_true((i / dh == 1) == isnan(y[i]));
        free(x);
        free(y);
        free(row);
    }
}

static void test_attention_gqa_cache(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 13);
    const int64_t P = 5, T = 4, nq = 6, nkv = 2, dh = 8, qs = nq * dh + 3, kvs = nkv * dh;
    float *q = rnd(&r, T * qs, 1.0), *k = rnd(&r, (P + T) * kvs, 1.0), *v = rnd(&r, (P + T) * kvs, 1.0);
    float *out = poison(T * nq * dh);
    double *ref = calloc((size_t)(T * nq * dh), 8);
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < nq; h++) {
            const int64_t kh = h / (nq / nkv), n = P + t + 1;
            double sc[16], mx = -INFINITY, sum = 0;
            for (int64_t j = 0; j < n; j++) {
                double d = 0;
                for (int64_t i = 0; i < dh; i++) d += (double)q[t * qs + h * dh + i] * k[j * kvs + kh * dh + i];
                sc[j] = d / sqrt((double)dh);
                mx = fmax(mx, sc[j]);
            }
            for (int64_t j = 0; j < n; j++) sum += (sc[j] = exp(sc[j] - mx));
            for (int64_t j = 0; j < n; j++)
                for (int64_t i = 0; i < dh; i++) ref[(t * nq + h) * dh + i] += sc[j] / sum * v[j * kvs + kh * dh + i];
        }
    assert_int_equal(op_attention_causal(q, qs, k, v, P, T, nq, nkv, dh, out), FP4MOE_OK);
    close_f64(out, ref, T * nq * dh, 1e-5, "attention");
    /* the paged form: the same rows scattered over pages of 3 in a shuffled order (the rows see 6..9
       keys: runs that end inside a page), read in place: bitwise equal to the contiguous call */
    const int64_t page = 3, np = (P + T + page - 1) / page;
    int32_t pages[8] = {4, 0, 2, 1, 3, 5, 6, 7};
    float *kp = poison((np + 5) * page * kvs), *vp = poison((np + 5) * page * kvs), *outp = poison(T * nq * dh);
    for (int64_t j = 0; j < P + T; j++) {
        memcpy(kp + (pages[j / page] * page + j % page) * kvs, k + j * kvs, (size_t)kvs * sizeof(float));
        memcpy(vp + (pages[j / page] * page + j % page) * kvs, v + j * kvs, (size_t)kvs * sizeof(float));
    }
    assert_int_equal(op_attention_causal_paged(q, qs, kp, vp, pages, page, P, T, nq, nkv, dh, outp), FP4MOE_OK);
    assert_memory_equal(out, outp, (size_t)(T * nq * dh) * sizeof(float));
    assert_int_equal(op_attention_causal_paged(q, qs, kp, vp, NULL, page, P, T, nq, nkv, dh, outp), FP4MOE_EINVAL);
    free(kp); free(vp); free(outp);
    free(q); free(k); free(v); free(out); free(ref);
}

/* The FP8 cache read in place (op_attention_causal_paged_fp8): bitwise equal to op_attention_causal
 * on the rows dequantized by op_kv_fp8_load, for GQA 3:1 with pages of 3 (runs ending inside a
 * page) and 16:1 with pages of 32 and a long prefix; the errors. */
static void fp8_attention_case(int64_t P, int64_t T, int64_t nq, int64_t nkv, int64_t dh, int64_t page, uint64_t seed) {
    tu_rng r;
    tu_rng_seed(&r, seed);
    const int64_t qs = nq * dh + 5, kvs = nkv * dh, n = P + T, np = (n + page - 1) / page, npool = np + 3;
    const size_t rb = op_kv_fp8_row_bytes(nkv, dh);
    float *q = rnd(&r, T * qs, 1.0), *k = rnd(&r, n * kvs, 1.0), *v = rnd(&r, n * kvs, 1.0);
    float *kd = poison(n * kvs), *vd = poison(n * kvs), *out = poison(T * nq * dh), *outp = poison(T * nq * dh);
    int32_t *pages = malloc(sizeof(int32_t) * (size_t)npool);
    for (int64_t i = 0; i < npool; i++) pages[i] = (int32_t)i;
    for (int64_t i = npool - 1; i > 0; i--) { /* shuffled pages */
        const int64_t j = (int64_t)tu_rng_below(&r, (uint32_t)(i + 1));
        const int32_t t = pages[i];
        pages[i] = pages[j];
        pages[j] = t;
    }
    uint8_t *kb = malloc(rb * (size_t)(npool * page)), *vb = malloc(rb * (size_t)(npool * page));
    memset(kb, 0xEE, rb * (size_t)(npool * page));
    memset(vb, 0xEE, rb * (size_t)(npool * page));
    for (int64_t j = 0; j < n; j++) {
        const int64_t row = (int64_t)pages[j / page] * page + j % page;
        op_kv_fp8_store(k + j * kvs, nkv, dh, kb + (size_t)row * rb);
        op_kv_fp8_store(v + j * kvs, nkv, dh, vb + (size_t)row * rb);
        op_kv_fp8_load(kb + (size_t)row * rb, nkv, dh, kd + j * kvs);
        op_kv_fp8_load(vb + (size_t)row * rb, nkv, dh, vd + j * kvs);
    }
    assert_int_equal(op_attention_causal(q, qs, kd, vd, P, T, nq, nkv, dh, out), FP4MOE_OK);
    assert_int_equal(op_attention_causal_paged_fp8(q, qs, kb, vb, pages, page, P, T, nq, nkv, dh, outp), FP4MOE_OK);
    assert_memory_equal(out, outp, (size_t)(T * nq * dh) * sizeof(float));
    assert_int_equal(op_attention_causal_paged_fp8(q, qs, kb, vb, NULL, page, P, T, nq, nkv, dh, outp), FP4MOE_EINVAL);
    free(q); free(k); free(v); free(kd); free(vd); free(out); free(outp); free(pages); free(kb); free(vb);
}

static void test_attention_fp8_cache(void **state) {
    fp8_attention_case(5, 4, 6, 2, 8, 3, 21);
    fp8_attention_case(70, 3, 32, 2, 64, 32, 22);
    fp8_attention_case(0, 37, 4, 4, 16, 32, 23);
    float q[4] = {0};
    uint8_t row[8] = {0};
    int32_t pg[1] = {0};
    assert_int_equal(op_attention_causal_paged_fp8(q, 130, row, row, pg, 1, 0, 1, 130, 1, 1, q), FP4MOE_EUNSUPPORTED);
}

/* ---- linear --------------------------------------------------------------------------------- */

static void test_linear_dense_and_nvfp4(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 17);
    const int64_t T = 5, N = 24, K = 48;
    float *x = rnd(&r, T * K, 1.0), *wf = rnd(&r, N * K, 0.2), *bias = rnd(&r, N, 1.0), *y = poison(T * N);
    uint16_t *wb = malloc((size_t)(N * K) * 2);
    fp4moe_from_f32(wf, N * K, FP4MOE_BF16, wb);
    const void *ptr[1] = {wb};
    op_linear dense = {1, N, K, 0, {0}, FP4MOE_BF16, ptr, bias};
    ops_ctx c = {.act = FP4MOE_F32, .route = FP4MOE_ROUTE_AUTO};
    double *ref = malloc((size_t)(T * N) * 8);
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double a = bias[n];
            for (int64_t i = 0; i < K; i++) a += (double)x[t * K + i] * fp4moe_bf16_to_f32(wb[n * K + i]);
            ref[t * N + n] = a;
        }
    assert_int_equal(op_linear_forward(&c, &dense, x, T, y), FP4MOE_OK);
    close_f64(y, ref, T * N, 1e-5, "dense bf16 linear");
    /* NVFP4 through gather_qmm, E = 1 */
    uint8_t *codes = malloc((size_t)(N * K / 2)), *scales = malloc((size_t)(N * K / 16));
    assert_int_equal(fp4moe_nvfp4_quantize(wf, FP4MOE_F32, N, K, 0, codes, scales, NULL), FP4MOE_OK);
    float *wd = malloc((size_t)(N * K) * 4);
    fp4moe_nvfp4_dequantize(codes, scales, N, K, 1.0f, FP4MOE_F32, wd);
    op_linear q = {1, N, K, 1, {codes, scales, NULL, 1, N, K}, FP4MOE_F32, NULL, NULL};
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) {
            double a = 0;
            for (int64_t i = 0; i < K; i++) a += (double)x[t * K + i] * wd[n * K + i];
            ref[t * N + n] = a;
        }
    tu_poison(y, FP4MOE_F32, T * N);
    assert_int_equal(op_linear_forward(&c, &q, x, T, y), FP4MOE_OK);
    close_f64(y, ref, T * N, 1e-5, "nvfp4 linear");
    /* bf16 activations: the result is the bf16 rounding of (bf16-rounded x) @ W */
    c.act = FP4MOE_BF16;
    tu_poison(y, FP4MOE_F32, T * N);
    assert_int_equal(op_linear_forward(&c, &q, x, T, y), FP4MOE_OK);
    for (int64_t i = 0; i < T * N; i++) assert_true(y[i] == fp4moe_bf16_to_f32(fp4moe_f32_to_bf16(y[i])));
    close_f64(y, ref, T * N, 2e-2, "nvfp4 linear, bf16 act");
    /* fp32 output (the lm_head): (bf16-rounded x) @ W accumulated in fp32 and not rounded */
    const op_linear *both[2] = {&q, &dense};
    for (int w = 0; w < 2; w++) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < N; n++) {
                double a = both[w]->bias ? bias[n] : 0.0;
                for (int64_t i = 0; i < K; i++)
                    a += (double)fp4moe_bf16_to_f32(fp4moe_f32_to_bf16(x[t * K + i])) *
                         (w ? fp4moe_bf16_to_f32(wb[n * K + i]) : wd[n * K + i]);
                ref[t * N + n] = a;
            }
        tu_poison(y, FP4MOE_F32, T * N);
        assert_int_equal(op_linear_forward_f32out(&c, both[w], x, T, y), FP4MOE_OK);
        close_f64(y, ref, T * N, 1e-5, w ? "dense linear, bf16 act, f32 out" : "nvfp4 linear, bf16 act, f32 out");
        int64_t off_bf16 = 0;
        for (int64_t i = 0; i < T * N; i++) off_bf16 += y[i] != fp4moe_bf16_to_f32(fp4moe_f32_to_bf16(y[i]));
        assert_true(off_bf16 > T * N / 2);
    }
    ops_ctx_free(&c);
    free(x); free(wf); free(bias); free(y); free(wb); free(ref); free(codes); free(scales); free(wd);
}

/* ---- sampler -------------------------------------------------------------------------------- */

static void test_sampler(void **state) {
    float lg[6] = {1.0f, 3.0f, 3.0f, -1.0f, NAN, 0.0f};
    assert_int_equal(fp4moe_argmax(lg, 6), 1);          /* tie: lowest id; NaN never wins */
    fp4moe_sampler s;
    assert_int_equal(fp4moe_sampler_init(&s, 6, 0.0f, 1.0f, 1), FP4MOE_OK);
    assert_int_equal(fp4moe_sample(&s, lg), 1);
    fp4moe_sampler_free(&s);
    assert_int_equal(fp4moe_sampler_init(&s, 6, 1.0f, 0.0f, 1), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_sampler_init(&s, 0, 1.0f, 1.0f, 1), FP4MOE_EINVAL);
    /* temperature 1 over 4 tokens: frequencies follow softmax; top_p 0.5 keeps only the top token */
    float l4[4] = {0.0f, 1.0f, 2.0f, -1.0f};
    double p[4], z = 0;
    for (int i = 0; i < 4; i++) z += (p[i] = exp(l4[i]));
    int cnt[4] = {0};
    assert_int_equal(fp4moe_sampler_init(&s, 4, 1.0f, 1.0f, 42), FP4MOE_OK);
    const int n = 20000;
    for (int i = 0; i < n; i++) cnt[fp4moe_sample(&s, l4)]++;
    for (int i = 0; i < 4; i++) assert_true(fabs(cnt[i] / (double)n - p[i] / z) < 0.02);
    fp4moe_sampler_free(&s);
    assert_int_equal(fp4moe_sampler_init(&s, 4, 1.0f, 0.5f, 42), FP4MOE_OK);
    for (int i = 0; i < 200; i++) assert_int_equal(fp4moe_sample(&s, l4), 2);
    fp4moe_sampler_free(&s);
    /* same seed, same draws */
    fp4moe_sampler a, b;
    fp4moe_sampler_init(&a, 4, 0.7f, 0.9f, 5);
    fp4moe_sampler_init(&b, 4, 0.7f, 0.9f, 5);
    for (int i = 0; i < 100; i++) assert_int_equal(fp4moe_sample(&a, l4), fp4moe_sample(&b, l4));
    fp4moe_sampler_free(&a);
    fp4moe_sampler_free(&b);
    /* top_k 2 keeps ids 2 and 1 (frequencies renormalised over them); min_p 0.5 keeps p >= p_max/2
     * (only id 2: p1/p2 = e^-1); top_k and min_p together; stop ids */
    fp4moe_sampler_params sp;
    fp4moe_sampler_params_default(&sp);
    sp.temperature = 1.0f;
    sp.top_k = 2;
    sp.seed = 9;
    int c2[4] = {0};
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    for (int i = 0; i < n; i++) c2[fp4moe_sample(&s, l4)]++;
    fp4moe_sampler_free(&s);
    assert_int_equal(c2[0] + c2[3], 0);
    assert_true(fabs(c2[2] / (double)n - p[2] / (p[1] + p[2])) < 0.02);
    sp.top_k = 0;
    sp.min_p = 0.5f;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    for (int i = 0; i < 200; i++) assert_int_equal(fp4moe_sample(&s, l4), 2);
    fp4moe_sampler_free(&s);
    sp.min_p = 0.3f;                                   /* keeps ids 2 and 1 (e^-1 = 0.37 >= 0.3) */
    sp.top_k = 3;
    memset(c2, 0, sizeof c2);
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    for (int i = 0; i < 2000; i++) c2[fp4moe_sample(&s, l4)]++;
    assert_int_equal(c2[0] + c2[3], 0);
    assert_true(c2[1] > 0 && c2[2] > 0);
    assert_false(fp4moe_sampler_is_stop(&s, 2));
    fp4moe_sampler_free(&s);
    sp.stop_ids[0] = 2;
    sp.stop_ids[1] = 3;
    sp.n_stop = 2;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    assert_true(fp4moe_sampler_is_stop(&s, 3) && fp4moe_sampler_is_stop(&s, 2) && !fp4moe_sampler_is_stop(&s, 1));
    fp4moe_sampler_free(&s);
    sp.stop_ids[1] = 4;                                /* outside the vocabulary */
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_EINVAL);
    sp.n_stop = 0;
    sp.min_p = 1.5f;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_EINVAL);
    sp.min_p = 0.0f;
    sp.top_k = -1;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_EINVAL);
    sp.top_k = 0;
    /* repetition penalty (greedy): logits {2.0, 1.5, -1, -1.2}; penalty 2 on id 0 -> 1.0 < 1.5 */
    const float lr[4] = {2.0f, 1.5f, -1.0f, -1.2f};
    sp.temperature = 0.0f;
    sp.repeat_penalty = 2.0f;
    sp.repeat_last_n = 2;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    assert_int_equal(fp4moe_sample(&s, lr), 0);         /* nothing accepted yet */
    fp4moe_sampler_accept(&s, 0);
    fp4moe_sampler_accept(&s, 0);                       /* twice: penalized once (1.0, not 0.5) */
    assert_int_equal(fp4moe_sample(&s, lr), 1);
    fp4moe_sampler_accept(&s, 1);                       /* window 2: {0, 1}: 1.0 vs 0.75 -> id 0 */
    assert_int_equal(fp4moe_sample(&s, lr), 0);
    fp4moe_sampler_accept(&s, 3);
    fp4moe_sampler_accept(&s, 1);                       /* window {3, 1}: id 0 is free again */
    assert_int_equal(fp4moe_sample(&s, lr), 0);
    fp4moe_sampler_free(&s);
    const float ln[4] = {-1.0f, -1.5f, -3.0f, -4.0f};   /* negative logits are multiplied */
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    fp4moe_sampler_accept(&s, 0);                       /* -2.0 < -1.5 */
    assert_int_equal(fp4moe_sample(&s, ln), 1);
    fp4moe_sampler_free(&s);
    sp.repeat_penalty = -1.0f;
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_EINVAL);
    sp.repeat_penalty = 1.0f;                           /* off: accept is a no-op */
    assert_int_equal(fp4moe_sampler_init_params(&s, 4, &sp), FP4MOE_OK);
    assert_null(s.recent);
    fp4moe_sampler_accept(&s, 0);
    assert_int_equal(fp4moe_sample(&s, lr), 0);
    fp4moe_sampler_free(&s);
}

/* vLLM's logits processing in double: bias, then the repetition penalty over the distinct ids of `win`, then
 * frequency x count + presence over the output ids `out` */
static void ref_penalize(const float *l, int64_t V, const int32_t *bid, const float *bv, int64_t nb, const int32_t *win,
                         int64_t nw, float rp, const int32_t *out, int64_t no, float fp, float pp, double *y) {
    for (int64_t i = 0; i < V; i++) y[i] = l[i];
    for (int64_t i = 0; i < nb; i++) y[bid[i]] = (float)(y[bid[i]] + bv[i]);
    char *seen = calloc((size_t)V, 1);
    for (int64_t i = 0; i < nw; i++) seen[win[i]] = 1;
    for (int64_t i = 0; rp != 1.0f && i < V; i++)
        if (seen[i]) y[i] = (float)(y[i] > 0 ? y[i] / rp : y[i] * rp);
    int *cnt = calloc((size_t)V, sizeof(int));
    for (int64_t i = 0; i < no; i++) cnt[out[i]]++;
    for (int64_t i = 0; i < V; i++)
        if (cnt[i]) y[i] -= fp * cnt[i] + pp;
    free(seen);
    free(cnt);
}

/* logit bias, presence / frequency penalties (greedy picks against the reference's argmax on random logits, the
 * penalized values through temperature sampling of a two-token vocabulary), their errors, forget */
static void test_sampler_penalties(void **state) {
    (void)state;
    tu_rng r;
    tu_rng_seed(&r, 7);
    const int64_t V = 300;
    float *lg = rnd(&r, V, 2.0);
    double *y = malloc((size_t)V * sizeof(double));
    const int32_t bid[3] = {5, 17, 5};                 /* id 5 twice: its biases add */
    const float bv[3] = {1.5f, -30.0f, 0.75f};
    fp4moe_sampler_params sp;
    fp4moe_sampler_params_default(&sp);
    sp.presence_penalty = 0.6f;
    sp.frequency_penalty = 0.45f;
    sp.repeat_penalty = 1.3f;
    sp.repeat_last_n = 8;
    sp.bias_ids = bid;
    sp.bias = bv;
    sp.n_bias = 3;
    fp4moe_sampler s;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_OK);
    int32_t win[64], out[64];
    int64_t nw = 0, no = 0;
    for (int i = 0; i < 5; i++) { /* a "prompt": the window only */
        win[nw++] = (int32_t)(tu_rng_u64(&r) % (uint64_t)V);
        fp4moe_sampler_accept(&s, win[nw - 1]);
    }
    for (int step = 0; step < 40; step++) {
        for (int64_t i = 0; i < V; i++) lg[i] = (float)(2.0 * tu_rng_normal(&r));
        if (step % 3 == 0 && no) lg[out[no - 1]] += 6.0f; /* make repeats likely, so that counts of 2+ occur */
        const int64_t w0 = nw > 8 ? nw - 8 : 0;
        ref_penalize(lg, V, bid, bv, 3, win + w0, nw - w0, 1.3f, out, no, 0.45f, 0.6f, y);
        int64_t best = 0;
        for (int64_t i = 1; i < V; i++)
            if (y[i] > y[best]) best = i;
        const int32_t id = fp4moe_sample(&s, lg);
        if (id != best) fail_msg("step %d: sampled %d, reference argmax %lld", step, id, (long long)best);
        /* every penalized logit as the reference (float32 arithmetic of the same steps) */
        for (int64_t i = 0; i < V; i++)
            if (fabs(s.pen[i] - y[i]) > 1e-5 * (1.0 + fabs(y[i]))) fail_msg("step %d: pen[%lld] %g vs %g", step, (long long)i, s.pen[i], y[i]);
        out[no++] = id;
        win[nw++] = id;
        fp4moe_sampler_accept_output(&s, id);
    }
    int twice = 0;
    for (int64_t i = 0; i < V; i++) twice |= s.count && s.count[i] >= 2;
    assert_true(twice);                                 /* the frequency term saw counts above 1 */
    /* the repetition marks wrapping around: the next pass clears them and still penalizes once */
    s.pass = UINT32_MAX;
    ref_penalize(lg, V, bid, bv, 3, win + nw - 8, 8, 1.3f, out, no, 0.45f, 0.6f, y);
    (void)fp4moe_sample(&s, lg);
    for (int64_t i = 0; i < V; i++)
        if (fabs(s.pen[i] - y[i]) > 1e-5 * (1.0 + fabs(y[i]))) fail_msg("after the wrap: pen[%lld] %g vs %g", (long long)i, s.pen[i], y[i]);
    fp4moe_sampler_forget(&s);                          /* counts and window emptied: the bias alone remains */
    ref_penalize(lg, V, bid, bv, 3, NULL, 0, 1.3f, NULL, 0, 0.45f, 0.6f, y);
    (void)fp4moe_sample(&s, lg);
    for (int64_t i = 0; i < V; i++) {
        if (fabs(s.pen[i] - y[i]) > 1e-6 * (1.0 + fabs(y[i]))) fail_msg("after forget: pen[%lld] %g vs %g", (long long)i, s.pen[i], y[i]);
        assert_int_equal(s.count[i], 0);
    }
    fp4moe_sampler_free(&s);
    /* a penalty through sampling: two tokens of equal logits, the first generated once with presence 0 and frequency
       ln 3: p = 1 / (1 + 3) for it, measured over 20,000 draws */
    const float l2[2] = {0.5f, 0.5f};
    fp4moe_sampler_params_default(&sp);
    sp.temperature = 1.0f;
    sp.frequency_penalty = (float)log(3.0);
    sp.seed = 99;
    assert_int_equal(fp4moe_sampler_init_params(&s, 2, &sp), FP4MOE_OK);
    fp4moe_sampler_accept_output(&s, 0);
    int n0 = 0;
    for (int i = 0; i < 20000; i++) n0 += fp4moe_sample(&s, l2) == 0;
    assert_true(fabs(n0 / 20000.0 - 0.25) < 0.015);
    fp4moe_sampler_free(&s);
    /* errors: each names its field */
    fp4moe_sampler_params_default(&sp);
    sp.presence_penalty = NAN;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    sp.presence_penalty = 0.0f;
    sp.frequency_penalty = INFINITY;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    sp.frequency_penalty = 0.0f;
    sp.n_bias = 1;                                      /* no arrays */
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    const int32_t bad_id[1] = {(int32_t)V};
    const float bad_v[1] = {NAN}, ok_v[1] = {1.0f};
    sp.bias_ids = bad_id;
    sp.bias = ok_v;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "outside"));
    sp.bias_ids = bid;
    sp.bias = bad_v;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    sp.n_bias = -1;
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_EINVAL);
    /* all off: no buffers, the logits themselves */
    fp4moe_sampler_params_default(&sp);
    assert_int_equal(fp4moe_sampler_init_params(&s, V, &sp), FP4MOE_OK);
    assert_null(s.pen);
    assert_null(s.count);
    fp4moe_sampler_accept_output(&s, 3);                /* a no-op */
    assert_int_equal(fp4moe_sample(&s, lg), fp4moe_argmax(lg, V));
    fp4moe_sampler_free(&s);
    free(lg);
    free(y);
}

/* fp4moe_logprobs against log_softmax in long double on random logits with ties, a NaN and -inf; the top-k order */
static void test_logprobs(void **state) {
    (void)state;
    tu_rng r;
    tu_rng_seed(&r, 11);
    const int64_t Vs[4] = {1, 3, 257, 8192};
    for (int c = 0; c < 4; c++) {
        const int64_t V = Vs[c];
        float *lg = rnd(&r, V, 3.0);
        if (V > 10) {
            lg[3] = lg[9] = lg[V - 1] = 40.0f;               /* a three-way tie at the top: ids 3, 9, V-1 in order */
            lg[4] = NAN;                                     /* counts as -inf */
            lg[5] = -INFINITY;
        }
        long double mx = -INFINITY, sum = 0;
        for (int64_t i = 0; i < V; i++)
            if (!isnan(lg[i]) && lg[i] > mx) mx = lg[i];
        for (int64_t i = 0; i < V; i++)
            if (!isnan(lg[i])) sum += expl((long double)lg[i] - mx);
        const long double lz = mx + logl(sum);
        fp4moe_prob_id top[21];
        for (int64_t k = 0; k <= 20; k += 4) {
            for (int i = 0; i < 21; i++) top[i] = (fp4moe_prob_id){NAN, -7}; /* poison */
            const int32_t id = (int32_t)(tu_rng_u64(&r) % (uint64_t)V);
            float lp = NAN;
            const int64_t got = fp4moe_logprobs(lg, V, id, &lp, k, top);
            assert_int_equal(got, k < V ? k : V);
            const double want = isnan(lg[id]) ? -INFINITY : (double)((long double)lg[id] - lz);
            if (!(lp == want || fabs(lp - want) <= 2e-6 * (1.0 + fabs(want))))
                fail_msg("V %lld id %d: logprob %.9g, want %.9g", (long long)V, id, lp, want);
            for (int64_t i = 0; i < got; i++) {
                const int32_t t = top[i].id;
                assert_true(t >= 0 && t < V);
                const double w = isnan(lg[t]) ? -INFINITY : (double)((long double)lg[t] - lz);
                if (!(top[i].p == w || fabs(top[i].p - w) <= 2e-6 * (1.0 + fabs(w))))
                    fail_msg("V %lld top[%lld] (id %d): %.9g, want %.9g", (long long)V, (long long)i, t, top[i].p, w);
                /* nothing outside the list beats its last entry; the list is ordered (ties: lower id first) */
                if (i > 0) assert_true(top[i - 1].p > top[i].p || (top[i - 1].p == top[i].p && top[i - 1].id < t));
            }
            for (int64_t j = 0; got && j < V; j++) {
                int in = 0;
                for (int64_t i = 0; i < got; i++) in |= top[i].id == j;
                const float lj = isnan(lg[j]) ? -INFINITY : lg[j], last = top[got - 1].p + (float)lz;
                if (!in && (lj > last + 1e-5f * fabsf(last) ||
                            (lg[j] == lg[top[got - 1].id] && j < top[got - 1].id)))
                    fail_msg("V %lld k %lld: id %lld (logit %g) left out", (long long)V, (long long)k, (long long)j, lj);
            }
            if (V > 10 && k >= 4) assert_true(top[0].id == 3 && top[1].id == 9 && top[2].id == V - 1);
            for (int64_t i = got; i < 21; i++) assert_int_equal(top[i].id, -7); /* nothing written past k */
        }
        free(lg);
    }
    const float l3[3] = {0.0f, 0.0f, 0.0f};
    float lp;
    fp4moe_prob_id t1[1];
    assert_int_equal(fp4moe_logprobs(l3, 3, 1, &lp, 0, NULL), 0);
    assert_true(fabs(lp + log(3.0)) < 1e-6);
    assert_int_equal(fp4moe_logprobs(l3, 3, 3, &lp, 1, t1), -1);  /* id outside */
    assert_int_equal(fp4moe_logprobs(l3, 3, 0, &lp, 1, NULL), -1); /* no top array */
    assert_int_equal(fp4moe_logprobs(l3, 3, 0, &lp, -1, t1), -1);
    assert_int_equal(fp4moe_logprobs(NULL, 3, 0, &lp, 0, NULL), -1);
    assert_int_equal(fp4moe_logprobs(l3, 0, 0, &lp, 0, NULL), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_router_ties_and_bias),
        cmocka_unit_test(test_router_random),
        cmocka_unit_test(test_sort_and_combine),
        cmocka_unit_test(test_conv1d_state),
        cmocka_unit_test(test_ssm_scan),
        cmocka_unit_test(test_rmsnorm_gated),
        cmocka_unit_test(test_attention_gqa_cache),
        cmocka_unit_test(test_kv_fp8_rows),
        cmocka_unit_test(test_attention_fp8_cache),
        cmocka_unit_test(test_linear_dense_and_nvfp4),
        cmocka_unit_test(test_sampler),
        cmocka_unit_test(test_sampler_penalties),
        cmocka_unit_test(test_logprobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
