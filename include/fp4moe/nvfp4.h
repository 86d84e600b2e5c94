/* fp4moe/nvfp4.h: scalar codecs (E2M1, E4M3, fp16, bf16) and NVFP4 block quantize/dequantize.
 *
 * Formulas: docs/spec/NVFP4.md (section 1 for the codecs, section 3 for quantize), which
 * follows OCP "Microscaling Formats (MX) v1.0" for E2M1/E4M3 and MLX's nvfp4 GPU quantizer for
 * the block procedure. All functions are pure and thread-safe.
 *
 * NVFP4 layout of one tensor of `rows` x K weights (K % 16 == 0):
 *   codes:  rows * K/2 bytes; byte j of a row holds element 2j in the LOW nibble, 2j+1 in the high.
 *   scales: rows * K/16 E4M3 bytes, one per block of 16 consecutive elements of a row.
 *   global scale gs: an optional fp32 DECODE multiplier: w = e2m1(code) * e4m3(scale) * gs. */
#ifndef FP4MOE_NVFP4_H
#define FP4MOE_NVFP4_H

#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FP4MOE_NVFP4_BLOCK 16      /* elements per block scale */
#define FP4MOE_E4M3_MAX 448.0f     /* largest finite E4M3 (byte 0x7E) */
#define FP4MOE_E2M1_MAX 6.0f
#define FP4MOE_NVFP4_GS_DENOM 2688.0f /* 6 * 448: MLX global_scale (amax) -> decode multiplier */

/* E2M1 code (low 4 bits used) -> value in {0,.5,1,1.5,2,3,4,6} with sign bit 3 (8 -> -0.0). */
float fp4moe_e2m1_to_f32(uint8_t code);

/* Round-to-nearest-even onto the E2M1 grid, saturating at +-6; sign kept (-0.0 -> 8).
 * Ties per spec: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. NaN -> 7 (saturates). */
uint8_t fp4moe_f32_to_e2m1(float v);

/* E4M3 byte -> value (bias 7, subnormals m/8*2^-6, no infinity). 0x7F and 0xFF -> NaN. */
float fp4moe_e4m3_to_f32(uint8_t b);

/* Round-to-nearest-even E4M3 encode, saturating at +-448 (0x7E/0xFE); NaN and +-Inf -> 0x7E
 * (448, sign of Inf kept). Never returns 0x7F or 0xFF. */
uint8_t fp4moe_f32_to_e4m3(float v);

/* IEEE binary16 and bfloat16 <-> fp32. The narrowing conversions round to nearest even, keep NaN
 * a (quiet) NaN and overflow to +-Inf like IEEE. */
float fp4moe_f16_to_f32(uint16_t h);
uint16_t fp4moe_f32_to_f16(float f);
float fp4moe_bf16_to_f32(uint16_t h);
uint16_t fp4moe_f32_to_bf16(float f);

/* Converts n elements of `src` (dtype) to fp32 / from fp32. Never fails for a valid dtype. */
void fp4moe_to_f32(const void *src, fp4moe_dtype dtype, int64_t n, float *dst);
void fp4moe_from_f32(const float *src, int64_t n, fp4moe_dtype dtype, void *dst);

/* max |w| over n elements of w (dtype); NaN elements are ignored. Used for the global amax. */
float fp4moe_amax(const void *w, fp4moe_dtype dtype, int64_t n);

/* The NaN / infinite values among n elements of w (dtype f32, f16 or bf16; an exponent field of all ones):
 * returns their count and sets *first (may be NULL) to the index of the first, -1 if none. NVFP4 has no NaN
 * or infinity (spec section 3 saturates them to finite codes), so callers that quantize real weights check
 * with this first and refuse such a tensor (fp4moe quantize, the loader's quantize-on-load, inspect).
 * Returns 0 for another dtype or n <= 0. w may sit at any byte address (a tensor read in place from a mapped
 * safetensors file need not be aligned to its element size); so may fp4moe_amax's and fp4moe_nvfp4_quantize's. */
int64_t fp4moe_count_nonfinite(const void *w, fp4moe_dtype dtype, int64_t n, int64_t *first);

/* NVFP4-quantizes a (rows x K) row-major tensor w of dtype `dtype` (spec section 3).
 *   global_amax: <= 0 for no global scale (decode multiplier 1); otherwise the tensor amax `a`
 *     (MLX convention): blocks are encoded with enc = 2688 / a and the decode multiplier a / 2688
 *     is stored in *decode_gs.
 *   codes: rows*K/2 bytes out; scales: rows*K/16 bytes out; decode_gs: may be NULL.
 * Errors: FP4MOE_EINVAL (NULL pointers, rows < 0, K <= 0 or K % 16 != 0, unknown dtype, NaN/Inf
 * global_amax), FP4MOE_EOVERFLOW (rows*K overflows). Parallel over rows (OpenMP). */
int fp4moe_nvfp4_quantize(const void *w, fp4moe_dtype dtype, int64_t rows, int64_t K,
                          float global_amax, uint8_t *codes, uint8_t *scales, float *decode_gs);

/* Dequantizes (rows x K) NVFP4 to `out` of dtype out_dtype: out = e2m1 * e4m3 * gs, computed in
 * fp32 and rounded once. gs is the decode multiplier (1.0f for none). A NaN scale byte (0x7F/0xFF)
 * yields NaN outputs: validate checkpoints with fp4moe_nvfp4_find_nan_scale first.
 * Errors: FP4MOE_EINVAL, FP4MOE_EOVERFLOW as for quantize. */
int fp4moe_nvfp4_dequantize(const uint8_t *codes, const uint8_t *scales, int64_t rows, int64_t K,
                            float gs, fp4moe_dtype out_dtype, void *out);

/* Index of the first NaN E4M3 byte (0x7F or 0xFF) among n scale bytes, or -1 if there is none. */
int64_t fp4moe_nvfp4_find_nan_scale(const uint8_t *scales, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
