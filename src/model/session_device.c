/* The device-agnostic glue of the CPU and CUDA runtimes (include/fp4moe/model.h "devices"): device
 * names, which device a session runs on, the greedy forward that keeps logits on the device, and
 * the profile accessor. The CUDA side lives in model_cuda.c (model_cuda_stub.c without CUDA). */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "model/model_cuda.h"
#include "model/model_internal.h"

const char *fp4moe_device_name(fp4moe_device d) {
    switch (d) {
    case FP4MOE_DEVICE_DEFAULT: return "default";
    case FP4MOE_DEVICE_CPU: return "cpu";
    case FP4MOE_DEVICE_CUDA: return "cuda";
    }
    return "?";
}

int fp4moe_device_parse(const char *s, fp4moe_device *out) {
    if (!s || !out) return fp4moe_set_error(FP4MOE_EINVAL, "device: NULL argument");
    if (!strcmp(s, "cpu")) *out = FP4MOE_DEVICE_CPU;
    else if (!strcmp(s, "cuda")) *out = FP4MOE_DEVICE_CUDA;
    else if (!strcmp(s, "auto")) *out = fp4moe_cuda_available() ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
    else return fp4moe_set_error(FP4MOE_EINVAL, "device '%s' (expected cpu, cuda or auto)", s);
    return FP4MOE_OK;
}

int fp4moe_model_on_gpu(const fp4moe_model *m) { return m && m->gpu != NULL; }

int session_device_init(fp4moe_session *s) {
    const fp4moe_model *m = s->m;
    fp4moe_device d = s->opt.device;
    if (d == FP4MOE_DEVICE_DEFAULT) d = m->gpu ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
    if (d == FP4MOE_DEVICE_CUDA) {
        if (!m->gpu)
            return fp4moe_set_error(FP4MOE_EINVAL, "session_new: device cuda needs a model whose "
                                    "weights are on the GPU (load it with device cuda)");
        return gpu_session_new(s);
    }
    if (d != FP4MOE_DEVICE_CPU)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: unknown device %d", (int)d);
    if (m->no_host_weights)
        return fp4moe_set_error(FP4MOE_EINVAL, "session_new: this synthetic model was generated on the "
                                "GPU and has no host weights: use device cuda");
    return FP4MOE_OK;
}

fp4moe_device fp4moe_session_device(const fp4moe_session *s) {
    return s && s->gpu ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
}

int fp4moe_session_forward_argmax(fp4moe_session *s, const int32_t *tokens, int64_t T,
                                  int32_t *next) {
    if (!next) return fp4moe_set_error(FP4MOE_EINVAL, "forward_argmax: NULL argument");
    int st = session_check_input(s, tokens, T);
    if (st) return st;
    if (s->gpu) return gpu_session_forward(s, tokens, T, NULL, 0, next);
    const int64_t V = s->m->cfg.vocab;
    float *lg = malloc((size_t)V * sizeof *lg);
    if (!lg) return fp4moe_set_error(FP4MOE_ENOMEM, "forward_argmax: out of memory");
    st = fp4moe_session_forward(s, tokens, T, lg, 0);
    if (!st) *next = fp4moe_argmax(lg, V);
    free(lg);
    return st;
}

const char *fp4moe_prof_kind_name(fp4moe_prof_kind k) {
    static const char *names[FP4MOE_PROF_KINDS] = {"mamba", "attention", "moe routed", "moe shared",
                                                   "lm_head", "other"};
    return (int)k >= 0 && k < FP4MOE_PROF_KINDS ? names[k] : "?";
}

int fp4moe_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset) {
    if (!s || !ms) return fp4moe_set_error(FP4MOE_EINVAL, "session profile: NULL argument");
    if (!s->gpu)
        return fp4moe_set_error(FP4MOE_EINVAL, "session profile: only CUDA sessions keep device timers");
    return gpu_session_profile(s, ms, reset);
}
