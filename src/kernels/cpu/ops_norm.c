/* RMSNorm, the gated grouped RMSNorm of Mamba-2, and elementwise activations (fp32).
 * Formulas: transformers NemotronHRMSNorm and Zamba2RMSNormGated (spec NEMOTRON_H.md). */
#include "kernels/cpu/ops.h"

#include <math.h>

/* 1 / sqrt(mean(v^2) + eps) over n values, accumulated in double for a stable sum. */
static float inv_rms(const float *v, int64_t n, float eps) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)v[i] * v[i];
    return 1.0f / sqrtf((float)(ss / (double)n) + eps);
}

void op_rmsnorm(const float *x, const float *w, int64_t T, int64_t H, float eps, float *y) {
#pragma omp parallel for schedule(static) if (T * H >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *yt = y + t * H;
        const float r = inv_rms(xt, H, eps);
        for (int64_t i = 0; i < H; i++) yt[i] = xt[i] * r * w[i];
    }
}

static float silu1(float v) { return v / (1.0f + expf(-v)); }

void op_rmsnorm_gated(const float *y, int64_t ys, const float *z, int64_t zs, const float *w,
                      int64_t T, int64_t D, int64_t G, float eps, float *out) {
    const int64_t gsz = D / G;
#pragma omp parallel for schedule(static) if (T * D >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * D;
        for (int64_t i = 0; i < D; i++) o[i] = y[t * ys + i] * silu1(z[t * zs + i]);
        for (int64_t g = 0; g < G; g++) {
            float *og = o + g * gsz;
            const float r = inv_rms(og, gsz, eps);
            for (int64_t i = 0; i < gsz; i++) og[i] = og[i] * r * w[g * gsz + i];
        }
    }
}

void op_silu(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = silu1(x[i]);
}

void op_relu2(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float r = x[i] > 0.0f ? x[i] : 0.0f;
        x[i] = r * r;
    }
}

void op_add(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}
