/* Scalar codecs: E2M1 (FP4), E4M3 (FP8), IEEE fp16 and bfloat16 <-> fp32.
 * Formulas: docs/spec/NVFP4.md section 1; OCP Microscaling Formats (MX) v1.0 for E2M1/E4M3;
 * IEEE 754-2008 binary16 for fp16. All rounding is round-to-nearest-even. */
#include "fp4moe/nvfp4.h"
#include "format/codecs_inline.h"

#include <math.h>
#include <string.h>

#define f32_bits fp4moe_f32_bits
#define bits_f32 fp4moe_bits_f32

/* ---- E2M1 ------------------------------------------------------------------------------------ */

static const float k_e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                 -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float fp4moe_e2m1_to_f32(uint8_t code) { return k_e2m1[code & 15]; }

uint8_t fp4moe_f32_to_e2m1(float v) { return fp4moe_e2m1_encode_inline(v); }

/* ---- E4M3 (bias 7, no infinities, 0x7F/0xFF NaN) --------------------------------------------- */

float fp4moe_e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) v = ldexpf((float)m, -9);                 /* m/8 * 2^-6 */
    else v = ldexpf((float)(8 + m), e - 10);              /* (1 + m/8) * 2^(e-7) */
    return (b & 0x80) ? -v : v;
}

uint8_t fp4moe_f32_to_e4m3(float v) {
    const uint8_t sign = signbit(v) ? 0x80 : 0;
    float a = fabsf(v);
    if (isnan(v)) return 0x7E;
    if (a >= FP4MOE_E4M3_MAX) return (uint8_t)(sign | 0x7E);   /* saturate (Inf too) */
    if (a < 0x1p-6f) {                                          /* subnormal grid, step 2^-9 */
        const int m = (int)rintf(a * 512.0f);                   /* 0..8; 8 is 2^-6 = byte 0x08 */
        return (uint8_t)(sign | m);
    }
    int ex;
    frexpf(a, &ex);                                             /* a = f * 2^ex, f in [0.5, 1) */
    int E = ex - 1;                                             /* a in [2^E, 2^(E+1)) */
    int q = (int)rintf(ldexpf(a, 3 - E));                       /* 8..16, exact scaling */
    if (q == 16) { q = 8; E++; }
    int byte = ((E + 7) << 3) | (q - 8);
    if (byte > 0x7E) byte = 0x7E;
    return (uint8_t)(sign | byte);
}

/* ---- fp16 ------------------------------------------------------------------------------------- */

float fp4moe_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t e = (h >> 10) & 31, m = h & 0x3FF;
    if (e == 0) {
        const float v = ldexpf((float)m, -24);
        return (h & 0x8000) ? -v : v;
    }
    if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

uint16_t fp4moe_f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((ax >> 13) & 0x3FF));   /* NaN */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);  /* >= 65520 rounds to Inf */
    if (ax < 0x38800000u)                                      /* < 2^-14: subnormal or zero */
        return (uint16_t)(sign | (uint16_t)rintf(bits_f32(ax) * 16777216.0f));
    ax += 0xC8000FFFu + ((ax >> 13) & 1);                      /* rebias 127->15, round to even */
    return (uint16_t)(sign | (ax >> 13));
}

/* ---- bfloat16 --------------------------------------------------------------------------------- */

float fp4moe_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t fp4moe_f32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

/* ---- arrays ------------------------------------------------------------------------------------ */

void fp4moe_to_f32(const void *src, fp4moe_dtype dtype, int64_t n, float *dst) {
    if (dtype == FP4MOE_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == FP4MOE_F16) {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = fp4moe_f16_to_f32(s[i]);
    } else {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++) dst[i] = fp4moe_bf16_to_f32(s[i]);
    }
}

void fp4moe_from_f32(const float *src, int64_t n, fp4moe_dtype dtype, void *dst) {
    if (dtype == FP4MOE_F32) {
        memmove(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == FP4MOE_F16) {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fp4moe_f32_to_f16(src[i]);
    } else {
        uint16_t *d = dst;
        for (int64_t i = 0; i < n; i++) d[i] = fp4moe_f32_to_bf16(src[i]);
    }
}
