/* CUDA linear layers of the nemotron_h forward pass: NVFP4 through the public
 * fp4moe_gather_qmm_cuda (E = 1 for plain linears, sorted rows for experts; never a second NVFP4
 * implementation), dense bf16/f32 through cuBLAS (cublasGemmEx, fp32 compute, no TF32), the fp32
 * router matmul, and a plain kernel for unquantized expert stacks. Contracts: ops_cuda.h;
 * formulas: src/kernels/cpu/ops_linear.c. */
#include <cublas_v2.h>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/cuda_launch.cuh"

#define BLAS_TRY(call, what)                                                                       \
    do {                                                                                           \
        const cublasStatus_t bt_s_ = (call);                                                       \
        if (bt_s_ != CUBLAS_STATUS_SUCCESS)                                                        \
            return fp4moe_set_error(FP4MOE_ECUDA, "cuda op %s: %s", (what),                        \
                                    cublasGetStatusString(bt_s_));                                 \
    } while (0)

extern "C" int cuda_blas_create(void *stream, void *workspace, size_t workspace_bytes, void **blas) {
    cublasHandle_t h = NULL;
    *blas = NULL;
    BLAS_TRY(cublasCreate(&h), "cublasCreate");
    cublasStatus_t s = cublasSetStream(h, (cudaStream_t)stream);
    if (s == CUBLAS_STATUS_SUCCESS && workspace) s = cublasSetWorkspace(h, workspace, workspace_bytes);
    if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cublasDestroy(h);
        return fp4moe_set_error(FP4MOE_ECUDA, "cuda op cublas setup: %s", cublasGetStatusString(s));
    }
    *blas = h;
    return FP4MOE_OK;
}

extern "C" void cuda_blas_destroy(void *blas) {
    if (blas) cublasDestroy((cublasHandle_t)blas);
}

/* Row-major y (T x N) = x (T x K) @ W^T with W (N x K) row-major: in cuBLAS's column-major terms
 * y^T (N x T, ld N) = (W^T as K x N, ld K)^T * x^T (K x T, ld K). */
static int gemm_xwt(cublasHandle_t h, const void *W, const void *x, void *y, cudaDataType_t ab,
                    cudaDataType_t c, int64_t T, int64_t N, int64_t K, const char *what) {
    if (T > 0x7fffffff || N > 0x7fffffff || K > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op %s: %lld x %lld x %lld exceeds int",
                                what, (long long)T, (long long)N, (long long)K);
    const float one = 1.0f, zero = 0.0f;
    BLAS_TRY(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)T, (int)K, &one, W, ab, (int)K, x,
                          ab, (int)K, &zero, y, c, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             what);
    return FP4MOE_OK;
}

/* ---- small kernels ----------------------------------------------------------------------------- */

static unsigned grid_for(int64_t n) {
    const int64_t b = (n + 255) / 256;
    return (unsigned)(b < 65536 ? (b > 0 ? b : 1) : 65536);
}

__global__ void widen_kernel(const uint16_t *x, int64_t n, float *y) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = ops_bf16_to_f32(x[i]);
}

__global__ void narrow_kernel(const float *x, int64_t n, uint16_t *y) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = ops_f32_to_bf16(x[i]);
}

__global__ void bias_kernel(uint16_t *y, const float *bias, int64_t T, int64_t N) {
    cu_pdl_entry();
    const int64_t n = T * N;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = ops_f32_to_bf16(__fadd_rn(ops_bf16_to_f32(y[i]), bias[i % N]));
}

__global__ void bias_f32_kernel(float *y, const float *bias, int64_t T, int64_t N) {
    cu_pdl_entry();
    const int64_t n = T * N;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = __fadd_rn(y[i], bias[i % N]);
}

/* Dense experts: warp per (row b, feature n), fp32 dot product; rows with idx >= E are zeros. */
__global__ void dense_gather_kernel(const void *W, int f32, int64_t E, int64_t N, int64_t K,
                                    const uint16_t *x, const uint32_t *idx, uint16_t *y) {
    cu_pdl_entry();
    const int lane = threadIdx.x & 31;
    const int64_t n = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), b = blockIdx.y;
    if (n >= N) return;
    const uint32_t e = idx[b];
    float acc = 0.0f;
    if (e < (uint32_t)E) {
        const int64_t off = ((int64_t)e * N + n) * K;
        for (int64_t k = lane; k < K; k += 32) {
            const float w = f32 ? ((const float *)W)[off + k] : ops_bf16_to_f32(((const uint16_t *)W)[off + k]);
            acc = fmaf(ops_bf16_to_f32(x[b * K + k]), w, acc);
        }
    }
    acc = ops_warp_sum(acc);
    if (lane == 0) y[b * N + n] = ops_f32_to_bf16(acc);
}

static int add_bias(const cuda_ops *o, const cuda_linear *w, int64_t T, uint16_t *y) {
    if (!w->bias) return FP4MOE_OK;
    cu_launch(bias_kernel, grid_for(T * w->N), 256, 0, (cudaStream_t)o->stream, y, w->bias, T, w->N);
    OPS_LAUNCH_CHECK("linear bias");
    return FP4MOE_OK;
}

/* ---- entry points ------------------------------------------------------------------------------ */

/* relu2 (only when the layer has no bias: the bias comes first) is done in the gather_qmm epilogue
 * where the chosen kernel can (*fused), else by the caller. */
static int nvfp4_call(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, const uint32_t *idx,
                      int64_t B, int relu2, uint16_t *y, int *fused) {
    return gather_qmm_cuda_ex(&w->q, w->tiled, x, FP4MOE_BF16, idx, B, 1, o->route, relu2, y, o->stream, fused,
                              &o->runs);
}

/* bias, then relu^2 unless already done */
static int finish(const cuda_ops *o, const cuda_linear *w, int64_t T, int relu2, int fused, uint16_t *y) {
    const int rc = add_bias(o, w, T, y);
    if (rc || !relu2 || fused) return rc;
    return cuda_relu2(o->stream, y, T * w->N);
}

extern "C" int cuda_linear_forward(const cuda_ops *o, const cuda_linear *w, const uint16_t *x,
                                   int64_t T, int relu2, uint16_t *y) {
    if (T <= 0) return FP4MOE_OK;
    cudaStream_t st = (cudaStream_t)o->stream;
    int rc, fused = 0;
    if (w->nvfp4) {
        if (T > o->zero_n)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear: %lld rows, idx zeros for %lld",
                                    (long long)T, (long long)o->zero_n);
        /* E = 1, idx all 0: the dense dequant_gemm form where that route is chosen (no host
         * synchronisation); beta = 0.0f read from the zeros of zero_idx (bit pattern 0) */
        rc = gather_qmm_cuda_linear(&w->q, w->tiled, x, FP4MOE_BF16, o->zero_idx, T, o->route, relu2 && !w->bias, y,
                                    o->stream, o->blas, o->dq, w->wbf16, (const float *)(const void *)o->zero_idx,
                                    o->e1_runs, &fused);
    } else if (w->dtype == FP4MOE_BF16) {
        rc = gemm_xwt((cublasHandle_t)o->blas, w->dense, x, y, CUDA_R_16BF, CUDA_R_16BF, T, w->N, w->K,
                      "linear (cublasGemmEx bf16)");
    } else {
        if (T * w->K > o->f32_n || T * w->N > o->f32_n)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear: f32 weights (%lld x %lld) need "
                                    "%lld staging floats, have %lld", (long long)w->N, (long long)w->K,
                                    (long long)(T * (w->K > w->N ? w->K : w->N)), (long long)o->f32_n);
        cu_launch(widen_kernel, grid_for(T * w->K), 256, 0, st, x, T * w->K, o->f32_x);
        OPS_LAUNCH_CHECK("linear (widen x to f32)");
        rc = gemm_xwt((cublasHandle_t)o->blas, w->dense, o->f32_x, o->f32_y, CUDA_R_32F, CUDA_R_32F, T,
                      w->N, w->K, "linear (cublasGemmEx f32)");
        if (rc) return rc;
        cu_launch(narrow_kernel, grid_for(T * w->N), 256, 0, st, o->f32_y, T * w->N, y);
        OPS_LAUNCH_CHECK("linear (round y to bf16)");
    }
    if (rc) return rc;
    return finish(o, w, T, relu2, fused, y);
}

extern "C" int cuda_linear_forward_f32out(const cuda_ops *o, const cuda_linear *w, const uint16_t *x,
                                          int64_t T, float *y) {
    if (T <= 0) return FP4MOE_OK;
    cudaStream_t st = (cudaStream_t)o->stream;
    int rc;
    if (w->nvfp4 && T > o->zero_n)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear (f32 out): %lld rows, idx zeros for %lld",
                                (long long)T, (long long)o->zero_n);
    if (!w->nvfp4 && w->dtype != FP4MOE_BF16) {         /* f32 weights read x as f32 */
        if (T * w->K > o->f32_n)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear (f32 out): x of %lld x %lld needs "
                                    "%lld staging floats, have %lld", (long long)T, (long long)w->K,
                                    (long long)(T * w->K), (long long)o->f32_n);
        cu_launch(widen_kernel, grid_for(T * w->K), 256, 0, st, x, T * w->K, o->f32_x);
        OPS_LAUNCH_CHECK("linear (widen x to f32)");
    }
    if (w->nvfp4) {
        rc = gather_qmm_cuda_bf16_f32out(&w->q, w->tiled, x, o->zero_idx, T, y, o->stream);
    } else if (w->dtype == FP4MOE_BF16) {
        rc = gemm_xwt((cublasHandle_t)o->blas, w->dense, x, y, CUDA_R_16BF, CUDA_R_32F, T, w->N, w->K,
                      "linear (cublasGemmEx bf16, f32 out)");
    } else {
        rc = gemm_xwt((cublasHandle_t)o->blas, w->dense, o->f32_x, y, CUDA_R_32F, CUDA_R_32F, T, w->N, w->K,
                      "linear (cublasGemmEx f32)");
    }
    if (rc || !w->bias) return rc;
    cu_launch(bias_f32_kernel, grid_for(T * w->N), 256, 0, st, y, w->bias, T, w->N);
    OPS_LAUNCH_CHECK("linear bias");
    return FP4MOE_OK;
}

extern "C" int cuda_linear_gather(const cuda_ops *o, const cuda_linear *w, const uint16_t *x,
                                  const uint32_t *idx, int64_t B, int relu2, uint16_t *y) {
    if (B <= 0) return FP4MOE_OK;
    int rc, fused = 0;
    if (w->nvfp4) {
        rc = nvfp4_call(o, w, x, idx, B, relu2 && !w->bias, y, &fused);
    } else {
        if (B > 65535)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear gather: %lld rows on dense "
                                    "(unquantized) experts; at most 65535", (long long)B);
        const dim3 grid(ops_blocks(w->N, 8), (unsigned)B);
        cu_launch(dense_gather_kernel, grid, 256, 0, (cudaStream_t)o->stream, w->dense, w->dtype == FP4MOE_F32, w->E,
                  w->N, w->K, x, idx, y);
        OPS_LAUNCH_CHECK("linear gather (dense experts)");
        rc = FP4MOE_OK;
    }
    if (rc) return rc;
    return finish(o, w, B, relu2, fused, y);
}

extern "C" int cuda_linear_gather_x1(const cuda_ops *o, const cuda_linear *w, const uint16_t *x,
                                     const uint32_t *idx, int64_t B, int relu2, uint16_t *y) {
    if (!w->nvfp4 || w->bias)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear gather (x1): dense or biased experts");
    return gather_qmm_cuda_x1(&w->q, w->tiled, x, idx, B, o->route, relu2, y, o->stream);
}

extern "C" int cuda_linear_gather_rows(const cuda_ops *o, const cuda_linear *w, const uint16_t *x, int64_t T,
                                       const uint32_t *row_of, int64_t k, const uint32_t *idx, int64_t B, int relu2,
                                       uint16_t *y) {
    if (!w->nvfp4 || w->bias)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda linear gather (rows): dense or biased experts");
    if (B <= 0) return FP4MOE_OK;
    return gather_qmm_cuda_rows(&w->q, w->tiled, x, T, row_of, k, idx, B, o->route, relu2, y, o->stream, &o->runs);
}

extern "C" int cuda_experts_rows(const cuda_ops *o, const cuda_linear *up, const cuda_linear *down, const uint16_t *x,
                                 int64_t T, const uint32_t *row_of, int64_t k, const uint32_t *idx, int64_t B,
                                 uint16_t *hs, uint16_t *ys) {
    if (!up->nvfp4 || up->bias || !down->nvfp4 || down->bias)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda experts (fused): dense or biased experts");
    if (B <= 0) return FP4MOE_OK;
    return gather_qmm_cuda_moe_rows(&up->q, up->tiled, &down->q, down->tiled, x, T, row_of, k, idx, B, o->route, hs, ys,
                                    o->stream, &o->runs);
}

/* y[i] = p[i] + p[n + i] + ... + p[(S-1) n + i], in that order */
__global__ void sum_splits_kernel(const float *__restrict__ p, int S, int64_t n, float *__restrict__ y) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = p[i];
#ifdef FP4MOE_INJECT_FAULT_SPLIT_SUM /* deliberate fault (tests must catch it): the last part dropped */
        for (int s = 1; s < S - 1; s++) v += p[(int64_t)s * n + i];
#else
        for (int s = 1; s < S; s++) v += p[(int64_t)s * n + i];
#endif
        y[i] = v;
    }
}

/* The K parts of cuda_matmul_f32's split-K form: for T <= MM_SPLIT_ROWS / 8 rows, the largest S <= 16
 * dividing K with S * T <= MM_SPLIT_ROWS, K / S % 4 == 0 and S * T * N <= split_n; 1: no split.
 * Measured on the H200 (docs/PERFORMANCE.md, session 17; router 512 / 2,048 x 128 x 2688): +1.0%
 * prefill at 512 tokens (16 parts), nothing at 2,048 (4 parts), hence no split above 1,024 rows. */
static int matmul_splits(int64_t T, int64_t N, int64_t K, int64_t split_n) {
    if (T > MM_SPLIT_ROWS / 8 || K % 8 != 0) return 1;
    for (int S = 16; S > 1; S--)
        if (K % S == 0 && (K / S) % 4 == 0 && S * T <= MM_SPLIT_ROWS && S * T * N <= split_n) return S;
    return 1;
}

extern "C" int cuda_matmul_f32(const cuda_ops *o, const float *x, int64_t T, const float *W, int64_t N,
                               int64_t K, float *y) {
    if (T <= 0) return FP4MOE_OK;
    const int S = o->split_ws ? matmul_splits(T, N, K, o->split_n) : 1;
    if (S > 1 && T <= 0x7fffffff && N <= 0x7fffffff && K <= 0x7fffffff) {
        const float one = 1.0f, zero = 0.0f;
        const int64_t Kc = K / S, n = T * N;
        /* part s: y_s^T (N x T, ld N) = W[:, s Kc ..]^T-view x x[:, s Kc ..]^T, as gemm_xwt */
        BLAS_TRY(cublasGemmStridedBatchedEx((cublasHandle_t)o->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, (int)T, (int)Kc,
                                            &one, W, CUDA_R_32F, (int)K, Kc, x, CUDA_R_32F, (int)K, Kc, &zero, o->split_ws,
                                            CUDA_R_32F, (int)N, n, S, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "matmul f32 (router, split K)");
        cu_launch(sum_splits_kernel, grid_for(n), 256, 0, (cudaStream_t)o->stream, o->split_ws, S, n, y);
        OPS_LAUNCH_CHECK("matmul f32 (router, the split-K sum)");
        return FP4MOE_OK;
    }
    return gemm_xwt((cublasHandle_t)o->blas, W, x, y, CUDA_R_32F, CUDA_R_32F, T, N, K,
                    "matmul f32 (router)");
}

/* ---- the router's matmul on bf16 tensor cores ---------------------------------------------------- */

/* out = three bf16 planes of w (n floats): p0 = bf16(w), p1 = bf16(w - p0), p2 = bf16(w - p0 - p1), each
 * difference exact in fp32; p0 + p1 + p2 = w exactly (8 + 8 + 8 significant bits cover fp32's 24; bf16 has
 * fp32's exponent range) unless a part falls below bf16's smallest normal (|w| < ~2^-110) or p0 rounds to
 * infinity (|w| >= 0x1.ff8p127). */
__global__ void split_bf16x3_kernel(const float *__restrict__ w, int64_t n, uint16_t *__restrict__ out) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const float v = w[i];
        const uint16_t a = ops_f32_to_bf16(v);
        const float r = v - ops_bf16_to_f32(a);
        const uint16_t b = ops_f32_to_bf16(r);
        out[i] = a;
        out[n + i] = b;
        out[2 * n + i] = ops_f32_to_bf16(r - ops_bf16_to_f32(b));
    }
}

extern "C" int cuda_split_bf16x3(void *stream, const float *w, int64_t n, uint16_t *out) {
    if (n <= 0) return FP4MOE_OK;
    cu_launch(split_bf16x3_kernel, grid_for(n), 256, 0, (cudaStream_t)stream, w, n, out);
    OPS_LAUNCH_CHECK("split into three bf16 planes (router weights)");
    return FP4MOE_OK;
}

extern "C" int64_t cuda_bf16x3_rows(const cuda_ops *o, int64_t N) {
    return o->split_ws && N > 0 ? o->split_n / (3 * N) : 0;
}

extern "C" int cuda_matmul_bf16x3_planes(const cuda_ops *o, const uint16_t *x, int64_t n, const uint16_t *W3, int64_t N,
                                         int64_t K) {
    if (n <= 0) return FP4MOE_OK;
    if (n > cuda_bf16x3_rows(o, N))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "cuda op matmul bf16x3: %lld rows, scratch for %lld rows of 3 x %lld outputs",
                                (long long)n, (long long)cuda_bf16x3_rows(o, N), (long long)N);
    return gemm_xwt((cublasHandle_t)o->blas, W3, x, o->split_ws, CUDA_R_16BF, CUDA_R_32F, n, 3 * N, K,
                    "matmul bf16x3 (router)");
}
