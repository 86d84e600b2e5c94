/* The qmv gather_qmm route: decode and unsorted batches, any activation dtype, fp32 CUDA-core FMA.
 * Contract: ../shared/spec/NVFP4.md section 4; notes: docs/GPU-NOTES.md.
 *
 * Rows are taken in chunks of 32 (one warp-wide load of idx). Inside a chunk a *segment* is a run of
 * consecutive rows with the same expert, cut every QMV_G rows; the warp finds the segments with two
 * ballots (no pre-pass, no host round trip). A warp computes one output feature n for one segment:
 * its lanes stream weight row n of the segment's expert in 16-byte pieces (2 NVFP4 blocks; 8-byte
 * pieces when K % 32 != 0), decode each code once to fp32 and use it for all rows of the segment,
 * then reduce across the warp. Blocks of 8 warps cover 8 consecutive features (so the x rows of the
 * segment are read from L1 after the first warp); blockIdx.x also selects which segments of the
 * chunk the block handles (segment slot), so that the segments of one chunk - e.g. the 6 experts
 * of one decode token - run in parallel. Rows with idx >= E are written as zeros. */
#include "kernels/cuda/gather_cuda.cuh"

#define QMV_WARPS 8  /* warps per block = consecutive output features */
#define QMV_CHUNK 32 /* rows per chunk */
#define QMV_G 8      /* rows per segment at most (accumulators per lane) */
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

/* One segment (rows b0 .. b0+len-1, expert e < E, len <= QMV_G), one output feature n.
 * Weights decode as (e2m1 * 2^-126) * (scale * 2^100) = e2m1 * scale * 2^-26 (exact, fp32 normal);
 * the epilogue multiplies by 2^26 and the global scale. */
template <typename T, int BPL>
__device__ __forceinline__ void qmv_segment(const gq_args &a, const T *__restrict__ x, T *__restrict__ y,
                                            uint32_t e, int64_t b0, int len, int n, int lane) {
    const int K = a.K, KB = K >> 4;
    const int64_t wrow = cu_weight_expert(e, a.E) * a.N + n;
    const uint8_t *codes = a.codes + wrow * (K >> 1);
    const uint8_t *scales = a.scales + wrow * KB;
    float acc[QMV_G];
#pragma unroll
    for (int r = 0; r < QMV_G; r++) acc[r] = 0.0f;

    uint32_t wd[4] = {0, 0, 0, 0}, sc = 0; /* this lane's next piece: codes, scale bytes */
    int kb = lane * BPL;
    if (kb < KB) {
        if (BPL == 2) {
            const uint4 q = cu_ld_stream16(codes + (int64_t)kb * 8);
            wd[0] = q.x; wd[1] = q.y; wd[2] = q.z; wd[3] = q.w;
            sc = __ldg(scales + kb) | (uint32_t)__ldg(scales + kb + 1) << 8;
        } else {
            const uint2 q = cu_ld_stream8(codes + (int64_t)kb * 8);
            wd[0] = q.x; wd[1] = q.y;
            sc = __ldg(scales + kb);
        }
    }
    for (; kb < KB; kb += 32 * BPL) {
        const uint32_t cw[4] = {wd[0], wd[1], wd[2], wd[3]}, cs = sc;
        const int nkb = kb + 32 * BPL; /* prefetch the next piece before using this one */
        if (nkb < KB) {
            if (BPL == 2) {
                const uint4 q = cu_ld_stream16(codes + (int64_t)nkb * 8);
                wd[0] = q.x; wd[1] = q.y; wd[2] = q.z; wd[3] = q.w;
                sc = __ldg(scales + nkb) | (uint32_t)__ldg(scales + nkb + 1) << 8;
            } else {
                const uint2 q = cu_ld_stream8(codes + (int64_t)nkb * 8);
                wd[0] = q.x; wd[1] = q.y;
                sc = __ldg(scales + nkb);
            }
        }
#pragma unroll
        for (int bi = 0; bi < BPL; bi++) {
            const float s = cu_e4m3_to_float((cs >> (8 * bi)) & 0xffu) * 0x1p100f;
            float w[16];
#pragma unroll
            for (int j = 0; j < 16; j++) w[j] = cu_e2m1_f32(cw[2 * bi + (j >> 3)], j & 7) * s;
            const int64_t k0 = (int64_t)(kb + bi) * 16;
#pragma unroll
            for (int r = 0; r < QMV_G; r++) {
                if (r < len) {
                    float xv[16];
                    qmv_load_x16(x + (b0 + r) * K + k0, xv);
#pragma unroll
                    for (int j = 0; j < 16; j++) acc[r] = fmaf(xv[j], w[j], acc[r]);
                }
            }
        }
    }
    const float mult = cu_expert_gs(a.gs, e) * 0x1p26f;
#pragma unroll
    for (int r = 0; r < QMV_G; r++) {
        if (r < len) {
            float v = acc[r];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
            if (lane == 0) y[(b0 + r) * a.N + n] = cu_from_float<T>(v * mult);
        }
    }
}

template <typename T, int BPL>
__global__ void __launch_bounds__(QMV_WARPS * 32, 2) gq_qmv_kernel(gq_args a, int slots) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nblk = (a.N + QMV_WARPS - 1) / QMV_WARPS;
    const int slot = blockIdx.x / nblk;
    const int n = (blockIdx.x % nblk) * QMV_WARPS + warp;
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
        uint32_t segs = __ballot_sync(FULL, valid && ((lane - run0) % QMV_G) == 0);
        for (int i = 0; i < slot && segs; i++) segs &= segs - 1; /* skip to this block's first */
        while (segs) {
            const int s = __ffs(segs) - 1;
            const uint32_t rest = segs & (segs - 1);
            const int len = (rest ? __ffs(rest) - 1 : nrows) - s;
            const uint32_t e = __shfl_sync(FULL, v, s);
            const int64_t b0 = c0 + s;
            if (e >= (uint32_t)a.E) {
                if (lane < len) y[(b0 + lane) * a.N + n] = cu_from_float<T>(0.0f);
            } else {
                qmv_segment<T, BPL>(a, x, y, e, b0, len, n, lane);
            }
            for (int i = 0; i < slots && segs; i++) segs &= segs - 1;
        }
    }
}

template <typename T>
static int launch(const gq_args *a, cudaStream_t st) {
    const int64_t chunks = ((int64_t)a->B + QMV_CHUNK - 1) / QMV_CHUNK;
    const int slots = a->B < QMV_SLOTS ? a->B : QMV_SLOTS;
    const int64_t nblk = (a->N + QMV_WARPS - 1) / QMV_WARPS;
    if (nblk * slots > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: qmv grid too large (N=%d)", a->N);
    const dim3 grid((unsigned)(nblk * slots), (unsigned)(chunks < 65535 ? chunks : 65535));
    const bool v16 = (a->K % 32) == 0 && ((uintptr_t)a->codes & 15) == 0;
    if (v16) gq_qmv_kernel<T, 2><<<grid, QMV_WARPS * 32, 0, st>>>(*a, slots);
    else gq_qmv_kernel<T, 1><<<grid, QMV_WARPS * 32, 0, st>>>(*a, slots);
    GQ_CUDA_TRY(cudaGetLastError(), "launch of the qmv kernel");
    return FP4MOE_OK;
}

int gq_launch_qmv(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    switch (dtype) {
    case FP4MOE_F32: return launch<float>(a, st);
    case FP4MOE_F16: return launch<__half>(a, st);
    default: return launch<__nv_bfloat16>(a, st);
    }
}
