/* The CUDA runtime's entry points in builds without CUDA (nvcc not found or -DFP4MOE_CUDA=OFF):
 * creating GPU weights or sessions fails with FP4MOE_EUNSUPPORTED and a message; freeing and
 * resetting are no-ops (nothing can exist). See src/model/model_cuda.h. */
#ifndef FP4MOE_HAVE_CUDA

#include "common/error.h"
#include "model/model_cuda.h"
#include "model/model_internal.h"

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

int gpu_session_new(fp4moe_session *s) {
    (void)s;
    return no_cuda();
}

void gpu_session_free(struct gpu_session *g) { (void)g; }

void gpu_session_reset(fp4moe_session *s) { (void)s; }

int gpu_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                        int all_logits, int32_t *next) {
    (void)s; (void)tokens; (void)T; (void)logits; (void)all_logits; (void)next;
    return no_cuda();
}

int gpu_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset) {
    (void)s; (void)ms; (void)reset;
    return no_cuda();
}

#endif /* !FP4MOE_HAVE_CUDA */
