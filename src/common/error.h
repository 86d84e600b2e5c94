/* Internal: setting the thread-local error message, and checked size arithmetic. */
#ifndef FP4MOE_COMMON_ERROR_H
#define FP4MOE_COMMON_ERROR_H

#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Formats the message (printf-style) into the thread-local buffer and returns `status`, so that
 * callers can write `return fp4moe_set_error(FP4MOE_EINVAL, "K=%lld is not a multiple of 16", K);` */
int fp4moe_set_error(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prepends "prefix: " to the current message (for adding context on the way up); returns status. */
int fp4moe_error_context(int status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

void fp4moe_clear_error(void);

/* *out = a * b; returns 0 when a, b >= 0 and the product fits in int64, else 1 (no store). */
int fp4moe_mul_overflow(int64_t a, int64_t b, int64_t *out);

#ifdef __cplusplus
}
#endif
#endif
