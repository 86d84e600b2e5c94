/* Internal: THE way fp4moe launches its CUDA kernels - programmatic dependent launch (PDL).
 *
 * A kernel launched by cu_launch() on a non-NULL stream carries the launch attribute
 * cudaLaunchAttributeProgrammaticStreamSerialization: the GPU may start launching it (and run its
 * blocks up to their first griddepcontrol.wait) while the kernel before it in the stream is still
 * running, once every block of that kernel has started and executed griddepcontrol.launch_dependents
 * (or exited). This hides the launch latency and the previous kernel's tail, which is most of the
 * time of the 2-7 us kernels of a decode step (docs/GPU-NOTES.md; CUDA C++ Programming Guide,
 * "Programmatic Dependent Launch and Synchronization"; PTX ISA "griddepcontrol"). In a stream
 * capture the attribute becomes a programmatic edge of the graph.
 *
 * The contract that keeps it exact: EVERY kernel body begins with cu_pdl_entry(), before any access
 * to global memory. Its griddepcontrol.wait blocks until the previous kernel of the stream has
 * completed and its memory is visible (a no-op for a kernel launched without the attribute), so no
 * kernel reads an input early or overwrites a buffer its predecessor still reads; the dependency is
 * transitive because every predecessor waited in turn. scripts/lint_cuda_launch.py (ctest
 * lint/cuda_launch) checks that every __global__ kernel under src/kernels/cuda calls it first.
 * Arguments are forwarded: pass nullptr, not NULL (an integer once forwarded), for a null pointer.
 *
 * Where it is set (FP4MOE_CUDA_PDL, read once per process, src/common/env.c): by default only on
 * launches captured into a CUDA graph, i.e. the decode steps; FP4MOE_CUDA_PDL=1 on every launch on a
 * stream; FP4MOE_CUDA_PDL=0 never (ordinary stream order). The kernels and their arithmetic are the
 * same in every mode (same greedy hashes). Measured on the H200 (2026-12-02, docs/PERFORMANCE.md,
 * synthetic 30B-A3B, one run): decode 431.1 tok/s off, 479.3 on every launch, 478.4 graph-only;
 * the prefill of 64 sequences x 256 tokens 40,640 tok/s off, 39,063 on every launch (-3.9%),
 * 40,529 graph-only - hence the default. */
#ifndef FP4MOE_KERNELS_CUDA_LAUNCH_CUH
#define FP4MOE_KERNELS_CUDA_LAUNCH_CUH

#include <cuda_runtime.h>

#include "common/env.h"

#include <utility>

/* First statement of every kernel: wait for the previous kernel of the stream (its completion and
 * memory flush), then let the next one start launching. */
__device__ __forceinline__ void cu_pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* FP4MOE_CUDA_PDL (src/common/env.c): "0" -> 0 (off), "1" -> 1 (every launch on a stream),
 * "graph" (the default) -> 2 (only launches captured into a graph: the decode steps). */
static inline int cu_pdl_mode(void) {
    const char *s = env_get(ENV_CUDA_PDL);
    return s[0] == '0' ? 0 : s[0] == '1' ? 1 : 2;
}

static inline bool cu_pdl_on(cudaStream_t st) {
    if (st == NULL) return false;
    const int m = cu_pdl_mode();
    if (m != 2) return m == 1;
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(st, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusActive;
}

/* kernel<<<grid, block, smem, st>>>(args...) with the PDL attribute where cu_pdl_on(st).
 * Returns the launch status; like <<<>>>, it is also what cudaGetLastError() reports next, so the
 * callers' FP4MOE_CUDA_LAUNCH / OPS_LAUNCH_CHECK after it keep working. The legacy NULL stream gets
 * an ordinary launch. */
template <typename... KArgs, typename... Args>
static inline cudaError_t cu_launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                    Args &&...args) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = cu_pdl_on(st) ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

#endif
