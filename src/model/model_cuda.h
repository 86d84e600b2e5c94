/* Internal: the nemotron_h runtime on CUDA (src/model/model_cuda.c; src/model/model_cuda_stub.c in
 * builds without CUDA, where every entry point fails with FP4MOE_EUNSUPPORTED and the free/reset
 * functions are no-ops). The public face is include/fp4moe/model.h (device fields of the load and
 * session options, fp4moe_model_synthetic); src/model/session_device.c holds the device-agnostic
 * glue. This header needs no CUDA headers. */
#ifndef FP4MOE_MODEL_CUDA_H
#define FP4MOE_MODEL_CUDA_H

#include <stdint.h>

#include "fp4moe/model.h"

struct gpu_model;
struct gpu_session;

/* Copies every weight of the loaded model m to the current GPU once (one device allocation),
 * reporting (done, total) uploaded bytes through progress (may be NULL); sets m->gpu.
 * Dense f16/f32 linears become f32 on the device, bf16 stays bf16, NVFP4 stays NVFP4.
 * Errors: FP4MOE_EUNSUPPORTED (no GPU, no CUDA build), FP4MOE_ENOMEM (device memory), FP4MOE_ECUDA. */
int gpu_model_upload(fp4moe_model *m, fp4moe_progress_fn progress, void *ctx);

/* Fills m->gpu with synthetic weights generated on the device for the shapes of m's host
 * metadata (src/model/synthetic.c built it): NVFP4 codes/scales by cuda_synth_nvfp4 with tensor
 * ids SYN_LAYER_ID(l, module), the bf16 embedding by cuda_synth_bf16; the small fp32 vectors and
 * global scales are copied from the host. */
int gpu_model_synthetic(fp4moe_model *m, uint64_t seed, fp4moe_progress_fn progress, void *ctx);

void gpu_model_free(struct gpu_model *g);

/* Chooses the session's device from s->opt.device and the model (session_device.c) and, for CUDA,
 * creates the GPU session (gpu_session_new). Errors: FP4MOE_EINVAL (CUDA asked for a model that
 * is not on the GPU, CPU asked for a model without host weights), those of gpu_session_new. */
int session_device_init(fp4moe_session *s);

/* The GPU part of session s (s->gpu): stream, cuBLAS handle, activation buffers for max_chunk
 * tokens, caches. Errors: FP4MOE_EINVAL (act_dtype not bf16), FP4MOE_ENOMEM, FP4MOE_ECUDA. */
int gpu_session_new(fp4moe_session *s);
void gpu_session_free(struct gpu_session *g);
/* Position 0: zeroes the conv and SSM states on the device (the KV rows beyond 0 are dead). */
void gpu_session_reset(fp4moe_session *s);

/* fp4moe_session_forward on the GPU (arguments already checked by session_check_input): chunks of
 * max_chunk tokens, one host synchronisation at the end of each chunk; decode (T = 1) replays the
 * captured graph. logits (optional) as fp32 on the host; next (optional): the greedy next token
 * computed on the device. */
int gpu_session_forward(fp4moe_session *s, const int32_t *tokens, int64_t T, float *logits,
                        int all_logits, int32_t *next);

/* fp4moe_session_profile for a CUDA session. */
int gpu_session_profile(fp4moe_session *s, double ms[FP4MOE_PROF_KINDS], int reset);

#endif
