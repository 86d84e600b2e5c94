/* CUDA ops: embedding rows, RMSNorm (plain and the gated grouped one of Mamba-2), relu^2, the
 * residual add, greedy argmax and the position counter. Formulas and the order of
 * fp32 operations follow src/kernels/cpu/ops_norm.c (transformers NemotronHRMSNorm,
 * Zamba2RMSNormGated): __fmul_rn / __fadd_rn keep nvcc from fusing what the CPU computes as two
 * roundings. Contracts: ops_cuda.h. */
#include <float.h>
#include <limits.h>
#include <math.h>

#include <cuda_fp16.h>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/cuda_launch.cuh"

#define NORM_THREADS 256

/* ---- block reductions -------------------------------------------------------------------------- */

/* Sum over the block (blockDim.x a multiple of 32, <= 1024); every thread gets the result. */
__device__ double block_sum_f64(double v) {
    __shared__ double part[32];
    __shared__ double total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = ops_warp_sum_f64(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        double s = lane < nw ? part[lane] : 0.0;
        s = ops_warp_sum_f64(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    const double r = total;
    __syncthreads(); /* part/total may be reused by a following call */
    return r;
}

/* ---- embedding -------------------------------------------------------------------------------- */

/* E2M1 code -> value: the bits (mag << 22 | sign << 31) read as fp32 are e2m1 * 2^-126
 * (src/kernels/cuda/gather_cuda.cuh); times 2^126, exact. */
__device__ __forceinline__ float e2m1_value(uint32_t c) {
    return __uint_as_float(((c & 7u) << 22) | ((c & 8u) << 28)) * 0x1p126f;
}

/* E4M3 byte -> value (spec NVFP4.md section 1); exact. */
__device__ __forceinline__ float e4m3_value(uint32_t b) {
    const uint32_t e = (b >> 3) & 15, m = b & 7;
    const float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120) << 23) | (m << 20));
    return (b & 0x80) ? -v : v;
}

__global__ void embed_kernel(const void *table, int kind, const uint8_t *codes, const uint8_t *scales,
                             const float *gs, const int32_t *tokens, int64_t H, float *h) {
    cu_pdl_entry();
    const int64_t t = blockIdx.x, id = tokens[t];
    float *out = h + t * H;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
        float v;
        if (kind == 3) { /* NVFP4: (e2m1 * e4m3) exact, then one rounding by gs */
            const uint32_t byte = codes[id * (H / 2) + i / 2];
            const float cs = __fmul_rn(e2m1_value(i & 1 ? byte >> 4 : byte & 15),
                                       e4m3_value(scales[id * (H / 16) + i / 16]));
            v = __fmul_rn(cs, gs ? gs[0] : 1.0f);
        } else if (kind == FP4MOE_BF16) {
            v = ops_bf16_to_f32(((const uint16_t *)table)[id * H + i]);
        } else if (kind == FP4MOE_F16) {
            v = __half2float(((const __half *)table)[id * H + i]);
        } else {
            v = ((const float *)table)[id * H + i];
        }
        out[i] = v;
    }
}

extern "C" int cuda_embed(void *stream, const cuda_linear *e, const int32_t *tokens, int64_t T,
                          float *h) {
    if (T <= 0) return FP4MOE_OK;
    const int kind = e->nvfp4 ? 3 : (int)e->dtype;
    cu_launch(embed_kernel, (unsigned)T, NORM_THREADS, 0, (cudaStream_t)stream, e->dense, kind, e->q.codes,
              e->q.scales, e->q.global_scale, tokens, e->K, h);
    OPS_LAUNCH_CHECK("embedding");
    return FP4MOE_OK;
}

/* ---- RMSNorm ---------------------------------------------------------------------------------- */

/* 1 / sqrt(mean + eps) exactly as the CPU's inv_rms: fp64 sum of squares, one conversion. */
__device__ __forceinline__ float inv_rms_from(double ss, int64_t n, float eps) {
    return __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn((float)(ss / (double)n), eps)));
}

/* One block of RMSNORM_THREADS per row. The elements are read in batches of NORM_U per thread, all
 * loads of a batch before any use (a plain loop waits one memory round trip per element: 11 us for
 * one row), and the second pass reuses the first pass's registers when the row fits
 * (H <= RMSNORM_THREADS * NORM_U = 4096); few registers, so that long prefill steps keep the GPU
 * full. */
#define NORM_U 4
#define RMSNORM_THREADS 1024
__global__ void rmsnorm_kernel(float *__restrict__ x, const uint16_t *__restrict__ ra, const uint16_t *__restrict__ rb,
                               const float *__restrict__ w, int64_t H, float eps, uint16_t *__restrict__ y,
                               float *__restrict__ y32, const int32_t *__restrict__ rows) {
    cu_pdl_entry();
    const int64_t t = blockIdx.x;
    float *xt = x + (rows ? (int64_t)rows[t] : t) * H;
    const int64_t step = blockDim.x;
    const bool kept = H <= step * NORM_U; /* xv (and wv) hold the thread's elements */
    float xv[NORM_U], wv[NORM_U];
    double ss = 0.0;
    for (int64_t i0 = threadIdx.x; i0 < H; i0 += step * NORM_U) {
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            const int64_t i = i0 + u * step;
            xv[u] = i < H ? xt[i] : 0.0f;
            if (kept) wv[u] = i < H ? w[i] : 0.0f; /* with the first loads: one round trip less */
        }
        if (ra) { /* the residual add first (residual_kernel's arithmetic), written back */
#pragma unroll
            for (int u = 0; u < NORM_U; u++) {
                const int64_t i = i0 + u * step;
                if (i < H) {
                    float o = ops_bf16_to_f32(ra[t * H + i]);
                    if (rb) o = __fadd_rn(o, ops_bf16_to_f32(rb[t * H + i]));
                    xv[u] = __fadd_rn(xv[u], o);
                    xt[i] = xv[u];
                }
            }
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++) ss += (double)xv[u] * (double)xv[u];
    }
    const float r = inv_rms_from(block_sum_f64(ss), H, eps);
    for (int64_t i0 = threadIdx.x; i0 < H; i0 += step * NORM_U) {
        if (!kept) {
#pragma unroll
            for (int u = 0; u < NORM_U; u++) {
                const int64_t i = i0 + u * step;
                wv[u] = i < H ? w[i] : 0.0f;
                xv[u] = i < H ? xt[i] : 0.0f;
            }
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            const int64_t i = i0 + u * step;
            if (i < H) {
                const uint16_t b = ops_f32_to_bf16(__fmul_rn(__fmul_rn(xv[u], r), wv[u]));
                y[t * H + i] = b;
                if (y32) y32[t * H + i] = ops_bf16_to_f32(b);
            }
        }
    }
}

/* The last reduction of the 256-thread forms: the 32 virtual warps' partials (part, written by the block before
 * the call) summed by warp 0's butterfly into *total, as rmsnorm_kernel's block_sum_f64 does; every thread gets
 * 1 / rms. */
__device__ __forceinline__ float rms_from_parts(const double *part, double *total, int lane, int warp, int64_t H,
                                                float eps) {
    __syncthreads();
    if (warp == 0) {
        const double sw = ops_warp_sum_f64(part[lane]); /* the 32 virtual warps */
        if (lane == 0) *total = sw;
    }
    __syncthreads();
    return inv_rms_from(*total, H, eps);
}

/* The same function for many rows (prefill): 256 threads a row, so that 8 rows share an SM instead of
 * 2, computing EXACTLY rmsnorm_kernel's arithmetic: thread r plays the 1024-thread kernel's threads
 * v = r + 256 q (q < 4), each partial sum over its elements v + 1024 k in the same order, each
 * virtual warp reduced by the same butterfly (real warp w holds virtual warps w + 8 q, lane for
 * lane), the 32 warp sums by the same last warp. So a row's result does not depend on how many rows
 * the call has (batched results equal solo results). */
#define RMSNORM_WIDE_THREADS 256
#define RMSNORM_Q (RMSNORM_THREADS / RMSNORM_WIDE_THREADS)
__global__ void __launch_bounds__(RMSNORM_WIDE_THREADS)
rmsnorm_wide_kernel(float *__restrict__ x, const uint16_t *__restrict__ ra, const uint16_t *__restrict__ rb,
                    const float *__restrict__ w, int64_t H, float eps, uint16_t *__restrict__ y,
                    float *__restrict__ y32, const int32_t *__restrict__ rows) {
    cu_pdl_entry();
    const int64_t t = blockIdx.x;
    float *xt = x + (rows ? (int64_t)rows[t] : t) * H;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int64_t VSTEP = RMSNORM_THREADS; /* the virtual kernel's blockDim */
    const bool kept = H <= VSTEP * NORM_U;
    float xv[RMSNORM_Q][NORM_U], wv[RMSNORM_Q][NORM_U];
    double ss[RMSNORM_Q];
#pragma unroll
    for (int q = 0; q < RMSNORM_Q; q++) {
        ss[q] = 0.0;
        const int64_t v = threadIdx.x + q * RMSNORM_WIDE_THREADS;
        for (int64_t i0 = v; i0 < H; i0 += VSTEP * NORM_U) { /* rmsnorm_kernel's loop of thread v */
#pragma unroll
            for (int u = 0; u < NORM_U; u++) {
                const int64_t i = i0 + u * VSTEP;
                xv[q][u] = i < H ? xt[i] : 0.0f;
                if (kept) wv[q][u] = i < H ? w[i] : 0.0f;
            }
            if (ra) {
#pragma unroll
                for (int u = 0; u < NORM_U; u++) {
                    const int64_t i = i0 + u * VSTEP;
                    if (i < H) {
                        float o = ops_bf16_to_f32(ra[t * H + i]);
                        if (rb) o = __fadd_rn(o, ops_bf16_to_f32(rb[t * H + i]));
                        xv[q][u] = __fadd_rn(xv[q][u], o);
                        xt[i] = xv[q][u];
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < NORM_U; u++) ss[q] += (double)xv[q][u] * (double)xv[q][u];
        }
    }
    __shared__ double part[RMSNORM_THREADS / 32];
    __shared__ double total;
#ifdef FP4MOE_INJECT_FAULT_RMSNORM_WIDE /* deliberate fault (tests must catch it): one virtual quarter lost */
    ss[RMSNORM_Q - 1] = 0.0;
#endif
#pragma unroll
    for (int q = 0; q < RMSNORM_Q; q++) {
        const double sq = ops_warp_sum_f64(ss[q]);
        if (lane == 0) part[warp + q * (RMSNORM_WIDE_THREADS / 32)] = sq;
    }
    const float r = rms_from_parts(part, &total, lane, warp, H, eps);
#pragma unroll
    for (int q = 0; q < RMSNORM_Q; q++) {
        const int64_t v = threadIdx.x + q * RMSNORM_WIDE_THREADS;
        for (int64_t i0 = v; i0 < H; i0 += VSTEP * NORM_U) {
            if (!kept) {
#pragma unroll
                for (int u = 0; u < NORM_U; u++) {
                    const int64_t i = i0 + u * VSTEP;
                    wv[q][u] = i < H ? w[i] : 0.0f;
                    xv[q][u] = i < H ? xt[i] : 0.0f;
                }
            }
#pragma unroll
            for (int u = 0; u < NORM_U; u++) {
                const int64_t i = i0 + u * VSTEP;
                if (i < H) {
                    const uint16_t bb = ops_f32_to_bf16(__fmul_rn(__fmul_rn(xv[q][u], r), wv[q][u]));
                    y[t * H + i] = bb;
                    if (y32) y32[t * H + i] = ops_bf16_to_f32(bb);
                }
            }
        }
    }
}

/* The 256-thread form with 4 consecutive elements a thread (16-byte loads): thread r plays the virtual threads
 * 4r + j (j < 4) of the 1024-thread kernel, element i = 4r + j + 1024 k in virtual thread 4r + j's sum in increasing
 * k, as there. A virtual warp (32 virtual threads) lives in 8 consecutive lanes; its butterfly (xor 16, 8, 4, 2, 1 over
 * virtual lanes) is xor 4, 2, 1 over those lanes for each j, then j ^ 2 and j ^ 1 inside the thread - each level the
 * same fp64 additions (a + b and b + a are the same bits), so the same sums, the same 32 partials and the same last
 * butterfly: the same bits as rmsnorm_kernel. For H % 4 == 0, H <= 4,096 and 16-byte (bf16: 8-byte) aligned rows;
 * rmsnorm_wide_kernel serves the others. Measured (session 27, H200, 30B-A3B shape: H = 2,688, 52 calls a forward):
 * prefill 2,048 tokens 48,321 -> 48,797 tok/s (+1.0%), 512 tokens 31,802 -> 31,993 (+0.6%); the same greedy ids. (More
 * blocks an SM through the launch bounds instead spilled and measured nothing.) */
#define RMSNORM_V4_K 4 /* float4 groups a thread: H <= 1024 x 4 */
__device__ __forceinline__ void v4_bf16(uint2 p, float (&o)[4]) {
    o[0] = ops_bf16_to_f32((uint16_t)(p.x & 0xffffu));
    o[1] = ops_bf16_to_f32((uint16_t)(p.x >> 16));
    o[2] = ops_bf16_to_f32((uint16_t)(p.y & 0xffffu));
    o[3] = ops_bf16_to_f32((uint16_t)(p.y >> 16));
}
__global__ void __launch_bounds__(RMSNORM_WIDE_THREADS)
rmsnorm_wide_v4_kernel(float *__restrict__ x, const uint16_t *__restrict__ ra, const uint16_t *__restrict__ rb,
                       const float *__restrict__ w, int64_t H, float eps, uint16_t *__restrict__ y,
                       float *__restrict__ y32, const int32_t *__restrict__ rows) {
    cu_pdl_entry();
    const int64_t t = blockIdx.x;
    float *xt = x + (rows ? (int64_t)rows[t] : t) * H;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t c0 = 4 * (int64_t)threadIdx.x;
    float xv[RMSNORM_V4_K][4], wv[RMSNORM_V4_K][4];
    double a[4] = {0.0, 0.0, 0.0, 0.0};
#pragma unroll
    for (int k = 0; k < RMSNORM_V4_K; k++) {
        const int64_t i = c0 + (int64_t)RMSNORM_THREADS * k;
        if (i < H) {
            const float4 xq = *reinterpret_cast<const float4 *>(xt + i);
            const float4 wq = __ldg(reinterpret_cast<const float4 *>(w + i));
            xv[k][0] = xq.x; xv[k][1] = xq.y; xv[k][2] = xq.z; xv[k][3] = xq.w;
            wv[k][0] = wq.x; wv[k][1] = wq.y; wv[k][2] = wq.z; wv[k][3] = wq.w;
        }
    }
    if (ra) { /* the residual add first (residual_kernel's arithmetic), written back */
#pragma unroll
        for (int k = 0; k < RMSNORM_V4_K; k++) {
            const int64_t i = c0 + (int64_t)RMSNORM_THREADS * k;
            if (i < H) {
                float o[4];
                v4_bf16(*reinterpret_cast<const uint2 *>(ra + t * H + i), o);
                if (rb) {
                    float o2[4];
                    v4_bf16(*reinterpret_cast<const uint2 *>(rb + t * H + i), o2);
#pragma unroll
                    for (int j = 0; j < 4; j++) o[j] = __fadd_rn(o[j], o2[j]);
                }
#pragma unroll
                for (int j = 0; j < 4; j++) xv[k][j] = __fadd_rn(xv[k][j], o[j]);
                *reinterpret_cast<float4 *>(xt + i) = make_float4(xv[k][0], xv[k][1], xv[k][2], xv[k][3]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < RMSNORM_V4_K; k++)
        if (c0 + (int64_t)RMSNORM_THREADS * k < H)
#pragma unroll
            for (int j = 0; j < 4; j++) a[j] += (double)xv[k][j] * (double)xv[k][j];
#ifdef FP4MOE_INJECT_FAULT_RMSNORM_WIDE /* deliberate fault (tests must catch it): one virtual quarter lost */
    a[3] = 0.0;
#endif
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) /* virtual xor 16, 8, 4 */
#pragma unroll
        for (int j = 0; j < 4; j++) a[j] += __shfl_xor_sync(0xffffffffu, a[j], o);
    const double b0 = a[0] + a[2], b1 = a[1] + a[3]; /* virtual xor 2 (lanes j, j ^ 2: the same sums) */
    const double vsum = b0 + b1;                     /* virtual xor 1 */
    __shared__ double part[RMSNORM_THREADS / 32];
    __shared__ double total;
    if ((lane & 7) == 0) part[warp * 4 + (lane >> 3)] = vsum;
    const float r = rms_from_parts(part, &total, lane, warp, H, eps);
#pragma unroll
    for (int k = 0; k < RMSNORM_V4_K; k++) {
        const int64_t i = c0 + (int64_t)RMSNORM_THREADS * k;
        if (i < H) {
            uint16_t bb[4];
#pragma unroll
            for (int j = 0; j < 4; j++) bb[j] = ops_f32_to_bf16(__fmul_rn(__fmul_rn(xv[k][j], r), wv[k][j]));
            *reinterpret_cast<uint2 *>(y + t * H + i) =
                make_uint2((uint32_t)bb[0] | (uint32_t)bb[1] << 16, (uint32_t)bb[2] | (uint32_t)bb[3] << 16);
            if (y32)
                *reinterpret_cast<float4 *>(y32 + t * H + i) = make_float4(ops_bf16_to_f32(bb[0]), ops_bf16_to_f32(bb[1]),
                                                                           ops_bf16_to_f32(bb[2]), ops_bf16_to_f32(bb[3]));
        }
    }
}
static bool rmsnorm_v4_fits(const float *x, const uint16_t *a, const uint16_t *b, const float *w, int64_t H,
                            const uint16_t *y, const float *y32) {
    return H % 4 == 0 && H <= RMSNORM_THREADS * RMSNORM_V4_K && (uintptr_t)x % 16 == 0 &&
           (uintptr_t)w % 16 == 0 && (uintptr_t)a % 8 == 0 && (uintptr_t)b % 8 == 0 && (uintptr_t)y % 8 == 0 &&
           (uintptr_t)y32 % 16 == 0;
}

/* rows at which the 256-thread form takes over (measured: 13 -> ~5 us a call at 512 rows of 2688) */
#ifndef RMSNORM_WIDE_ROWS
#define RMSNORM_WIDE_ROWS 64
#endif

static void rmsnorm_launch(cudaStream_t st, float *x, const uint16_t *a, const uint16_t *b, const float *w,
                           int64_t T, int64_t H, float eps, uint16_t *y, float *y32, const int32_t *rows) {
    if (T >= RMSNORM_WIDE_ROWS && rmsnorm_v4_fits(x, a, b, w, H, y, y32))
        cu_launch(rmsnorm_wide_v4_kernel, (unsigned)T, RMSNORM_WIDE_THREADS, 0, st, x, a, b, w, H, eps, y, y32, rows);
    else if (T >= RMSNORM_WIDE_ROWS)
        cu_launch(rmsnorm_wide_kernel, (unsigned)T, RMSNORM_WIDE_THREADS, 0, st, x, a, b, w, H, eps, y, y32, rows);
    else
        cu_launch(rmsnorm_kernel, (unsigned)T, RMSNORM_THREADS, 0, st, x, a, b, w, H, eps, y, y32, rows);
}

extern "C" int cuda_rmsnorm(void *stream, float *x, const uint16_t *a, const uint16_t *b, const float *w,
                            int64_t T, int64_t H, float eps, uint16_t *y, float *y32) {
    if (T <= 0) return FP4MOE_OK;
    rmsnorm_launch((cudaStream_t)stream, x, a, a ? b : NULL, w, T, H, eps, y, y32, NULL);
    OPS_LAUNCH_CHECK("rmsnorm");
    return FP4MOE_OK;
}

/* One block per (token, group) (decode and short calls). When the group fits the block's registers
 * (gsz <= NORM_THREADS * NORM_U: nemotron_h's 512) g = y * silu(z) is computed once and kept for the
 * output pass; longer groups compute it twice (no size limit). The same operations either way. */
__global__ void rmsnorm_gated_kernel(const float *__restrict__ y, const uint16_t *__restrict__ z, int64_t zs,
                                     const float *__restrict__ w, int64_t D, int64_t gsz, float eps,
                                     uint16_t *__restrict__ out) {
    cu_pdl_entry();
    const int64_t t = blockIdx.x, g0 = (int64_t)blockIdx.y * gsz;
    const float *yt = y + t * D + g0;
    const uint16_t *zt = z + t * zs + g0;
    const int64_t step = blockDim.x;
    const bool kept = gsz <= step * NORM_U;
    float gv[NORM_U], wv[NORM_U];
    double ss = 0.0;
    for (int64_t i0 = threadIdx.x; i0 < gsz; i0 += step * NORM_U) {
        float yv[NORM_U], zv[NORM_U];
#pragma unroll
        for (int u = 0; u < NORM_U; u++) { /* loads first (see rmsnorm_kernel) */
            const int64_t i = i0 + u * step;
            yv[u] = i < gsz ? yt[i] : 0.0f;
            zv[u] = i < gsz ? ops_bf16_to_f32(zt[i]) : 0.0f;
            if (kept) wv[u] = i < gsz ? w[g0 + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            gv[u] = 0.0f;
            if (i0 + u * step < gsz) { /* no silu of the padding: the exp and divide are the cost */
                gv[u] = __fmul_rn(yv[u], ops_silu(zv[u]));
                ss += (double)gv[u] * (double)gv[u];
            }
        }
    }
    const float r = inv_rms_from(block_sum_f64(ss), gsz, eps);
    for (int64_t i0 = threadIdx.x; i0 < gsz; i0 += step * NORM_U) {
        if (!kept) {
            float yv[NORM_U], zv[NORM_U];
#pragma unroll
            for (int u = 0; u < NORM_U; u++) {
                const int64_t i = i0 + u * step;
                yv[u] = i < gsz ? yt[i] : 0.0f;
                zv[u] = i < gsz ? ops_bf16_to_f32(zt[i]) : 0.0f;
                wv[u] = i < gsz ? w[g0 + i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < NORM_U; u++)
                if (i0 + u * step < gsz) gv[u] = __fmul_rn(yv[u], ops_silu(zv[u]));
        }
#pragma unroll
        for (int u = 0; u < NORM_U; u++) {
            const int64_t i = i0 + u * step;
            if (i < gsz) out[t * D + g0 + i] = ops_f32_to_bf16(__fmul_rn(__fmul_rn(gv[u], r), wv[u]));
        }
    }
}

/* The same function for many rows (prefill): one warp per (token, group), GATED_WARPS of them a block
 * (item = token * G + group), no block barrier - computing EXACTLY rmsnorm_gated_kernel's arithmetic
 * (NORM_THREADS = 256 threads): lane l plays the block's threads v = l + 32 k (k < 8), whose elements
 * are i = v + 256 m in increasing order, i.e. the lane's elements l + 32 u with k = u % 8; each
 * virtual thread's fp64 partial sum in the same order, each virtual warp reduced by the same butterfly
 * (that warp's sum), and the 8 warp sums (zeros above) by the same last butterfly. So a row's result
 * does not depend on the call's size or kernel (batched == solo). Measured (H200, 30B-A3B shape): the
 * block form took 16 / 59 us a call at 512 / 2,048 tokens (one DRAM round trip and three barriers for
 * 2 elements a thread); it stays for short calls, where this form's 16 elements a lane are the longer
 * chain (decode: -1.3% with this form at T = 1). */
#define GATED_WARPS 8
#define GATED_U 16 /* elements a lane kept in registers: 512 = nemotron_h's group */
#ifndef GATED_WARP_ROWS
#define GATED_WARP_ROWS 64 /* rows from which the warp form runs */
#endif
static_assert(NORM_THREADS == 256 && GATED_U % 8 == 0, "rmsnorm_gated_warp_kernel emulates 8 warps of 32 threads");
__global__ void __launch_bounds__(GATED_WARPS * 32)
rmsnorm_gated_warp_kernel(const float *__restrict__ y, const uint16_t *__restrict__ z, int64_t zs,
                          const float *__restrict__ w, int64_t D, int64_t gsz, int64_t G, int64_t items, float eps,
                          uint16_t *__restrict__ out) {
    cu_pdl_entry();
    const int64_t item = (int64_t)blockIdx.x * GATED_WARPS + (threadIdx.x >> 5);
    if (item >= items) return; /* whole warps only: no block-wide synchronisation below */
    const int lane = threadIdx.x & 31;
    const int64_t t = item / G, g0 = (item % G) * gsz;
    const float *yt = y + t * D + g0;
    const uint16_t *zt = z + t * zs + g0;
    const bool kept = gsz <= 32 * GATED_U;
    float gv[GATED_U], wv[GATED_U];
    double ss[8]; /* virtual thread lane + 32 k */
#pragma unroll
    for (int k = 0; k < 8; k++) ss[k] = 0.0;
    for (int64_t i0 = lane; i0 < gsz; i0 += 32 * GATED_U) {
        float yv[GATED_U], zv[GATED_U];
#pragma unroll
        for (int u = 0; u < GATED_U; u++) { /* loads first (see rmsnorm_kernel) */
            const int64_t i = i0 + 32 * u;
            yv[u] = i < gsz ? yt[i] : 0.0f;
            zv[u] = i < gsz ? ops_bf16_to_f32(zt[i]) : 0.0f;
            if (kept) wv[u] = i < gsz ? w[g0 + i] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < GATED_U; u++) {
            gv[u] = 0.0f;
            if (i0 + 32 * u < gsz) { /* no silu of the padding: the exp and divide are the cost */
                gv[u] = __fmul_rn(yv[u], ops_silu(zv[u]));
                ss[u % 8] += (double)gv[u] * (double)gv[u];
            }
        }
    }
#ifdef FP4MOE_INJECT_FAULT_GATED_LANES /* deliberate fault (tests must catch it): one virtual thread's squares lost */
    if (lane == 31) ss[7] = 0.0;
#endif
    double fin = 0.0; /* the last butterfly's input: virtual warp `lane`'s sum, zeros above 8 */
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const double sk = ops_warp_sum_f64(ss[k]);
        if (lane == k) fin = sk;
    }
    const float r = inv_rms_from(ops_warp_sum_f64(fin), gsz, eps);
    for (int64_t i0 = lane; i0 < gsz; i0 += 32 * GATED_U) {
        if (!kept) {
            float yv[GATED_U], zv[GATED_U];
#pragma unroll
            for (int u = 0; u < GATED_U; u++) {
                const int64_t i = i0 + 32 * u;
                yv[u] = i < gsz ? yt[i] : 0.0f;
                zv[u] = i < gsz ? ops_bf16_to_f32(zt[i]) : 0.0f;
                wv[u] = i < gsz ? w[g0 + i] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < GATED_U; u++)
                if (i0 + 32 * u < gsz) gv[u] = __fmul_rn(yv[u], ops_silu(zv[u]));
        }
#pragma unroll
        for (int u = 0; u < GATED_U; u++) {
            const int64_t i = i0 + 32 * u;
            if (i < gsz) out[t * D + g0 + i] = ops_f32_to_bf16(__fmul_rn(__fmul_rn(gv[u], r), wv[u]));
        }
    }
}

/* rmsnorm_gated_warp_kernel with 4 consecutive elements a lane (16-byte loads): lane l holds elements i = 4l + j + 128 m
 * (j < 4, m < gsz / 128), i.e. virtual thread v = i % 256 of the 256-thread kernel, in virtual warp l / 8 + 4 (m % 2),
 * virtual lane 4 (l % 8) + j; each virtual thread's squares summed in increasing i (m, then m + 2), each virtual warp
 * reduced by its butterfly (xor 4, 2, 1 over the 8 lanes, then j ^ 2, j ^ 1 inside the lane: the same fp64
 * additions), virtual warp k's sum moved to lane k and the last butterfly over 32 lanes (zeros above 8) as there:
 * the same bits. For gsz % 128 == 0, gsz <= 512, D and zs multiples of 4 and 16-byte (bf16: 8-byte) aligned rows;
 * rmsnorm_gated_warp_kernel serves the others. Measured (session 27, H200, 23 calls a forward, with the 16-byte
 * rmsnorm above): prefill 2,048 tokens 48,797 -> 49,013 tok/s, 512 tokens 31,993 -> 32,073. 76 registers (101). */
__global__ void __launch_bounds__(GATED_WARPS * 32)
rmsnorm_gated_v4_kernel(const float *__restrict__ y, const uint16_t *__restrict__ z, int64_t zs,
                        const float *__restrict__ w, int64_t D, int64_t gsz, int64_t G, int64_t items, float eps,
                        uint16_t *__restrict__ out) {
    cu_pdl_entry();
    const int64_t item = (int64_t)blockIdx.x * GATED_WARPS + (threadIdx.x >> 5);
    if (item >= items) return; /* whole warps only */
    const int lane = threadIdx.x & 31;
    const int64_t t = item / G, g0 = (item % G) * gsz;
    const float *yt = y + t * D + g0;
    const uint16_t *zt = z + t * zs + g0;
    float gv[4][4], wv[4][4];
    double a[2][4] = {{0.0, 0.0, 0.0, 0.0}, {0.0, 0.0, 0.0, 0.0}};
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int64_t i = 4 * lane + 128 * m;
        if (i < gsz) {
            const float4 yq = *reinterpret_cast<const float4 *>(yt + i);
            const uint2 zq = *reinterpret_cast<const uint2 *>(zt + i);
            const float4 wq = __ldg(reinterpret_cast<const float4 *>(w + g0 + i));
            float zv[4];
            v4_bf16(zq, zv);
            const float yv[4] = {yq.x, yq.y, yq.z, yq.w};
            wv[m][0] = wq.x; wv[m][1] = wq.y; wv[m][2] = wq.z; wv[m][3] = wq.w;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                gv[m][j] = __fmul_rn(yv[j], ops_silu(zv[j]));
                a[m & 1][j] += (double)gv[m][j] * (double)gv[m][j];
            }
        }
    }
#ifdef FP4MOE_INJECT_FAULT_GATED_LANES /* deliberate fault (tests must catch it): one virtual thread's squares lost */
    if (lane == 7) a[1][3] = 0.0;
#endif
    double S[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int o = 4; o > 0; o >>= 1)
#pragma unroll
            for (int j = 0; j < 4; j++) a[h][j] += __shfl_xor_sync(0xffffffffu, a[h][j], o);
        S[h] = (a[h][0] + a[h][2]) + (a[h][1] + a[h][3]);
    }
    const double t0 = __shfl_sync(0xffffffffu, S[0], 8 * (lane & 3)), t1 = __shfl_sync(0xffffffffu, S[1], 8 * (lane & 3));
    const double fin = lane < 4 ? t0 : lane < 8 ? t1 : 0.0; /* virtual warp `lane`'s sum */
    const float r = inv_rms_from(ops_warp_sum_f64(fin), gsz, eps);
#pragma unroll
    for (int m = 0; m < 4; m++) {
        const int64_t i = 4 * lane + 128 * m;
        if (i < gsz) {
            uint16_t bb[4];
#pragma unroll
            for (int j = 0; j < 4; j++) bb[j] = ops_f32_to_bf16(__fmul_rn(__fmul_rn(gv[m][j], r), wv[m][j]));
            *reinterpret_cast<uint2 *>(out + t * D + g0 + i) =
                make_uint2((uint32_t)bb[0] | (uint32_t)bb[1] << 16, (uint32_t)bb[2] | (uint32_t)bb[3] << 16);
        }
    }
}

extern "C" int cuda_rmsnorm_gated(void *stream, const float *y, const uint16_t *z, int64_t zs,
                                  const float *w, int64_t T, int64_t D, int64_t G, float eps,
                                  uint16_t *out) {
    if (T <= 0) return FP4MOE_OK;
    if (G < 1 || G > 65535 || D % G)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op rmsnorm_gated: %lld groups of %lld channels",
                                (long long)G, (long long)D);
    const int64_t items = T * G;
    const int64_t gsz = D / G;
    const bool v4 = gsz % 128 == 0 && gsz <= 512 && D % 4 == 0 && zs % 4 == 0 && (uintptr_t)y % 16 == 0 &&
                    (uintptr_t)z % 8 == 0 && (uintptr_t)w % 16 == 0 && (uintptr_t)out % 8 == 0;
    if (T >= GATED_WARP_ROWS && items / GATED_WARPS < (1ll << 31) - 1 && v4) {
        cu_launch(rmsnorm_gated_v4_kernel, ops_blocks(items, GATED_WARPS), GATED_WARPS * 32, 0, (cudaStream_t)stream,
                  y, z, zs, w, D, gsz, G, items, eps, out);
    } else if (T >= GATED_WARP_ROWS && items / GATED_WARPS < (1ll << 31) - 1) {
        cu_launch(rmsnorm_gated_warp_kernel, ops_blocks(items, GATED_WARPS), GATED_WARPS * 32, 0, (cudaStream_t)stream,
                  y, z, zs, w, D, D / G, G, items, eps, out);
    } else {
        const dim3 grid((unsigned)T, (unsigned)G);
        cu_launch(rmsnorm_gated_kernel, grid, NORM_THREADS, 0, (cudaStream_t)stream, y, z, zs, w, D, D / G, eps, out);
    }
    OPS_LAUNCH_CHECK("rmsnorm_gated");
    return FP4MOE_OK;
}

/* ---- elementwise -------------------------------------------------------------------------------- */

__device__ __forceinline__ uint16_t relu2_1(uint16_t b) {
    const float v = ops_bf16_to_f32(b);
    const float r = v > 0.0f ? v : 0.0f;
    return ops_f32_to_bf16(__fmul_rn(r, r));
}

/* n8 = n / 8 pieces of 8 bf16 (16 bytes) when x is 16-byte aligned, else n8 = 0; the tail elementwise. */
__global__ void relu2_kernel(uint16_t *x, int64_t n, int64_t n8) {
    cu_pdl_entry();
    const int64_t i0 = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, step = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = i0; i < n8; i += step) {
        uint4 q = reinterpret_cast<uint4 *>(x)[i];
        uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++)
            w[j] = (uint32_t)relu2_1((uint16_t)(w[j] & 0xffffu)) | (uint32_t)relu2_1((uint16_t)(w[j] >> 16)) << 16;
        reinterpret_cast<uint4 *>(x)[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    for (int64_t i = n8 * 8 + i0; i < n; i += step) x[i] = relu2_1(x[i]);
}

/* One thread waits ns nanoseconds of the GPU's global timer (cuda_spin). */
__global__ void spin_kernel(uint64_t ns) {
    cu_pdl_entry();
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

extern "C" int cuda_spin(void *stream, int64_t us) {
    if (us <= 0) return FP4MOE_OK;
    cu_launch(spin_kernel, 1, 1, 0, (cudaStream_t)stream, (uint64_t)us * 1000u);
    OPS_LAUNCH_CHECK("spin");
    return FP4MOE_OK;
}

/* Grid size for a grid-stride loop over n elements. */
static unsigned stride_blocks(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

extern "C" int cuda_relu2(void *stream, uint16_t *x, int64_t n) {
    if (n <= 0) return FP4MOE_OK;
    const int64_t n8 = ((uintptr_t)x & 15) ? 0 : n / 8;
    cu_launch(relu2_kernel, stride_blocks(n8 ? n8 : n), 256, 0, (cudaStream_t)stream, x, n, n8);
    OPS_LAUNCH_CHECK("relu2");
    return FP4MOE_OK;
}

__global__ void residual_kernel(float *__restrict__ h, const uint16_t *__restrict__ a,
                                const uint16_t *__restrict__ b, int64_t n) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float o = ops_bf16_to_f32(a[i]);
        if (b) o = __fadd_rn(o, ops_bf16_to_f32(b[i]));
        h[i] = __fadd_rn(h[i], o);
    }
}

extern "C" int cuda_residual_add(void *stream, float *h, const uint16_t *a, const uint16_t *b,
                                 int64_t n) {
    if (n <= 0) return FP4MOE_OK;
    cu_launch(residual_kernel, stride_blocks(n), 256, 0, (cudaStream_t)stream, h, a, b, n);
    OPS_LAUNCH_CHECK("residual add");
    return FP4MOE_OK;
}

/* ---- greedy argmax ---------------------------------------------------------------------------- */

/* a beats b: a number beats NaN; larger wins; equal values: lower index. */
__device__ __forceinline__ bool arg_better(float av, int ai, float bv, int bi) {
    const bool an = isnan(av), bn = isnan(bv);
    if (an != bn) return bn;
    if (!an && av != bv) return av > bv;
#ifdef FP4MOE_INJECT_FAULT_ARGMAX_TIE /* deliberate fault (tests must catch it): ties to the higher index */
    return ai > bi;
#else
    return ai < bi;
#endif
}

#ifndef ARGMAX_THREADS
#define ARGMAX_THREADS 1024 /* one block a row: the most loads in flight (256: 31 us for a 131,072-logit row, ncu) */
#endif

/* The block's best (value, index) of (v, i) pairs held one per thread, into (*bv, *bi) of thread 0. */
__device__ void block_argmax(float v, int i, float *bv, int *bi) {
    __shared__ float sv[32];
    __shared__ int si[32];
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (arg_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        const bool has = lane < (int)(blockDim.x >> 5);
        v = has ? sv[lane] : __int_as_float(0x7fc00000);
        i = has ? si[lane] : INT_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, i, o);
            if (arg_better(ov, oi, v, i)) { v = ov; i = oi; }
        }
        if (lane == 0) { *bv = v; *bi = i; }
    }
}

/* The best (value, index) of x[lo, hi) into (*bv, *bi), folded into what they hold, a thread's share of
 * THREADS: float4 loads when vec (x 16-byte aligned, lo and hi multiples of 4), UNROLL of them in flight
 * a thread (one block reading a row with one load at a time is latency-bound: 217 us for the 131,072
 * logits of a decode row). The order rules are a total order on (value, index), so the result does not
 * depend on which thread sees which element. */
template <int THREADS, int UNROLL>
__device__ __forceinline__ void argmax_range(const float *__restrict__ x, int lo, int hi, int vec, float *bv,
                                             int *bi) {
    if (vec) {
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
        const int hi4 = hi / 4;
        for (int i0 = lo / 4 + (int)threadIdx.x; i0 < hi4; i0 += THREADS * UNROLL) {
            float4 q[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int i = i0 + u * THREADS;
                q[u] = i < hi4 ? __ldg(x4 + i) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                const int i = i0 + u * THREADS;
                if (i < hi4) {
                    const float v[4] = {q[u].x, q[u].y, q[u].z, q[u].w};
#pragma unroll
                    for (int c = 0; c < 4; c++)
                        if (arg_better(v[c], 4 * i + c, *bv, *bi)) { *bv = v[c]; *bi = 4 * i + c; }
                }
            }
        }
    } else {
        for (int i = lo + (int)threadIdx.x; i < hi; i += THREADS) {
            const float v = x[i];
            if (arg_better(v, i, *bv, *bi)) { *bv = v; *bi = i; }
        }
    }
}

/* One block per row: out[r] = argmax of row r (rows too many or too short for the split form). */
#define ARGMAX_UNROLL 8
__global__ void __launch_bounds__(ARGMAX_THREADS)
argmax_rows_kernel(const float *__restrict__ x, int n, int vec, int32_t *__restrict__ out) {
    cu_pdl_entry();
    float bv = __int_as_float(0x7fc00000);
    int bi = INT_MAX;
    argmax_range<ARGMAX_THREADS, ARGMAX_UNROLL>(x + (int64_t)blockIdx.x * n, 0, n, vec, &bv, &bi);
    __shared__ float v;
    __shared__ int i;
    block_argmax(bv, bi, &v, &i);
    if (threadIdx.x == 0) out[blockIdx.x] = i == INT_MAX ? 0 : i;
}

/* The split form, for the few rows of a decode step: one 1,024-thread block reading a 131,072-logit row
 * took ~16 us of a ~1,680 us decode token (Nsight Compute, session 31), on the step's critical path.
 * Row r's n logits are cut into P parts of ps elements (ps a multiple of 4 x ARGMAX_SPLIT_THREADS,
 * P <= ARGMAX_SPLIT_PARTS), one block a part (grid P x rows). Each block writes its part's best pair
 * to the scratch; the block that takes a row's last ticket (an atomic counter a row) reduces the P
 * pairs into out[r] and sets the counter back to 0, so the scratch is ready for the next call (and
 * for a graph's next replay). The same order rules, so the same result as one block a row. */
#define ARGMAX_SPLIT_THREADS 256
#define ARGMAX_SPLIT_PARTS 64 /* at most: the last block's warp reduces them, two a lane */
#define ARGMAX_SPLIT_ROWS 8   /* at most (more rows: one block a row has blocks enough) */
#define ARGMAX_SPLIT_MIN 8192 /* n below: one block a row */
struct argmax_split_ws {
    int ticket[ARGMAX_SPLIT_ROWS];
    float v[ARGMAX_SPLIT_ROWS][ARGMAX_SPLIT_PARTS];
    int i[ARGMAX_SPLIT_ROWS][ARGMAX_SPLIT_PARTS];
};

__global__ void __launch_bounds__(ARGMAX_SPLIT_THREADS)
argmax_split_kernel(const float *__restrict__ x, int n, int ps, int vec, argmax_split_ws *ws,
                    int32_t *__restrict__ out) {
    cu_pdl_entry();
    const int p = blockIdx.x, P = gridDim.x, r = blockIdx.y, lo = p * ps, hi = min(n, lo + ps);
    float bv = __int_as_float(0x7fc00000);
    int bi = INT_MAX;
    argmax_range<ARGMAX_SPLIT_THREADS, 4>(x + (int64_t)r * n, lo, hi, vec, &bv, &bi);
    __shared__ float v;
    __shared__ int i;
    __shared__ int last;
    block_argmax(bv, bi, &v, &i);
    if (threadIdx.x == 0) {
        ws->v[r][p] = v;
        ws->i[r][p] = i;
        __threadfence(); /* the pair is visible before the ticket */
        last = atomicAdd(&ws->ticket[r], 1) == P - 1;
    }
    __syncthreads();
    if (!last || threadIdx.x >= 32) return;
    __threadfence(); /* every other block's pair was written before its ticket */
    const int lane = threadIdx.x;
    bv = __int_as_float(0x7fc00000);
    bi = INT_MAX;
    for (int j = lane; j < P; j += 32) {
        const float jv = __ldcg(&ws->v[r][j]);
        const int ji = __ldcg(&ws->i[r][j]);
        if (arg_better(jv, ji, bv, bi)) { bv = jv; bi = ji; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (arg_better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) {
        out[r] = bi == INT_MAX ? 0 : bi;
#ifndef FP4MOE_INJECT_FAULT_ARGMAX_RESET /* deliberate fault (tests must catch it): the counter left as it is */
        ws->ticket[r] = 0;
#endif
    }
}

extern "C" size_t cuda_argmax_ws_bytes(void) { return sizeof(argmax_split_ws); }

extern "C" int cuda_argmax_rows_f32(void *stream, const float *x, int64_t rows, int64_t n, int32_t *out, void *ws) {
    if (rows <= 0) return FP4MOE_OK;
    if (n < 1 || n > INT_MAX || rows > INT_MAX)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op argmax rows: %lld x %lld", (long long)rows,
                                (long long)n);
    const int vec = (n % 4) == 0 && ((uintptr_t)x & 15) == 0;
    if (ws && rows <= ARGMAX_SPLIT_ROWS && n >= ARGMAX_SPLIT_MIN) {
        const int64_t q = 4 * ARGMAX_SPLIT_THREADS; /* a part: whole float4 rounds of the block */
        const int64_t ps = ((n + ARGMAX_SPLIT_PARTS - 1) / ARGMAX_SPLIT_PARTS + q - 1) / q * q;
        const unsigned P = (unsigned)((n + ps - 1) / ps);
        cu_launch(argmax_split_kernel, dim3(P, (unsigned)rows), ARGMAX_SPLIT_THREADS, 0, (cudaStream_t)stream, x,
                  (int)n, (int)ps, vec, (argmax_split_ws *)ws, out);
    } else {
        cu_launch(argmax_rows_kernel, (unsigned)rows, ARGMAX_THREADS, 0, (cudaStream_t)stream, x, (int)n, vec, out);
    }
    OPS_LAUNCH_CHECK("argmax rows");
    return FP4MOE_OK;
}

extern "C" int cuda_rmsnorm_rows(void *stream, const float *x, const int32_t *rows, int64_t n, const float *w,
                                 int64_t H, float eps, uint16_t *y) {
    if (n <= 0) return FP4MOE_OK;
    rmsnorm_launch((cudaStream_t)stream, (float *)x, NULL, NULL, w, n, H, eps, y, NULL, rows);
    OPS_LAUNCH_CHECK("rmsnorm rows");
    return FP4MOE_OK;
}
