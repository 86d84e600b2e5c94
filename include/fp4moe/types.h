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

/* The library's version (MAJOR.MINOR.PATCH, CMakeLists.txt's project version): the headers' FP4MOE_VERSION, and
 * fp4moe_version() the one the linked library was built with (equal unless headers and library are mixed up). */
#define FP4MOE_VERSION "0.1.0"
const char *fp4moe_version(void);

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

/* Setting the message (for code built on the library, e.g. the CLI, that reports in the same
 * scheme): formats the message (printf-style) into the thread-local buffer and returns `status`,
 * so that callers can write `return fp4moe_set_error(FP4MOE_EINVAL, "K=%lld ...", K);`. */
int fp4moe_set_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prepends "prefix: " to the current message (context on the way up); returns status. */
int fp4moe_error_context(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Empties this thread's last error message (fp4moe_last_error() then returns ""). */
void fp4moe_clear_error(void);

/* *out = a * b; returns 0 when a, b >= 0 and the product fits in int64, else 1 (no store). */
int fp4moe_mul_overflow(int64_t a, int64_t b, int64_t *out);

/* ---- environment ---------------------------------------------------------------------------- */

/* The FP4MOE_* environment variables the library reads: one table (src/common/env.c), each read
 * once, on first use. A value outside `allowed` is ignored by the library (the default applies)
 * and reported by fp4moe_env_check. */
typedef struct {
    const char *name;           /* "FP4MOE_GATHER_ROUTE" */
    const char *allowed;        /* "auto|qmv|batched|dequant_gemm", or "integer >= 0" */
    const char *def;            /* the value used when unset */
    const char *doc;            /* one line */
} fp4moe_env_var;

/* Number of variables and the i-th (0 <= i < count; NULL outside). */
int fp4moe_env_count(void);
const fp4moe_env_var *fp4moe_env_var_at(int i);

/* FP4MOE_OK when every set variable has an allowed value, else FP4MOE_EINVAL with a message that
 * names the variable, its value and the allowed values. */
int fp4moe_env_check(void);

/* The value in force of variable `name` (its value when allowed, else the default); NULL for a
 * name outside the table. */
const char *fp4moe_env_value(const char *name);

#ifdef __cplusplus
}
#endif
#endif
