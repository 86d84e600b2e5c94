/* The shape and the random inputs of the Mamba-2 scan benchmarks (bench/gpu_ssm.c, bench/gpu_ssm_chunk.cu):
 * one Nemotron-3-Nano-30B-A3B layer, 64 heads x head_dim 64, state 128, 8 groups; operands laid out as
 * in the model (x, B, C inside the conv output rows of CD floats; raw bf16 dt inside the in_proj rows of
 * NP values). Usable from C and from CUDA C++. */
#ifndef FP4MOE_BENCH_SSM_BENCH_H
#define FP4MOE_BENCH_SSM_BENCH_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define NH 64
#define HD 64
#define NS 128
#define NG 8
#define DI (NH * HD)
#define CD (DI + 2 * NG * NS) /* conv channels: x, B, C */
#define NP (DI + CD + NH)     /* in_proj rows: z, xBC, dt */

typedef struct {
    float *xbc;                     /* Tmax x CD, U(-1, 1) */
    uint16_t *zx;                   /* Tmax x NP raw bf16 values; dt ~ U(-6, 2) (truncated to bf16) */
    float bias[NH], A[NH], D[NH];   /* dt_bias U(-4, -1), A = -exp(U(0, 2.8)), D U(0.5, 1.5) */
    float *st;                      /* NH x HD x NS initial state, U(-0.5, 0.5) */
} ssm_bench_host;

/* The inputs for up to Tmax tokens from r (the same draws in every benchmark: seed 42 for both). */
static inline void ssm_bench_host_make(ssm_bench_host *d, int64_t Tmax, tu_rng *r) {
    d->xbc = (float *)malloc((size_t)Tmax * CD * 4);
    d->zx = (uint16_t *)malloc((size_t)Tmax * NP * 2);
    d->st = (float *)malloc((size_t)NH * HD * NS * 4);
    if (!d->xbc || !d->zx || !d->st) abort();
    for (int64_t i = 0; i < Tmax * CD; i++) d->xbc[i] = (float)(2.0 * tu_rng_uniform(r) - 1.0);
    for (int64_t i = 0; i < Tmax * NP; i++) {
        const float f = (float)(-6.0 + 8.0 * tu_rng_uniform(r));
        uint32_t u;
        memcpy(&u, &f, 4);
        d->zx[i] = (uint16_t)(u >> 16);
    }
    for (int h = 0; h < NH; h++) {
        d->bias[h] = (float)(-4.0 + 3.0 * tu_rng_uniform(r));
        d->A[h] = -expf((float)(2.8 * tu_rng_uniform(r)));
        d->D[h] = (float)(tu_rng_uniform(r) + 0.5);
    }
    for (int64_t i = 0; i < (int64_t)NH * HD * NS; i++) d->st[i] = (float)(tu_rng_uniform(r) - 0.5);
}

static inline void ssm_bench_host_free(ssm_bench_host *d) {
    free(d->xbc);
    free(d->zx);
    free(d->st);
}

#endif
