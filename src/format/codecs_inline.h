/* Internal: inline forms of the hot scalar codecs, shared by codecs.c (the public functions) and
 * nvfp4.c (the block quantizer), so that both use one definition and the quantizer's inner loops
 * can be vectorized. Formulas: ../../docs/spec/NVFP4.md section 1. */
#ifndef FP4MOE_FORMAT_CODECS_INLINE_H
#define FP4MOE_FORMAT_CODECS_INLINE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float fp4moe_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t fp4moe_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float fp4moe_bf16_to_f32_inline(uint16_t h) { return fp4moe_bits_f32((uint32_t)h << 16); }

/* E2M1 round-to-nearest-even of |v| as a count of grid thresholds passed; a tie goes to the even
 * code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; beyond 6 saturates; NaN -> 6
 * (code 7). The sign is kept (bit 3), also when the magnitude rounds to 0 (-0 -> 8). */
static inline uint8_t fp4moe_e2m1_encode_inline(float v) {
    const float a = fabsf(v);
    /* NaN fails every comparison (c = 0) and then gets 7; no branch, so loops vectorize */
    const int c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                  (a >= 3.5f) + (a > 5.0f) + 7 * (a != a);
    return (uint8_t)((fp4moe_f32_bits(v) >> 28 & 8) | c);
}

#endif
