/* Internal: THE way fp4moe checks a CUDA runtime status (kernels, backends, tests of them): a
 * failure becomes FP4MOE_ECUDA with the message "<module>: <what>: <CUDA's error string>".
 *   FP4MOE_CUDA_TRY(module, call, what)    returns the status from the calling function;
 *   FP4MOE_CUDA_LAUNCH(module, what)       the same for the last kernel launch (cudaGetLastError);
 *   FP4MOE_CUDA_TRY_GOTO(module, call, what, rc, label)  sets rc and jumps to label (cleanup). */
#ifndef FP4MOE_KERNELS_CUDA_CHECK_H
#define FP4MOE_KERNELS_CUDA_CHECK_H

#include <cuda_runtime_api.h>

#include "common/error.h"

#define FP4MOE_CUDA_STATUS(err, module, what)                                                      \
    fp4moe_set_error(FP4MOE_ECUDA, "%s: %s: %s", (module), (what), cudaGetErrorString(err))

#define FP4MOE_CUDA_TRY(module, call, what)                                                        \
    do {                                                                                           \
        const cudaError_t fp4moe_ce_ = (call);                                                     \
        if (fp4moe_ce_ != cudaSuccess) return FP4MOE_CUDA_STATUS(fp4moe_ce_, module, what);        \
    } while (0)

#define FP4MOE_CUDA_LAUNCH(module, what) FP4MOE_CUDA_TRY(module, cudaGetLastError(), what)

#define FP4MOE_CUDA_TRY_GOTO(module, call, what, rc, label)                                        \
    do {                                                                                           \
        const cudaError_t fp4moe_ce_ = (call);                                                     \
        if (fp4moe_ce_ != cudaSuccess) {                                                           \
            (rc) = FP4MOE_CUDA_STATUS(fp4moe_ce_, module, what);                                   \
            goto label;                                                                            \
        }                                                                                          \
    } while (0)

#endif
