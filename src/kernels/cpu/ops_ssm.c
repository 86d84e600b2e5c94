/* Mamba-2 on the CPU: the causal depthwise conv1d with state and the selective scan (recurrent
 * form, fp32 state). Formulas: spec NEMOTRON_H.md "Mamba-2"; transformers NemotronHMamba2Mixer
 * torch_forward; dt clamped to the config's time_step_limit [lo, hi] on both the prefill and the
 * decode path, as mlx-lm, vLLM and the state-spaces/mamba kernels do (src/model/mamba2.c). */
#include "kernels/cpu/ops.h"

#include <math.h>
#include <string.h>

void op_conv1d_causal(const float *x, int64_t xs, int64_t T, int64_t C, const float *w,
                      const float *b, int64_t Kc, float *state, float *y) {
    const int64_t P = Kc - 1;            /* state rows: inputs t-P .. t-1 */
#pragma omp parallel for schedule(static) if (T * C * Kc >= (1 << 16))
    for (int64_t c = 0; c < C; c++) {
        const float *wc = w + c * Kc;
        for (int64_t t = 0; t < T; t++) {
            float acc = b ? b[c] : 0.0f;
            for (int64_t j = 0; j < Kc; j++) {
                const int64_t src = t - P + j;  /* < 0: from the state */
                const float v = src >= 0 ? x[src * xs + c] : state[(P + src) * C + c];
                acc += wc[j] * v;
            }
            y[t * C + c] = acc;
        }
        /* new state: the last P inputs of (state ++ x). Ascending i reads state row T+i > i
         * (T >= 1), which is not overwritten yet, so the shift works in place. */
        for (int64_t i = 0; i < P; i++) {
            const int64_t src = T - P + i;
            state[i * C + c] = src >= 0 ? x[src * xs + c] : state[(P + src) * C + c];
        }
    }
}

/* torch.nn.functional.softplus (beta 1, threshold 20). */
static float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* One head over all T tokens. */
static void scan_head(const op_ssm_args *a, int64_t h) {
    const int64_t hd = a->hd, S = a->S, g = h / (a->nh / a->G);
    float *st = a->state + h * hd * S;
    for (int64_t t = 0; t < a->T; t++) {
        float dt = softplus(a->dt[t * a->dts + h] + a->dt_bias[h]);
        if (dt < a->dt_lo) dt = a->dt_lo;          /* torch.clamp(dt, lo, hi) */
        if (dt > a->dt_hi) dt = a->dt_hi;
        const float dA = expf(dt * a->A[h]);
        const float *xh = a->x + t * a->xs + h * hd;
        const float *B = a->B + t * a->bcs + g * S, *C = a->C + t * a->bcs + g * S;
        float *yh = a->y + t * (a->nh * hd) + h * hd;
        for (int64_t p = 0; p < hd; p++) {
            float *sp = st + p * S;
            const float dx = dt * xh[p];
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < S; n++) {
                sp[n] = dA * sp[n] + dx * B[n];
                acc += sp[n] * C[n];
            }
            yh[p] = acc + a->D[h] * xh[p];
        }
    }
}

void op_ssm_scan(const op_ssm_args *a) {
#pragma omp parallel for schedule(static) if (a->T * a->nh * a->hd * a->S >= (1 << 15))
    for (int64_t h = 0; h < a->nh; h++) scan_head(a, h);
}
