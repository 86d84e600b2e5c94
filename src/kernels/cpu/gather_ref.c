/* The fp64 reference of gather_qmm: the test oracle. Deliberately the plain formula of
 * docs/spec/NVFP4.md section 4, sharing no code with the routes (not even the fault hooks of
 * gather_common.h), so that a broken route cannot also break its oracle. */
#include "fp4moe/gather_qmm.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "fp4moe/nvfp4.h"

static double load_x(const void *x, fp4moe_dtype dtype, int64_t i) {
    switch (dtype) {
    case FP4MOE_F32: return ((const float *)x)[i];
    case FP4MOE_F16: return fp4moe_f16_to_f32(((const uint16_t *)x)[i]);
    default: return fp4moe_bf16_to_f32(((const uint16_t *)x)[i]);
    }
}

int fp4moe_gather_qmm_ref_f64(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                              const uint32_t *idx, int64_t B, double *y64) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y64);
    if (st) return fp4moe_error_context(st, "gather_qmm_ref_f64");
    if (fp4moe_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_ref_f64: unknown dtype %d", (int)dtype);
    const int64_t E = w->E, N = w->N, K = w->K;
    double e2m1[16], e4m3[256];
    for (int c = 0; c < 16; c++) e2m1[c] = fp4moe_e2m1_to_f32((uint8_t)c);
    for (int s = 0; s < 256; s++) e4m3[s] = fp4moe_e4m3_to_f32((uint8_t)s);
    for (int64_t b = 0; b < B; b++) {
        double *yrow = y64 + b * N;
        if (idx[b] >= (uint64_t)E) {                      /* out-of-range rows are zeros */
            memset(yrow, 0, (size_t)N * sizeof *yrow);
            continue;
        }
        const int64_t e = idx[b];
        const double gs = w->global_scale ? (double)w->global_scale[e] : 1.0;
        for (int64_t n = 0; n < N; n++) {
            const int64_t row = e * N + n;                 /* weight row in the stacked tensor */
            const uint8_t *codes = w->codes + row * (K / 2);
            const uint8_t *scales = w->scales + row * (K / 16);
            double acc = 0.0;
            for (int64_t k = 0; k < K; k++) {
                const uint8_t code = (uint8_t)(codes[k / 2] >> (4 * (k & 1))) & 15;
                const double wk = e2m1[code] * e4m3[scales[k / 16]] * gs;
                acc += load_x(x, dtype, b * K + k) * wk;
            }
            yrow[n] = acc;
        }
    }
    return FP4MOE_OK;
}

/* W4A8: the quantization written out again here (not shared with the kernels' gather_q8.h). */
int fp4moe_gather_qmm_ref_w4a8_f64(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                   const uint32_t *idx, int64_t B, double *y64) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y64);
    if (st) return fp4moe_error_context(st, "gather_qmm_ref_w4a8_f64");
    if (fp4moe_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_ref_w4a8_f64: unknown dtype %d", (int)dtype);
    const int64_t E = w->E, N = w->N, K = w->K, nb = K / 16;
    float *q = malloc((size_t)K * sizeof *q), *d = malloc((size_t)nb * sizeof *d);
    if (!q || !d) {
        free(q);
        free(d);
        return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm_ref_w4a8_f64: %lld floats", (long long)K);
    }
    for (int64_t b = 0; b < B; b++) {
        double *yrow = y64 + b * N;
        if (idx[b] >= (uint64_t)E) {
            memset(yrow, 0, (size_t)N * sizeof *yrow);
            continue;
        }
        for (int64_t blk = 0; blk < nb; blk++) {
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < 16; i++) {
                const float a = fabsf((float)load_x(x, dtype, b * K + 16 * blk + i));
                finite &= isfinite(a) != 0;
                amax = fmaxf(amax, a);
            }
            d[blk] = finite ? amax / 127.0f : NAN; /* a NaN / Inf activation poisons its block (gather_q8.h) */
            for (int i = 0; i < 16; i++) {
                if (!finite) {
                    q[16 * blk + i] = 0.0f;
                    continue;
                }
                const float v = d[blk] > 0.0f ? nearbyintf((float)load_x(x, dtype, b * K + 16 * blk + i) / d[blk]) : 0.0f;
                q[16 * blk + i] = fminf(127.0f, fmaxf(-127.0f, v));
            }
        }
        const int64_t e = idx[b];
        const double gs = w->global_scale ? (double)w->global_scale[e] : 1.0;
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *codes = w->codes + (e * N + n) * (K / 2), *scales = w->scales + (e * N + n) * nb;
            double acc = 0.0;
            for (int64_t blk = 0; blk < nb; blk++) {
                double s = 0.0;
                for (int i = 0; i < 16; i++) {
                    const int64_t k = 16 * blk + i;
                    s += q[k] * (double)fp4moe_e2m1_to_f32((uint8_t)(codes[k / 2] >> (4 * (k & 1))) & 15);
                }
                acc += s * (double)d[blk] * (double)fp4moe_e4m3_to_f32(scales[blk]);
            }
            yrow[n] = acc * gs;
        }
    }
    free(q);
    free(d);
    return FP4MOE_OK;
}
