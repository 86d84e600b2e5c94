/* Internal: the error scheme of fp4moe/types.h, for the library's own files. */
#ifndef FP4MOE_COMMON_ERROR_H
#define FP4MOE_COMMON_ERROR_H

#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* fp4moe_set_error, fp4moe_error_context, fp4moe_clear_error, fp4moe_mul_overflow: declared in
 * fp4moe/types.h (public: the CLI and applications report in the same scheme). */

#ifdef __cplusplus
}
#endif
#endif
