/* The qmv gather_qmm route: decode and unsorted batches, any activation dtype, fp32 CUDA-core FMA.
 * Contract: ../shared/spec/NVFP4.md section 4; notes: docs/GPU-NOTES.md.
 *
 * Rows are taken in chunks of 32 (one warp-wide load of idx). Inside a chunk a *segment* is a run of
 * consecutive rows with the same expert, cut every QMV_G rows; the warp finds the segments with two
 * ballots (no pre-pass, no host round trip). A warp computes NF (2 or 4) output features for one segment:
 * its lanes stream weight rows n, n+1 of the segment's expert in 16-byte pieces (2 NVFP4 blocks; 8-byte
 * pieces when K % 32 != 0), decode each code once to fp32 and use it for all rows of the segment,
 * then reduce across the warp. Blocks of 8 warps cover 8 consecutive features (so the x rows of the
 * segment are read from L1 after the first warp); blockIdx.x also selects which segments of the
 * chunk the block handles (segment slot), so that the segments of one chunk - e.g. the 6 experts
 * of one decode token - run in parallel. Rows with idx >= E are written as zeros. */
#include "kernels/cuda/gather_cuda.cuh"

#define QMV_WARPS 8  /* warps per block = consecutive output features */
#define QMV_CHUNK 32 /* rows per chunk */
#define QMV_G 8      /* rows per segment at most (accumulators per lane), B > 32 */
#define QMV_SLOTS 8  /* segments of a chunk handled in parallel */
#define FULL 0xffffffffu

/* 16 consecutive activations (one NVFP4 block) as fp32. */
__device__ __forceinline__ void qmv_load_x16(const float *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 q = __ldg(reinterpret_cast<const float4 *>(p) + i);
        v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
    }
}
__device__ __forceinline__ void qmv_load_x16(const __nv_bfloat16 *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p) + i);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) { /* bf16 -> fp32 is a 16-bit shift */
            v[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            v[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    }
}
__device__ __forceinline__ void qmv_load_x16(const __half *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p) + i);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[j]));
            v[8 * i + 2 * j] = f.x;
            v[8 * i + 2 * j + 1] = f.y;
        }
    }
}

/* v4 (round 4, docs/GPU-NOTES.md): one NVFP4 block (code words w0, w1; E4M3 scale byte sb) as 16
 * fp32 weights e2m1 * scale * 2^-8 (exact): code pairs (i, i+4) as bf16x2 patterns by one integer
 * multiply each (cu_e2m1x2_bf16_mul, e2m1 * 2^-126), one packed multiply by scale * 2^118 (exact,
 * as in the batched route), then each bf16 half is an fp32 by a shift or a mask. 2.6 integer ops
 * + 0.5 packed multiplies per weight instead of ~4 ops + 1 fp32 multiply, and the decode is done
 * once per block and feature, not once per row. */
__device__ __forceinline__ void qmv_decode16(uint32_t w0, uint32_t w1, uint32_t sb, float (&wv)[16]) {
    const __nv_bfloat162 s2 = __float2bfloat162_rn(cu_e4m3_to_float(sb) * 0x1p118f); /* < 2^127 */
    const uint32_t s = *reinterpret_cast<const uint32_t *>(&s2);
    const uint32_t w[2] = {w0, w1};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t w8 = w[h] >> 8;
        const uint32_t p[4] = {cu_e2m1x2_bf16_mul<0>(w[h], w8), cu_e2m1x2_bf16_mul<1>(w[h], w8),
                               cu_e2m1x2_bf16_mul<2>(w[h], w8), cu_e2m1x2_bf16_mul<3>(w[h], w8)};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t d;
            asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(p[i]), "r"(s));
            wv[8 * h + i] = __uint_as_float(d << 16);             /* code 8h + i */
            wv[8 * h + i + 4] = __uint_as_float(d & 0xffff0000u); /* code 8h + i + 4 */
        }
    }
}

/* One segment (rows b0 .. b0+len-1, expert e < E, len <= G), output features n0 .. n0+NF-1 (those
 * < N). The lane's weight pieces are loaded QMV_PM at a time, all before any is used (for the
 * Nemotron K one batch covers the whole row: one memory latency per warp). Weights decode as
 * (e2m1 * 2^-126) * (scale * 2^100) = e2m1 * scale * 2^-26 (exact, fp32 normal); the epilogue
 * multiplies by 2^26 and the global scale. */
#define QMV_PM 3 /* pieces per lane in flight per feature */
template <typename T, int BPL, int G, int NF, int V>
__device__ __forceinline__ void qmv_segment(const gq_args &a, const T *__restrict__ x, T *__restrict__ y,
                                            uint32_t e, int64_t b0, int len, int n0, int lane) {
    const int K = a.K, KB = K >> 4;
    const uint8_t *codes[NF], *scales[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        const int64_t wrow = cu_weight_expert(e, a.E) * a.N + min(n0 + f, a.N - 1);
        codes[f] = a.codes + wrow * (K >> 1);
        scales[f] = a.scales + wrow * KB;
    }
    float acc[NF][G];
#pragma unroll
    for (int f = 0; f < NF; f++)
#pragma unroll
        for (int r = 0; r < G; r++) acc[f][r] = 0.0f;

    for (int kc = lane * BPL; kc < KB; kc += 32 * BPL * QMV_PM) {
        uint32_t cw[QMV_PM][NF][2 * BPL], cs[QMV_PM][NF];
#pragma unroll
        for (int p = 0; p < QMV_PM; p++) { /* issue every load of this batch first */
            const int kb = kc + p * 32 * BPL;
#pragma unroll
            for (int f = 0; f < NF; f++) {
                if (kb < KB) {
                    if constexpr (BPL == 2) {
                        const uint4 q = cu_ld_stream16(codes[f] + (int64_t)kb * 8);
                        cw[p][f][0] = q.x; cw[p][f][1] = q.y; cw[p][f][2] = q.z; cw[p][f][3] = q.w;
                        cs[p][f] = __ldg(scales[f] + kb) | (uint32_t)__ldg(scales[f] + kb + 1) << 8;
                    } else {
                        const uint2 q = cu_ld_stream8(codes[f] + (int64_t)kb * 8);
                        cw[p][f][0] = q.x; cw[p][f][1] = q.y;
                        cs[p][f] = __ldg(scales[f] + kb);
                    }
                }
            }
        }
#pragma unroll
        for (int p = 0; p < QMV_PM; p++) {
            const int kb = kc + p * 32 * BPL;
            if (kb >= KB) break;
#pragma unroll
            for (int bi = 0; bi < BPL; bi++) {
                const int64_t k0 = (int64_t)(kb + bi) * 16;
                if constexpr (V == 4 && G == 1) { /* decode: one row, x shared by the NF features */
                    float xv[16];
                    qmv_load_x16(x + b0 * K + k0, xv);
#pragma unroll
                    for (int f = 0; f < NF; f++) {
                        float wv[16];
                        qmv_decode16(cw[p][f][2 * bi], cw[p][f][2 * bi + 1], (cs[p][f] >> (8 * bi)) & 0xffu, wv);
#pragma unroll
                        for (int j = 0; j < 16; j++) acc[f][0] = fmaf(xv[j], wv[j], acc[f][0]);
                    }
                } else if constexpr (V == 4) { /* weights decoded once, used by every row */
                    float wv[NF][16];
#pragma unroll
                    for (int f = 0; f < NF; f++)
                        qmv_decode16(cw[p][f][2 * bi], cw[p][f][2 * bi + 1], (cs[p][f] >> (8 * bi)) & 0xffu, wv[f]);
#pragma unroll
                    for (int r = 0; r < G; r++) {
                        if (r < len) {
                            float xv[16];
                            qmv_load_x16(x + (b0 + r) * K + k0, xv);
#pragma unroll
                            for (int f = 0; f < NF; f++)
#pragma unroll
                                for (int j = 0; j < 16; j++) acc[f][r] = fmaf(xv[j], wv[f][j], acc[f][r]);
                        }
                    }
                } else { /* v3 */
#pragma unroll
                    for (int r = 0; r < G; r++) {
                        if (r < len) {
                            float xv[16];
                            qmv_load_x16(x + (b0 + r) * K + k0, xv);
#pragma unroll
                            for (int f = 0; f < NF; f++) {
                                const float s = cu_e4m3_to_float((cs[p][f] >> (8 * bi)) & 0xffu) * 0x1p100f;
#pragma unroll
                                for (int j = 0; j < 16; j++)
                                    acc[f][r] = fmaf(xv[j], cu_e2m1_f32(cw[p][f][2 * bi + (j >> 3)], j & 7) * s, acc[f][r]);
                            }
                        }
                    }
                }
            }
        }
    }
    const float mult = cu_expert_gs(a.gs, e) * (V == 4 ? 0x1p8f : 0x1p26f);
#pragma unroll
    for (int r = 0; r < G; r++) {
        if (r < len) {
#pragma unroll
            for (int f = 0; f < NF; f++) {
                float v = acc[f][r];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
                if (lane == 0 && n0 + f < a.N) y[(b0 + r) * a.N + n0 + f] = cu_from_float<T>(v * mult);
            }
        }
    }
}

template <typename T, int BPL, int G, int NF, int V>
__global__ void __launch_bounds__(QMV_WARPS * 32, 2) gq_qmv_kernel(gq_args a, int slots) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nblk = (a.N + QMV_WARPS * NF - 1) / (QMV_WARPS * NF);
    const int slot = blockIdx.x / nblk;
    const int n = ((blockIdx.x % nblk) * QMV_WARPS + warp) * NF; /* first of NF features */
    if (n >= a.N) return; /* whole warp; no block-wide barriers below */
    const T *x = static_cast<const T *>(a.x);
    T *y = static_cast<T *>(a.y);
    for (int64_t c0 = (int64_t)blockIdx.y * QMV_CHUNK; c0 < a.B; c0 += (int64_t)gridDim.y * QMV_CHUNK) {
        const int nrows = (int)min((int64_t)QMV_CHUNK, (int64_t)a.B - c0);
        const bool valid = lane < nrows;
        const uint32_t v = valid ? __ldg(a.idx + c0 + lane) : 0xffffffffu;
        const uint32_t prev = __shfl_up_sync(FULL, v, 1);
        const uint32_t heads = __ballot_sync(FULL, valid && (lane == 0 || v != prev));
        const int run0 = 31 - __clz(heads & (FULL >> (31 - lane))); /* start of this lane's run */
        uint32_t segs = __ballot_sync(FULL, valid && ((lane - run0) % G) == 0);
        for (int i = 0; i < slot && segs; i++) segs &= segs - 1; /* skip to this block's first */
        while (segs) {
            const int s = __ffs(segs) - 1;
            const uint32_t rest = segs & (segs - 1);
            const int len = (rest ? __ffs(rest) - 1 : nrows) - s;
            const uint32_t e = __shfl_sync(FULL, v, s);
            const int64_t b0 = c0 + s;
            if (e >= (uint32_t)a.E) {
                if (lane < len)
                    for (int f = 0; f < NF && n + f < a.N; f++)
                        y[(b0 + lane) * a.N + n + f] = cu_from_float<T>(0.0f);
            } else {
                qmv_segment<T, BPL, G, NF, V>(a, x, y, e, b0, len, n, lane);
            }
            for (int i = 0; i < slots && segs; i++) segs &= segs - 1;
        }
    }
}

template <typename T, int G, int NF, int V>
static int launch_g(const gq_args *a, cudaStream_t st) {
    const int64_t chunks = ((int64_t)a->B + QMV_CHUNK - 1) / QMV_CHUNK;
    const int slots = a->B < QMV_SLOTS ? a->B : QMV_SLOTS;
    const int64_t nblk = (a->N + QMV_WARPS * NF - 1) / (QMV_WARPS * NF);
    if (nblk * slots > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: qmv grid too large (N=%d)", a->N);
    const dim3 grid((unsigned)(nblk * slots), (unsigned)(chunks < 65535 ? chunks : 65535));
    const bool v16 = (a->K % 32) == 0 && ((uintptr_t)a->codes & 15) == 0;
    if (v16) gq_qmv_kernel<T, 2, G, NF, V><<<grid, QMV_WARPS * 32, 0, st>>>(*a, slots);
    else gq_qmv_kernel<T, 1, G, NF, V><<<grid, QMV_WARPS * 32, 0, st>>>(*a, slots);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the qmv kernel");
    return FP4MOE_OK;
}

/* Decode-sized batches (B <= 32): segments of one row and 4 features per warp (more weight bytes in
 * flight per warp, fewer waves); larger batches: segments of up to 8 rows sharing each weight
 * load, 2 features per warp. */
template <typename T>
static int launch(const gq_args *a, cudaStream_t st) {
    return a->B <= QMV_CHUNK ? launch_g<T, 1, 4, 4>(a, st) : launch_g<T, QMV_G, 2, 4>(a, st);
}

int gq_launch_qmv(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    switch (dtype) {
    case FP4MOE_F32: return launch<float>(a, st);
    case FP4MOE_F16: return launch<__half>(a, st);
    default: return launch<__nv_bfloat16>(a, st);
    }
}
