/* AVX-512 gather_qmm kernels (see gather_cpu.h). Compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512dq -mavx512vnni (CMakeLists.txt, files named *_avx512.c) and only called after
 * gather_cpu_kernels_select() has checked the CPU and the OS (XCR0 opmask and ZMM state).
 *
 * One NVFP4 block of 16 weights is one zmm of fp32: the 8 code bytes are split into nibbles in
 * element order (byte j: element 2j low nibble, 2j+1 high), looked up as 2*e2m1 in int8 with one
 * byte shuffle, widened to int32, converted and multiplied by e4m3(scale)/2 -- every step exact,
 * w = e2m1 * e4m3 as in spec NVFP4.md section 1, the same values as the AVX2 and portable tables.
 * Two blocks (16 code bytes) are decoded per step so that one 16-byte load feeds both. */
#if defined(__x86_64__) || defined(__i386__)
#include "kernels/cpu/gather_cpu.h"
#include "kernels/cpu/gather_q8.h"

#include <immintrin.h>
#include <string.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* 2 * e2m1(code) for code 0..15 (8 = -0 -> 0). */
#define E2M1_X2_LUT _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

/* Code bytes of two consecutive blocks -> the two blocks' 16 int8 values 2*e2m1, element order. */
ALWAYS_INLINE void nibbles32(const uint8_t *codes, __m128i *v0, __m128i *v1) {
    const __m128i c = _mm_loadu_si128((const __m128i *)codes);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(c, m4), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m4);
    *v0 = _mm_shuffle_epi8(E2M1_X2_LUT, _mm_unpacklo_epi8(lo, hi));
    *v1 = _mm_shuffle_epi8(E2M1_X2_LUT, _mm_unpackhi_epi8(lo, hi));
}

/* One block (8 code bytes) -> 16 int8 values 2*e2m1, element order. */
ALWAYS_INLINE __m128i nibbles16(const uint8_t *codes) {
    const __m128i c = _mm_loadl_epi64((const __m128i *)codes);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(c, m4), hi = _mm_and_si128(_mm_srli_epi16(c, 4), m4);
    return _mm_shuffle_epi8(E2M1_X2_LUT, _mm_unpacklo_epi8(lo, hi));
}

/* 16 int8 (2*e2m1) times half the block scale -> the block's 16 fp32 weights. */
ALWAYS_INLINE __m512 widen(__m128i v, float half_scale) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(half_scale));
}

/* ---- qmv: R rows share each weight decode ----------------------------------------------------- */
/* The qmv kernel works on chunks of 128 weights of one row = 64 code bytes = 16 dwords of 8
 * nibbles. Nibble t of dword i is element 8i + t, so a right shift by 4t puts element 8i + t in the
 * low 4 bits of lane i, and one vpermps (which reads only those 4 bits) looks the 16 of them up in
 * a table of e2m1 values: 4 vector operations per 16 weights (shift, lookup, scale, FMA), none of
 * them a byte unpack. The activations are laid out to match once per call (qmv_x below):
 * xq[c*128 + 16t + i] = x[c*128 + 8i + t], zero past K. The block scale of lane i is that of
 * block c*8 + i/2 for every t; it is built once per chunk from the 8 E4M3 bytes through F16C:
 * (b & 0x7F) << 7 | (b & 0x80) << 8 is the fp16 of e4m3(b) * 2^-8 for every b (subnormals
 * included), with 0x7F / 0xFF (E4M3 NaN) set to NaN; the 2^8 is in the e2m1 table. Exact. */

#define QMV_CHUNK 128
#define QMV_PREFETCH 2048 /* bytes of codes ahead: the rows of a piece are one contiguous stream */

static int64_t qmv_ld_avx512(int64_t K) { return (K + QMV_CHUNK - 1) / QMV_CHUNK * QMV_CHUNK; }

static void qmv_x_avx512(const float *x, int64_t ldx, int R, int64_t K, float *xq) {
    const int64_t ld = qmv_ld_avx512(K);
    for (int r = 0; r < R; r++) {
        const float *xr = x + r * ldx;
        float *q = xq + r * ld;
        for (int64_t c = 0; c < ld; c += QMV_CHUNK)
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 16; i++) {
                    const int64_t k = c + 8 * i + t;
                    q[c + 16 * t + i] = k < K ? xr[k] : 0.0f;
                }
    }
}

/* The scales of the (up to) 16 blocks of two chunks (2^-8 times): 16 E4M3 bytes -> fp16 bits
 * (b << 7 puts bits 6..0 at 13..7 and the sign at bit 14; adding bit 14 to itself carries it to
 * bit 15) -> fp32; 0x7F / 0xFF -> NaN. Lane i = block i. */
ALWAYS_INLINE __m512 block_scales16(const uint8_t *s, __mmask16 bytes) {
    const __m256i w = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(bytes, s)), 7);
    const __m256i h = _mm256_add_epi16(w, _mm256_and_si256(w, _mm256_set1_epi16(0x4000)));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(w, _mm256_set1_epi16(0x3F80)),
                                                  _mm256_set1_epi16(0x3F80));
    return _mm512_mask_mov_ps(_mm512_cvtph_ps(h), nan, _mm512_set1_ps(__builtin_nanf("")));
}

/* Per chunk, the partial sums of one row are kept unscaled (lane i's 8 products all have block
 * i/2's scale) and multiplied by the scales once: 1 FMA per 16 weights and row, plus 1 per chunk. */
ALWAYS_INLINE void qmv_rows(const uint8_t *codes, const uint8_t *scales, int64_t K, int64_t nn,
                            const float *xq, const int R, float *y, int64_t ldy) {
    const int64_t nb = K / 16, ld = qmv_ld_avx512(K), nchunks = ld / QMV_CHUNK;
    const int tail_lanes = (int)(K % QMV_CHUNK / 8); /* dwords of the last chunk when partial */
    const __m512 lut = _mm512_setr_ps(0.f, 128.f, 256.f, 384.f, 512.f, 768.f, 1024.f, 1536.f, /* e2m1 * 2^8 */
                                      -0.f, -128.f, -256.f, -384.f, -512.f, -768.f, -1024.f, -1536.f);
    const __m512i dup_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
    for (int64_t j = 0; j < nn; j++) {
        const uint8_t *cj = codes + j * (K / 2), *sj = scales + j * nb;
        __m512 acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        _mm_prefetch((const char *)(sj + nb), _MM_HINT_T0); /* the next row's scales */
        __m512 s16 = _mm512_setzero_ps();
        for (int64_t c = 0; c < nchunks; c++) {
            const int partial = c == nchunks - 1 && tail_lanes;
            if (c % 2 == 0) {
                const int64_t left = nb - 8 * c;
                s16 = block_scales16(sj + 8 * c, left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1));
            }
            const __m512 sv = _mm512_permutexvar_ps(c % 2 ? dup_hi : dup_lo, s16);
            __m512i q;
            if (!partial) {
                _mm_prefetch((const char *)(cj + 64 * c + QMV_PREFETCH), _MM_HINT_T0);
                q = _mm512_loadu_si512((const void *)(cj + 64 * c));
            } else {
                q = _mm512_maskz_loadu_epi32((__mmask16)((1u << tail_lanes) - 1), cj + 64 * c);
            }
            const float *xc = xq + QMV_CHUNK * c;
            __m512 p[8][2];
            for (int t = 0; t < 8; t++) {
                const __m512 w = _mm512_permutexvar_ps(t ? _mm512_srli_epi32(q, 4 * t) : q, lut);
                for (int r = 0; r < R; r++) {
                    const __m512 xv = _mm512_loadu_ps(xc + r * ld + 16 * t);
                    p[r][t & 1] = t < 2 ? _mm512_mul_ps(xv, w) : _mm512_fmadd_ps(xv, w, p[r][t & 1]);
                }
            }
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(p[r][0], p[r][1]), sv, acc[r]);
        }
        for (int r = 0; r < R; r++) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r]);
    }
}

static void qmv_avx512(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                       int64_t nn, const float *xq, int64_t ldx, int R, float *y, int64_t ldy) {
    (void)stab;
    (void)ldx; /* qmv_ld_avx512(K) */
#define QMV(n) qmv_rows(codes, scales, K, nn, xq, n, y, ldy)
    GATHER_SWITCH_ROWS(R, QMV);
#undef QMV
}

/* ---- expert-batched: decode a tile once, then a register-blocked micro-kernel ----------------- */

static void decode_avx512(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                          int64_t nn, int64_t k0, int64_t kc, float *w, int64_t ldw) {
    const int64_t nb = K / 16;
    for (int64_t j = 0; j < nn; j++) {
        const uint8_t *cj = codes + j * (K / 2) + k0 / 2, *sj = scales + j * nb + k0 / 16;
        float *wj = w + j * ldw;
        int64_t k = 0;
        for (; k + 32 <= kc; k += 32) {
            __m128i v0, v1;
            nibbles32(cj + k / 2, &v0, &v1);
            _mm512_storeu_ps(wj + k, widen(v0, 0.5f * stab[sj[k / 16]]));
            _mm512_storeu_ps(wj + k + 16, widen(v1, 0.5f * stab[sj[k / 16 + 1]]));
        }
        if (k < kc) _mm512_storeu_ps(wj + k, widen(nibbles16(cj + k / 2), 0.5f * stab[sj[k / 16]]));
    }
}

/* Outer-product micro-kernel over a 16-row panel: one zmm of 16 activation rows per k, NR weight
 * rows broadcast, NR fp32 accumulators. Per k: 1 vector load, NR broadcasts, NR FMAs. */
ALWAYS_INLINE void micro16(const int NR, int64_t kc, const float *xp, const float *w, int64_t ldw,
                           float *c, int64_t ldc, int first) {
    __m512 acc[24];
    for (int j = 0; j < NR; j++) acc[j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + j * ldc);
    for (int64_t k = 0; k < kc; k++) {
        const __m512 xv = _mm512_loadu_ps(xp + k * 16);
        for (int j = 0; j < NR; j++) acc[j] = _mm512_fmadd_ps(xv, _mm512_set1_ps(w[j * ldw + k]), acc[j]);
    }
    for (int j = 0; j < NR; j++) _mm512_storeu_ps(c + j * ldc, acc[j]);
}

static void panel_gemm_avx512(int mv, int64_t n, int64_t kc, const float *xp, const float *w, int64_t ldw,
                              float *c, int64_t ldc, int first) {
    if (mv != 2) { /* 8-row panels: the AVX2 micro-kernel */
        gather_avx2_panel_gemm(mv, n, kc, xp, w, ldw, c, ldc, first);
        return;
    }
    int64_t j = 0; /* n % 12 == 0 */
    for (; j + 24 <= n; j += 24) micro16(24, kc, xp, w + j * ldw, ldw, c + j * ldc, ldc, first);
    if (j < n) micro16(12, kc, xp, w + j * ldw, ldw, c + j * ldc, ldc, first);
}

/* ---- W4A8 (gather_q8.h), group size 128: one 64-byte vector of code bytes per group ----------- */

#define Q8_G 128

static void q8_x_avx512(const float *x, int64_t n, int64_t K, int8_t *xq, float *xs, int32_t *xc) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t r = 0; r < n; r++) q8_quantize_row(x + r * K, K, Q8_G, xq + r * Kp, xs + r * Kp / 8, xc + r * Kp / 8);
}

/* Group g (128 weights = 64 code bytes) of one NVFP4 row: the unsigned weight bytes in the layout of
 * gather_q8.h (*ue even, *uo odd elements) and the 16 lane scales e4m3 / 2 (*wsv); *s16 carries the
 * scales of groups g and g + 1 from the even group to the odd one. Past K: codes 0 (u = 12), scales
 * 0. */
ALWAYS_INLINE void q8_group(const uint8_t *cj, const uint8_t *sj, int64_t K, int64_t g, __m512 *s16, __m512i *ue,
                            __m512i *uo, __m512 *wsv) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    const __m512i dup = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                         _mm512_set1_epi32(g % 2 ? 8 : 0));
    _mm_prefetch((const char *)(cj + 64 * g + QMV_PREFETCH), _MM_HINT_T0); /* rows are contiguous */
    const int64_t left = K / 2 - 64 * g;                                   /* code bytes from here on */
    const __m512i c = left >= 64 ? _mm512_loadu_si512((const void *)(cj + 64 * g))
                                 : _mm512_maskz_loadu_epi8(((__mmask64)1 << left) - 1, cj + 64 * g);
    *ue = _mm512_shuffle_epi8(lut, _mm512_and_si512(c, m4));
    *uo = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(c, 4), m4));
    if (g % 2 == 0) { /* e4m3 / 2 = 128 * (block_scales16's 2^-8 e4m3) */
        const int64_t bl = K / 16 - 8 * g;
        *s16 = _mm512_mul_ps(_mm512_set1_ps(128.0f),
                             block_scales16(sj + 8 * g, bl >= 16 ? 0xFFFF : (__mmask16)((1u << bl) - 1)));
    }
    *wsv = _mm512_permutexvar_ps(dup, *s16);
}

/* acc[r] += the group's 16 lane sums for activation rows r < R: two vpdpbusd (u8 x s8, 4 products
 * per int32 lane, no saturation) onto the lane corrections, one conversion, one FMA with ws * xs. */
ALWAYS_INLINE void q8_group_dot(__m512i ue, __m512i uo, __m512 wsv, const int8_t *xq, const float *xs,
                                const int32_t *xc, int64_t Kp, int64_t g, const int R, __m512 *acc) {
    const int64_t nl = Kp / 8;
    for (int r = 0; r < R; r++) {
        const int8_t *q = xq + r * Kp + Q8_G * g;
        __m512i s = _mm512_loadu_si512((const void *)(xc + r * nl + 16 * g));
        s = _mm512_dpbusd_epi32(s, ue, _mm512_loadu_si512((const void *)q));
        s = _mm512_dpbusd_epi32(s, uo, _mm512_loadu_si512((const void *)(q + 64)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(wsv, _mm512_loadu_ps(xs + r * nl + 16 * g)),
                                 acc[r]);
    }
}

static void q8_decode_avx512(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K,
                             int64_t nn, uint8_t *wq, float *ws) {
    (void)stab;
    const int64_t Kp = q8_padded_k(K, Q8_G), ng = Kp / Q8_G;
    for (int64_t j = 0; j < nn; j++) {
        __m512 s16 = _mm512_setzero_ps(), wsv;
        __m512i ue, uo;
        for (int64_t g = 0; g < ng; g++) {
            q8_group(codes + j * (K / 2), scales + j * (K / 16), K, g, &s16, &ue, &uo, &wsv);
            _mm512_storeu_si512((void *)(wq + j * Kp + Q8_G * g), ue);
            _mm512_storeu_si512((void *)(wq + j * Kp + Q8_G * g + 64), uo);
            _mm512_storeu_ps(ws + j * (Kp / 8) + 16 * g, wsv);
        }
    }
}

/* From a decoded tile (q8_decode): the expert-batched route, every row group over the same tile. */
ALWAYS_INLINE void q8_dot_rows(const uint8_t *wq, const float *ws, int64_t Kp, int64_t nn, const int8_t *xq,
                               const float *xs, const int32_t *xc, const int R, float *y, int64_t ldy) {
    for (int64_t j = 0; j < nn; j++) {
        __m512 acc[8];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < Kp / Q8_G; g++)
            q8_group_dot(_mm512_loadu_si512((const void *)(wq + j * Kp + Q8_G * g)),
                         _mm512_loadu_si512((const void *)(wq + j * Kp + Q8_G * g + 64)),
                         _mm512_loadu_ps(ws + j * (Kp / 8) + 16 * g), xq, xs, xc, Kp, g, R, acc);
        for (int r = 0; r < R; r++) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r]);
    }
}

/* Decode + dot in registers for a few rows (the qmv route: no weight buffer, codes streamed once). */
ALWAYS_INLINE void q8_qmv_rows(const uint8_t *codes, const uint8_t *scales, int64_t K, int64_t nn,
                               const int8_t *xq, const float *xs, const int32_t *xc, const int R, float *y,
                               int64_t ldy) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
    for (int64_t j = 0; j < nn; j++) {
        __m512 acc[8], s16 = _mm512_setzero_ps(), wsv;
        __m512i ue, uo;
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t g = 0; g < Kp / Q8_G; g++) {
            q8_group(codes + j * (K / 2), scales + j * (K / 16), K, g, &s16, &ue, &uo, &wsv);
            q8_group_dot(ue, uo, wsv, xq, xs, xc, Kp, g, R, acc);
        }
        for (int r = 0; r < R; r++) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r]);
    }
}

static void q8_qmv_avx512(const uint8_t *codes, const uint8_t *scales, const float *stab, int64_t K, int64_t nn,
                          const int8_t *xq, const float *xs, const int32_t *xc, int R, float *y, int64_t ldy) {
    (void)stab;
#define Q8_QMV(n) q8_qmv_rows(codes, scales, K, nn, xq, xs, xc, n, y, ldy)
    GATHER_SWITCH_ROWS(R, Q8_QMV);
#undef Q8_QMV
}

static void q8_dot_avx512(const uint8_t *wq, const float *ws, int64_t K, int64_t nn, const int8_t *xq,
                          const float *xs, const int32_t *xc, int R, float *y, int64_t ldy) {
    const int64_t Kp = q8_padded_k(K, Q8_G);
#define Q8_DOT(n) q8_dot_rows(wq, ws, Kp, nn, xq, xs, xc, n, y, ldy)
    GATHER_SWITCH_ROWS(R, Q8_DOT);
#undef Q8_DOT
}

const gather_cpu_kernels gather_cpu_kernels_avx512 = {
    "avx512", gather_avx2_x_to_f32, gather_avx2_y_from_f32, qmv_avx512, decode_avx512, panel_gemm_avx512,
    qmv_ld_avx512, qmv_x_avx512, Q8_G, q8_x_avx512, q8_decode_avx512, q8_dot_avx512, q8_qmv_avx512,
};
#endif
