/* fp4moe: NVFP4 Mixture-of-Experts inference. Umbrella header. */
#ifndef FP4MOE_FP4MOE_H
#define FP4MOE_FP4MOE_H
#include "fp4moe/types.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/gather_qmm.h"
#include "fp4moe/safetensors.h"
#include "fp4moe/tokenizer.h"
#define FP4MOE_VERSION "0.1.0"
#endif
