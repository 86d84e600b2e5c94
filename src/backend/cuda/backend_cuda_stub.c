/* The CUDA backend's entry points in builds without CUDA (nvcc not found or -DFP4MOE_CUDA=OFF):
 * creating GPU weights or a CUDA backend fails with FP4MOE_EUNSUPPORTED and a message; freeing is a
 * no-op (nothing can exist). See src/backend/backend.h and src/backend/cuda/placement.h. */
#ifndef FP4MOE_HAVE_CUDA

#include "backend/backend.h"
#include "backend/cuda/placement.h"
#include "common/error.h"

static int no_cuda(void) {
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "device cuda: this build of fp4moe has no CUDA backend "
                            "(configure with nvcc on the PATH and -DFP4MOE_CUDA=ON)");
}

int gpu_model_upload(fp4moe_model *m, fp4moe_progress_fn progress, void *ctx) {
    (void)m; (void)progress; (void)ctx;
    return no_cuda();
}

int gpu_model_synthetic(fp4moe_model *m, uint64_t seed, fp4moe_progress_fn progress, void *ctx) {
    (void)m; (void)seed; (void)progress; (void)ctx;
    return no_cuda();
}

void gpu_model_free(struct gpu_model *g) { (void)g; }

int be_cuda_new(const fp4moe_model *m, fp4moe_route route, int64_t max_rows, int64_t max_decode_rows,
                int profile, const be_ops **ops, void **bc) {
    (void)m; (void)route; (void)max_rows; (void)max_decode_rows; (void)profile; (void)ops; (void)bc;
    return no_cuda();
}

void be_cuda_free(void *bc) { (void)bc; }

const fw_weights *be_cuda_weights(const fp4moe_model *m) { (void)m; return NULL; }
int be_cuda_weights_experts(const fp4moe_model *m, int64_t lo, int64_t hi, fw_weights *out, fw_layer *layers,
                            void *views) {
    (void)m; (void)lo; (void)hi; (void)out; (void)layers; (void)views;
    return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "this build has no CUDA support");
}
size_t be_cuda_linear_size(void) { return 1; }
void be_cuda_graphs_off(void *bc) { (void)bc; }

int be_cuda_profile(void *bc, double ms[FP4MOE_PROF_KINDS], int reset) {
    (void)bc; (void)ms; (void)reset;
    return no_cuda();
}

#endif /* !FP4MOE_HAVE_CUDA */
