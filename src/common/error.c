#include "common/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define FP4MOE_ERR_LEN 1024
static _Thread_local char g_err[FP4MOE_ERR_LEN];

int fp4moe_set_error(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return status;
}

int fp4moe_error_context(int status, const char *fmt, ...) {
    char prefix[FP4MOE_ERR_LEN], old[FP4MOE_ERR_LEN];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, g_err, sizeof old);
    size_t n = strlen(prefix);            /* "prefix: old", cut to the buffer */
    if (n > sizeof g_err - 3) n = sizeof g_err - 3;
    memcpy(g_err, prefix, n);
    memcpy(g_err + n, ": ", 2);
    size_t m = strlen(old);
    if (m > sizeof g_err - n - 3) m = sizeof g_err - n - 3;
    memcpy(g_err + n + 2, old, m);
    g_err[n + 2 + m] = '\0';
    return status;
}

void fp4moe_clear_error(void) { g_err[0] = '\0'; }

const char *fp4moe_last_error(void) { return g_err; }

int fp4moe_mul_overflow(int64_t a, int64_t b, int64_t *out) {
    if (a < 0 || b < 0) return 1;
    if (a != 0 && b > INT64_MAX / a) return 1;
    *out = a * b;
    return 0;
}

const char *fp4moe_status_name(int status) {
    switch (status) {
    case FP4MOE_OK: return "ok";
    case FP4MOE_EINVAL: return "invalid argument";
    case FP4MOE_ENOMEM: return "out of memory";
    case FP4MOE_EIO: return "I/O error";
    case FP4MOE_EFORMAT: return "malformed data";
    case FP4MOE_EOVERFLOW: return "size overflow";
    case FP4MOE_EUNSUPPORTED: return "unsupported";
    case FP4MOE_ECUDA: return "CUDA error";
    case FP4MOE_EINTERRUPTED: return "interrupted";
    default: return "unknown error";
    }
}

size_t fp4moe_dtype_size(fp4moe_dtype dtype) {
    switch (dtype) {
    case FP4MOE_F32: return 4;
    case FP4MOE_F16: return 2;
    case FP4MOE_BF16: return 2;
    default: return 0;
    }
}

const char *fp4moe_version(void) { return FP4MOE_VERSION; }

const char *fp4moe_dtype_name(fp4moe_dtype dtype) {
    switch (dtype) {
    case FP4MOE_F32: return "f32";
    case FP4MOE_F16: return "f16";
    case FP4MOE_BF16: return "bf16";
    default: return "?";
    }
}

int fp4moe_dtype_parse(const char *s, fp4moe_dtype *out) {
    if (!s || !out) return fp4moe_set_error(FP4MOE_EINVAL, "dtype: NULL argument");
    if (!strcmp(s, "f32") || !strcmp(s, "float32")) { *out = FP4MOE_F32; return FP4MOE_OK; }
    if (!strcmp(s, "f16") || !strcmp(s, "float16")) { *out = FP4MOE_F16; return FP4MOE_OK; }
    if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16")) { *out = FP4MOE_BF16; return FP4MOE_OK; }
    return fp4moe_set_error(FP4MOE_EINVAL, "unknown dtype '%s' (expected f32, f16 or bf16)", s);
}
