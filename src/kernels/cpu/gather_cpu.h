/* Internal: the CPU gather_qmm kernels, one table per instruction set (portable C, AVX2+FMA+F16C).
 * The route drivers in gather_qmm_cpu.c split the work and call these; the kernels only compute.
 * Weights are NVFP4 rows of one expert (spec NVFP4.md section 1): `codes` points at row n0
 * (K/2 bytes per row), `scales` at the same row (K/16 E4M3 bytes per row); `stab` is the 256-entry
 * table E4M3 byte -> fp32 value. No global scale here: the drivers apply it in the epilogue. */
#ifndef FP4MOE_KERNELS_CPU_GATHER_CPU_H
#define FP4MOE_KERNELS_CPU_GATHER_CPU_H

#include <stdint.h>
#include "fp4moe/types.h"

/* The qmv route lets up to this many adjacent rows of one expert share each weight decode
 * (overridable at compile time for measurements, 1..8). */
#ifndef GATHER_QMV_ROWS
#define GATHER_QMV_ROWS 8
#endif

typedef struct {
    const char *name; /* "avx2" or "portable" */

    /* dst[i] = fp32(src[i]) for i < n; src of dtype. Exact. */
    void (*x_to_f32)(const void *src, fp4moe_dtype dtype, int64_t n, float *dst);

    /* dst[i] = dtype(src[i] * gs) for i < n: one fp32 multiply, one rounding (nearest even). */
    void (*y_from_f32)(const float *src, int64_t n, float gs, fp4moe_dtype dtype, void *dst);

    /* qmv: y[r*ldy + j] = sum_{k<K} x[r*ldx + k] * w[j][k] for r < R (1..GATHER_QMV_ROWS),
     * j < nn, where w[j] is NVFP4 row j of codes/scales. fp32 accumulation; each weight block is
     * decoded once for all R rows. */
    void (*qmv)(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K, int64_t nn,
                const float *x, int64_t ldx, int R, float *y, int64_t ldy);

    /* Decodes columns [k0, k0 + kc) of NVFP4 rows j < nn to fp32: w[j*ldw + k - k0] =
     * e2m1 * e4m3 (exact). k0 and kc are multiples of 16. */
    void (*decode)(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                   int64_t nn, int64_t k0, int64_t kc, float *w, int64_t ldw);

    /* The register-blocked micro-kernel of the expert-batched route, over one panel of PW = 8*mv
     * activation rows (mv = 1 or 2), packed k-major: xp[k*PW + r]. For the n weight rows of w
     * (n % 12 == 0, zero rows as padding) and r < PW:
     *   c[j*ldc + r] = (first ? 0 : c[j*ldc + r]) + sum_{k<kc} xp[k*PW + r] * w[j*ldw + k]. */
    void (*panel_gemm)(int mv, int64_t n, int64_t kc, const float *xp, const float *w, int64_t ldw,
                       float *c, int64_t ldc, int first);
} gather_cpu_kernels;

extern const gather_cpu_kernels gather_cpu_kernels_portable;
#if defined(__x86_64__) || defined(__i386__)
extern const gather_cpu_kernels gather_cpu_kernels_avx2;
#endif

/* The table for this machine: AVX2 when the CPU has AVX2, FMA and F16C, else portable.
 * FP4MOE_CPU_ISA=portable in the environment forces the portable kernels (tests use it so that
 * both code paths are checked against the reference). */
const gather_cpu_kernels *gather_cpu_kernels_select(void);

#endif
