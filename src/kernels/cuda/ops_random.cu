/* CUDA kernels that fill synthetic model weights directly in GPU memory (fp4moe bench --synthetic:
 * 17.6 GB for the 30B-A3B shape, never staged on the host). Per-element formulas:
 * src/model/synthetic.h (shared with the CPU generator: the same bits on both devices).
 * Contracts: ops_cuda.h. */
#include "kernels/cuda/ops_cuda.h"
#include "kernels/synthetic.h"
#include "kernels/cuda/cuda_launch.cuh"

static unsigned fill_blocks(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 131072 ? (b > 0 ? b : 1) : 131072);
}

/* One thread per NVFP4 block: 8 code bytes (one 8-byte store) and 1 scale byte. */
__global__ void synth_nvfp4_kernel(uint64_t key, int64_t n_blocks, int64_t blocks_per_row, float sigma,
                                   float enc, uint8_t *codes, uint8_t *scales) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_blocks;
         i += (int64_t)gridDim.x * blockDim.x) {
        uint8_t c[8], s;
        syn_nvfp4_block(key, i, blocks_per_row, sigma, enc, c, &s);
        uint2 v;
        v.x = (uint32_t)c[0] | (uint32_t)c[1] << 8 | (uint32_t)c[2] << 16 | (uint32_t)c[3] << 24;
        v.y = (uint32_t)c[4] | (uint32_t)c[5] << 8 | (uint32_t)c[6] << 16 | (uint32_t)c[7] << 24;
        ((uint2 *)codes)[i] = v;
        scales[i] = s;
    }
}

extern "C" int cuda_synth_nvfp4(void *stream, uint64_t seed, uint64_t tensor_id, int64_t n_blocks,
                                int64_t blocks_per_row, float sigma, float enc, uint8_t *codes,
                                uint8_t *scales) {
    if (n_blocks <= 0) return FP4MOE_OK;
    if (blocks_per_row < 1)
        return fp4moe_set_error(FP4MOE_EINVAL, "cuda op synth nvfp4: %lld blocks per row", (long long)blocks_per_row);
    if ((uintptr_t)codes & 7)
        return fp4moe_set_error(FP4MOE_EINVAL, "cuda op synth nvfp4: codes not 8-byte aligned");
    cu_launch(synth_nvfp4_kernel, fill_blocks(n_blocks), 256, 0, (cudaStream_t)stream, syn_key(seed, tensor_id),
              n_blocks, blocks_per_row, sigma, enc, codes, scales);
    OPS_LAUNCH_CHECK("synthetic nvfp4 weights");
    return FP4MOE_OK;
}

__global__ void synth_bf16_kernel(uint64_t key, int64_t n, float sigma, uint16_t *out) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        out[i] = syn_bf16(key, i, sigma);
}

extern "C" int cuda_synth_bf16(void *stream, uint64_t seed, uint64_t tensor_id, int64_t n, float sigma,
                               uint16_t *out) {
    if (n <= 0) return FP4MOE_OK;
    cu_launch(synth_bf16_kernel, fill_blocks(n), 256, 0, (cudaStream_t)stream, syn_key(seed, tensor_id), n, sigma,
              out);
    OPS_LAUNCH_CHECK("synthetic bf16 weights");
    return FP4MOE_OK;
}
