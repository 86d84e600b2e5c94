/* gather_qmm CUDA entry points for builds without CUDA (nvcc not found or -DFP4MOE_CUDA=OFF):
 * they validate nothing and report FP4MOE_EUNSUPPORTED. See include/fp4moe/gather_qmm.h. */
#include "common/error.h"
#include "fp4moe/gather_qmm.h"

int fp4moe_gather_qmm_cuda_route(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                 const uint32_t *idx, int64_t B, int sorted, fp4moe_route route,
                                 void *y, void *stream) {
    (void)w; (void)x; (void)dtype; (void)idx; (void)B; (void)sorted; (void)route; (void)y; (void)stream;
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                            "gather_qmm_cuda: this build of fp4moe has no CUDA backend "
                            "(configure with nvcc on the PATH and -DFP4MOE_CUDA=ON)");
}

int fp4moe_gather_qmm_cuda(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                           const uint32_t *idx, int64_t B, int sorted, void *y, void *stream) {
    return fp4moe_gather_qmm_cuda_route(w, x, dtype, idx, B, sorted, FP4MOE_ROUTE_AUTO, y, stream);
}

int fp4moe_cuda_available(void) { return 0; }
int fp4moe_cuda_check(void) {
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda: this build of fp4moe has no CUDA backend (configure with nvcc "
                            "on the PATH and -DFP4MOE_CUDA=ON); the cpu device runs without it");
}
int fp4moe_cuda_device_count(void) { return 0; }
int fp4moe_cuda_set_device(int device) {
    (void)device;
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda_set_device: this build has no CUDA support");
}
