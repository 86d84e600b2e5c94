/* Portable C gather_qmm kernels (see gather_cpu.h), and the run-time choice of kernel table.
 * The same computations as gather_kernels_avx2.c, written for clarity; the compiler vectorises
 * what it can for the baseline instruction set. */
#include "kernels/cpu/gather_cpu.h"
#include "kernels/cpu/gather_q8.h"
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

/* ---- W4A8 (gather_q8.h), group size 16 ------------------------------------------------------ */

#define Q8_G 16

static void q8_x_portable(const float *x, int64_t n, int64_t K, int8_t *xq, float *xs, int32_t *xc) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t r = 0; r < n; r++) q8_quantize_row(x + r * K, K, Q8_G, xq + r * Kp, xs + r * Kp / 8, xc + r * Kp / 8);
}

/* u = 2 * e2m1(code) + 12 */
static const uint8_t k_e2m1_u[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

static void q8_decode_portable(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                               int64_t nn, uint8_t *wq, float *ws) {
    const int64_t Kp = q8_padded_k(K, Q8_G), nb = K / 16;
    for (int64_t j = 0; j < nn; j++)
        for (int64_t b = 0; b < nb; b++) { /* G = 16: one group per block */
            const uint8_t *c = codes + j * (K / 2) + 8 * b;
            uint8_t *u = wq + j * Kp + 16 * b;
            for (int m = 0; m < 8; m++) {
                u[m] = k_e2m1_u[c[m] & 15];
                u[8 + m] = k_e2m1_u[c[m] >> 4];
            }
            ws[j * Kp / 8 + 2 * b] = ws[j * Kp / 8 + 2 * b + 1] = 0.5f * stab[scales[j * nb + b]];
        }
}

static void q8_dot_portable(const uint8_t *wq, const float *ws, int64_t K, int64_t nn, const int8_t *xq,
                            const float *xs, const int32_t *xc, int R, float *y, int64_t ldy) {
    const int64_t Kp = q8_padded_k(K, Q8_G), nl = Kp / 8;
    for (int64_t j = 0; j < nn; j++)
        for (int r = 0; r < R; r++) {
            const uint8_t *u = wq + j * Kp;
            const int8_t *q = xq + r * Kp;
            float acc = 0.0f;
            for (int64_t l = 0; l < nl; l++) {
                const int64_t g0 = l / 2 * Q8_G, o = 4 * (l % 2); /* lane l: bytes [o, o+4) of each half */
                int32_t s = xc[r * nl + l];
                for (int i = 0; i < 4; i++)
                    s += u[g0 + o + i] * q[g0 + o + i] + u[g0 + Q8_G / 2 + o + i] * q[g0 + Q8_G / 2 + o + i];
                acc += (float)s * (ws[j * nl + l] * xs[r * nl + l]);
            }
            y[r * ldy + j] = acc;
        }
}

const gather_cpu_kernels gather_cpu_kernels_portable = {
    "portable", x_to_f32_portable, y_from_f32_portable, qmv_portable, decode_portable, panel_gemm_portable,
    NULL, NULL, Q8_G, q8_x_portable, q8_decode_portable, q8_dot_portable, NULL,
};

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
/* From CPUID (Intel SDM vol. 2A, leaves 1 and 7) and the state the OS saves (XGETBV XCR0, SDM vol.
 * 1 section 13.3): works with gcc and clang alike (clang 14 lacks __builtin_cpu_supports("f16c")).
 * 2: AVX-512 F, BW, VL, DQ, VNNI with opmask/ZMM state (XCR0 bits 5-7); 1: AVX2, FMA, F16C with
 * YMM state (bits 1-2); 0: neither. */
static int cpu_x86_level(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int fma = (c >> 12) & 1, osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, f16c = (c >> 29) & 1;
    if (!fma || !osxsave || !avx || !f16c) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6u) != 6u) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!((b >> 5) & 1)) return 0;                      /* AVX2 */
    const int avx512 = ((b >> 16) & 1) && ((b >> 17) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) /* F DQ BW VL */
                       && ((c >> 11) & 1)                                                        /* VNNI */
                       && (lo & 0xE0u) == 0xE0u;
    return avx512 ? 2 : 1;
}
#endif

const gather_cpu_kernels *gather_cpu_kernels_select(void) {
    const char *want = env_get(ENV_CPU_ISA);
    if (!strcmp(want, "portable")) return &gather_cpu_kernels_portable;
#if defined(__x86_64__) || defined(__i386__)
    static int level = -1;
    if (level < 0) level = cpu_x86_level();
    if (level >= 2 && strcmp(want, "avx2")) return &gather_cpu_kernels_avx512;
    if (level >= 1) return &gather_cpu_kernels_avx2;
#endif
    return &gather_cpu_kernels_portable;
}

const char *fp4moe_gather_cpu_isa(void) { return gather_cpu_kernels_select()->name; }
