/* Internal: the route-agnostic pieces of gather_qmm that every backend (CPU, CUDA) shares:
 * expert runs of an idx vector, the environment switches, and the two deliberate-fault hooks.
 * Contract: docs/spec/NVFP4.md section 4 and include/fp4moe/gather_qmm.h.
 * Implemented in src/kernels/cpu/gather_common.c (that directory is compiled in every build). */
#ifndef FP4MOE_KERNELS_GATHER_COMMON_H
#define FP4MOE_KERNELS_GATHER_COMMON_H

#include <stdint.h>
#include "fp4moe/gather_qmm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A maximal run of consecutive rows [start, start + len) with the same idx value `expert`.
 * expert >= E marks out-of-range rows, whose outputs are zeros. */
typedef struct {
    int64_t start, len;
    uint32_t expert;
} gather_run;

/* Splits idx (B entries, B >= 0) into maximal runs of equal consecutive values, in row order.
 * require_sorted != 0: idx must be non-decreasing; a decrease is FP4MOE_EINVAL naming the row
 * (one O(B) scan, so a broken "sorted" promise is an error, never an out-of-bounds access).
 * *runs is malloc'ed (free() it; NULL when *nruns == 0). Errors: FP4MOE_EINVAL, FP4MOE_ENOMEM. */
int gather_find_runs(const uint32_t *idx, int64_t B, int require_sorted, gather_run **runs,
                     int64_t *nruns);

/* FP4MOE_GATHER_ROUTE: the route named there (qmv|batched|dequant_gemm), or FP4MOE_ROUTE_AUTO
 * when unset, "auto" or not a route name. */
fp4moe_route gather_env_route(void);
/* 1 when FP4MOE_GATHER_EXPERT_BATCHED is set to "0" (expert-batched route off), else 0. */
int gather_env_batched_off(void);

/* Writes zeros to rows [start, start + len) of y (B x N of dtype_size bytes per element). */
void gather_zero_rows(void *y, int64_t N, int64_t dtype_size, int64_t start, int64_t len);

/* The expert whose weights a route reads for the rows of expert e (0 <= e < E). */
static inline int64_t gather_weight_expert(int64_t e, int64_t E) {
#ifdef FP4MOE_INJECT_FAULT_EXPERT_OFFSET /* deliberate fault (tests must catch it): shifted expert */
    return e + 1 < E ? e + 1 : (e > 0 ? e - 1 : e);
#endif
    (void)E;
    return e;
}

/* The global-scale decode multiplier of expert e (1 without global scales). */
static inline float gather_expert_gs(const float *global_scale, int64_t e) {
#ifdef FP4MOE_INJECT_FAULT_GLOBAL_SCALE /* deliberate fault (tests must catch it): gs dropped */
    return 1.0f;
#endif
    return global_scale ? global_scale[e] : 1.0f;
}

#ifdef __cplusplus
}
#endif
#endif
