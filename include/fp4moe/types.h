/* fp4moe/types.h: element types, status codes and the error-reporting scheme shared by every
 * fp4moe function.
 *
 * Every fallible function returns an int status: FP4MOE_OK (0) on success, a negative
 * fp4moe_status otherwise. On failure a human-readable message naming what is wrong and where
 * (file, tensor, argument, position) is stored in a thread-local buffer that
 * fp4moe_last_error() returns. Nothing below the CLI ever calls exit() or prints. */
#ifndef FP4MOE_TYPES_H
#define FP4MOE_TYPES_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Activation / output element types. Sizes: F32 4 bytes, F16 2 (IEEE binary16), BF16 2. */
typedef enum { FP4MOE_F32 = 0, FP4MOE_F16 = 1, FP4MOE_BF16 = 2 } fp4moe_dtype;

typedef enum {
    FP4MOE_OK = 0,
    FP4MOE_EINVAL = -1,      /* invalid argument (NULL pointer, bad size, K % 16 != 0, ...) */
    FP4MOE_ENOMEM = -2,      /* allocation failed */
    FP4MOE_EIO = -3,         /* file could not be opened, read, mapped or written */
    FP4MOE_EFORMAT = -4,     /* malformed input data (bad header, truncated file, NaN scale) */
    FP4MOE_EOVERFLOW = -5,   /* a size product overflows int64 / size_t */
    FP4MOE_EUNSUPPORTED = -6,/* valid but not supported (unknown dtype, no CUDA in this build) */
    FP4MOE_ECUDA = -7,       /* a CUDA runtime / cuBLAS call or kernel launch failed */
    FP4MOE_EINTERRUPTED = -8 /* stopped by the user (Ctrl-C) */
} fp4moe_status;

/* Size in bytes of one element of dtype; 0 for an unknown value. */
size_t fp4moe_dtype_size(fp4moe_dtype dtype);

/* "f32", "f16", "bf16"; "?" for an unknown value. */
const char *fp4moe_dtype_name(fp4moe_dtype dtype);

/* Parses "f32"/"float32", "f16"/"float16", "bf16"/"bfloat16". Returns FP4MOE_OK or FP4MOE_EINVAL. */
int fp4moe_dtype_parse(const char *s, fp4moe_dtype *out);

/* The message of the last failed call on this thread ("" if none). Valid until the next fp4moe
 * call on this thread. */
const char *fp4moe_last_error(void);

/* Short name of a status code ("ok", "invalid argument", ...). */
const char *fp4moe_status_name(int status);

#ifdef __cplusplus
}
#endif
#endif
