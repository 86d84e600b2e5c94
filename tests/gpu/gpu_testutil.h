/* Small helpers for the GPU test and benchmark programs (C, CUDA runtime API): device buffers,
 * host<->device copies, NaN poisoning on the device, and the "no GPU -> skip (77)" rule.
 * Every CUDA call is checked; a failure prints the call and exits 1 (test programs only). */
#ifndef FP4MOE_GPU_TESTUTIL_H
#define FP4MOE_GPU_TESTUTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <cuda_runtime_api.h>

#include "fp4moe/gather_qmm.h"
#include "testutil.h"

#define GT_CHECK(call)                                                                             \
    do {                                                                                           \
        const cudaError_t gt_e_ = (call);                                                          \
        if (gt_e_ != cudaSuccess) {                                                                \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(gt_e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* Exits with 77 (ctest: skipped) when this build or machine has no CUDA device. */
static inline void gt_require_gpu(const char *prog) {
    if (!fp4moe_cuda_available()) {
        fprintf(stderr, "%s: no CUDA device visible: skipped\n", prog);
        exit(77);
    }
}

/* cudaMalloc + copy of n bytes from host (src may be NULL: allocation only). */
static inline void *gt_upload(const void *src, size_t n) {
    void *d = NULL;
    GT_CHECK(cudaMalloc(&d, n ? n : 1));
    if (src && n) GT_CHECK(cudaMemcpy(d, src, n, cudaMemcpyHostToDevice));
    return d;
}

static inline void gt_download(void *dst, const void *src, size_t n) {
    if (n) GT_CHECK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}

/* All bytes 0xFF: NaN in f32, f16 and bf16. */
static inline void gt_poison(void *d, size_t n) { GT_CHECK(cudaMemset(d, 0xFF, n)); }

/* fp32 -> fp16 bits, round to nearest even, saturated at +-65504 (as the CUDA KV append stores V:
 * src/kernels/cuda/ops_attention.cu). */
static inline unsigned short gt_f2h(float f) {
    if (f != f) return 0x7E00;
    if (f > 65504.0f) f = 65504.0f;
    if (f < -65504.0f) f = -65504.0f;
    union { float f; unsigned u; } v = {f};
    const unsigned sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7FFFFFFFu;
    if (a < 0x38800000u) {                     /* below 2^-14: a subnormal (or 0) of 2^-24 steps */
        union { unsigned u; float f; } m = {a};
        const float x = m.f * 16777216.0f;     /* exact: a power-of-two scaling */
        unsigned n = (unsigned)x;
        const float rem = x - (float)n;
        if (rem > 0.5f || (rem == 0.5f && (n & 1u))) n++;
        return (unsigned short)(sign | n);
    }
    const unsigned r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23); /* rebias 127 -> 15, round bit 13 */
    return (unsigned short)(sign | (r >> 13));
}

/* fp32 -> bf16 bits, round to nearest even. */
static inline unsigned short gt_f2bf(float f) {
    union { float f; unsigned u; } v = {f};
    return (unsigned short)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* n values uniform in [-a, a] on the device: bf16, or fp16 with f16 (the CUDA V cache's type). */
static inline void *gt_rand_dev(int64_t n, float a, tu_rng *r, int f16) {
    unsigned short *h = (unsigned short *)malloc((size_t)n * 2);
    if (!h) {
        fprintf(stderr, "gt_rand_dev: out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < n; i++) {
        const float x = (float)((2.0 * tu_rng_uniform(r) - 1.0) * a);
        h[i] = f16 ? gt_f2h(x) : gt_f2bf(x);
    }
    void *d = gt_upload(h, (size_t)n * 2);
    free(h);
    return d;
}

/* Median milliseconds of one fn(ctx) call over reps (<= 32) batches of `inner` calls timed with CUDA
 * events on the default stream, after one untimed call (a failure there prints the error, exit 1). */
static inline float gt_time_ms(int (*fn)(void *), void *ctx, int reps, int inner) {
    cudaEvent_t a, b;
    float ms[32];
    if (reps > 32) reps = 32;
    GT_CHECK(cudaEventCreate(&a));
    GT_CHECK(cudaEventCreate(&b));
    if (fn(ctx)) {
        fprintf(stderr, "timed call: %s\n", fp4moe_last_error());
        exit(1);
    }
    for (int r = 0; r < reps; r++) {
        GT_CHECK(cudaEventRecord(a, 0));
        for (int i = 0; i < inner; i++) fn(ctx);
        GT_CHECK(cudaEventRecord(b, 0));
        GT_CHECK(cudaEventSynchronize(b));
        GT_CHECK(cudaEventElapsedTime(&ms[r], a, b));
        ms[r] /= (float)inner;
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    for (int i = 1; i < reps; i++)          /* insertion sort: reps is small */
        for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
            const float t = ms[j];
            ms[j] = ms[j - 1];
            ms[j - 1] = t;
        }
    return ms[reps / 2];
}

static inline void gt_free(void *d) {
    if (d) GT_CHECK(cudaFree(d));
}

/* The device-to-device copy rate in bytes read + written a second (median of 10 copies of `bytes` after 2 warm-up
 * copies, CUDA events on the legacy stream): the bandwidth of the benchmarks' memory floors. */
static inline double gt_copy_rate(size_t bytes) {
    void *s = gt_upload(NULL, bytes), *d = gt_upload(NULL, bytes);
    GT_CHECK(cudaMemset(s, 0x5A, bytes));
    cudaEvent_t a, b;
    GT_CHECK(cudaEventCreate(&a));
    GT_CHECK(cudaEventCreate(&b));
    float t[10];
    for (int i = 0; i < 12; i++) {
        GT_CHECK(cudaEventRecord(a, NULL));
        GT_CHECK(cudaMemcpyAsync(d, s, bytes, cudaMemcpyDeviceToDevice, NULL));
        GT_CHECK(cudaEventRecord(b, NULL));
        GT_CHECK(cudaEventSynchronize(b));
        if (i >= 2) GT_CHECK(cudaEventElapsedTime(&t[i - 2], a, b));
    }
    GT_CHECK(cudaEventDestroy(a));
    GT_CHECK(cudaEventDestroy(b));
    gt_free(s);
    gt_free(d);
    for (int i = 1; i < 10; i++) /* insertion sort */
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            const float v = t[j];
            t[j] = t[j - 1];
            t[j - 1] = v;
        }
    return 2.0 * (double)bytes / (0.5 * (t[4] + t[5]) * 1e-3);
}

#endif
