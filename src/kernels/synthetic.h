/* Internal: the per-element formulas of synthetic (random) model weights, shared by the CPU
 * generator (src/model/synthetic.c) and the CUDA kernels (src/kernels/cuda/ops_random.cu), so that
 * a synthetic model has the same weights, bit for bit, on both devices.
 *
 * Counter-based: element i of tensor `tensor` depends only on (seed, tensor, i), never on the order
 * of generation. Only integer arithmetic and single IEEE-rounded fp32 operations (no libm), so the
 * host and the device give identical results.
 *   normal-like value:  the sum of four 16-bit uniforms (Irwin-Hall), centred, scaled to unit
 *                       variance (range +-3.46; light tails, like a clipped Gaussian).
 *   NVFP4 block:        16 weights sigma_row * n_i, where each output row has its own std
 *                       sigma_row = sigma * (0.5 + j/128), j uniform in 0..255 (rows of trained
 *                       layers differ in scale), quantized as spec NVFP4.md section 3 with the
 *                       encode factor enc (1 without a global scale; 2688 / amax_tensor with one):
 *                       s = e4m3_rne(amax / 6 * enc), codes = e2m1_rne(w * enc / e4m3(s)).
 * So the block scales have the distribution a real quantizer produces from such weights. */
#ifndef FP4MOE_MODEL_SYNTHETIC_H
#define FP4MOE_MODEL_SYNTHETIC_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define SYN_HD static __host__ __device__ __forceinline__
#else
#define SYN_HD static inline
#endif

/* Tensor ids: 1 embedding, 2 lm_head, (layer + 1) * 64 + SYN_* for the modules of a layer. */
enum {
    SYN_IN_PROJ = 0, SYN_OUT_PROJ, SYN_Q, SYN_K, SYN_V, SYN_O, SYN_EXPERTS_UP, SYN_EXPERTS_DOWN,
    SYN_SHARED_UP, SYN_SHARED_DOWN, SYN_LATENT_IN, SYN_LATENT_OUT, SYN_UP, SYN_DOWN,
    SYN_NORM = 20, SYN_CONV_W, SYN_CONV_B, SYN_A_LOG, SYN_D, SYN_DT_BIAS, SYN_GNORM, SYN_ROUTER,
    SYN_ROUTER_BIAS
};
#define SYN_EMBED 1
#define SYN_LM_HEAD 2
#define SYN_NORM_F 3
#define SYN_LAYER_ID(l, what) ((uint64_t)((l) + 1) * 64 + (uint64_t)(what))

/* Weights of every synthetic linear layer and of the embedding: std SYN_SIGMA (trained-model
 * scale) times a per-row factor in [0.5, 2.5). With a global scale (ModelOpt-style) the tensor
 * amax is the largest value the generator can give, 2.5 * 3.47 standard deviations: decode
 * gs = amax / 2688, encode factor 2688 / amax (spec NVFP4.md sections 1 and 3). */
#define SYN_SIGMA 0.02f
#define SYN_AMAX_SIGMAS 8.7f

SYN_HD uint64_t syn_mix(uint64_t z) { /* splitmix64's finalizer */
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* The key of one tensor; element i then draws syn_mix(key ^ i * odd constant). */
SYN_HD uint64_t syn_key(uint64_t seed, uint64_t tensor) { return syn_mix(seed ^ syn_mix(tensor)); }

SYN_HD uint64_t syn_u64(uint64_t key, uint64_t i) { return syn_mix(key ^ (i * 0xD1B54A32D192ED03ull)); }

SYN_HD float syn_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

SYN_HD uint32_t syn_f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* Unit-variance, zero-mean value from 64 random bits (exact integer sum, one rounding). */
SYN_HD float syn_normal(uint64_t h) {
    const int32_t s = (int32_t)(h & 0xFFFF) + (int32_t)((h >> 16) & 0xFFFF) +
                      (int32_t)((h >> 32) & 0xFFFF) + (int32_t)(h >> 48);
    return (float)(s - 131070) * 2.64290e-5f; /* 1 / (65536 * sqrt(4/12)) */
}

/* E4M3 byte (0..126) -> value; exact (spec NVFP4.md section 1). */
SYN_HD float syn_e4m3_value(uint32_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7;
    return e == 0 ? (float)m * 0.001953125f : syn_bits_f32(((e + 120) << 23) | (m << 20));
}

/* v >= 0 -> E4M3 byte, round to nearest even, saturating at 448 (0x7E); never the NaN byte. */
SYN_HD uint8_t syn_e4m3_rne(float v) {
    if (!(v < 448.0f)) return 0x7E;
    uint32_t lo = 0, hi = 126; /* value(lo) <= v < value(hi) */
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (syn_e4m3_value(mid) <= v) lo = mid;
        else hi = mid;
    }
    const float half = (syn_e4m3_value(lo) + syn_e4m3_value(hi)) * 0.5f; /* exact */
    if (v > half) return (uint8_t)hi;
    if (v < half) return (uint8_t)lo;
    return (uint8_t)((lo & 1) ? hi : lo);
}

/* x -> E2M1 code, round to nearest even, saturating at 6; the sign is kept (-0 -> 8). Ties as spec
 * NVFP4.md section 3: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4. */
SYN_HD uint8_t syn_e2m1_rne(float x) {
    const uint32_t sign = syn_f32_bits(x) >> 31;
    const float a = syn_bits_f32(syn_f32_bits(x) & 0x7FFFFFFFu);
    uint8_t c;
    if (a <= 0.25f) c = 0;
    else if (a < 0.75f) c = 1;
    else if (a <= 1.25f) c = 2;
    else if (a < 1.75f) c = 3;
    else if (a <= 2.5f) c = 4;
    else if (a < 3.5f) c = 5;
    else if (a <= 5.0f) c = 6;
    else c = 7;
    return (uint8_t)(c | (sign << 3));
}

/* The std of row `row` of a tensor: sigma * (0.5 + j/128), j in 0..255 (exact). */
SYN_HD float syn_row_sigma(uint64_t key, int64_t row, float sigma) {
    const uint32_t j = (uint32_t)(syn_mix(key + 0x632BE59BD9B4E019ull * (uint64_t)(row + 1)) >> 56);
    return sigma * (0.5f + (float)j * 0.0078125f);
}

/* Weight i of block `blk` (block_per_row blocks of 16 per row). */
SYN_HD float syn_weight(uint64_t key, int64_t blk, int64_t blocks_per_row, int i, float sigma) {
    return syn_row_sigma(key, blk / blocks_per_row, sigma) *
           syn_normal(syn_u64(key, (uint64_t)blk * 16 + (uint64_t)i));
}

/* Block `blk` (weights 16*blk .. 16*blk+15 of the flattened tensor, rows of blocks_per_row
 * blocks) as codes[8] + *scale. */
SYN_HD void syn_nvfp4_block(uint64_t key, int64_t blk, int64_t blocks_per_row, float sigma, float enc,
                            uint8_t codes[8], uint8_t *scale) {
    float w[16], amax = 0.0f;
    const float rs = syn_row_sigma(key, blk / blocks_per_row, sigma);
    for (int i = 0; i < 16; i++) {
        w[i] = rs * syn_normal(syn_u64(key, (uint64_t)blk * 16 + (uint64_t)i));
        const float a = w[i] < 0.0f ? -w[i] : w[i];
        amax = a > amax ? a : amax;
    }
    const uint8_t s = syn_e4m3_rne(amax / 6.0f * enc);
    const float ds = syn_e4m3_value(s), r = ds == 0.0f ? 0.0f : enc / ds;
    for (int j = 0; j < 8; j++)
        codes[j] = (uint8_t)(syn_e2m1_rne(w[2 * j] * r) | (syn_e2m1_rne(w[2 * j + 1] * r) << 4));
    *scale = s;
}

/* Element i as bf16 bits: sigma * normal, rounded to nearest even. */
SYN_HD uint16_t syn_bf16(uint64_t key, int64_t i, float sigma) {
    const uint32_t u = syn_f32_bits(sigma * syn_normal(syn_u64(key, (uint64_t)i)));
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* Element i as fp32: mean + sigma * normal. */
SYN_HD float syn_f32(uint64_t key, int64_t i, float mean, float sigma) {
    return mean + sigma * syn_normal(syn_u64(key, (uint64_t)i));
}

#endif
