/* Portable C gather_qmm kernels (see gather_cpu.h), and the run-time choice of kernel table.
 * The same computations as gather_kernels_avx2.c, written for clarity; the compiler vectorises
 * what it can for the baseline instruction set. */
#include "kernels/cpu/gather_cpu.h"
#include "common/env.h"

#include <stdlib.h>
#include <string.h>

#include "fp4moe/nvfp4.h"

static void x_to_f32_portable(const void *src, fp4moe_dtype dtype, int64_t n, float *dst) {
    fp4moe_to_f32(src, dtype, n, dst);
}

static void y_from_f32_portable(const float *src, int64_t n, float gs, fp4moe_dtype dtype, void *dst) {
    float tmp[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int64_t m = n - i0 < 256 ? n - i0 : 256;
        for (int64_t i = 0; i < m; i++) tmp[i] = src[i0 + i] * gs;
        fp4moe_from_f32(tmp, m, dtype, (char *)dst + i0 * (int64_t)fp4moe_dtype_size(dtype));
    }
}

/* One NVFP4 block (16 weights: 8 code bytes, one scale) -> fp32, w = e2m1(code) * e4m3(scale). */
static void decode_block(const uint8_t codes[8], float scale, float w[16]) {
    for (int j = 0; j < 8; j++) {
        w[2 * j] = fp4moe_e2m1_to_f32(codes[j] & 15) * scale;
        w[2 * j + 1] = fp4moe_e2m1_to_f32(codes[j] >> 4) * scale;
    }
}

static void qmv_portable(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                         int64_t nn, const float *x, int64_t ldx, int R, float *y, int64_t ldy) {
    const int64_t nb = K / 16;
    for (int64_t j = 0; j < nn; j++) {
        float acc[GATHER_QMV_ROWS][16] = {{0}};
        for (int64_t b = 0; b < nb; b++) {
            float w[16];
            decode_block(codes + j * (K / 2) + b * 8, stab[scales[j * nb + b]], w);
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 16; i++) acc[r][i] += x[r * ldx + b * 16 + i] * w[i];
        }
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int i = 0; i < 16; i++) s += acc[r][i];
            y[r * ldy + j] = s;
        }
    }
}

static void decode_portable(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                            int64_t nn, int64_t k0, int64_t kc, float *w, int64_t ldw) {
    const int64_t nb = K / 16;
    for (int64_t j = 0; j < nn; j++)
        for (int64_t k = 0; k < kc; k += 16) {
            const int64_t b = (k0 + k) / 16;
            decode_block(codes + j * (K / 2) + b * 8, stab[scales[j * nb + b]], w + j * ldw + k);
        }
}

static void panel_gemm_portable(int mv, int64_t n, int64_t kc, const float *xp, const float *w,
                                int64_t ldw, float *c, int64_t ldc, int first) {
    const int pw = 8 * mv;
    for (int64_t j = 0; j < n; j++)
        for (int r = 0; r < pw; r++) {
            float acc = first ? 0.0f : c[j * ldc + r];
            for (int64_t k = 0; k < kc; k++) acc += xp[k * pw + r] * w[j * ldw + k];
            c[j * ldc + r] = acc;
        }
}

const gather_cpu_kernels gather_cpu_kernels_portable = {
    "portable", x_to_f32_portable, y_from_f32_portable, qmv_portable, decode_portable, panel_gemm_portable,
};

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
/* AVX2, FMA and F16C from CPUID (Intel SDM vol. 2A, CPUID leaves 1 and 7) and the OS saving the
 * AVX state (XGETBV XCR0 bits 1-2): works with gcc and clang alike (clang 14 lacks
 * __builtin_cpu_supports("f16c")). */
static int cpu_has_avx2_fma_f16c(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!fma || !osxsave || !avx || !f16c) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6u) != 6u) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 5) & 1;                                /* AVX2 */
}
#endif

const gather_cpu_kernels *gather_cpu_kernels_select(void) {
    if (!strcmp(env_get(ENV_CPU_ISA), "portable")) return &gather_cpu_kernels_portable;
#if defined(__x86_64__) || defined(__i386__)
    if (cpu_has_avx2_fma_f16c()) return &gather_cpu_kernels_avx2;
#endif
    return &gather_cpu_kernels_portable;
}

const char *fp4moe_gather_cpu_isa(void) { return gather_cpu_kernels_select()->name; }
