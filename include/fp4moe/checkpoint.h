/* fp4moe/checkpoint.h: NVFP4-quantized modules as stored in safetensors checkpoints (spec NVFP4.md
 * section 2).
 * Used by the quantize / dequantize / inspect commands and by the model loader.
 *
 *   MLX nvfp4:      <m>.weight U32 (..., N, K/8)   <m>.scales U8 (..., N, K/16)
 *                   optional <m>.global_scale F32 (1 or one per leading index): MLX convention, the
 *                   tensor amax a; decode multiplier a / 2688 (written by `fp4moe quantize
 *                   --global-scale`; mlx-lm checkpoints have none).
 *   ModelOpt NVFP4: <m>.weight U8 (..., N, K/2)    <m>.weight_scale F8_E4M3 (or U8) (..., N, K/16)
 *                   <m>.weight_scale_2 F32 (1 or one per leading index): the decode multiplier;
 *                   <m>.input_scale F32: activation scale, unused by weight-only inference.
 * Codes: byte b of a row holds element 2b in the low nibble, 2b+1 in the high one (both formats). */
#ifndef FP4MOE_CHECKPOINT_H
#define FP4MOE_CHECKPOINT_H

#include <stdint.h>
#include "fp4moe/safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    FP4MOE_QFMT_PLAIN = 0,     /* no quantized module */
    FP4MOE_QFMT_MLX_NVFP4 = 1,
    FP4MOE_QFMT_MODELOPT_NVFP4 = 2,
    FP4MOE_QFMT_MIXED = 3      /* modules of both kinds: not a checkpoint any tool writes */
} fp4moe_qformat;

/* "plain", "MLX nvfp4", "ModelOpt NVFP4", "mixed". */
const char *fp4moe_qformat_name(fp4moe_qformat f);

/* One quantized module: views of its tensors and its logical shape. */
typedef struct {
    fp4moe_qformat format;
    const fp4moe_st_tensor *weight;  /* codes */
    const fp4moe_st_tensor *scales;  /* block scales, E4M3 bytes */
    const fp4moe_st_tensor *gs;      /* global scale tensor or NULL (see the conventions above) */
    const fp4moe_st_tensor *input_scale; /* ModelOpt only, or NULL */
    int ndim;                        /* logical rank, >= 2 */
    int64_t shape[FP4MOE_ST_MAX_DIMS]; /* logical (..., N, K) */
    int64_t E, N, K;                 /* E = product of the leading dims (1 for a matrix) */
} fp4moe_qtensor;

/* Format of a model from its tensor names: MLX when some "<m>.scales" exists, ModelOpt when some
 * "<m>.weight_scale" exists, MIXED when both, else PLAIN. */
fp4moe_qformat fp4moe_qformat_detect(const fp4moe_st_model *m);

/* Whether the tensor `weight` (named "<m>.weight") is the codes of an NVFP4 module of m.
 * Returns 1 and fills *q when it is, 0 when it is a plain tensor (or not named *.weight), or a
 * negative status when the module is inconsistent: wrong dtypes, scales shape not (..., N, K/16),
 * a global scale that is not F32 with 1 or E elements, a ModelOpt module without its
 * weight_scale_2, MLX ".biases" (affine, not nvfp4: FP4MOE_EUNSUPPORTED). Messages name the tensors. */
int fp4moe_qtensor_of(const fp4moe_st_model *m, const fp4moe_st_tensor *weight, fp4moe_qtensor *q);

/* Decode multiplier of leading index e (0 <= e < E): 1 without a global scale, a/2688 for MLX,
 * weight_scale_2 for ModelOpt. Errors: FP4MOE_EFORMAT when the stored value is negative, NaN or
 * infinite (names the tensor), FP4MOE_EINVAL for e out of range. */
int fp4moe_qtensor_gs(const fp4moe_qtensor *q, int64_t e, float *gs);

/* Whether the tensor named `name` is an auxiliary tensor of a quantized module of m (its scales,
 * global scale or input scale), i.e. no tensor of its own. */
int fp4moe_qtensor_is_aux(const fp4moe_st_model *m, const char *name);

#ifdef __cplusplus
}
#endif

#endif
