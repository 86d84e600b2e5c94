/* fp4moe/gather_qmm.h: the MoE gather quantized matmul on NVFP4 expert weights.
 *
 * Contract (docs/spec/NVFP4.md section 4; MLX gather_qmm(transpose=True, M=1, rhs indices)):
 *   y[b][n] = sum_k x[b][k] * w[idx[b]][n][k]     for b < B, n < N
 * x: B x K activations of `dtype` (row-major); y: B x N of the same dtype; fp32 accumulation,
 * rounded once to dtype. w[e][n][k] = e2m1(code) * e4m3(scale) * (global_scale ? gs[e] : 1).
 * Rows with idx[b] >= E are written as zeros. `sorted != 0` promises idx is non-decreasing (one
 * contiguous run of rows per expert). Inputs are never modified; every output element is written.
 *
 * Routes (one function chooses: fp4moe_gather_route_choose_cpu):
 *   QMV           each row streams its expert's weights; rows of one expert share weight decodes.
 *   BATCHED       expert-batched: sorted && B >= 64; each expert's run found once, each weight tile
 *                 decoded once for all rows of the run (register-blocked micro-kernel).
 *   DEQUANT_GEMM  sorted: dequantize each run's expert to fp32 and call BLAS sgemm.
 * Environment: FP4MOE_GATHER_EXPERT_BATCHED=0 forces QMV for the automatic choice;
 *              FP4MOE_GATHER_ROUTE=qmv|batched|dequant_gemm forces a route where it is legal. */
#ifndef FP4MOE_GATHER_QMM_H
#define FP4MOE_GATHER_QMM_H

#include <stdint.h>
#include "fp4moe/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* E stacked experts, each an N x K NVFP4 matrix (row n = output feature n). */
typedef struct {
    const uint8_t *codes;        /* E*N*(K/2) bytes; byte j of a row: element 2j low nibble, 2j+1 high */
    const uint8_t *scales;       /* E*N*(K/16) E4M3 bytes */
    const float *global_scale;   /* NULL, or E fp32 decode multipliers (one per expert) */
    int64_t E, N, K;             /* E >= 1, N >= 1, K >= 16 and K % 16 == 0 */
} fp4moe_nvfp4_weights;

typedef enum {
    FP4MOE_ROUTE_AUTO = 0,
    FP4MOE_ROUTE_QMV = 1,
    FP4MOE_ROUTE_BATCHED = 2,
    FP4MOE_ROUTE_DEQUANT_GEMM = 3
} fp4moe_route;

/* Minimum rows for the expert-batched / dequant-GEMM routes (sorted input). */
#define FP4MOE_BATCHED_MIN_ROWS 64

/* "auto", "qmv", "batched", "dequant_gemm". */
const char *fp4moe_route_name(fp4moe_route r);
/* Parses the names above. Returns FP4MOE_OK or FP4MOE_EINVAL. */
int fp4moe_route_parse(const char *s, fp4moe_route *out);

/* Validates w and the call's sizes (NULL pointers, E/N/K ranges, K % 16, overflow of E*N*K, B < 0).
 * Returns FP4MOE_OK or an error with a message naming the bad argument. Shared by all backends. */
int fp4moe_gather_qmm_check(const fp4moe_nvfp4_weights *w, const void *x, const uint32_t *idx,
                            int64_t B, const void *y);

/* The route the automatic choice takes on the CPU for this call, after the environment switches.
 * The one place where the CPU route predicate lives. */
fp4moe_route fp4moe_gather_route_choose_cpu(const fp4moe_nvfp4_weights *w, int64_t B, int sorted);

/* gather_qmm on the CPU, route chosen automatically. x, idx, y: host pointers.
 * Errors: FP4MOE_EINVAL (see fp4moe_gather_qmm_check, unknown dtype), FP4MOE_EOVERFLOW,
 * FP4MOE_ENOMEM. OpenMP-parallel. */
int fp4moe_gather_qmm_cpu(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                          const uint32_t *idx, int64_t B, int sorted, void *y);

/* Same, with an explicit route (FP4MOE_ROUTE_AUTO = automatic). BATCHED and DEQUANT_GEMM need
 * sorted != 0 (FP4MOE_EINVAL otherwise) but accept any B >= 0. Environment switches are ignored. */
int fp4moe_gather_qmm_cpu_route(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                const uint32_t *idx, int64_t B, int sorted, fp4moe_route route,
                                void *y);

/* Reference in fp64 (for tests): y64[b][n] = sum_k double(x[b][k]) * double(w[idx[b]][n][k]),
 * zeros for idx[b] >= E. Single-threaded and slow; works for any sorted or unsorted idx. */
int fp4moe_gather_qmm_ref_f64(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                              const uint32_t *idx, int64_t B, double *y64);

/* W4A8 on the CPU (the "q8" CPU activation mode; llama.cpp's Q8_0 activations, with NVFP4's
 * 16-element block): each activation row is quantized per block of 16 elements to
 *   d = max|x| / 127 (fp32),  q = round_half_even(x / d) clamped to [-127, 127]  (q = 0 if d = 0),
 * and y[b][n] = gs * sum over blocks of (d * e4m3(scale)) * sum_k q_k * e2m1(code_k): the inner
 * sums exact in int32 (u8 x s8 dot products: AVX-512 VNNI vpdpbusd, AVX2 vpmaddubsw), the outer
 * in fp32. Blocks of 16 rather than Q8_0's 32: the weights change scale every 16 elements anyway,
 * so the finer activation scale costs nothing. x, y, dtype, idx, sorted and out-of-range rows as
 * in fp4moe_gather_qmm_cpu_route. route: AUTO (the same predicate, fp4moe_gather_route_choose_cpu),
 * QMV (groups of <= 8 rows of an expert), BATCHED (expert-batched: runs in chunks of <= 96 rows,
 * each weight tile decoded once for all rows of the chunk); DEQUANT_GEMM has no W4A8 form and runs
 * BATCHED. Errors as fp4moe_gather_qmm_cpu_route. Accuracy against fp4moe_gather_qmm_ref_f64: the
 * activation rounding, |error| per block <= d/2 per element (measured in docs/PERFORMANCE.md). */
int fp4moe_gather_qmm_cpu_w4a8(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                               const uint32_t *idx, int64_t B, int sorted, fp4moe_route route, void *y);

/* Reference in fp64 of the W4A8 formula above (the quantization done as specified there, the sums
 * in fp64): what fp4moe_gather_qmm_cpu_w4a8 computes up to fp32 rounding. For tests. */
int fp4moe_gather_qmm_ref_w4a8_f64(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                   const uint32_t *idx, int64_t B, double *y64);

/* GPU (CUDA) version: same contract; w's codes/scales/global_scale, x, idx, y are DEVICE pointers;
 * stream is a cudaStream_t (NULL = default stream). Asynchronous: returns after enqueueing; launch
 * errors are checked and returned. No host synchronisation (except the dequant_gemm route, which
 * needs the run sizes on the host). Returns FP4MOE_EUNSUPPORTED in builds without CUDA.
 * Automatic route: qmv for unsorted input or B < 64; dequant_gemm for >= 512 rows per expert on
 * average (E > 1) or >= 256 rows (E = 1); else the expert-batched route. FP4MOE_GATHER_EXPERT_BATCHED=0
 * replaces the expert-batched route by qmv, which for sorted f16/bf16 input with B >= 64 runs the
 * batched kernel's arithmetic in 8-row tiles (weights re-read every 8 rows): bit-identical outputs.
 * FP4MOE_GATHER_ROUTE forces a route where it is legal. */
int fp4moe_gather_qmm_cuda(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                           const uint32_t *idx, int64_t B, int sorted, void *y, void *stream);
int fp4moe_gather_qmm_cuda_route(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                 const uint32_t *idx, int64_t B, int sorted, fp4moe_route route,
                                 void *y, void *stream);

/* 1 when this build has CUDA support and the current CUDA device can run its kernels (compute capability 9.0:
 * H100, H200 - the kernels are sm_90a code), else 0. */
int fp4moe_cuda_available(void);
/* FP4MOE_OK when fp4moe_cuda_available(), else FP4MOE_EUNSUPPORTED with the reason as the last error: the build
 * has no CUDA backend ("no CUDA backend"), no device is visible (CUDA_VISIBLE_DEVICES named when set), the
 * driver cannot be used, or the device's compute capability is not 9.0 (its name and capability given). */
int fp4moe_cuda_check(void);
/* The number of visible CUDA devices (0 without CUDA or a device). */
int fp4moe_cuda_device_count(void);
/* Makes CUDA device `device` current for the calling thread (cudaSetDevice): a model loaded or made
 * with device CUDA afterwards is placed there, and its batches run there from any thread.
 * Errors: FP4MOE_EINVAL (out of range), FP4MOE_EUNSUPPORTED (no CUDA build), FP4MOE_ECUDA. */
int fp4moe_cuda_set_device(int device);

/* The CPU kernel set gather_qmm uses on this machine: "avx512" (AVX-512 F/BW/VL/DQ/VNNI found at
 * run time), "avx2" (AVX2+FMA+F16C) or "portable" (no AVX2, or FP4MOE_CPU_ISA=portable);
 * FP4MOE_CPU_ISA=avx2 keeps an AVX-512 machine on the AVX2 set. */
const char *fp4moe_gather_cpu_isa(void);

/* Threads of the CPU kernels (OpenMP) and of OpenBLAS, for every later call (llama.cpp's --threads): the
 * OpenMP team size of the calling thread (an OpenMP setting per thread) and OpenBLAS's count (one per
 * process). n >= 1; n = 0 restores the default (one per core, or OMP_NUM_THREADS).
 * Errors: FP4MOE_EINVAL (n < 0). */
int fp4moe_set_threads(int n);

#ifdef __cplusplus
}
#endif
#endif
