/* gpu_pdl_chain: what a kernel boundary costs in a decode step's graph (issue 12; session 37 measured a decode qmv
 * call at ~2.4-2.5 us besides its bytes, bench/gpu_moe_decode). A chain of dependent kernels captured into one CUDA
 * graph and replayed, with and without programmatic dependent launch (the attribute cu_launch sets), for:
 *   empty  - griddepcontrol.wait / launch_dependents only (cu_pdl_entry), G blocks of 128 threads;
 *   load   - the same, then every thread loads 16 bytes of a fresh 64 MB stream region (DRAM) and stores 4 (a decode
 *            kernel's first load and its output, no compute);
 *   chain4 - as load, but each warp's 4 loads one after another, each address from the previous value (a qmv warp's
 *            ~4-5 dependent K steps' latency, no bandwidth);
 * at G = 1, 132 and 1,056 blocks of 128 threads (one block; an SM each; the decode pair's grid) and the last one's
 * threads in 264 x 512 and 132 x 1,024 (is the cost a block's or a thread's?). Printed: us a kernel (median of 9
 * replays of 200 kernels). The differences say how much of the ~2.5 us is the boundary itself (empty), the first DRAM
 * round trip (load - empty) and a warp's load chain (chain4 - load).
 * Usage: gpu_pdl_chain. */
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/cuda/cuda_launch.cuh"

#define CK(call)                                                                                                    \
    do {                                                                                                            \
        cudaError_t e_ = (call);                                                                                    \
        if (e_ != cudaSuccess) {                                                                                    \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                   \
            exit(1);                                                                                                \
        }                                                                                                           \
    } while (0)

#define KERNELS 200

__global__ void k_empty(int *out) {
    cu_pdl_entry();
    if (threadIdx.x == 0 && blockIdx.x == 0 && out[0] == 12345) out[1] = 1; /* keeps the kernel */
}

/* one 16-byte load a thread from region i of the stream, one 4-byte store */
__global__ void k_load(const uint4 *src, int64_t region, int *out) {
    cu_pdl_entry();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    const uint4 v = src[region + t];
    if ((v.x ^ v.y ^ v.z ^ v.w) == 0x9e3779b9u) out[t & 1023] = 1;
}

/* four dependent loads a thread: each index from the previous value (the values are 0: the addresses step on) */
__global__ void k_chain4(const uint4 *src, int64_t region, int64_t stride, int *out) {
    cu_pdl_entry();
    const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint32_t acc = 0;
#pragma unroll 1
    for (int s = 0; s < 4; s++) {
        const uint4 v = src[region + t + s * stride + (acc & 1u)];
        acc += v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[t & 1023] = 1;
}

/* k<<<G, 128, 0, st>>>(args...) with (pdl) or without the programmatic-serialization attribute (what cu_launch
 * sets in production when FP4MOE_CUDA_PDL allows; here chosen per graph) */
template <typename... KArgs, typename... Args>
static cudaError_t launch(bool pdl, void (*k)(KArgs...), unsigned G, unsigned T, cudaStream_t st, Args... args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(T);
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, k, args...);
}

static float replay_us(cudaGraphExec_t ge, cudaStream_t st) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaGraphLaunch(ge, st));
    std::vector<float> t;
    for (int r = 0; r < 9; r++) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(ge, st));
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return t[4] * 1e3f / KERNELS;
}

int main() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        fprintf(stderr, "gpu_pdl_chain: no CUDA device: skipped\n");
        return 77;
    }
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    const size_t region_bytes = 64u << 20, total = 40 * region_bytes; /* 40 regions: past L2 between kernels */
    uint4 *src;
    int *out;
    CK(cudaMalloc(&src, total));
    CK(cudaMemset(src, 0, total));
    CK(cudaMalloc(&out, 4096 * sizeof(int)));
    CK(cudaMemset(out, 0, 4096 * sizeof(int)));
    cudaStream_t st;
    CK(cudaStreamCreate(&st));
    const int64_t rq = (int64_t)(region_bytes / sizeof(uint4));
    printf("gpu_pdl_chain: %s, %d SMs; us a kernel in a graph of %d dependent kernels\n", p.name, p.multiProcessorCount,
           KERNELS);
    printf("| kernel | blocks x threads | with PDL | without PDL |\n|---|---:|---:|---:|\n");
    const int sm = p.multiProcessorCount;
    /* 1 block; a block an SM; the decode pair's 8 blocks an SM of 128 threads; the same threads in 2 and 1 blocks an SM */
    const int grids[5] = {1, sm, 8 * sm, 2 * sm, sm}, threads[5] = {128, 128, 128, 512, 1024};
    const char *names[3] = {"empty", "load", "chain4"};
    for (int kind = 0; kind < 3; kind++)
        for (int gi = 0; gi < 5; gi++) {
            const unsigned G = (unsigned)grids[gi], T = (unsigned)threads[gi];
            float us[2];
            for (int pdl = 1; pdl >= 0; pdl--) {
                cudaGraph_t g;
                cudaGraphExec_t ge;
                CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
                for (int i = 0; i < KERNELS; i++) {
                    const int64_t region = (int64_t)(i % 40) * rq;
                    cudaError_t e;
                    if (kind == 0) e = launch(pdl, k_empty, G, T, st, out);
                    else if (kind == 1) e = launch(pdl, k_load, G, T, st, (const uint4 *)src, region, out);
                    else e = launch(pdl, k_chain4, G, T, st, (const uint4 *)src, region, rq / 8, out);
                    CK(e);
                }
                CK(cudaStreamEndCapture(st, &g));
                CK(cudaGraphInstantiate(&ge, g, 0));
                us[pdl] = replay_us(ge, st);
                CK(cudaGraphExecDestroy(ge));
                CK(cudaGraphDestroy(g));
            }
            printf("| %s | %u x %u | %.2f | %.2f |\n", names[kind], G, T, us[1], us[0]);
        }
    CK(cudaFree(src));
    CK(cudaFree(out));
    return 0;
}
