/* Causal grouped-query attention without positional encoding (nemotron_h has no RoPE), fp32.
 * Formula: spec NEMOTRON_H.md "Attention"; transformers eager_attention_forward. */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <stdlib.h>

#include "common/error.h"

/* One query row against keys 0..n-1 of kv head `kh`: out = softmax(q.k * scale) @ v. */
static void attend_one(const float *q, const float *k, const float *v, int64_t n, int64_t kvs,
                       int64_t dh, float scale, float *sc, float *out) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        const float *kj = k + j * kvs;
        float d = 0.0f;
#pragma omp simd reduction(+ : d)
        for (int64_t i = 0; i < dh; i++) d += q[i] * kj[i];
        sc[j] = d * scale;
        if (sc[j] > mx) mx = sc[j];
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        sc[j] = expf(sc[j] - mx);
        sum += sc[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < dh; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float p = sc[j] * inv;
        const float *vj = v + j * kvs;
        for (int64_t i = 0; i < dh; i++) out[i] += p * vj[i];
    }
}

int op_attention_causal(const float *q, int64_t qs, const float *k, const float *v, int64_t P,
                        int64_t T, int64_t nq, int64_t nkv, int64_t dh, float *out) {
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
                attend_one(q + t * qs + h * dh, k + kh * dh, v + kh * dh, P + t + 1, kvs, dh,
                           scale, sc, out + t * nq * dh + h * dh);
            }
        free(sc);
    }
    if (failed) return fp4moe_set_error(FP4MOE_ENOMEM, "attention: out of memory for scores");
    return FP4MOE_OK;
}
