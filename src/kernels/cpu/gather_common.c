/* Route-agnostic gather_qmm pieces shared by the CPU and CUDA backends: route names, argument
 * validation, expert runs, environment switches (see src/kernels/gather_common.h). */
#include "kernels/gather_common.h"

#include <stdlib.h>
#include <string.h>

#include "common/env.h"
#include "common/error.h"

static const char *const k_route_names[] = {"auto", "qmv", "batched", "dequant_gemm"};

const char *fp4moe_route_name(fp4moe_route r) {
    if ((int)r < 0 || (int)r > (int)FP4MOE_ROUTE_DEQUANT_GEMM) return "?";
    return k_route_names[r];
}

int fp4moe_route_parse(const char *s, fp4moe_route *out) {
    if (!s || !out) return fp4moe_set_error(FP4MOE_EINVAL, "route: NULL argument");
    for (int r = 0; r <= (int)FP4MOE_ROUTE_DEQUANT_GEMM; r++)
        if (!strcmp(s, k_route_names[r])) {
            *out = (fp4moe_route)r;
            return FP4MOE_OK;
        }
    return fp4moe_set_error(FP4MOE_EINVAL,
                            "unknown gather route '%s' (expected auto, qmv, batched or dequant_gemm)", s);
}

int fp4moe_gather_qmm_check(const fp4moe_nvfp4_weights *w, const void *x, const uint32_t *idx,
                            int64_t B, const void *y) {
    int64_t t;
    if (!w) return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: weights w is NULL");
    if (!w->codes || !w->scales)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: w.%s is NULL", w->codes ? "scales" : "codes");
    if (w->E < 1 || w->N < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: E=%lld, N=%lld (both must be >= 1)",
                                (long long)w->E, (long long)w->N);
    if (w->K < 16 || w->K % 16 != 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: K=%lld is not a positive multiple of 16",
                                (long long)w->K);
    if (B < 0) return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: B=%lld < 0", (long long)B);
    /* E*N*K weights (and their fp32 dequantization, 4 bytes each) must be addressable. */
    if (fp4moe_mul_overflow(w->E, w->N, &t) || fp4moe_mul_overflow(t, w->K, &t) ||
        fp4moe_mul_overflow(t, 4, &t) || (uint64_t)t > SIZE_MAX)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "gather_qmm: E*N*K = %lld*%lld*%lld overflows",
                                (long long)w->E, (long long)w->N, (long long)w->K);
    /* B*K activations and B*N outputs, up to 4 bytes each (f32). */
    if (fp4moe_mul_overflow(B, w->K, &t) || fp4moe_mul_overflow(t, 4, &t) ||
        fp4moe_mul_overflow(B, w->N, &t) || fp4moe_mul_overflow(t, 4, &t) || (uint64_t)t > SIZE_MAX)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "gather_qmm: B=%lld rows x K=%lld / N=%lld overflows",
                                (long long)B, (long long)w->K, (long long)w->N);
    if (B > 0 && (!x || !idx || !y))
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm: %s is NULL with B=%lld",
                                !x ? "x" : !idx ? "idx" : "y", (long long)B);
    return FP4MOE_OK;
}

int gather_find_runs(const uint32_t *idx, int64_t B, int require_sorted, gather_run **runs,
                     int64_t *nruns) {
    *runs = NULL;
    *nruns = 0;
    if (B <= 0) return FP4MOE_OK;
    int64_t n = 1;
    for (int64_t b = 1; b < B; b++) {
        if (require_sorted && idx[b] < idx[b - 1])
            return fp4moe_set_error(FP4MOE_EINVAL,
                                    "gather_qmm: idx is not sorted (idx[%lld]=%u < idx[%lld]=%u) but "
                                    "the route needs sorted input",
                                    (long long)b, idx[b], (long long)(b - 1), idx[b - 1]);
        n += idx[b] != idx[b - 1];
    }
    gather_run *r = malloc((size_t)n * sizeof *r);
    if (!r) return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm: %lld runs", (long long)n);
    int64_t j = 0;
    r[0] = (gather_run){0, 1, idx[0]};
    for (int64_t b = 1; b < B; b++) {
        if (idx[b] == r[j].expert) {
            r[j].len++;
        } else {
            r[++j] = (gather_run){b, 1, idx[b]};
        }
    }
    *runs = r;
    *nruns = n;
    return FP4MOE_OK;
}

fp4moe_route gather_env_route(void) {
    const char *s = env_get(ENV_GATHER_ROUTE);
    for (int r = 1; r <= (int)FP4MOE_ROUTE_DEQUANT_GEMM; r++)
        if (!strcmp(s, k_route_names[r])) return (fp4moe_route)r;
    return FP4MOE_ROUTE_AUTO;
}

int gather_env_batched_off(void) {
    return !strcmp(env_get(ENV_GATHER_EXPERT_BATCHED), "0");
}

void gather_zero_rows(void *y, int64_t N, int64_t dtype_size, int64_t start, int64_t len) {
    /* all-zero bits are +0.0 in f32, f16 and bf16 */
    memset((char *)y + start * N * dtype_size, 0, (size_t)(len * N * dtype_size));
}
