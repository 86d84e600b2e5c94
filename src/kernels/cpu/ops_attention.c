/* Causal grouped-query attention without positional encoding (nemotron_h has no RoPE), fp32.
 * Formula: spec NEMOTRON_H.md "Attention"; transformers eager_attention_forward. */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"

/* ---- the FP8 KV cache's rows (contract: ops.h) ----------------------------------------------- */

static float g_e4m3[256];
static pthread_once_t g_e4m3_once = PTHREAD_ONCE_INIT;
static void e4m3_table(void) {
    for (int i = 0; i < 256; i++) g_e4m3[i] = fp4moe_e4m3_to_f32((uint8_t)i);
}

static size_t fp8_codes_bytes(int64_t nkv, int64_t dh) { return ((size_t)(nkv * dh) + 3) / 4 * 4; }

size_t op_kv_fp8_row_bytes(int64_t nkv, int64_t dh) {
    return fp8_codes_bytes(nkv, dh) + (size_t)nkv * sizeof(float);
}

void op_kv_fp8_store(const float *x, int64_t nkv, int64_t dh, uint8_t *row) {
    const size_t cb = fp8_codes_bytes(nkv, dh);
    memset(row + nkv * dh, 0, cb - (size_t)(nkv * dh));
    for (int64_t h = 0; h < nkv; h++) {
        const float *xh = x + h * dh;
        float amax = 0.0f;
        for (int64_t i = 0; i < dh; i++) {
            const float a = fabsf(xh[i]);
            if (a != a) amax = NAN;
            else if (a > amax) amax = a;    /* (NaN stays: a > NaN is false) */
        }
        const float s = amax == 0.0f ? 1.0f : amax / 448.0f;
        for (int64_t i = 0; i < dh; i++) row[h * dh + i] = fp4moe_f32_to_e4m3(xh[i] / s);
        memcpy(row + cb + (size_t)h * sizeof(float), &s, sizeof s);
    }
}

/* Head kh of an FP8 cache row as fp32: e4m3(code) * s_kh (cb: the row's code bytes). */
static void fp8_load_head(const uint8_t *row, size_t cb, int64_t kh, int64_t dh, float *x) {
    float s;
    memcpy(&s, row + cb + (size_t)kh * sizeof(float), sizeof s);
#ifdef FP4MOE_INJECT_FAULT_KV_FP8_SCALE /* deliberate fault (tests must catch it): the scale ignored */
    s = 1.0f;
#endif
    const uint8_t *c = row + kh * dh;
    for (int64_t i = 0; i < dh; i++) x[i] = g_e4m3[c[i]] * s;
}

void op_kv_fp8_load(const uint8_t *row, int64_t nkv, int64_t dh, float *x) {
    pthread_once(&g_e4m3_once, e4m3_table);
    const size_t cb = fp8_codes_bytes(nkv, dh);
    for (int64_t h = 0; h < nkv; h++) fp8_load_head(row, cb, h, dh, x + h * dh);
}

/* The three steps of one query row's softmax attention, shared by the f32 and FP8 readers so that
 * both do the same arithmetic in the same order:
 * run_scores: sc[jj] = (q . k_jj) * scale for the m keys of a run (k_jj at kp + jj * stride), returns
 * the running max; softmax_row: sc = exp(sc - mx) over n keys, returns 1 / sum; run_accumulate:
 * out += (sc[jj] * inv) * v_jj over a run of m values. */
static inline float run_scores(const float *q, const float *kp, int64_t m, int64_t stride, int64_t dh, float scale,
                               float *sc, float mx) {
    for (int64_t jj = 0; jj < m; jj++) {
        const float *kj = kp + jj * stride;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < dh; i++) d += q[i] * kj[i];
        sc[jj] = d * scale;
        if (sc[jj] > mx) mx = sc[jj];
    }
    return mx;
}
static inline float softmax_row(float *sc, int64_t n, float mx) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    return 1.0f / sum;
}
static inline void run_accumulate(const float *sc, float inv, const float *vp, int64_t m, int64_t stride, int64_t dh,
                                  float *out) {
    for (int64_t jj = 0; jj < m; jj++) {
        const float p = sc[jj] * inv;
        const float *vj = vp + jj * stride;
        for (int64_t i = 0; i < dh; i++) out[i] += p * vj[i];
    }
}

/* One query row against keys 0..n-1 of kv head `kh`: out = softmax(q.k * scale) @ v. Keys are read
 * a run of `page` at a time: run r at row pages[r] * page (contiguous: pages NULL, rows j). */
static void attend_one(const float *q, const float *k, const float *v, const int32_t *pages, int64_t page,
                       int64_t n, int64_t kvs, int64_t dh, float scale, float *sc, float *out) {
    if (!pages) page = n > 0 ? n : 1;
    float mx = -INFINITY;
    for (int64_t j0 = 0; j0 < n; j0 += page) {
        const float *kp = k + (pages ? (int64_t)pages[j0 / page] * page : j0) * kvs;
        mx = run_scores(q, kp, n - j0 < page ? n - j0 : page, kvs, dh, scale, sc + j0, mx);
    }
    const float inv = softmax_row(sc, n, mx);
    for (int64_t i = 0; i < dh; i++) out[i] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += page) {
        const float *vp = v + (pages ? (int64_t)pages[j0 / page] * page : j0) * kvs;
        run_accumulate(sc + j0, inv, vp, n - j0 < page ? n - j0 : page, kvs, dh, out);
    }
}

static int attention(const float *q, int64_t qs, const float *k, const float *v, const int32_t *pages,
                     int64_t page, int64_t P, int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out) {
    const int64_t kvs = nkv * dh, rep = nq / nkv;
    const float scale = 1.0f / sqrtf((float)dh);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *sc = malloc((size_t)(P + T) * sizeof(float));
        if (!sc) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < nq; h++) {
                if (!sc) continue;
                const int64_t kh = h / rep;
                attend_one(q + t * qs + h * dh, k + kh * dh, v + kh * dh, pages, page, P + t + 1, kvs, dh,
                           scale, sc, out + t * nq * dh + h * dh);
            }
        free(sc);
    }
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "attention: out of memory for scores");
    return FP4MOE_OK;
}

/* Query row t's `rep` heads of kv head kh against keys 0..n-1 of the FP8 cache, read in place:
 * each page's rows of head kh dequantized once into kbuf (page x dh; the keys, later the values)
 * and used by all rep heads. Per head attend_one's steps (run_scores, softmax_row, run_accumulate)
 * on the dequantized rows, in the same order. sc: rep x n scores. */
static void attend_fp8_group(const float *q, int64_t qh_stride, const uint8_t *kb, const uint8_t *vb, size_t rb,
                             size_t cb, const int32_t *pages, int64_t page, int64_t n, int64_t kh, int64_t rep,
                             int64_t dh, float scale, float *sc, float *kbuf, float *out, int64_t oh_stride) {
    float mxs[64], invs[64];
    for (int64_t hr = 0; hr < rep; hr++) mxs[hr] = -INFINITY;
    for (int64_t j0 = 0; j0 < n; j0 += page) {
        const int64_t base = (int64_t)pages[j0 / page] * page, m = n - j0 < page ? n - j0 : page;
        for (int64_t jj = 0; jj < m; jj++) fp8_load_head(kb + (size_t)(base + jj) * rb, cb, kh, dh, kbuf + jj * dh);
        for (int64_t hr = 0; hr < rep; hr++)
            mxs[hr] = run_scores(q + hr * qh_stride, kbuf, m, dh, dh, scale, sc + hr * n + j0, mxs[hr]);
    }
    for (int64_t hr = 0; hr < rep; hr++) {
        invs[hr] = softmax_row(sc + hr * n, n, mxs[hr]);
        for (int64_t i = 0; i < dh; i++) out[hr * oh_stride + i] = 0.0f;
    }
    for (int64_t j0 = 0; j0 < n; j0 += page) {
        const int64_t base = (int64_t)pages[j0 / page] * page, m = n - j0 < page ? n - j0 : page;
        for (int64_t jj = 0; jj < m; jj++) fp8_load_head(vb + (size_t)(base + jj) * rb, cb, kh, dh, kbuf + jj * dh);
        for (int64_t hr = 0; hr < rep; hr++)
            run_accumulate(sc + hr * n + j0, invs[hr], kbuf, m, dh, dh, out + hr * oh_stride);
    }
}

int op_attention_causal_paged_fp8(const float *q, int64_t qs, const uint8_t *k, const uint8_t *v,
                                  const int32_t *pages, int64_t page, int64_t P, int64_t T, int64_t nq, int64_t nkv,
                                  int64_t dh, float *out) {
    if (!pages || page < 1) return fp4moe_set_error(FP4MOE_EINVAL, "attention: no page table");
    const int64_t rep = nq / nkv;
    if (rep > 64) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "attention (fp8 cache): %lld query heads a kv head "
                                          "(at most 64)", (long long)rep);
    pthread_once(&g_e4m3_once, e4m3_table);
    const size_t rb = op_kv_fp8_row_bytes(nkv, dh), cb = fp8_codes_bytes(nkv, dh);
    const float scale = 1.0f / sqrtf((float)dh);
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *sc = malloc((size_t)(rep * (P + T)) * sizeof(float)), *kbuf = malloc((size_t)(page * dh) * sizeof(float));
        if (!sc || !kbuf) failed = 1;
#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < T; t++)
            for (int64_t kh = 0; kh < nkv; kh++) {
                if (!sc || !kbuf) continue;
                attend_fp8_group(q + t * qs + kh * rep * dh, dh, k, v, rb, cb, pages, page, P + t + 1, kh, rep, dh,
                                 scale, sc, kbuf, out + t * nq * dh + kh * rep * dh, dh);
            }
        free(sc);
        free(kbuf);
    }
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "attention: out of memory for scores");
    return FP4MOE_OK;
}

int op_attention_causal(const float *q, int64_t qs, const float *k, const float *v, int64_t P,
                        int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out) {
    return attention(q, qs, k, v, NULL, 1, P, T, nq, nkv, dh, out);
}

int op_attention_causal_paged(const float *q, int64_t qs, const float *k, const float *v, const int32_t *pages,
                              int64_t page, int64_t P, int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out) {
    if (!pages || page < 1) return fp4moe_set_error(FP4MOE_EINVAL, "attention: no page table");
    return attention(q, qs, k, v, pages, page, P, T, nq, nkv, dh, out);
}
