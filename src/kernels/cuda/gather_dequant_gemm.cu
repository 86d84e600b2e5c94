/* The dequantize + cuBLAS gather_qmm route (sorted idx). Contract: docs/spec/NVFP4.md
 * section 4; measurements: docs/PERFORMANCE.md, docs/GPU-NOTES.md.
 *
 * 1. The runs kernel finds each expert's run on the device; its E+1 run starts (and the global
 *    scales) are copied to the host: the route SYNCHRONIZES THE STREAM once, because cuBLAS needs
 *    each run's row count on the host.
 * 2. Experts that have rows are dequantized (w = e2m1 * e4m3, exact in f16/bf16/f32) into a cached
 *    per-device scratch, as many at a time as fit in FP4MOE_DQ_SCRATCH_BYTES.
 * 3. One cublasGemmEx per run: y_run (len x N) = gs[e] * x_run (len x K) * W_e^T, fp32 compute
 *    (CUBLAS_COMPUTE_32F: f32 activations get plain fp32, no TF32), rounded once to dtype.
 *    Out-of-range rows (the sorted tail) are cleared with cudaMemsetAsync.
 * The scratch and the cuBLAS handle are cached per device and guarded by a process-wide mutex,
 * which is held until the stream has finished with the scratch (a second synchronisation at the
 * end), so concurrent calls from several host threads are serialized but safe. */
#include <cublas_v2.h>
#include <pthread.h>
#include <stdlib.h>

#include "kernels/cuda/gather_cuda.cuh"
#include "kernels/gather_common.h"
#include "kernels/cuda/cuda_launch.cuh"

#define FP4MOE_DQ_SCRATCH_BYTES (1ull << 30) /* dequantized experts per batch: at most 1 GiB */
#define DQ_MAX_DEVICES 64

/* w[e][n][k] for the experts e0 .. e0+ne-1 that have rows, into out[(e - e0)][n][k] (dtype T).
 * One thread per NVFP4 block (16 weights: one 8-byte code load, one scale byte). tiled: the codes
 * and scale bytes of block (n, kb) are read from its piece of the tiled layout (gather_cuda.cuh). */
template <typename T>
__global__ void gq_dequant_kernel(const uint8_t *__restrict__ codes, const uint8_t *__restrict__ scales,
                                  int E, int N, int K, const int *__restrict__ starts, int e0, int tiled,
                                  T *__restrict__ out) {
    cu_pdl_entry();
    const int e = e0 + blockIdx.y;
    if (starts && starts[e + 1] <= starts[e]) return; /* no rows: not needed (NULL: every expert) */
    const int64_t nblocks = (int64_t)N * (K >> 4);
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= nblocks) return;
    uint2 c;
    float s;
    if (tiled) {
        const int n = (int)(i / (K >> 4)), kb = (int)(i % (K >> 4)), ch = kb >> 1, r16 = n & 15;
        const int lane = (r16 & 7) * 4 + (ch & 3), hb = r16 >> 3; /* hb: row r + 8 of the tile */
        const uint8_t *p = gq_tiled_piece(codes, cu_weight_expert(e, E), n >> 4, ch >> 2, N, K);
        c = cu_ld_stream8(p + hb * 512 + lane * 16 + (kb & 1) * 8);
        c.x = tc_unarrange(c.x); /* the checkpoint words (src/kernels/tiled_codes.h) */
        c.y = tc_unarrange(c.y);
        s = tc_scale_f32(__ldg(p + 1024 + lane * 4 + hb * 2 + (kb & 1))); /* |s|: the sign is in the codes */
    } else {
        const int64_t src = cu_weight_expert(e, E) * nblocks + i; /* block index within all experts */
        c = cu_ld_stream8(codes + src * 8);
        s = cu_e4m3_to_float(__ldg(scales + src));
    }
    const uint32_t cw[2] = {c.x, c.y};
    union {
        T v[16];
        uint4 q[16 * sizeof(T) / 16];
    } o;
#pragma unroll
    for (int j = 0; j < 16; j++) /* (e2m1 * 2^-126 * 2^100) * (s * 2^26): exact in fp32 */
        o.v[j] = cu_from_float<T>(cu_e2m1_f32(cw[j >> 3], j & 7) * 0x1p100f * (s * 0x1p26f));
    uint4 *dst = reinterpret_cast<uint4 *>(out + (int64_t)blockIdx.y * nblocks * 16 + i * 16);
#pragma unroll
    for (int j = 0; j < (int)(16 * sizeof(T) / 16); j++) dst[j] = o.q[j]; /* 16-byte stores */
}

static pthread_mutex_t g_dq_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
    cublasHandle_t handle;
    void *scratch;
    size_t bytes;
} g_dq[DQ_MAX_DEVICES];

#define CUBLAS_TRY(call, what)                                                                     \
    do {                                                                                           \
        const cublasStatus_t cs_ = (call);                                                         \
        if (cs_ != CUBLAS_STATUS_SUCCESS) {                                                        \
            rc = fp4moe_set_error(FP4MOE_ECUDA, "gather_qmm_cuda: %s: cuBLAS status %d", (what),   \
                                  (int)cs_);                                                       \
            goto done;                                                                             \
        }                                                                                          \
    } while (0)

template <typename T>
static int dequant_gemm(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    const cudaDataType_t ty = dtype == FP4MOE_F32 ? CUDA_R_32F : dtype == FP4MOE_F16 ? CUDA_R_16F : CUDA_R_16BF;
    const size_t es = sizeof(T);
    const int64_t per_expert = (int64_t)a->N * a->K; /* weights */
    int rc = FP4MOE_OK, dev = 0, e0 = 0;
    int *d_starts = NULL, *h_starts = NULL;
    float *h_gs = NULL;
    int64_t batch;

    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetDevice(&dev), "cudaGetDevice");
    if (dev < 0 || dev >= DQ_MAX_DEVICES)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: device %d >= %d", dev, DQ_MAX_DEVICES);
    if ((uint64_t)per_expert * es > FP4MOE_DQ_SCRATCH_BYTES)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "gather_qmm_cuda: dequant_gemm: one expert (N=%d x K=%d) exceeds the %llu-byte scratch",
                                a->N, a->K, (unsigned long long)FP4MOE_DQ_SCRATCH_BYTES);
    h_starts = (int *)malloc(((size_t)a->E + 1) * sizeof(int));
    h_gs = (float *)malloc((size_t)a->E * sizeof(float));
    if (!h_starts || !h_gs) {
        free(h_starts);
        free(h_gs);
        return fp4moe_set_error(FP4MOE_ENOMEM, "gather_qmm_cuda: dequant_gemm: host buffers for E=%d", a->E);
    }
    pthread_mutex_lock(&g_dq_lock);

    /* 1. run starts (and global scales) on the host: the one synchronisation of this route */
    rc = gq_scratch_alloc((void **)&d_starts, ((size_t)a->E + 1) * sizeof(int), st);
    if (rc != FP4MOE_OK) goto done;
    rc = gq_launch_runs(a, 1, d_starts, NULL, st);
    if (rc != FP4MOE_OK) goto done;
    FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaMemcpyAsync(h_starts, d_starts, ((size_t)a->E + 1) * sizeof(int), cudaMemcpyDeviceToHost, st),
                  "copy of the run starts to the host", rc, done);
    if (a->gs)
        FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaMemcpyAsync(h_gs, a->gs, (size_t)a->E * sizeof(float), cudaMemcpyDeviceToHost, st),
                      "copy of the global scales to the host", rc, done);
    FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaStreamSynchronize(st), "cudaStreamSynchronize (run sizes for cuBLAS)", rc, done);

    /* 2. cached scratch and handle */
    if (!g_dq[dev].handle) CUBLAS_TRY(cublasCreate(&g_dq[dev].handle), "cublasCreate");
    CUBLAS_TRY(cublasSetStream(g_dq[dev].handle, st), "cublasSetStream");
    CUBLAS_TRY(cublasSetPointerMode(g_dq[dev].handle, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
    batch = (int64_t)(FP4MOE_DQ_SCRATCH_BYTES / ((uint64_t)per_expert * es));
    if (batch > a->E) batch = a->E;
    if (batch > 65535) batch = 65535; /* gridDim.y of the dequantize kernel */
    if (g_dq[dev].bytes < (size_t)(batch * per_expert) * es) {
        if (g_dq[dev].scratch) FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaFree(g_dq[dev].scratch), "cudaFree of the dequant scratch", rc, done);
        g_dq[dev].scratch = NULL;
        g_dq[dev].bytes = 0;
        FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaMalloc(&g_dq[dev].scratch, (size_t)(batch * per_expert) * es),
                      "cudaMalloc of the dequant scratch", rc, done);
        g_dq[dev].bytes = (size_t)(batch * per_expert) * es;
    }

    /* 3. per batch of experts: dequantize those with rows, one GEMM per run */
    for (e0 = 0; e0 < a->E; e0 += (int)batch) {
        const int ne = (int)(a->E - e0 < batch ? a->E - e0 : batch);
        if (h_starts[e0 + ne] <= h_starts[e0]) continue; /* no rows in this batch */
        const int64_t nblocks = (int64_t)a->N * (a->K >> 4);
        const dim3 grid((unsigned)((nblocks + 255) / 256), (unsigned)ne);
        cu_launch(gq_dequant_kernel<T>, grid, 256, 0, st, a->codes, a->scales, a->E, a->N, a->K, d_starts, e0, a->tiled,
                  (T *)g_dq[dev].scratch);
        FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaGetLastError(), "launch of the dequantize kernel", rc, done);
        for (int e = e0; e < e0 + ne; e++) {
            const int len = h_starts[e + 1] - h_starts[e];
            if (len <= 0) continue;
            /* column-major view: Y^T (N x len, ld N) = W_e (K x N, ld K)^T * X^T (K x len, ld K) */
            const float alpha = gather_expert_gs(a->gs ? h_gs : NULL, e), beta = 0.0f;
            const char *W = (const char *)g_dq[dev].scratch + (size_t)(e - e0) * per_expert * es;
            const char *X = (const char *)a->x + (size_t)h_starts[e] * a->K * es;
            char *Y = (char *)a->y + (size_t)h_starts[e] * a->N * es;
            CUBLAS_TRY(cublasGemmEx(g_dq[dev].handle, CUBLAS_OP_T, CUBLAS_OP_N, a->N, len, a->K, &alpha, W, ty,
                                    a->K, X, ty, a->K, &beta, Y, ty, a->N, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT),
                       "cublasGemmEx");
        }
    }
    /* out-of-range rows: [starts[E], B) */
    if (h_starts[a->E] < a->B)
        FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaMemsetAsync((char *)a->y + (size_t)h_starts[a->E] * a->N * es, 0,
                                      (size_t)(a->B - h_starts[a->E]) * a->N * es, st),
                      "cudaMemsetAsync of the out-of-range rows", rc, done);
    /* the scratch is reused by the next call: wait for this one before releasing the lock */
    FP4MOE_CUDA_TRY_GOTO("gather_qmm_cuda", cudaStreamSynchronize(st), "cudaStreamSynchronize (end of dequant_gemm)", rc, done);
done:
    if (d_starts) {
        const int rc2 = gq_scratch_free(d_starts, st);
        if (rc == FP4MOE_OK) rc = rc2;
    }
    pthread_mutex_unlock(&g_dq_lock);
    free(h_starts);
    free(h_gs);
    return rc;
}

extern "C" int cuda_nvfp4_dequant_bf16(void *stream, const uint8_t *codes, const uint8_t *scales, int tiled,
                                       int64_t N, int64_t K, void *out) {
    if (K % 16 || N <= 0 || K <= 0 || N > INT32_MAX || K > INT32_MAX || N * K / 16 / 256 >= INT32_MAX)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda_nvfp4_dequant_bf16: N=%lld K=%lld (K %% 16 == 0)",
                                (long long)N, (long long)K);
    const int64_t nblocks = N * K / 16;
    cu_launch(gq_dequant_kernel<__nv_bfloat16>, dim3((unsigned)((nblocks + 255) / 256), 1), 256, 0,
              (cudaStream_t)stream, codes, scales, 1, (int)N, (int)K, nullptr, 0, tiled, (__nv_bfloat16 *)out);
    FP4MOE_CUDA_TRY("cuda_nvfp4_dequant_bf16", cudaGetLastError(), "launch of the dequantize kernel");
    return FP4MOE_OK;
}

/* The plain-linear form (E = 1, every row's idx 0; gq_dense_dequant_gemm in gather_cuda.cuh): no
 * runs, no host synchronisation, the caller's stream-ordered scratch and cuBLAS handle. */
int gq_dense_dequant_gemm(const gq_args *a, cudaStream_t st, void *blas, gq_dense_scratch *dq, const void *wbf16,
                          const float *d_zero) {
    const int64_t per_expert = (int64_t)a->N * a->K;
    const size_t bytes = (size_t)per_expert * sizeof(__nv_bfloat16);
    cublasHandle_t h = (cublasHandle_t)blas;
    int rc = FP4MOE_OK;
    if (wbf16) {
        /* dequantized at load: the same bits as the kernel below writes */
    } else if (dq->bytes < bytes) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaStreamIsCapturing(st, &cs), "cudaStreamIsCapturing");
        if (cs != cudaStreamCaptureStatusNone) /* no allocation inside a graph capture */
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: dense dequant scratch of %zu bytes "
                                    "first needed during a graph capture", bytes);
        if (dq->p) {
            FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaStreamSynchronize(st), "cudaStreamSynchronize (scratch growth)");
            FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaFree(dq->p), "cudaFree of the dense dequant scratch");
        }
        dq->p = NULL;
        dq->bytes = 0;
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaMalloc(&dq->p, bytes), "cudaMalloc of the dense dequant scratch");
        dq->bytes = bytes;
    }
    if (!wbf16) {
        const int drc = cuda_nvfp4_dequant_bf16(st, a->codes, a->scales, a->tiled, a->N, a->K, dq->p);
        if (drc) return drc;
    }
    const void *W = wbf16 ? wbf16 : dq->p;
    /* y^T (N x B, ld N) = W (K x N, ld K)^T * x^T (K x B, ld K), alpha = the global scale (read by
     * cuBLAS from device memory: no copy to the host), beta = 0, fp32 compute, one rounding */
    const float one = 1.0f, zero = 0.0f;
#ifdef FP4MOE_INJECT_FAULT_GLOBAL_SCALE /* deliberate fault (tests must catch it): gs dropped */
    const bool dev_alpha = false;
#else
    const bool dev_alpha = a->gs != NULL;
#endif
    if (dev_alpha) CUBLAS_TRY(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE), "cublasSetPointerMode");
    CUBLAS_TRY(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, a->N, a->B, a->K, dev_alpha ? a->gs : &one, W,
                            CUDA_R_16BF, a->K, a->x, CUDA_R_16BF, a->K, dev_alpha ? d_zero : &zero, a->y,
                            CUDA_R_16BF, a->N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (dense NVFP4 linear)");
done:
    if (dev_alpha) {
        const cublasStatus_t cs = cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST);
        if (cs != CUBLAS_STATUS_SUCCESS && rc == FP4MOE_OK)
            rc = fp4moe_set_error(FP4MOE_ECUDA, "gather_qmm_cuda: cublasSetPointerMode: cuBLAS status %d", (int)cs);
    }
    return rc;
}

int gq_run_dequant_gemm(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    switch (dtype) {
    case FP4MOE_F32: return dequant_gemm<float>(a, dtype, st);
    case FP4MOE_F16: return dequant_gemm<__half>(a, dtype, st);
    default: return dequant_gemm<__nv_bfloat16>(a, dtype, st);
    }
}
