/* Linear layers on the CPU: NVFP4 through fp4moe_gather_qmm_cpu (E = 1, idx all zero), dense
 * through OpenBLAS sgemm on fp32 panels of the weight. Activations fp32, rounded to the session's
 * act dtype at the matmul input and output. */
#include "kernels/cpu/ops.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"

#define PANEL_FLOATS (1 << 18)   /* dense weights are converted to fp32 in panels of ~1 MB */

void ops_ctx_free(ops_ctx *c) {
    free(c->buf);
    c->buf = NULL;
    c->cap = 0;
}

/* The ops' grow-only scratch: at least `bytes`, 64-byte aligned, contents undefined. */
static void *scratch(ops_ctx *c, size_t bytes) {
    if (bytes <= c->cap) return c->buf;
    void *p = NULL;
    size_t cap = bytes + bytes / 2 + 4096;
    if (posix_memalign(&p, 64, cap)) {
        fp4moe_set_error(FP4MOE_ENOMEM, "ops: cannot allocate %zu bytes of scratch", cap);
        return NULL;
    }
    free(c->buf);
    c->buf = p;
    c->cap = cap;
    return p;
}

static size_t align64(size_t n) { return (n + 63) & ~(size_t)63; }

void op_round_act(fp4moe_dtype act, float *x, int64_t n) {
    if (act != FP4MOE_BF16) return;
    for (int64_t i = 0; i < n; i++) x[i] = fp4moe_bf16_to_f32(fp4moe_f32_to_bf16(x[i]));
}

static void add_bias(const float *bias, int64_t T, int64_t N, float *y) {
    if (!bias) return;
    for (int64_t t = 0; t < T; t++)
        for (int64_t n = 0; n < N; n++) y[t * N + n] += bias[n];
}

/* ---- NVFP4 -------------------------------------------------------------------------------- */

static int gather_call(const ops_ctx *c, const fp4moe_nvfp4_weights *q, const void *x,
                       fp4moe_dtype dt, const uint32_t *idx, int64_t B, void *y) {
    if (c->q8) return fp4moe_gather_qmm_cpu_w4a8(q, x, dt, idx, B, 1, c->route, y);
    if (c->route == FP4MOE_ROUTE_AUTO) return fp4moe_gather_qmm_cpu(q, x, dt, idx, B, 1, y);
    return fp4moe_gather_qmm_cpu_route(q, x, dt, idx, B, 1, c->route, y);
}

/* y (B x N) = gather_qmm(x (B x K), idx sorted) in act dtype, fp32 in and out. */
static int nvfp4_matmul(ops_ctx *c, const op_linear *w, const float *x, const uint32_t *idx,
                        int64_t B, float *y) {
    if (c->act == FP4MOE_F32) return gather_call(c, &w->q, x, FP4MOE_F32, idx, B, y);
    const size_t nx = align64((size_t)(B * w->K) * 2), ny = (size_t)(B * w->N) * 2;
    uint8_t *buf = scratch(c, nx + ny);
    if (!buf) return FP4MOE_ENOMEM;
    uint16_t *x16 = (uint16_t *)buf, *y16 = (uint16_t *)(buf + nx);
    fp4moe_from_f32(x, B * w->K, FP4MOE_BF16, x16);
    int st = gather_call(c, &w->q, x16, FP4MOE_BF16, idx, B, y16);
    if (!st) fp4moe_to_f32(y16, FP4MOE_BF16, B * w->N, y);
    return st;
}

/* ---- dense -------------------------------------------------------------------------------- */

#define GEMV_MAX_ROWS 8          /* fewer activation rows: dot products here, not OpenBLAS */
#define SGEMM_MIN_MACS (1 << 24)  /* smaller products: the same (thread start-up dominates) */
#define GEMV_BF16_MAX_ROWS 32    /* bf16 weights: dot products in place below this (no fp32 panel per call:
                                    batched decode heads, the same bits as a solo decode) */

/* y (T x N, leading dimension ldy) = x (T x K) @ W^T for fp32 W (N x K). Few rows (decode) or
 * small products use plain dot products parallel over N: OpenBLAS's own thread pool would fight
 * the OpenMP threads for the cores on every small call; large products (prefill) use sgemm. */
static int use_blas(int64_t T, int64_t N, int64_t K) {
    return T >= GEMV_MAX_ROWS && (double)T * (double)N * (double)K >= SGEMM_MIN_MACS;
}

static void matmul_f32(const float *x, int64_t T, const float *W, int64_t N, int64_t K, float *y,
                       int64_t ldy, int blas) {
    if (blas) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)N, (int)K, 1.0f, x,
                    (int)K, W, (int)K, 0.0f, y, (int)ldy);
        return;
    }
#pragma omp parallel for schedule(static) if (N * K >= (1 << 17))
    for (int64_t n = 0; n < N; n++) {
        const float *w = W + n * K;
        for (int64_t t = 0; t < T; t++) {
            const float *xt = x + t * K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += xt[k] * w[k];
            y[t * ldy + n] = acc;
        }
    }
}

void op_matmul_f32(const float *x, int64_t T, const float *W, int64_t N, int64_t K, float *y,
                   int64_t ldy) {
    matmul_f32(x, T, W, N, K, y, ldy, use_blas(T, N, K));
}

/* bf16 -> fp32 is a shift of the bits (inline, so that the loop below vectorizes). */
static inline float bf16_bits_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Few rows against a bf16 weight, reading it once and in place (decode): y = x @ W^T. Rows go
 * eight or four at a time through one loop (each weight converted once for those rows), the last
 * T % 4 one by one. */
static void gemv_bf16(const float *x, int64_t T, const uint16_t *W, int64_t N, int64_t K, float *y) {
    const int64_t T8 = T - T % 8, T4 = T - T % 4;
#pragma omp parallel for schedule(static) if (N * K * T >= (1 << 17))
    for (int64_t n = 0; n < N; n++) {
        const uint16_t *w = W + n * K;
        for (int64_t t = 0; t < T8; t += 8) {
            const float *x0 = x + t * K;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
            for (int64_t k = 0; k < K; k++) {
                const float wk = bf16_bits_to_f32(w[k]);
                a0 += x0[k] * wk;
                a1 += x0[K + k] * wk;
                a2 += x0[2 * K + k] * wk;
                a3 += x0[3 * K + k] * wk;
                a4 += x0[4 * K + k] * wk;
                a5 += x0[5 * K + k] * wk;
                a6 += x0[6 * K + k] * wk;
                a7 += x0[7 * K + k] * wk;
            }
            const float a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
            for (int i = 0; i < 8; i++) y[(t + i) * N + n] = a[i];
        }
        for (int64_t t = T8; t < T4; t += 4) {
            const float *x0 = x + t * K, *x1 = x0 + K, *x2 = x0 + 2 * K, *x3 = x0 + 3 * K;
            float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (int64_t k = 0; k < K; k++) {
                const float wk = bf16_bits_to_f32(w[k]);
                a0 += x0[k] * wk;
                a1 += x1[k] * wk;
                a2 += x2[k] * wk;
                a3 += x3[k] * wk;
            }
            y[t * N + n] = a0;
            y[(t + 1) * N + n] = a1;
            y[(t + 2) * N + n] = a2;
            y[(t + 3) * N + n] = a3;
        }
        for (int64_t t = T4; t < T; t++) {
            const float *xt = x + t * K;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < K; k++) acc += xt[k] * bf16_bits_to_f32(w[k]);
            y[t * N + n] = acc;
        }
    }
}

/* y (T x N, leading dimension N) = xr (T x K) @ W^T for a dense N x K weight of dtype dt. */
static int dense_matmul(ops_ctx *c, const void *W, fp4moe_dtype dt, int64_t N, int64_t K,
                        const float *xr, int64_t T, float *y) {
    if (dt == FP4MOE_BF16 && T < GEMV_BF16_MAX_ROWS) {
        gemv_bf16(xr, T, W, N, K, y);
        return FP4MOE_OK;
    }
    if (dt == FP4MOE_F32) {
        matmul_f32(xr, T, W, N, K, y, N, use_blas(T, N, K));
        return FP4MOE_OK;
    }
    int64_t rows = PANEL_FLOATS / K;
    if (rows < 16) rows = 16;
    if (rows > N) rows = N;
    float *panel = malloc((size_t)(rows * K) * sizeof(float));
    if (!panel) return fp4moe_set_error(FP4MOE_ENOMEM, "linear: cannot allocate a weight panel");
    const uint16_t *w16 = W;
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
        const int64_t nr = N - n0 < rows ? N - n0 : rows;
#pragma omp parallel for schedule(static) if (nr * K >= (1 << 16))
        for (int64_t r = 0; r < nr; r++) {
            const uint16_t *src = w16 + (n0 + r) * K;
            float *dst = panel + r * K;
            if (dt == FP4MOE_BF16)
                for (int64_t k = 0; k < K; k++) dst[k] = bf16_bits_to_f32(src[k]);
            else
                fp4moe_to_f32(src, dt, K, dst);
        }
        matmul_f32(xr, T, panel, nr, K, y + n0, N, use_blas(T, N, K));  /* decided on the whole */
    }
    free(panel);
    (void)c;
    return FP4MOE_OK;
}

/* x rounded to the act dtype (a copy in scratch when rounding changes anything). */
static const float *act_input(ops_ctx *c, const float *x, int64_t n) {
    if (c->act == FP4MOE_F32) return x;
    float *xr = scratch(c, (size_t)n * sizeof(float));
    if (!xr) return NULL;
    memcpy(xr, x, (size_t)n * sizeof(float));
    op_round_act(c->act, xr, n);
    return xr;
}

/* y = x @ W[e]^T with x rounded to the act dtype; y rounded to it too when round_y. */
static int dense_forward(ops_ctx *c, const op_linear *w, int64_t e, const float *x, int64_t T,
                         float *y, int round_y) {
    const float *xr = act_input(c, x, T * w->K);
    if (!xr) return FP4MOE_ENOMEM;
    int st = dense_matmul(c, w->dense[e], w->dtype, w->N, w->K, xr, T, y);
    if (round_y) op_round_act(c->act, y, T * w->N);
    return st;
}

/* NVFP4 y (B x N) = gather_qmm(x rounded to the act dtype, idx sorted) in fp32, not rounded: a
 * bf16-valued x in fp32 gives the products of the bf16 call, accumulated in fp32 as there. */
static int nvfp4_matmul_f32out(ops_ctx *c, const op_linear *w, const float *x, const uint32_t *idx,
                               int64_t B, float *y) {
    const float *xr = act_input(c, x, B * w->K);
    if (!xr) return FP4MOE_ENOMEM;
    return gather_call(c, &w->q, xr, FP4MOE_F32, idx, B, y);
}

/* ---- entry points ------------------------------------------------------------------------- */

/* op_linear_forward (round_y = 1) and op_linear_forward_f32out (round_y = 0). */
static int linear_forward(ops_ctx *c, const op_linear *w, const float *x, int64_t T, float *y,
                          int round_y) {
    int st;
    if (T <= 0) return FP4MOE_OK;
    if (w->nvfp4) {
        uint32_t *idx = calloc((size_t)T, sizeof *idx);    /* E = 1: every row uses expert 0 */
        if (!idx) return fp4moe_set_error(FP4MOE_ENOMEM, "linear: out of memory");
        st = round_y ? nvfp4_matmul(c, w, x, idx, T, y) : nvfp4_matmul_f32out(c, w, x, idx, T, y);
        free(idx);
    } else {
        st = dense_forward(c, w, 0, x, T, y, round_y);
    }
    if (!st) add_bias(w->bias, T, w->N, y);
    return st;
}

int op_linear_forward(ops_ctx *c, const op_linear *w, const float *x, int64_t T, float *y) {
    return linear_forward(c, w, x, T, y, 1);
}

int op_linear_forward_f32out(ops_ctx *c, const op_linear *w, const float *x, int64_t T, float *y) {
    return linear_forward(c, w, x, T, y, 0);
}

int op_linear_gather(ops_ctx *c, const op_linear *w, const float *x, const uint32_t *idx,
                     int64_t B, float *y) {
    if (B <= 0) return FP4MOE_OK;
    if (w->nvfp4) return nvfp4_matmul(c, w, x, idx, B, y);
    for (int64_t b0 = 0; b0 < B;) {                      /* one sgemm per run of one expert */
        int64_t b1 = b0 + 1;
        while (b1 < B && idx[b1] == idx[b0]) b1++;
        if (idx[b0] >= (uint32_t)w->E)
            return fp4moe_set_error(FP4MOE_EINVAL, "linear_gather: expert %u >= E=%lld",
                                    idx[b0], (long long)w->E);
        int st = dense_forward(c, w, idx[b0], x + b0 * w->K, b1 - b0, y + b0 * w->N, 1);
        if (st) return st;
        b0 = b1;
    }
    return FP4MOE_OK;
}

void op_linear_experts(const op_linear *w, int64_t lo, int64_t hi, op_linear *v) {
    const int64_t per = w->N * w->K;
    op_linear r = *w;
    r.E = hi - lo;
    if (w->nvfp4) {
        r.q.codes = w->q.codes + lo * (per / 2);
        r.q.scales = w->q.scales + lo * (per / FP4MOE_NVFP4_BLOCK);
        if (w->q.global_scale) r.q.global_scale = w->q.global_scale + lo;
        r.q.E = hi - lo;
    } else if (w->dense) {
        r.dense = w->dense + lo;
    }
    *v = r;
}
