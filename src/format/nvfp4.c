/* NVFP4 block quantize / dequantize (docs/spec/NVFP4.md sections 1 and 3; the block procedure
 * matches MLX's nvfp4 GPU quantizer, which real checkpoints come from). */
#include "fp4moe/nvfp4.h"

#include <math.h>
#include <string.h>

#include "common/error.h"
#include "format/codecs_inline.h"

static int check_tensor_args(const char *fn, const void *a, const void *b, const void *c,
                             int64_t rows, int64_t K) {
    int64_t n;
    if (!a || !b || !c) return fp4moe_set_error(FP4MOE_EINVAL, "%s: NULL buffer", fn);
    if (rows < 0) return fp4moe_set_error(FP4MOE_EINVAL, "%s: rows=%lld < 0", fn, (long long)rows);
    if (K <= 0 || K % FP4MOE_NVFP4_BLOCK != 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "%s: K=%lld is not a positive multiple of 16", fn,
                                (long long)K);
    if (fp4moe_mul_overflow(rows, K, &n) || (uint64_t)n > SIZE_MAX / 4)
        return fp4moe_set_error(FP4MOE_EOVERFLOW, "%s: rows*K = %lld*%lld overflows", fn,
                                (long long)rows, (long long)K);
    return FP4MOE_OK;
}

/* Element i of a 16- / 32-bit array that may sit at any byte address: a safetensors data area starts right after
 * its header, whose length the file chooses (a header padded to a length that is not a multiple of 4 is valid), so
 * tensors read in place from a mapping need not be aligned to their element size. */
static inline uint16_t ld_u16(const void *w, int64_t i) {
    uint16_t v;
    memcpy(&v, (const uint8_t *)w + (size_t)i * 2, 2);
    return v;
}
static inline uint32_t ld_u32(const void *w, int64_t i) {
    uint32_t v;
    memcpy(&v, (const uint8_t *)w + (size_t)i * 4, 4);
    return v;
}

/* n elements of w (dtype) starting at element i0 -> fp32 */
static void load_block_f32(const void *w, fp4moe_dtype dtype, int64_t i0, int n, float *v) {
    if (dtype == FP4MOE_F32) {
        memcpy(v, (const uint8_t *)w + (size_t)i0 * 4, (size_t)n * sizeof(float));
    } else if (dtype == FP4MOE_BF16) {
        for (int i = 0; i < n; i++) v[i] = fp4moe_bf16_to_f32_inline(ld_u16(w, i0 + i));
    } else {
        for (int i = 0; i < n; i++) v[i] = fp4moe_f16_to_f32(ld_u16(w, i0 + i));
    }
}

static float load_f32(const void *w, fp4moe_dtype dtype, int64_t i) {
    switch (dtype) {
    case FP4MOE_F32: {
        const uint32_t u = ld_u32(w, i);
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case FP4MOE_F16: return fp4moe_f16_to_f32(ld_u16(w, i));
    default: return fp4moe_bf16_to_f32(ld_u16(w, i));
    }
}

float fp4moe_amax(const void *w, fp4moe_dtype dtype, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) m = fmaxf(m, fabsf(load_f32(w, dtype, i))); /* fmaxf skips NaN */
    return m;
}

int64_t fp4moe_count_nonfinite(const void *w, fp4moe_dtype dtype, int64_t n, int64_t *first) {
    int64_t count = 0, at = -1;
    if (w && dtype == FP4MOE_F32) {
        for (int64_t i = 0; i < n; i++)
            if ((ld_u32(w, i) & 0x7F800000u) == 0x7F800000u && count++ == 0) at = i;
    } else if (w && (dtype == FP4MOE_BF16 || dtype == FP4MOE_F16)) {
        const uint16_t mask = dtype == FP4MOE_BF16 ? 0x7F80u : 0x7C00u;
        for (int64_t i = 0; i < n; i++)
            if ((ld_u16(w, i) & mask) == mask && count++ == 0) at = i;
    }
    if (first) *first = at;
    return count;
}

/* One block of 16 weights (spec section 3, steps 1-4; `enc` from step 1). Writes 8 code bytes
 * and returns the E4M3 scale byte. */
static uint8_t quantize_block(const float v[16], float enc, uint8_t codes[8]) {
    float amax = 0.0f;
    for (int i = 0; i < 16; i++) {                                        /* NaN skipped */
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
    const uint8_t s = fp4moe_f32_to_e4m3(amax / 6.0f * enc);              /* step 2 */
    const float ds = fp4moe_e4m3_to_f32(s);
    const float r = ds == 0.0f ? 0.0f : enc / ds;                         /* step 3 */
    uint8_t q[16];
    for (int i = 0; i < 16; i++) q[i] = fp4moe_e2m1_encode_inline(v[i] * r); /* step 4 */
    for (int j = 0; j < 8; j++) codes[j] = (uint8_t)(q[2 * j] | (q[2 * j + 1] << 4));
    return s;
}

int fp4moe_nvfp4_quantize(const void *w, fp4moe_dtype dtype, int64_t rows, int64_t K,
                          float global_amax, uint8_t *codes, uint8_t *scales, float *decode_gs) {
    int st = check_tensor_args("nvfp4_quantize", w, codes, scales, rows, K);
    if (st) return st;
    if (fp4moe_dtype_size(dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "nvfp4_quantize: unknown dtype %d", (int)dtype);
    if (!isfinite(global_amax))
        return fp4moe_set_error(FP4MOE_EINVAL, "nvfp4_quantize: global amax is %g", global_amax);
    const int use_gs = global_amax > 0.0f;
    const float enc = use_gs ? FP4MOE_NVFP4_GS_DENOM / global_amax : 1.0f;  /* step 1 */
    if (decode_gs) *decode_gs = use_gs ? global_amax / FP4MOE_NVFP4_GS_DENOM : 1.0f;
    const int64_t nb = K / FP4MOE_NVFP4_BLOCK;
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        float v[16];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i0 = r * K + b * 16;
            load_block_f32(w, dtype, i0, 16, v);
            scales[r * nb + b] = quantize_block(v, enc, codes + i0 / 2);
        }
    }
    return FP4MOE_OK;
}

int fp4moe_nvfp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                            float gs, fp4moe_dtype out_dtype, void *out) {
    int st = check_tensor_args("nvfp4_dequantize", codes, scales, out, rows, K);
    if (st) return st;
    if (fp4moe_dtype_size(out_dtype) == 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "nvfp4_dequantize: unknown dtype %d", (int)out_dtype);
    const int64_t nb = K / FP4MOE_NVFP4_BLOCK;
#pragma omp parallel for schedule(static) if (rows * K >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        float v[16];
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i0 = r * K + b * 16;
            /* code * scale is exact in fp32; the one rounding is the multiply by gs */
            const float s = fp4moe_e4m3_to_f32(scales[r * nb + b]);
            for (int j = 0; j < 8; j++) {
                const uint8_t c = codes[i0 / 2 + j];
                v[2 * j] = fp4moe_e2m1_to_f32(c & 15) * s * gs;
                v[2 * j + 1] = fp4moe_e2m1_to_f32(c >> 4) * s * gs;
            }
            if (out_dtype == FP4MOE_F32) memcpy((float *)out + i0, v, sizeof v);
            else fp4moe_from_f32(v, 16, out_dtype, (uint16_t *)out + i0);
        }
    }
    return FP4MOE_OK;
}

int64_t fp4moe_nvfp4_find_nan_scale(const uint8_t *scales, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if ((scales[i] & 0x7F) == 0x7F) return i;
    return -1;
}
