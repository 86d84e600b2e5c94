/* CUDA attention (src/kernels/cuda/ops_attention.cu) against an fp64 reference on random data:
 * paged KV caches with pages in random order, several sequences per decode call, context lengths
 * 1, 127, 128, 129, 4097, 20001 and 41000 (decode), prefill chunks (P, T) with and without a cached prefix, GQA ratios 1,
 * 4 and 16, head_dim 64 and 128; the split-KV decode kernel, the per-head decode kernel, the prefill
 * kernel and the paged KV append (V stored as fp16). Outputs are poisoned (NaN) before every call. Tolerance: bf16
 * output rounding plus fp32 accumulation, |gpu - ref| <= 1e-2 * max |ref| of the row (+1e-6). The
 * deliberate-fault builds (FP4MOE_INJECT_FAULT=causal_mask / kv_block) must fail this test
 * (scripts/gpu-check.sh). Needs a CUDA device; exits 77 (skipped) without. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "fp4moe/fp4moe.h"
#include "gpu_testutil.h"
#include "kernels/cuda/ops_cuda.h"
#include "testutil.h"

#define PAGE 32
#define RTOL 1e-2

static double bf2d(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

typedef struct {
    int64_t nq, nkv, dh, kvs;
    int nseq;
    int64_t *len;                   /* positions held by each sequence */
    int64_t max_pages, n_pages;
    int32_t *pages;                 /* nseq x max_pages */
    uint16_t *k, *v;                /* host caches: n_pages * PAGE rows of kvs */
    void *dk, *dv, *dpages;
} caches;

/* Caches for sequences of the given lengths, pages shuffled; K and V uniform in [-1, 1]. */
static caches make_caches(int64_t nq, int64_t nkv, int64_t dh, const int64_t *len, int nseq, tu_rng *r) {
    caches c = {nq, nkv, dh, nkv * dh, nseq, NULL, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL};
    c.len = malloc(sizeof(int64_t) * (size_t)nseq);
    for (int i = 0; i < nseq; i++) {
        c.len[i] = len[i];
        const int64_t np = (len[i] + PAGE - 1) / PAGE;
        if (np > c.max_pages) c.max_pages = np;
        c.n_pages += np;
    }
    c.n_pages += 3;                 /* unused pages in between */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)c.n_pages);
    for (int64_t i = 0; i < c.n_pages; i++) perm[i] = (int32_t)i;
    for (int64_t i = c.n_pages - 1; i > 0; i--) {
        const int64_t j = (int64_t)(tu_rng_uniform(r) * (double)(i + 1)) % (i + 1);
        const int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    c.pages = calloc((size_t)(nseq * c.max_pages), sizeof(int32_t));
    int64_t next = 0;
    for (int i = 0; i < nseq; i++)
        for (int64_t p = 0; p < (len[i] + PAGE - 1) / PAGE; p++) c.pages[i * c.max_pages + p] = perm[next++];
    free(perm);
    const size_t n = (size_t)(c.n_pages * PAGE * c.kvs);
    c.k = malloc(n * 2);
    c.v = malloc(n * 2);
    for (size_t i = 0; i < n; i++) {
        c.k[i] = gt_f2bf((float)(2.0 * tu_rng_uniform(r) - 1.0));
        c.v[i] = gt_f2bf((float)(2.0 * tu_rng_uniform(r) - 1.0));
    }
    c.dk = gt_upload(c.k, n * 2);
    uint16_t *vh = malloc(n * 2);               /* the device V cache holds fp16 (ops_cuda.h) */
    for (size_t i = 0; i < n; i++) vh[i] = gt_f2h((float)bf2d(c.v[i]));
    c.dv = gt_upload(vh, n * 2);
    free(vh);
    c.dpages = gt_upload(c.pages, sizeof(int32_t) * (size_t)(nseq * c.max_pages));
    return c;
}

static void free_caches(caches *c) {
    gt_free(c->dk); gt_free(c->dv); gt_free(c->dpages);
    free(c->k); free(c->v); free(c->pages); free(c->len);
}

static int64_t row_of(const caches *c, int s, int64_t pos) {
    return (int64_t)c->pages[s * c->max_pages + pos / PAGE] * PAGE + pos % PAGE;
}

/* fp64 attention of query q (nq x dh) of sequence s over keys 0 .. last; out nq x dh. Heads in
 * parallel (OpenMP); each output sums its keys in order 0 .. last. */
static void reference(const caches *c, int s, const uint16_t *q, int64_t last, double *out) {
    const int64_t G = c->nq / c->nkv, n = last + 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t h = 0; h < c->nq; h++) {
        double *sc = malloc(sizeof(double) * (size_t)n);
        const int64_t kh = h / G;
        double m = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            const uint16_t *kr = c->k + row_of(c, s, j) * c->kvs + kh * c->dh;
            double d = 0;
            for (int64_t i = 0; i < c->dh; i++) d += bf2d(q[h * c->dh + i]) * bf2d(kr[i]);
            sc[j] = d / sqrt((double)c->dh);
            if (sc[j] > m) m = sc[j];
        }
        double l = 0;
        for (int64_t j = 0; j < n; j++) l += (sc[j] = exp(sc[j] - m));
        double *o = out + h * c->dh;
        for (int64_t i = 0; i < c->dh; i++) o[i] = 0;
        for (int64_t j = 0; j < n; j++) { /* a V row at a time (each o[i] still sums j in order) */
            const uint16_t *vr = c->v + row_of(c, s, j) * c->kvs + kh * c->dh;
            for (int64_t i = 0; i < c->dh; i++) o[i] += sc[j] * bf2d(vr[i]);
        }
        for (int64_t i = 0; i < c->dh; i++) o[i] /= l;
        free(sc);
    }
}

/* Worst |gpu - ref| / max|ref| over the rows of nq*dh values; NaN counts as infinite. */
static double row_err(const uint16_t *gpu, const double *ref, int64_t n) {
    double mx = 0, e = 0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs(bf2d(gpu[i]) - ref[i]);
        if (isnan(d)) return INFINITY;
        e = fmax(e, d);
    }
    return e / (mx + 1e-6);
}

typedef struct { int64_t nq, nkv, dh; } shape;
static const shape k_shapes[] = {{4, 4, 64}, {16, 4, 128}, {32, 2, 128}, {8, 2, 64}, {6, 2, 96}};

static void test_decode(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 31);
    /* 20001 and 41000: several pages per split (256 splits), so that more than one warp of a split
     * holds keys and one warp holds two pages */
    const int64_t lens[] = {1, 127, 128, 129, 4097, 20001, 41000};
    const int nseq = 7;
    double worst = 0;
    for (size_t si = 0; si < sizeof k_shapes / sizeof k_shapes[0]; si++) {
        const shape sh = k_shapes[si];
        caches c = make_caches(sh.nq, sh.nkv, sh.dh, lens, nseq, &r);
        const int64_t qn = nseq * sh.nq * sh.dh;
        uint16_t *q = malloc((size_t)qn * 2), *out = malloc((size_t)qn * 2);
        for (int64_t i = 0; i < qn; i++) q[i] = gt_f2bf((float)(4.0 * tu_rng_uniform(&r) - 2.0));
        int32_t slot[7], pos[7];
        for (int i = 0; i < nseq; i++) {
            slot[i] = (int32_t)((i * 5 + 1) % nseq);    /* rows in another order than the slots */
            pos[i] = (int32_t)(lens[slot[i]] - 1);
        }
        void *dq = gt_upload(q, (size_t)qn * 2), *dout = gt_upload(NULL, (size_t)qn * 2);
        void *dslot = gt_upload(slot, sizeof slot), *dpos = gt_upload(pos, sizeof pos);
        void *scratch = gt_upload(NULL, cuda_attention_decode_scratch(nseq, sh.nq, sh.dh));
        double *ref = malloc(sizeof(double) * (size_t)qn); /* each row's reference, for both kernels */
        for (int i = 0; i < nseq; i++) reference(&c, slot[i], q + i * sh.nq * sh.dh, pos[i], ref + i * sh.nq * sh.dh);
        for (int kernel = 0; kernel < 2; kernel++) {
            gt_poison(dout, (size_t)qn * 2);
            const int rc = kernel == 0
                ? cuda_attention_decode_split(NULL, dq, c.dk, c.dv, dslot, dpos, c.dpages, c.max_pages, nseq, sh.nq,
                                              sh.nkv, sh.dh, scratch, dout)
                : cuda_attention_decode(NULL, dq, c.dk, c.dv, dslot, dpos, c.dpages, c.max_pages, nseq, sh.nq, sh.nkv,
                                        sh.dh, dout);
            if (rc) fail_msg("decode: %s", fp4moe_last_error());
            GT_CHECK(cudaDeviceSynchronize());
            gt_download(out, dout, (size_t)qn * 2);
            for (int i = 0; i < nseq; i++) {
                const double e = row_err(out + i * sh.nq * sh.dh, ref + i * sh.nq * sh.dh, sh.nq * sh.dh);
                worst = fmax(worst, e);
                if (e > RTOL)
                    fail_msg("decode (%s) nq=%lld nkv=%lld dh=%lld, context %d: error %.3g", kernel ? "per head" : "split",
                             (long long)sh.nq, (long long)sh.nkv, (long long)sh.dh, pos[i] + 1, e);
            }
        }
        printf("decode nq=%lld nkv=%lld dh=%lld: contexts 1..41000 in one call, both kernels within %.0e\n",
               (long long)sh.nq, (long long)sh.nkv, (long long)sh.dh, RTOL);
        free(ref); free(q); free(out);
        gt_free(dq); gt_free(dout); gt_free(dslot); gt_free(dpos); gt_free(scratch);
        free_caches(&c);
    }
    printf("decode: worst row error %.3g\n", worst);
}

/* Prefill: T new tokens of a sequence after P cached ones: the T keys/values appended by
 * cuda_kv_append (the host copy updated the same way), then causal attention. */
/* the prefill of one kernel choice (FP4MOE_CUDA_ATTENTION: "wgmma" for head_dim 128 with an even group,
 * "mma" the mma.sync kernel); (300, 517): several 64-token blocks, diagonals across 128-key steps */
static void prefill_kernel(const char *kernel) {
    tu_setenv("FP4MOE_CUDA_ATTENTION", kernel);
    tu_rng r;
    tu_rng_seed(&r, 37);
    const int64_t cases[][2] = {{0, 1}, {0, 127}, {0, 128}, {0, 129}, {100, 29}, {4000, 97}, {31, 1}, {300, 517}};
    double worst = 0;
    for (size_t si = 0; si < sizeof k_shapes / sizeof k_shapes[0]; si++) {
        const shape sh = k_shapes[si];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const int64_t P = cases[ci][0], T = cases[ci][1], len = P + T;
            caches c = make_caches(sh.nq, sh.nkv, sh.dh, &len, 1, &r);
            /* new rows: random k, v appended through the kernel; the host caches get them too */
            uint16_t *kn = malloc((size_t)(T * c.kvs) * 2), *vn = malloc((size_t)(T * c.kvs) * 2);
            int32_t *slot = calloc((size_t)T, 4), *pos = malloc((size_t)T * 4);
            for (int64_t t = 0; t < T; t++) {
                pos[t] = (int32_t)(P + t);
                for (int64_t i = 0; i < c.kvs; i++) {
                    kn[t * c.kvs + i] = gt_f2bf((float)(2.0 * tu_rng_uniform(&r) - 1.0));
                    vn[t * c.kvs + i] = gt_f2bf((float)(2.0 * tu_rng_uniform(&r) - 1.0));
                    c.k[row_of(&c, 0, P + t) * c.kvs + i] = kn[t * c.kvs + i];
                    c.v[row_of(&c, 0, P + t) * c.kvs + i] = vn[t * c.kvs + i];
                }
            }
            void *dkn = gt_upload(kn, (size_t)(T * c.kvs) * 2), *dvn = gt_upload(vn, (size_t)(T * c.kvs) * 2);
            void *dslot = gt_upload(slot, (size_t)T * 4), *dpos = gt_upload(pos, (size_t)T * 4);
            if (cuda_kv_append(NULL, dkn, dvn, T, c.kvs, dslot, dpos, c.dpages, c.max_pages, c.dk, c.dv))
                fail_msg("kv append: %s", fp4moe_last_error());
            const int64_t qn = T * sh.nq * sh.dh;
            uint16_t *q = malloc((size_t)qn * 2), *out = malloc((size_t)qn * 2);
            for (int64_t i = 0; i < qn; i++) q[i] = gt_f2bf((float)(4.0 * tu_rng_uniform(&r) - 2.0));
            void *dq = gt_upload(q, (size_t)qn * 2), *dout = gt_upload(NULL, (size_t)qn * 2);
            gt_poison(dout, (size_t)qn * 2);
            if (cuda_attention_prefill(NULL, dq, c.dk, c.dv, c.dpages, P, T, sh.nq, sh.nkv, sh.dh, dout))
                fail_msg("prefill: %s", fp4moe_last_error());
            GT_CHECK(cudaDeviceSynchronize());
            gt_download(out, dout, (size_t)qn * 2);
            double *ref = malloc(sizeof(double) * (size_t)(sh.nq * sh.dh));
            for (int64_t t = 0; t < T; t++) {
                reference(&c, 0, q + t * sh.nq * sh.dh, P + t, ref);
                const double e = row_err(out + t * sh.nq * sh.dh, ref, sh.nq * sh.dh);
                worst = fmax(worst, e);
                if (e > RTOL)
                    fail_msg("prefill nq=%lld nkv=%lld dh=%lld, P=%lld T=%lld, token %lld: error %.3g", (long long)sh.nq,
                             (long long)sh.nkv, (long long)sh.dh, (long long)P, (long long)T, (long long)t, e);
            }
            free(ref); free(q); free(out); free(kn); free(vn); free(slot); free(pos);
            gt_free(dq); gt_free(dout); gt_free(dkn); gt_free(dvn); gt_free(dslot); gt_free(dpos);
            free_caches(&c);
        }
    }
    printf("prefill (%s): (P, T) in {(0,1) (0,127) (0,128) (0,129) (100,29) (4000,97) (31,1) (300,517)} x 5 shapes, "
           "worst row error %.3g\n", kernel, worst);
}

/* one test a kernel choice, so that a fault in one shows even when the other fails too */
static void test_prefill_wgmma(void **state) {
    (void)state;
    prefill_kernel("wgmma");
    tu_setenv("FP4MOE_CUDA_ATTENTION", NULL);
}

static void test_prefill_mma(void **state) {
    (void)state;
    prefill_kernel("mma");
    tu_setenv("FP4MOE_CUDA_ATTENTION", NULL);
}

int main(void) {
    gt_require_gpu("test_attention_gpu");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode),
        cmocka_unit_test(test_prefill_wgmma),
        cmocka_unit_test(test_prefill_mma),
    };
    /* FP4MOE_TEST_FILTER: the tests whose names start with it (e.g. test_prefill: both prefill tests),
     * so that a name that grew a suffix never leaves a filter matching nothing */
    const char *filter = getenv("FP4MOE_TEST_FILTER");
    static char pattern[128];
    if (filter && *filter) {
        snprintf(pattern, sizeof pattern, "%s*", filter);
        cmocka_set_test_filter(pattern);
    }
    return cmocka_run_group_tests(tests, NULL, NULL);
}
