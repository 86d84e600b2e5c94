/* AVX2 + FMA + F16C gather_qmm kernels (see gather_cpu.h). Compiled with -mavx2 -mfma -mf16c
 * (CMakeLists.txt, files named *_avx2.c) and only called after gather_cpu_kernels_select() has
 * checked the CPU.
 *
 * NVFP4 decode of one block of 16 weights (spec NVFP4.md section 1), 8 code bytes -> 2 x 8 fp32:
 * split the nibbles, interleave them into element order (byte j: element 2j low nibble, 2j+1 high),
 * look up 2*e2m1(code) as int8 with one byte shuffle, widen to int32, convert to fp32 and multiply
 * by e4m3(scale)/2. Every step is exact: w = e2m1 * e4m3 as in the spec. */
#if defined(__x86_64__) || defined(__i386__)
#include "kernels/cpu/gather_cpu.h"
#include "kernels/cpu/gather_q8.h"

#include <immintrin.h>
#include <string.h>

#include "fp4moe/nvfp4.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 2 * e2m1(code) for code 0..15: 0 .5 1 1.5 2 3 4 6 and their negatives (8 = -0 -> 0). */
#define E2M1_X2_LUT _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

ALWAYS_INLINE void decode16(const uint8_t *codes, float scale, __m256 *w0, __m256 *w1) {
    const __m128i c = _mm_loadl_epi64((const __m128i *)codes);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(c, m4), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m4);
    const __m128i v = _mm_shuffle_epi8(E2M1_X2_LUT, _mm_unpacklo_epi8(lo, hi)); /* 16 x int8 */
    const __m256 s = _mm256_set1_ps(scale * 0.5f);
    *w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), s);
    *w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))), s);
}

ALWAYS_INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- conversions -------------------------------------------------------------------------- */

void gather_avx2_x_to_f32(const void *src, fp4moe_dtype dtype, int64_t n, float *dst) {
    int64_t i = 0;
    if (dtype == FP4MOE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *h = src;
    if (dtype == FP4MOE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        for (; i < n; i++) dst[i] = fp4moe_f16_to_f32(h[i]);
    } else {
        for (; i + 8 <= n; i += 8) {
            const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i)));
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
        }
        for (; i < n; i++) dst[i] = fp4moe_bf16_to_f32(h[i]);
    }
}

/* fp32 -> bf16, round to nearest even, NaN kept quiet: the vector form of fp4moe_f32_to_bf16. */
ALWAYS_INLINE __m128i f32_to_bf16_x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

void gather_avx2_y_from_f32(const float *src, int64_t n, float gs, fp4moe_dtype dtype, void *dst) {
    const __m256 g = _mm256_set1_ps(gs);
    int64_t i = 0;
    if (dtype == FP4MOE_F32) {
        float *d = dst;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), g));
        for (; i < n; i++) d[i] = src[i] * gs;
    } else if (dtype == FP4MOE_F16) {
        uint16_t *d = dst;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), g),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) d[i] = fp4moe_f32_to_f16(src[i] * gs);
    } else {
        uint16_t *d = dst;
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i), f32_to_bf16_x8(_mm256_mul_ps(_mm256_loadu_ps(src + i), g)));
        for (; i < n; i++) d[i] = fp4moe_f32_to_bf16(src[i] * gs);
    }
}

/* ---- qmv: R rows share each block decode ------------------------------------------------------ */

ALWAYS_INLINE void qmv_rows(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                            int64_t nn, const float *x, int64_t ldx, const int R, float *y, int64_t ldy) {
    const int64_t nb = K / 16;
    for (int64_t j = 0; j < nn; j++) {
        const uint8_t *cj = codes + j * (K / 2), *sj = scales + j * nb;
        __m256 acc[8][2]; /* R <= 8 */
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256 w0, w1;
            decode16(cj + 8 * b, stab[sj[b]], &w0, &w1);
            for (int r = 0; r < R; r++) {
                acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + 16 * b), w0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + 16 * b + 8), w1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; r++) y[r * ldy + j] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
    }
}

static void qmv_avx2(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                     int64_t nn, const float *x, int64_t ldx, int R, float *y, int64_t ldy) {
#define QMV(n) qmv_rows(codes, scales, stab, K, nn, x, ldx, n, y, ldy)
    GATHER_SWITCH_ROWS(R, QMV);
#undef QMV
}

/* ---- expert-batched: decode a tile once, then a register-blocked micro-kernel ----------------- */

static void decode_avx2(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                        int64_t nn, int64_t k0, int64_t kc, float *w, int64_t ldw) {
    const int64_t nb = K / 16;
    for (int64_t j = 0; j < nn; j++) {
        const uint8_t *cj = codes + j * (K / 2) + k0 / 2, *sj = scales + j * nb + k0 / 16;
        float *wj = w + j * ldw;
        for (int64_t k = 0; k < kc; k += 16) {
            __m256 w0, w1;
            decode16(cj + k / 2, stab[sj[k / 16]], &w0, &w1);
            _mm256_storeu_ps(wj + k, w0);
            _mm256_storeu_ps(wj + k + 8, w1);
        }
    }
}

/* Outer-product micro-kernel: MV vectors of 8 activation rows x NR weight rows (MV*NR = 12
 * fp32 accumulators, no horizontal sums). Per k: MV vector loads of x, NR broadcasts of w, 12 FMAs. */
ALWAYS_INLINE void micro(const int MV, const int NR, int64_t kc, const float *xp, const float *w,
                         int64_t ldw, float *c, int64_t ldc, int first) {
    __m256 acc[2][12];
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++)
            acc[v][j] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + j * ldc + 8 * v);
    for (int64_t k = 0; k < kc; k++) {
        __m256 xv[2];
        for (int v = 0; v < MV; v++) xv[v] = _mm256_loadu_ps(xp + k * 8 * MV + 8 * v);
        for (int j = 0; j < NR; j++) {
            const __m256 b = _mm256_broadcast_ss(w + j * ldw + k);
            for (int v = 0; v < MV; v++) acc[v][j] = _mm256_fmadd_ps(xv[v], b, acc[v][j]);
        }
    }
    for (int v = 0; v < MV; v++)
        for (int j = 0; j < NR; j++) _mm256_storeu_ps(c + j * ldc + 8 * v, acc[v][j]);
}

void gather_avx2_panel_gemm(int mv, int64_t n, int64_t kc, const float *xp, const float *w, int64_t ldw,
                            float *c, int64_t ldc, int first) {
    if (mv == 2) {
        for (int64_t j = 0; j < n; j += 6) micro(2, 6, kc, xp, w + j * ldw, ldw, c + j * ldc, ldc, first);
    } else {
        for (int64_t j = 0; j < n; j += 12) micro(1, 12, kc, xp, w + j * ldw, ldw, c + j * ldc, ldc, first);
    }
}

/* ---- W4A8 (gather_q8.h), group size 64: one 32-byte vector of code bytes per group ------------ */

#define Q8_G 64

static void q8_x_avx2(const float *x, int64_t n, int64_t K, int8_t *xq, float *xs, int32_t *xc) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t r = 0; r < n; r++) q8_quantize_row(x + r * K, K, Q8_G, xq + r * Kp, xs + r * Kp / 8, xc + r * Kp / 8);
}

/* u = 2 * e2m1(code) + 12, in both 128-bit lanes */
#define E2M1_U_LUT _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, \
                                    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)

/* Group g (64 weights = 32 code bytes) of one NVFP4 row: the unsigned weight bytes in the layout of
 * gather_q8.h (*ue even, *uo odd elements) and the 8 lane scales e4m3 / 2 (*wsv). Past K: codes 0
 * (u = 12), scales 0. */
ALWAYS_INLINE void q8_group(const uint8_t *cj, const uint8_t *sj, const float *stab, int64_t K, int64_t g,
                            __m256i *ue, __m256i *uo, __m256 *wsv) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int64_t nb = K / 16;
    __m256i c;
    _mm_prefetch((const char *)(cj + 32 * g + 2048), _MM_HINT_T0); /* rows are contiguous */
    if (32 * (g + 1) <= K / 2) {
        c = _mm256_loadu_si256((const __m256i *)(cj + 32 * g));
    } else { /* the last, partial group */
        uint8_t tmp[32] = {0};
        memcpy(tmp, cj + 32 * g, (size_t)(K / 2 - 32 * g));
        c = _mm256_loadu_si256((const __m256i *)tmp);
    }
    *ue = _mm256_shuffle_epi8(E2M1_U_LUT, _mm256_and_si256(c, m4));
    *uo = _mm256_shuffle_epi8(E2M1_U_LUT, _mm256_and_si256(_mm256_srli_epi16(c, 4), m4));
    float sv[4];
    for (int b = 0; b < 4; b++) sv[b] = 4 * g + b < nb ? 0.5f * stab[sj[4 * g + b]] : 0.0f;
    *wsv = _mm256_setr_ps(sv[0], sv[0], sv[1], sv[1], sv[2], sv[2], sv[3], sv[3]);
}

/* acc[r] += the group's 8 lane sums for activation rows r < R: two u8 x s8 pair products
 * (vpmaddubsw: |24 * 127 * 2| fits int16, no saturation), their int16 sum (<= 12192), pairs to
 * int32 (vpmaddwd with ones) = the lanes, plus the corrections, one conversion, one FMA. */
ALWAYS_INLINE void q8_group_dot(__m256i ue, __m256i uo, __m256 wsv, const int8_t *xq, const float *xs,
                                const int32_t *xc, int64_t Kp, int64_t g, const int R, __m256 *acc) {
    const int64_t nl = Kp / 8;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) {
        const int8_t *q = xq + r * Kp + Q8_G * g;
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_loadu_si256((const __m256i *)q)),
                                           _mm256_maddubs_epi16(uo, _mm256_loadu_si256((const __m256i *)(q + 32))));
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(p, ones),
                                             _mm256_loadu_si256((const __m256i *)(xc + r * nl + 8 * g)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(wsv, _mm256_loadu_ps(xs + r * nl + 8 * g)),
                                 acc[r]);
    }
}

static void q8_decode_avx2(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                           int64_t nn, uint8_t *wq, float *ws) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t j = 0; j < nn; j++)
        for (int64_t g = 0; g < Kp / Q8_G; g++) {
            __m256i ue, uo;
            __m256 wsv;
            q8_group(codes + j * (K / 2), scales + j * (K / 16), stab, K, g, &ue, &uo, &wsv);
            _mm256_storeu_si256((__m256i *)(wq + j * Kp + Q8_G * g), ue);
            _mm256_storeu_si256((__m256i *)(wq + j * Kp + Q8_G * g + 32), uo);
            _mm256_storeu_ps(ws + j * (Kp / 8) + 8 * g, wsv);
        }
}

/* From a decoded tile (q8_decode): the expert-batched route, every row group over the same tile. */
ALWAYS_INLINE void q8_dot_rows(const uint8_t *wq, const float *ws, int64_t Kp, int64_t nn, const int8_t *xq,
                               const float *xs, const int32_t *xc, const int R, float *y, int64_t ldy) {
    for (int64_t j = 0; j < nn; j++) {
        __m256 acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < Kp / Q8_G; g++)
            q8_group_dot(_mm256_loadu_si256((const __m256i *)(wq + j * Kp + Q8_G * g)),
                         _mm256_loadu_si256((const __m256i *)(wq + j * Kp + Q8_G * g + 32)),
                         _mm256_loadu_ps(ws + j * (Kp / 8) + 8 * g), xq, xs, xc, Kp, g, R, acc);
        for (int r = 0; r < R; r++) y[r * ldy + j] = hsum8(acc[r]);
    }
}

/* Decode + dot in registers for a few rows (the qmv route: no weight buffer, codes streamed once). */
ALWAYS_INLINE void q8_qmv_rows(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                               int64_t nn, const int8_t *xq, const float *xs, const int32_t *xc, const int R,
                               float *y, int64_t ldy) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t j = 0; j < nn; j++) {
        __m256 acc[8], wsv;
        __m256i ue, uo;
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t g = 0; g < Kp / Q8_G; g++) {
            q8_group(codes + j * (K / 2), scales + j * (K / 16), stab, K, g, &ue, &uo, &wsv);
            q8_group_dot(ue, uo, wsv, xq, xs, xc, Kp, g, R, acc);
        }
        for (int r = 0; r < R; r++) y[r * ldy + j] = hsum8(acc[r]);
    }
}

static void q8_qmv_avx2(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K, int64_t nn,
                        const int8_t *xq, const float *xs, const int32_t *xc, int R, float *y, int64_t ldy) {
#define Q8_QMV(n) q8_qmv_rows(codes, scales, stab, K, nn, xq, xs, xc, n, y, ldy)
    GATHER_SWITCH_ROWS(R, Q8_QMV);
#undef Q8_QMV
}

static void q8_dot_avx2(const uint8_t *wq, const float *ws, int64_t K, int64_t nn, const int8_t *xq,
                        const float *xs, const int32_t *xc, int R, float *y, int64_t ldy) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
#define Q8_DOT(n) q8_dot_rows(wq, ws, Kp, nn, xq, xs, xc, n, y, ldy)
    GATHER_SWITCH_ROWS(R, Q8_DOT);
#undef Q8_DOT
}

const gather_cpu_kernels gather_cpu_kernels_avx2 = {
    "avx2", gather_avx2_x_to_f32, gather_avx2_y_from_f32, qmv_avx2, decode_avx2, gather_avx2_panel_gemm,
    NULL, NULL, Q8_G, q8_x_avx2, q8_decode_avx2, q8_dot_avx2, q8_qmv_avx2,
};
#endif
