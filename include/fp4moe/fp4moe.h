/* fp4moe: NVFP4 Mixture-of-Experts inference. Umbrella header: the whole public API (template.h and grammar.h
 * take cJSON values: cJSON's headers, <cjson/cJSON.h>, are needed with it). */
#ifndef FP4MOE_FP4MOE_H
#define FP4MOE_FP4MOE_H
#include "fp4moe/types.h"
#include "fp4moe/nvfp4.h"
#include "fp4moe/gather_qmm.h"
#include "fp4moe/safetensors.h"
#include "fp4moe/checkpoint.h"
#include "fp4moe/tokenizer.h"
#include "fp4moe/template.h"
#include "fp4moe/grammar.h"
#include "fp4moe/model.h"
#endif
