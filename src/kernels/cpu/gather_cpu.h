/* Internal: the CPU gather_qmm kernels, one table per instruction set (portable C, AVX2+FMA+F16C,
 * AVX-512).
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

/* Calls CALL(n) with the compile-time row count n = R (1..8; larger R as 8): the kernels are
 * written for a constant row count so that their accumulators stay in registers. */
#define GATHER_SWITCH_ROWS(R, CALL)                                                                     \
    switch (R) {                                                                                      \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    case 3: CALL(3); break;                                                                           \
    case 4: CALL(4); break;                                                                           \
    case 5: CALL(5); break;                                                                           \
    case 6: CALL(6); break;                                                                           \
    case 7: CALL(7); break;                                                                           \
    default: CALL(8); break;                                                                          \
    }

typedef struct {
    const char *name; /* "avx512", "avx2" or "portable" */

    /* dst[i] = fp32(src[i]) for i < n; src of dtype. Exact. */
    void (*x_to_f32)(const void *src, fp4moe_dtype dtype, int64_t n, float *dst);

    /* dst[i] = dtype(src[i] * gs) for i < n: one fp32 multiply, one rounding (nearest even). */
    void (*y_from_f32)(const float *src, int64_t n, float gs, fp4moe_dtype dtype, void *dst);

    /* qmv: y[r*ldy + j] = sum_{k<K} x[r*ldx + k] * w[j][k] for r < R (1..GATHER_QMV_ROWS),
     * j < nn, where w[j] is NVFP4 row j of codes/scales. fp32 accumulation; each weight block is
     * decoded once for all R rows. Where the table has qmv_x, x is in its layout instead (made by
     * qmv_x, ldx = qmv_ld(K)). */
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

    /* Optional (NULL: qmv takes x row-major, ldx >= K): qmv's activation layout. qmv_ld(K) is the
     * floats per row (>= K); qmv_x rearranges R fp32 rows x[r*ldx + k] into xq (R x qmv_ld(K)),
     * once per call for all the weight rows that use them. */
    int64_t (*qmv_ld)(int64_t K);
    void (*qmv_x)(const float *x, int64_t ldx, int R, int64_t K, float *xq);

    /* W4A8 (gather_q8.h: quantizer, layout, formula). q8_group is the kernels' group size G
     * (Kp = roundup(K, G)). q8_x quantizes n rows x[r*K + k] into xq (Kp bytes per row), xs and
     * xc (Kp/8 per row). q8_decode writes NVFP4 rows j < nn as wq (Kp bytes per row) and ws (Kp/8
     * fp32 per row). q8_dot: y[r*ldy + j] = sum over lanes of float(sum(q * u) + xc) * ws * xs
     * for rows r < R (1..8) of the quantized activations (row stride Kp) and weight rows j < nn;
     * integer sums exact, fp32 accumulation. */
    int q8_group;
    void (*q8_x)(const float *x, int64_t n, int64_t K, int8_t *xq, float *xs, int32_t *xc);
    void (*q8_decode)(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K, int64_t nn,
                      uint8_t *wq, float *ws);
    void (*q8_dot)(const uint8_t *wq, const float *ws, int64_t K, int64_t nn, const int8_t *xq,
                   const float *xs, const int32_t *xc, int R, float *y, int64_t ldy);
    /* Optional (NULL: q8_decode + q8_dot): the same y straight from the NVFP4 rows, decoded in
     * registers (for a few rows, where a decoded tile would be used once). */
    void (*q8_qmv)(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K, int64_t nn,
                   const int8_t *xq, const float *xs, const int32_t *xc, int R, float *y, int64_t ldy);
} gather_cpu_kernels;

extern const gather_cpu_kernels gather_cpu_kernels_portable;
#if defined(__x86_64__) || defined(__i386__)
extern const gather_cpu_kernels gather_cpu_kernels_avx2;
extern const gather_cpu_kernels gather_cpu_kernels_avx512;
/* AVX2 kernels the AVX-512 table shares (conversions, and 8-row panels). */
void gather_avx2_x_to_f32(const void *src, fp4moe_dtype dtype, int64_t n, float *dst);
void gather_avx2_y_from_f32(const float *src, int64_t n, float gs, fp4moe_dtype dtype, void *dst);
void gather_avx2_panel_gemm(int mv, int64_t n, int64_t kc, const float *xp, const float *w, int64_t ldw,
                            float *c, int64_t ldc, int first);
#endif

/* The table for this machine: the widest of avx512 (AVX-512 F, BW, VL, DQ and VNNI), avx2 (AVX2,
 * FMA and F16C) and portable that the CPU and the OS support. FP4MOE_CPU_ISA=portable|avx2|avx512
 * in the environment asks for one (tests run every table the machine has against the reference);
 * one the CPU lacks falls back to the best available (fp4moe_gather_cpu_isa() names the result). */
const gather_cpu_kernels *gather_cpu_kernels_select(void);

#endif
