/* gpu_gemm_lt: the dense bf16 GEMMs of a nemotron_h prefill step (the plain linears' bf16 copies, y = x W^T, fp32
 * compute, bf16 out) as production calls them - cublasGemmEx(CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, ...,
 * CUBLAS_GEMM_DEFAULT) on a handle with a 32 MiB workspace (src/kernels/cuda/gather_dequant_gemm.cu,
 * gq_dense_dequant_gemm) - against every algorithm cublasLt's heuristic offers for the same problem (up to
 * GL_ALGOS, default 16), each checked against production's output first (bitwise-equal count, max |diff| / max |y|)
 * and then timed. Question it answers: do these shapes leave time on the table in cuBLAS's default choice (wave
 * quantization: in_proj at 512 rows is ~164 tiles of 128 x 256 on 132 SMs)?
 * Shapes (30B-A3B): in_proj 10,304 x 2,688 and out_proj 2,688 x 4,096 (23 Mamba-2 layers), the shared expert's up
 * 3,712 x 2,688 and down 2,688 x 3,712 (23), attention q 4,096 x 2,688, k / v 256 x 2,688, o 2,688 x 4,096 (6).
 * Timing: median of 7 batches of 20 calls (CUDA events), weights rotated over enough copies that a call does not
 * find its weights in L2 (as in the model, where every layer has its own).
 * Usage: [GL_EXPERTS=1] gpu_gemm_lt [ROWS ...] (default 512 2048). Prints a table per row count and, last, the step totals
 * (calls x ms): production against the best algorithm of each shape. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CK(call)                                                                                                \
    do {                                                                                                        \
        cudaError_t e_ = (call);                                                                                \
        if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); exit(1); } \
    } while (0)
#define CB(call)                                                                                                \
    do {                                                                                                        \
        int s_ = (int)(call);                                                                                   \
        if (s_ != 0) { fprintf(stderr, "%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #call, s_); exit(1); } \
    } while (0)

__global__ void fill_bf16(__nv_bfloat16 *p, int64_t n, uint32_t seed, float amp) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        p[i] = __float2bfloat16(((float)(h & 0xffffff) / 16777216.0f - 0.5f) * amp);
    }
}

struct shape { const char *name; int N, K, calls; };
static const shape SHAPES[] = {{"in_proj", 10304, 2688, 23}, {"out_proj", 2688, 4096, 23}, {"shared_up", 3712, 2688, 23},
                               {"shared_down", 2688, 3712, 23}, {"attn_q", 4096, 2688, 6}, {"attn_kv", 256, 2688, 12},
                               {"attn_o", 2688, 4096, 6}};
/* GL_EXPERTS=1: the dequant_gemm route's per-expert GEMMs instead (src/kernels/cuda/gather_dequant_gemm.cu: one
 * cublasGemmEx an expert with rows; ROWS = rows an expert, e.g. 384 768 1536 at 8k / 16k / 32k-token steps; calls: 128
 * experts x 23 layers). Session 39 measured production's at 8k (Nsight Compute): 12.5 us, ~306 TFLOP/s. */
static const shape EXPERT_SHAPES[] = {{"expert_up", 1856, 2688, 128 * 23}, {"expert_down", 2688, 1856, 128 * 23}};

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

template <typename F> static float time_ms(F call, cudaStream_t st) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) call(i);
    std::vector<float> v;
    for (int r = 0; r < 7; r++) {
        CK(cudaEventRecord(a, st));
        for (int i = 0; i < 20; i++) call(i);
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0; CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms / 20);
    }
    CK(cudaEventDestroy(a)); CK(cudaEventDestroy(b));
    return median(v);
}

static float bf(uint16_t u) { uint32_t w = (uint32_t)u << 16; float f; memcpy(&f, &w, 4); return f; }

int main(int argc, char **argv) {
    int dev_n = 0;
    if (cudaGetDeviceCount(&dev_n) != cudaSuccess || dev_n == 0) { fprintf(stderr, "gpu_gemm_lt: no CUDA device: skipped\n"); return 77; }
    std::vector<int> rows;
    for (int i = 1; i < argc; i++) rows.push_back(atoi(argv[i]));
    if (rows.empty()) rows = {512, 2048};
    const int nalg = getenv("GL_ALGOS") ? atoi(getenv("GL_ALGOS")) : 16;
    cudaStream_t st; CK(cudaStreamCreate(&st));
    cublasHandle_t h; CB(cublasCreate(&h)); CB(cublasSetStream(h, st));
    const size_t wsb = 32u << 20;
    void *ws; CK(cudaMalloc(&ws, wsb));
    CB(cublasSetWorkspace(h, ws, wsb)); CB(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
    cublasLtHandle_t lt; CB(cublasLtCreate(&lt));
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("gpu_gemm_lt: %s, %d SMs, cuBLAS %d\n", prop.name, prop.multiProcessorCount, CUBLAS_VERSION);
    struct tot { double prod, best; };
    std::vector<tot> tots(rows.size(), {0, 0});
    for (size_t ri = 0; ri < rows.size(); ri++) {
        const int M = rows[ri];
        printf("\n%d rows | shape | production ms (TFLOP/s) | algos | best ms (TFLOP/s) | best: #, tile, splitK, stages, cluster | bitwise eq / max rel diff | speedup\n", M);
        const bool ex = getenv("GL_EXPERTS") && atoi(getenv("GL_EXPERTS"));
        const std::vector<shape> shapes = ex ? std::vector<shape>(std::begin(EXPERT_SHAPES), std::end(EXPERT_SHAPES))
                                             : std::vector<shape>(std::begin(SHAPES), std::end(SHAPES));
        for (const shape &s : shapes) {
            const int N = s.N, K = s.K;
            const int64_t wn = (int64_t)N * K;
            const int copies = (int)std::max<int64_t>(1, std::min<int64_t>(8, (200ll << 20) / (wn * 2) + 1));
            __nv_bfloat16 *W, *X, *Y0, *Y1;
            CK(cudaMalloc(&W, wn * 2 * copies)); CK(cudaMalloc(&X, (size_t)M * K * 2));
            CK(cudaMalloc(&Y0, (size_t)M * N * 2)); CK(cudaMalloc(&Y1, (size_t)M * N * 2));
            fill_bf16<<<1024, 256, 0, st>>>(W, wn * copies, 0x1234u + N, 0.1f);
            fill_bf16<<<1024, 256, 0, st>>>(X, (int64_t)M * K, 0x9876u + K, 2.0f);
            CK(cudaGetLastError());
            const float one = 1.0f, zero = 0.0f;
            auto prod = [&](int i) {
                CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, W + (int64_t)(i % copies) * wn, CUDA_R_16BF, K, X,
                                CUDA_R_16BF, K, &zero, Y0, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            };
            prod(0);
            CK(cudaStreamSynchronize(st));
            std::vector<uint16_t> y0((size_t)M * N), y1((size_t)M * N);
            CK(cudaMemcpy(y0.data(), Y0, y0.size() * 2, cudaMemcpyDeviceToHost));
            float ymax = 0;
            for (uint16_t u : y0) ymax = std::max(ymax, fabsf(bf(u)));
            const float tp = time_ms(prod, st);
            const double flop = 2.0 * M * N * K;

            cublasLtMatmulDesc_t op; CB(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
            CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
            CB(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
            cublasLtMatrixLayout_t la, lb, lc;
            CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K));
            CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
            CB(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
            cublasLtMatmulPreference_t pref; CB(cublasLtMatmulPreferenceCreate(&pref));
            CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
            std::vector<cublasLtMatmulHeuristicResult_t> res(nalg);
            int got = 0;
            CB(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, nalg, res.data(), &got));
            float best = 1e30f; int bi = -1, beq = 0; float bdiff = 0;
            for (int a = 0; a < got; a++) {
                if (res[a].state != CUBLAS_STATUS_SUCCESS) continue;
                auto run = [&](int i) {
                    CB(cublasLtMatmul(lt, op, &one, W + (int64_t)(i % copies) * wn, la, X, lb, &zero, Y1, lc, Y1, lc,
                                      &res[a].algo, ws, wsb, st));
                };
                CK(cudaMemsetAsync(Y1, 0xff, (size_t)M * N * 2, st));
                run(0);
                CK(cudaStreamSynchronize(st));
                CK(cudaMemcpy(y1.data(), Y1, y1.size() * 2, cudaMemcpyDeviceToHost));
                int64_t eq = 0; float md = 0;
                for (size_t i = 0; i < y0.size(); i++) {
                    eq += y0[i] == y1[i];
                    const float d = fabsf(bf(y0[i]) - bf(y1[i]));
                    md = d == d ? std::max(md, d) : 1e30f;
                }
                const float t = time_ms(run, st);
                if (getenv("GL_ALL"))
                    printf("   algo %d: %.4f ms, eq %.4f, rel %.2e\n", a, t, (double)eq / y0.size(), md / ymax);
                if (md / ymax < 1e-2f && t < best) { best = t; bi = a; beq = eq == (int64_t)y0.size(); bdiff = md / ymax; }
            }
            int tile = -1, splitk = -1, stages = -1, cluster = -1;
            if (bi >= 0) {
                size_t w = 0;
                cublasLtMatmulAlgoConfigGetAttribute(&res[bi].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&res[bi].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&res[bi].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&res[bi].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &w);
            }
            printf("%d | %s %dx%d | %.4f (%.0f) | %d | %.4f (%.0f) | %d, %d, %d, %d, %d | %s / %.1e | %.3fx\n", M, s.name, N, K,
                   tp, flop / tp / 1e9, got, best, flop / best / 1e9, bi, tile, splitk, stages, cluster,
                   beq ? "yes" : "no", bdiff, tp / best);
            tots[ri].prod += s.calls * tp;
            tots[ri].best += s.calls * std::min(tp, best);
            cublasLtMatmulPreferenceDestroy(pref);
            cublasLtMatrixLayoutDestroy(la); cublasLtMatrixLayoutDestroy(lb); cublasLtMatrixLayoutDestroy(lc);
            cublasLtMatmulDescDestroy(op);
            CK(cudaFree(W)); CK(cudaFree(X)); CK(cudaFree(Y0)); CK(cudaFree(Y1));
        }
    }
    printf("\nrows | dense GEMMs of a prefill step, production ms | with each shape's best algorithm ms | saved\n");
    for (size_t ri = 0; ri < rows.size(); ri++)
        printf("%d | %.3f | %.3f | %.3f\n", rows[ri], tots[ri].prod, tots[ri].best, tots[ri].prod - tots[ri].best);
    return 0;
}
