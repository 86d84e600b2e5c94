/* Internal: the model's weights on the GPU (src/backend/cuda/backend_cuda.c; backend_cuda_stub.c in
 * builds without CUDA, where every entry point fails with FP4MOE_EUNSUPPORTED and the free functions
 * are no-ops). The public face is include/fp4moe/model.h (device fields of the load and batch
 * options, fp4moe_model_synthetic). This header needs no CUDA headers. */
#ifndef FP4MOE_BACKEND_CUDA_PLACEMENT_H
#define FP4MOE_BACKEND_CUDA_PLACEMENT_H

#include <stdint.h>

#include "fp4moe/model.h"

struct gpu_model;

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

#endif
