/* gather_qmm on CUDA: the public entry points, the route choice, the device-side expert runs and
 * the per-call scratch. Contract: docs/spec/NVFP4.md section 4, include/fp4moe/gather_qmm.h.
 *
 * Routes (src/kernels/cuda/):
 *   qmv           gather_qmv.cu      decode / unsorted: bf16 with B <= 32 and K % 32 == 0 on tensor
 *                                    cores (qmv v5: 16 features x a segment of <= 8 rows of one
 *                                    expert per mma tile, K split over a block's warps); otherwise
 *                                    a warp per (segment, output features), fp32 CUDA-core FMA.
 *                                    Sorted f16/bf16 input with B >= FP4MOE_BATCHED_MIN_ROWS (on
 *                                    tiled weights: more than 32 rows):
 *                                    "qmv, tiled by 8 rows" (gq_launch_qmv_tiled), the batched
 *                                    kernel with 8-row tiles (weights re-read every 8 rows), bitwise
 *                                    equal to the batched route, so FP4MOE_GATHER_EXPERT_BATCHED=0
 *                                    changes speed but not the numbers wherever the automatic
 *                                    choice would be batched.
 *   batched       gather_batched.cu  sorted: tensor-core mma.sync over work items (expert, row-tile,
 *                                    N-tile) found on the device; f16/bf16 activations. bf16 plain
 *                                    linears (E = 1) of 33-64 rows with N >= 2,048 take
 *                                    gq_dense_kg_kernel on this route and on qmv's 8-row tiles alike
 *                                    (launch_tiled), so the route switch keeps their bits. For f32
 *                                    activations the batched route runs the qmv kernel (fp32 FMA,
 *                                    rows of one expert share each weight load), to meet the f32
 *                                    tolerance without TF32.
 *   dequant_gemm  gather_dequant_gemm.cu  sorted: dequantize each used expert to dtype, cuBLAS GEMM
 *                                    per run; synchronizes the stream once (run sizes on the host).
 * Automatic choice: FP4MOE_GATHER_ROUTE (where legal), else FP4MOE_GATHER_EXPERT_BATCHED=0 -> qmv,
 * else sorted && B >= FP4MOE_BATCHED_MIN_ROWS -> batched (measured faster than dequant_gemm on the
 * Nemotron shapes up to 8192 tokens, docs/PERFORMANCE.md), or dequant_gemm when the runs average
 * >= 512 rows per expert (E > 1; compute-bound: cuBLAS measured faster at 16,384 tokens; this default then
 * synchronizes the stream) or a plain linear (E = 1) has >= 256 rows, else qmv.
 *
 * Thread safety: qmv and batched are reentrant (per-call scratch comes from cudaMallocAsync on the
 * caller's stream). dequant_gemm serializes on a process-wide mutex (it owns a cached scratch
 * buffer and cuBLAS handle per device). Pointers must belong to the current device. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>

#include "common/env.h"
#include "kernels/cuda/gather_cuda.cuh"
#include "kernels/cuda/ops_cuda.h"
#include "kernels/gather_common.h"
#include "kernels/cuda/cuda_launch.cuh"

/* ---- expert runs on the device ------------------------------------------------------------- */
#define RUNS_THREADS 1024

/* off[0] = 0, off[e + 1] = tiles(0) + ... + tiles(e) for e < E (tiles(e): a function of the run length starts[e + 1] -
 * starts[e]), off[E + 1] = 0 (the work counter of the expert-batched kernels' dynamic item order; gather_batched.cu,
 * bt_sched): an exclusive scan in chunks of RUNS_THREADS experts by the whole block, starts[] already visible to it */
template <typename F>
__device__ __forceinline__ void runs_scan(const int *starts, int E, int *off, F tiles) {
    __shared__ int warp_sum[RUNS_THREADS / 32];
    __shared__ int carry;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) {
        carry = 0;
        off[0] = 0;
        off[E + 1] = 0;
    }
    __syncthreads();
    for (int base = 0; base < E; base += RUNS_THREADS) {
        const int e = base + threadIdx.x;
        int v = e < E ? tiles(starts[e + 1] - starts[e]) : 0;
        for (int o = 1; o < 32; o <<= 1) { /* inclusive warp scan */
            const int u = __shfl_up_sync(0xffffffffu, v, o);
            if (lane >= o) v += u;
        }
        if (lane == 31) warp_sum[warp] = v;
        __syncthreads();
        if (warp == 0) {
            int s = warp_sum[lane];
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, s, o);
                if (lane >= o) s += u;
            }
            warp_sum[lane] = s; /* inclusive over warps */
        }
        __syncthreads();
        const int incl = carry + v + (warp > 0 ? warp_sum[warp - 1] : 0);
        if (e < E) off[e + 1] = incl;
        __syncthreads();
        if (threadIdx.x == RUNS_THREADS - 1) carry = incl;
        __syncthreads();
    }
}

__global__ void __launch_bounds__(RUNS_THREADS)
gq_runs_kernel(const uint32_t *__restrict__ idx, int B, int E, int row_tile, int *__restrict__ starts,
               int *__restrict__ tile_off, int *__restrict__ rem_off) {
    cu_pdl_entry();
    /* starts[e] = lower bound of e in idx (first b with idx[b] >= e), e = 0..E: written by the
     * boundary b with idx[b-1] < e <= idx[b] (idx[-1] = -1; b = B stands for every e up to E), so
     * each e once, from one coalesced read of idx (a binary search per expert was a chain of ~12
     * dependent loads: 5.5 us a call at 3,072 rows, Nsight Compute) */
    for (int b = threadIdx.x; b <= B; b += blockDim.x) {
        const int64_t prev = b > 0 ? (int64_t)idx[b - 1] : -1;
        const int64_t cur = b < B ? (int64_t)idx[b] : (int64_t)E;
#ifdef FP4MOE_INJECT_FAULT_RUNS /* deliberate fault (tests must catch it): an expert's start one row late */
        for (int64_t e = prev + 1; e <= cur && e <= E; e++) starts[e] = b + (e == E / 2 && b < B);
#else
        for (int64_t e = prev + 1; e <= cur && e <= E; e++) starts[e] = b;
#endif
    }
    if (!tile_off) return;
    __syncthreads(); /* starts[] written by this block is visible to it after the barrier */
    const int half = row_tile / 2;
    if (!rem_off) { /* ceil(run / row_tile) tiles an expert */
        runs_scan(starts, E, tile_off, [=](int n) { return n > 0 ? (n + row_tile - 1) / row_tile : 0; });
        return;
    }
    /* split (gq_launch_runs_split): a run's remainder r = n % row_tile of 1 .. row_tile / 2 rows is a tile of its own
     * in rem_off; the row_tile tiles of tile_off take the rest (and a longer remainder as their last, short, tile) */
    runs_scan(starts, E, tile_off, [=](int n) {
        return n > 0 ? n / row_tile + (n % row_tile > half ? 1 : 0) : 0;
    });
    runs_scan(starts, E, rem_off, [=](int n) {
        const int r = n > 0 ? n % row_tile : 0;
#ifdef FP4MOE_INJECT_FAULT_BIG_REM /* deliberate fault (tests must catch it): remainders of exactly row_tile / 2 rows lost */
        return r > 0 && r < half ? 1 : 0;
#else
        return r > 0 && r <= half ? 1 : 0;
#endif
    });
}

int gq_launch_runs(const gq_args *a, int row_tile, int *starts, int *tile_off, cudaStream_t st) {
    cu_launch(gq_runs_kernel, 1, RUNS_THREADS, 0, st, a->idx, a->B, a->E, row_tile, starts, tile_off, (int *)nullptr);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-runs kernel");
    return FP4MOE_OK;
}

int gq_launch_runs_split(const gq_args *a, int row_tile, int *starts, int *tile_off, int *rem_off, cudaStream_t st) {
    cu_launch(gq_runs_kernel, 1, RUNS_THREADS, 0, st, a->idx, a->B, a->E, row_tile, starts, tile_off, rem_off);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-runs kernel (split)");
    return FP4MOE_OK;
}

/* ---- per-call scratch ------------------------------------------------------------------------ */
#define GQ_MAX_DEVICES 64
static int g_pool_ready[GQ_MAX_DEVICES];

int gq_scratch_alloc(void **p, size_t bytes, cudaStream_t st) {
    int dev = 0;
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetDevice(&dev), "cudaGetDevice");
    if (dev >= 0 && dev < GQ_MAX_DEVICES && !__atomic_load_n(&g_pool_ready[dev], __ATOMIC_ACQUIRE)) {
        /* keep up to 64 MiB in the default pool across synchronisations (default: 0, every
         * cudaStreamSynchronize would hand small buffers back and the next call re-map them) */
        cudaMemPool_t pool;
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaDeviceGetDefaultMemPool(&pool, dev), "cudaDeviceGetDefaultMemPool");
        uint64_t thr = 0;
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr),
                    "cudaMemPoolGetAttribute");
        if (thr < (64ull << 20)) {
            thr = 64ull << 20;
            FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr),
                        "cudaMemPoolSetAttribute");
        }
        __atomic_store_n(&g_pool_ready[dev], 1, __ATOMIC_RELEASE);
    }
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaMallocAsync(p, bytes, st), "cudaMallocAsync of the per-call scratch");
    return FP4MOE_OK;
}

int gq_scratch_free(void *p, cudaStream_t st) {
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaFreeAsync(p, st), "cudaFreeAsync of the per-call scratch");
    return FP4MOE_OK;
}

/* ---- public API ------------------------------------------------------------------------------ */
static int route_needs_sorted(fp4moe_route r) {
    return r == FP4MOE_ROUTE_BATCHED || r == FP4MOE_ROUTE_DEQUANT_GEMM;
}

/* The automatic choice on CUDA (the one place where the CUDA route predicate lives). */
#define GQ_DEQUANT_GEMM_ROWS_PLAIN 256   /* a plain linear (E = 1): cuBLAS on its bf16 copy from 256 rows */
#ifndef GQ_BIG_ROWS_PER_EXPERT
#define GQ_BIG_ROWS_PER_EXPERT 128 /* a MoE layer's up + down on 128 x 256 tiles (gq_launch_moe_big) from 128 rows
                                    * an expert on average (2,731 tokens of top-6 over 128 experts) up to the
                                    * dequant_gemm route's 1,024. Measured (H100, synthetic 30B-A3B, prefill + 8,
                                    * alternated rounds, big tiles / 64-row tiles): session 46 2,048 tokens (96 an
                                    * expert) 49,964 / 50,904 tok/s (-1.8%), 4,096 55,662 / 54,182 (+2.7%), 8,192
                                    * 56,888 / 54,577 (+4.2%); session 47 (short remainders on 64-row tiles) 2,048
                                    * -0.5%, 3,072 (144) 54,155 / 52,729 (+2.7%), 3,584 (168) 54,522 / 53,196 (+2.5%);
                                    * between 96 and 128 not measured */
#endif
#ifndef GQ_DEQUANT_GEMM_ROWS_PER_EXPERT
#define GQ_DEQUANT_GEMM_ROWS_PER_EXPERT 512 /* experts (E > 1): rows an expert on average (see choose_route) */
#endif
#ifndef GQ_BIG_DEQUANT_ROWS_PER_EXPERT
#define GQ_BIG_DEQUANT_ROWS_PER_EXPERT 1024 /* the same while the big tiles are on (FP4MOE_CUDA_MOE_BIG != 0). Measured
                                             * (session 47, H100, synthetic 30B-A3B, prefill + 4, two alternated
                                             * rounds, big tiles against dequant_gemm): 12,288 tokens (576 an expert)
                                             * 56,572 / 50,109 tok/s (+12.9%), 16,384 (768) 54,515 / 52,235 (+4.4%),
                                             * 32,768 (1,536) 48,113 / 51,577 (-6.7%) */
#endif
static fp4moe_route choose_route(int64_t B, int64_t E, int sorted) {
    const fp4moe_route env = gather_env_route();
    if (env != FP4MOE_ROUTE_AUTO && (sorted || !route_needs_sorted(env))) return env;
    if (!sorted || B < FP4MOE_BATCHED_MIN_ROWS) return FP4MOE_ROUTE_QMV;
    /* long runs are compute-bound: cuBLAS on the dequantized weights beats the batched kernels there. A plain
     * linear (E = 1) from 256 rows (its bf16 copy made once, no dequantization a call). Experts (E > 1) dequantize
     * every used expert a call (~3.3 ms of fixed cost a 30B-A3B layer, H100): session 38 measured the MoE layer's
     * up + down (bench/gpu_gather_wg, H100, uniform / skew 0.5 routing) batched 3.40 / 3.18 ms against dequant_gemm
     * 4.35 / 4.36 at 8,192 tokens (384 rows an expert), 6.48 / 6.41 against 5.41 / 5.82 at 16,384 (768): the
     * crossover near 550 rows an expert (it was 256 before the wgmma kernel, session 10). The big tiles (a MoE layer's
     * up + down, gq_launch_moe_big) move it to 1,024 (GQ_BIG_DEQUANT_ROWS_PER_EXPERT): the same rule for the two
     * separate calls that stand in when the big tiles cannot run (weights not tiled), so that
     * FP4MOE_GATHER_EXPERT_BATCHED=0 still changes only batched -> qmv */
    const int64_t per_expert = E > 1 ? (strcmp(env_get(ENV_CUDA_MOE_BIG), "0") ? GQ_BIG_DEQUANT_ROWS_PER_EXPERT
                                                                               : GQ_DEQUANT_GEMM_ROWS_PER_EXPERT)
                                     : GQ_DEQUANT_GEMM_ROWS_PLAIN;
#ifdef FP4MOE_INJECT_FAULT_ROUTE_ROWS /* deliberate fault (tests must catch it): experts at the plain linears' 256 rows */
    (void)per_expert;
    if (B >= GQ_DEQUANT_GEMM_ROWS_PLAIN * E) return FP4MOE_ROUTE_DEQUANT_GEMM;
#else
    if (B >= per_expert * E) return FP4MOE_ROUTE_DEQUANT_GEMM;
#endif
    /* FP4MOE_GATHER_EXPERT_BATCHED=0 replaces the expert-batched route by qmv and nothing else: the
     * sorted qmv runs the same mma arithmetic in 8-row tiles, so the outputs are bit-identical and
     * greedy output cannot depend on the switch */
    return gather_env_batched_off() ? FP4MOE_ROUTE_QMV : FP4MOE_ROUTE_BATCHED;
}

static int misaligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) != 0; }

/* The checks every CUDA gather_qmm call makes (FP4MOE_OK or the error). */
static int check_call(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype, const uint32_t *idx,
                      int64_t B, int sorted, fp4moe_route route, void *y) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y);
    if (st != FP4MOE_OK) return st;
    if (dtype != FP4MOE_F32 && dtype != FP4MOE_F16 && dtype != FP4MOE_BF16)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda: unknown activation dtype %d", (int)dtype);
    if ((int)route < (int)FP4MOE_ROUTE_AUTO || (int)route > (int)FP4MOE_ROUTE_DEQUANT_GEMM)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda: unknown route %d", (int)route);
    if (route_needs_sorted(route) && !sorted)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda: route %s needs sorted idx",
                                fp4moe_route_name(route));
    if (B == 0) return FP4MOE_OK;
    /* the kernels count rows, features and K in int (64-bit offsets) */
    if (B > INT_MAX || w->E > INT_MAX - 1 || w->N > INT_MAX || w->K > INT_MAX)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED,
                                "gather_qmm_cuda: B=%lld, E=%lld, N=%lld or K=%lld exceeds 2^31-1",
                                (long long)B, (long long)w->E, (long long)w->N, (long long)w->K);
    /* vector loads: x rows in 16-byte pieces, codes in 8- or 16-byte pieces */
    if (misaligned(x, 16) || misaligned(w->codes, 8) || misaligned(y, fp4moe_dtype_size(dtype)) ||
        misaligned(idx, 4) || misaligned(w->global_scale, 4))
        return fp4moe_set_error(FP4MOE_EINVAL,
                                "gather_qmm_cuda: misaligned device pointer (x needs 16 bytes, w.codes 8, "
                                "y its element size, idx and w.global_scale 4; cudaMalloc gives 256)");
    return FP4MOE_OK;
}

/* runs made for this call's idx, B and E (gq_runs) */
static bool runs_match(const gq_runs *r, const uint32_t *idx, int64_t B, int64_t E) {
    return r && r->buf && r->idx == idx && r->B == B && r->E == E;
}

__global__ void e1_runs_kernel(int *t, int64_t n) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i <= n; i += (int64_t)gridDim.x * blockDim.x) {
        t[2 * i] = 0;
        t[2 * i + 1] = (int)i;
    }
}

extern "C" int cuda_e1_runs_table(void *stream, int64_t n, int **out) {
    *out = nullptr;
    if (n < 0 || n > INT_MAX - 1) return fp4moe_set_error(FP4MOE_EINVAL, "cuda: e1 runs table of %lld rows", (long long)n);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaMalloc((void **)out, (size_t)(2 * (n + 1)) * sizeof(int)),
                    "cudaMalloc of the plain linears' runs table");
    cu_launch(e1_runs_kernel, 256, 256, 0, (cudaStream_t)stream, *out, n);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the runs table kernel");
    return FP4MOE_OK;
}

extern "C" fp4moe_route gather_qmm_cuda_auto_route(int64_t B, int64_t E, int sorted) {
    return choose_route(B, E, sorted);
}

extern "C" int gather_qmm_cuda_row_tile(int64_t B, int64_t E) {
    gq_args a = {};
    a.E = (int)E;
    a.B = (int)B;
    a.N = 1;
    return gq_batched_row_tile(&a, FP4MOE_BF16);
}

extern "C" int gather_qmm_cuda_ex(const fp4moe_nvfp4_weights *w, int tiled, const void *x, fp4moe_dtype dtype,
                                  const uint32_t *idx, int64_t B, int sorted, fp4moe_route route, int relu2,
                                  void *y, void *stream, int *fused, const gq_runs *runs) {
    *fused = 0;
    int st = check_call(w, x, dtype, idx, B, sorted, route, y);
    if (st != FP4MOE_OK || B == 0) return st;
    if (route == FP4MOE_ROUTE_AUTO) route = choose_route(B, w->E, sorted);
    /* the epilogue: every kernel but dequant_gemm's cuBLAS GEMM, on f16/bf16 outputs */
    const int ep = relu2 && dtype != FP4MOE_F32 && route != FP4MOE_ROUTE_DEQUANT_GEMM;
    const bool rm = sorted && runs_match(runs, idx, B, w->E);
    const bool e1 = sorted && runs && runs->e1_pairs && w->E == 1 && runs->idx == idx && B <= runs->e1_n;
    const gq_args a = {w->codes, w->scales, w->global_scale, (int)w->E, (int)w->N, (int)w->K,
                       x, y, idx, (int)B, ep, tiled, 0, nullptr, 0, rm ? runs->buf : nullptr, rm ? runs->mt : 0,
                       e1 ? runs->e1_pairs : nullptr};
    cudaStream_t s = (cudaStream_t)stream;
    switch (route) {
    case FP4MOE_ROUTE_BATCHED:
        st = dtype == FP4MOE_F32 ? gq_launch_qmv(&a, dtype, s) : gq_launch_batched(&a, dtype, s);
        break;
    case FP4MOE_ROUTE_DEQUANT_GEMM: st = gq_run_dequant_gemm(&a, dtype, s); break;
    default:
        /* qmv: sorted prefill-sized f16/bf16 batches take "qmv, tiled by 8 rows" (bitwise equal to
         * the batched route); decode-sized, unsorted and f32 batches the fp32 FMA kernel (the f32
         * batched route runs that kernel too), bf16 ones of <= 32 rows the tensor-core qmv. Sorted
         * f16/bf16 calls of 33-63 rows (a prefill's last chunk, 33-63 tokens) take the 8-row-tile
         * kernel on both layouts (the fp32 kernel cannot read the tiled one), so that the two
         * layouts give the same bits there too (test_model_gpu tiled_layout); bf16 plain linears of
         * those with N >= 2,048 run gq_dense_kg_kernel instead, on both routes (launch_tiled) */
#ifdef FP4MOE_INJECT_FAULT_QMV_ROWS /* deliberate fault (tests must catch it): the old rule, the checkpoint layout's
                                       33-63-row calls on the fp32 kernel */
        st = dtype != FP4MOE_F32 && sorted && (B >= FP4MOE_BATCHED_MIN_ROWS || (tiled && !gq_qmv_mma_fits(&a)))
#else
        st = dtype != FP4MOE_F32 && sorted &&
                     (B >= FP4MOE_BATCHED_MIN_ROWS || !gq_qmv_mma_fits(&a) || gq_dense_kg_fits(&a, dtype))
#endif
                 ? gq_launch_qmv_tiled(&a, dtype, s)
                 : gq_launch_qmv(&a, dtype, s);
        break;
    }
    if (st != FP4MOE_OK)
        return fp4moe_error_context(st, "gather_qmm_cuda (route %s, E=%d N=%d K=%d B=%d)",
                                    fp4moe_route_name(route), a.E, a.N, a.K, a.B);
    *fused = ep;
    return FP4MOE_OK;
}

extern "C" int gather_qmm_cuda_x1(const fp4moe_nvfp4_weights *w, int tiled, const void *x, const uint32_t *idx,
                                  int64_t B, fp4moe_route route, int relu2, void *y, void *stream) {
    int st = check_call(w, x, FP4MOE_BF16, idx, 1, 1, route, y);
    if (st != FP4MOE_OK) return st;
    if (B < 0) return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda (x1): B=%lld", (long long)B);
    if (B == 0) return FP4MOE_OK;
    if (w->E > INT_MAX - 1 || w->N > INT_MAX || w->K > INT_MAX)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (x1): E, N or K exceeds 2^31-1");
    const gq_args a = {w->codes, w->scales, w->global_scale, (int)w->E, (int)w->N, (int)w->K, x, y, idx, (int)B,
                       relu2 ? 1 : 0, tiled, 1, nullptr, 0, nullptr, 0, nullptr};
    /* where gather_qmm_cuda_ex on B gathered rows would run the tensor-core qmv (route qmv as it
     * resolves there, B < 64, bf16, gq_qmv_mma_fits) */
    const fp4moe_route r = route == FP4MOE_ROUTE_AUTO ? choose_route(B, w->E, 1) : route;
    if (r != FP4MOE_ROUTE_QMV || B >= FP4MOE_BATCHED_MIN_ROWS || !gq_qmv_mma_fits(&a) || gq_dense_kg_fits(&a, FP4MOE_BF16))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (x1): B=%lld rows, route %s: only the "
                                "tensor-core qmv reads one x row for all", (long long)B, fp4moe_route_name(r));
    st = gq_launch_qmv_mma(&a, false, (cudaStream_t)stream);
    return st ? fp4moe_error_context(st, "gather_qmm_cuda (x1, E=%d N=%d K=%d B=%d)", a.E, a.N, a.K, a.B) : FP4MOE_OK;
}

extern "C" int gather_qmm_cuda_rows(const fp4moe_nvfp4_weights *w, int tiled, const void *x, int64_t T,
                                    const uint32_t *xrow, int64_t xdiv, const uint32_t *idx, int64_t B,
                                    fp4moe_route route, int relu2, void *y, void *stream, const gq_runs *runs) {
    int st = check_call(w, x, FP4MOE_BF16, idx, B, 1, route, y);
    if (st != FP4MOE_OK || B == 0) return st;
    if (T < 1 || T > INT_MAX || xdiv < 1 || xdiv > INT_MAX || misaligned(xrow, 4) || !xrow)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda (rows): T=%lld, xdiv=%lld or xrow (%p) invalid",
                                (long long)T, (long long)xdiv, (const void *)xrow);
    if (w->K % 8 != 0) /* each x row starts 16-byte aligned */
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (rows): K=%lld is not a multiple of 8",
                                (long long)w->K);
    const bool rm = runs_match(runs, idx, B, w->E);
    const gq_args a = {w->codes, w->scales, w->global_scale, (int)w->E, (int)w->N, (int)w->K, x, y, idx, (int)B,
                       relu2 ? 1 : 0, tiled, 0, xrow, (int)xdiv, rm ? runs->buf : nullptr, rm ? runs->mt : 0, nullptr};
    /* where gather_qmm_cuda_ex on the B gathered rows would run the expert-batched kernel: route
     * batched, or qmv as "qmv, tiled by 8 rows" (the same kernel with 8-row tiles) */
    const fp4moe_route r = route == FP4MOE_ROUTE_AUTO ? choose_route(B, w->E, 1) : route;
    const bool qt = r == FP4MOE_ROUTE_QMV && (B >= FP4MOE_BATCHED_MIN_ROWS || !gq_qmv_mma_fits(&a) ||
                                              gq_dense_kg_fits(&a, FP4MOE_BF16));
    if (r != FP4MOE_ROUTE_BATCHED && !qt)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (rows): B=%lld rows, route %s: only the "
                                "expert-batched kernels read x through a row map", (long long)B, fp4moe_route_name(r));
    cudaStream_t s = (cudaStream_t)stream;
    st = qt ? gq_launch_qmv_tiled(&a, FP4MOE_BF16, s) : gq_launch_batched(&a, FP4MOE_BF16, s);
    return st ? fp4moe_error_context(st, "gather_qmm_cuda (rows, E=%d N=%d K=%d B=%d)", a.E, a.N, a.K, a.B) : FP4MOE_OK;
}

extern "C" int gather_qmm_cuda_moe_rows(const fp4moe_nvfp4_weights *wu, int tiled_u, const fp4moe_nvfp4_weights *wd,
                                        int tiled_d, const void *x, int64_t T, const uint32_t *xrow, int64_t xdiv,
                                        const uint32_t *idx, int64_t B, fp4moe_route route, void *h, void *y,
                                        void *stream, const gq_runs *runs) {
    int st = check_call(wu, x, FP4MOE_BF16, idx, B, 1, route, h);
    if (st == FP4MOE_OK) st = check_call(wd, h, FP4MOE_BF16, idx, B, 1, route, y);
    if (st != FP4MOE_OK || B == 0) return st;
    if (T < 1 || T > INT_MAX || xdiv < 1 || xdiv > INT_MAX || misaligned(xrow, 4) || !xrow || wd->K != wu->N ||
        wd->E != wu->E)
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda (moe pair): T=%lld, xdiv=%lld, xrow (%p), down K %lld "
                                "vs up N %lld or E %lld vs %lld invalid", (long long)T, (long long)xdiv,
                                (const void *)xrow, (long long)wd->K, (long long)wu->N, (long long)wd->E,
                                (long long)wu->E);
    const fp4moe_route r = route == FP4MOE_ROUTE_AUTO ? choose_route(B, wu->E, 1) : route;
    cudaStream_t s = (cudaStream_t)stream;
    const char *big = env_get(ENV_CUDA_MOE_BIG); /* 0 | 1 (short remainders on 64-row tiles) | all */
    if (r == FP4MOE_ROUTE_BATCHED && B >= GQ_BIG_ROWS_PER_EXPERT * wu->E && strcmp(big, "0")) {
        const gq_args u = {wu->codes, wu->scales, wu->global_scale, (int)wu->E, (int)wu->N, (int)wu->K, x, h, idx,
                           (int)B, 1, tiled_u, 0, xrow, (int)xdiv, nullptr, 0, nullptr};
        const gq_args d = {wd->codes, wd->scales, wd->global_scale, (int)wd->E, (int)wd->N, (int)wd->K, h, y, idx,
                           (int)B, 0, tiled_d, 0, nullptr, 0, nullptr, 0, nullptr};
        if (gq_moe_big_fits(&u, &d)) {
            st = gq_launch_moe_big(&u, &d, T, strcmp(big, "all") != 0, s);
            return st ? fp4moe_error_context(st, "gather_qmm_cuda (moe, big tiles, E=%d up %dx%d down %dx%d B=%d)", u.E,
                                             u.N, u.K, d.N, d.K, u.B)
                      : FP4MOE_OK;
        }
    }
    if (strcmp(env_get(ENV_CUDA_MOE_FUSED), "1"))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe pair): off (FP4MOE_CUDA_MOE_FUSED=0)");
    if (r != FP4MOE_ROUTE_BATCHED || !runs_match(runs, idx, B, wu->E) || !runs->done)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe pair): route %s or no runs made with idx",
                                fp4moe_route_name(r));
    const gq_args u = {wu->codes, wu->scales, wu->global_scale, (int)wu->E, (int)wu->N, (int)wu->K, x, h, idx, (int)B,
                       1, tiled_u, 0, xrow, (int)xdiv, runs->buf, runs->mt, nullptr};
    const gq_args d = {wd->codes, wd->scales, wd->global_scale, (int)wd->E, (int)wd->N, (int)wd->K, h, y, idx, (int)B,
                       0, tiled_d, 0, nullptr, 0, runs->buf, runs->mt, nullptr};
    st = gq_launch_moe_pair(&u, &d, runs->done, runs->done_n, s);
    if (st == FP4MOE_EUNSUPPORTED) return st;
    return st ? fp4moe_error_context(st, "gather_qmm_cuda (moe pair, E=%d up %dx%d down %dx%d B=%d)", u.E, u.N, u.K,
                                     d.N, d.K, u.B)
              : FP4MOE_OK;
}

extern "C" int64_t cuda_moe_done_ints(int64_t B, int64_t E) { return gq_moe_done_ints(B, E); }

extern "C" int gather_qmm_cuda_linear(const fp4moe_nvfp4_weights *w, int tiled, const void *x, fp4moe_dtype dtype,
                                      const uint32_t *zero_idx, int64_t B, fp4moe_route route, int relu2, void *y,
                                      void *stream, void *blas, gq_dense_scratch *dq, const void *wbf16,
                                      const float *d_zero, const int *e1_runs, int *fused) {
    *fused = 0;
    int st = check_call(w, x, dtype, zero_idx, B, 1, route, y);
    if (st != FP4MOE_OK || B == 0) return st;
    const fp4moe_route r = route == FP4MOE_ROUTE_AUTO ? choose_route(B, w->E, 1) : route;
    if (r != FP4MOE_ROUTE_DEQUANT_GEMM || w->E != 1 || dtype != FP4MOE_BF16 || !blas || (!dq && !wbf16) || !d_zero) {
        gq_runs r1 = {};
        r1.idx = zero_idx;
        r1.e1_pairs = e1_runs;
        r1.e1_n = e1_runs ? B : 0; /* (the caller's table has B rows or more) */
        return gather_qmm_cuda_ex(w, tiled, x, dtype, zero_idx, B, 1, route, relu2, y, stream, fused, &r1);
    }
    const gq_args a = {w->codes, w->scales, w->global_scale, 1, (int)w->N, (int)w->K, x, y, zero_idx, (int)B, 0, tiled, 0,
                       nullptr, 0, nullptr, 0, nullptr};
    st = gq_dense_dequant_gemm(&a, (cudaStream_t)stream, blas, dq, wbf16, d_zero);
    return st ? fp4moe_error_context(st, "gather_qmm_cuda (route dequant_gemm, dense N=%d K=%d B=%d)", a.N, a.K, a.B)
              : FP4MOE_OK;
}

extern "C" int fp4moe_gather_qmm_cuda_route(const fp4moe_nvfp4_weights *w, const void *x,
                                            fp4moe_dtype dtype, const uint32_t *idx, int64_t B,
                                            int sorted, fp4moe_route route, void *y, void *stream) {
    int fused;
    return gather_qmm_cuda_ex(w, 0, x, dtype, idx, B, sorted, route, 0, y, stream, &fused, nullptr);
}

extern "C" int fp4moe_gather_qmm_cuda(const fp4moe_nvfp4_weights *w, const void *x, fp4moe_dtype dtype,
                                      const uint32_t *idx, int64_t B, int sorted, void *y, void *stream) {
    return fp4moe_gather_qmm_cuda_route(w, x, dtype, idx, B, sorted, FP4MOE_ROUTE_AUTO, y, stream);
}

/* FP4MOE_OK when the current device can run this build's kernels, else FP4MOE_EUNSUPPORTED with the reason in
 * why (when set_error: also as the last error). The kernels are sm_90a code only (no PTX): exactly compute
 * capability 9.0 (H100, H200); any other device fails at its first launch ("no kernel image"). */
static int cuda_usable(int set_error) {
    char why[320];
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    const char *cvd = getenv("CUDA_VISIBLE_DEVICES");
    char vis[128] = "";
    if (cvd) snprintf(vis, sizeof vis, " (CUDA_VISIBLE_DEVICES=%.80s)", cvd);
    if (e != cudaSuccess) (void)cudaGetLastError(); /* clear the error state: "no device" is an answer, not a fault */
    if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
        snprintf(why, sizeof why, "cuda: no CUDA device is visible%s; the cpu device runs without one", vis);
    } else if (e == cudaErrorInsufficientDriver) {
        snprintf(why, sizeof why, "cuda: no usable CUDA driver (no NVIDIA GPU driver installed, or one older than this "
                 "build's CUDA %d.%d runtime needs)%s; the cpu device runs without it", CUDART_VERSION / 1000,
                 CUDART_VERSION % 1000 / 10, vis);
    } else if (e != cudaSuccess) {
        snprintf(why, sizeof why, "cuda: the CUDA driver cannot be used (%s)%s; the cpu device runs without it",
                 cudaGetErrorString(e), vis);
    } else {
        int dev = 0;
        cudaDeviceProp p;
        if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
            (void)cudaGetLastError();
            snprintf(why, sizeof why, "cuda: the properties of the current CUDA device cannot be read%s", vis);
        } else if (p.major != 9 || p.minor != 0) {
            snprintf(why, sizeof why, "cuda: device %d (%.64s) has compute capability %d.%d, and this build's kernels "
                     "run on 9.0 only (H100, H200: sm_90a); the cpu device runs anywhere", dev, p.name, p.major,
                     p.minor);
        } else {
            return FP4MOE_OK;
        }
    }
    return set_error ? fp4moe_set_error(FP4MOE_EUNSUPPORTED, "%s", why) : FP4MOE_EUNSUPPORTED;
}

extern "C" int fp4moe_cuda_check(void) { return cuda_usable(1); }

extern "C" int fp4moe_cuda_available(void) { return cuda_usable(0) == FP4MOE_OK; }

extern "C" int fp4moe_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" int fp4moe_cuda_set_device(int device) {
    const int n = fp4moe_cuda_device_count();
    if (device < 0 || device >= n)
        return fp4moe_set_error(FP4MOE_EINVAL, "cuda_set_device: device %d, %d visible", device, n);
    FP4MOE_CUDA_TRY("cuda_set_device", cudaSetDevice(device), "cudaSetDevice");
    return FP4MOE_OK;
}

extern "C" int gather_qmm_cuda_bf16_f32out(const fp4moe_nvfp4_weights *w, int tiled, const void *x, const uint32_t *idx,
                                           int64_t B, float *y, void *stream) {
    int st = fp4moe_gather_qmm_check(w, x, idx, B, y);
    if (st != FP4MOE_OK) return st;
    if (B == 0) return FP4MOE_OK;
    if (B > INT_MAX || w->E > INT_MAX - 1 || w->N > INT_MAX || w->K > INT_MAX)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (f32 out): B=%lld, E=%lld, N=%lld or "
                                "K=%lld exceeds 2^31-1", (long long)B, (long long)w->E, (long long)w->N,
                                (long long)w->K);
    if (misaligned(x, 16) || misaligned(w->codes, 8) || misaligned(y, 4) || misaligned(idx, 4) ||
        misaligned(w->global_scale, 4))
        return fp4moe_set_error(FP4MOE_EINVAL, "gather_qmm_cuda (f32 out): misaligned device pointer");
    const gq_args a = {w->codes, w->scales, w->global_scale, (int)w->E, (int)w->N, (int)w->K, x, y, idx, (int)B, 0,
                       tiled, 0, nullptr, 0, nullptr, 0, nullptr};
    /* decode-sized rows: the qmv v5 kernel with fp32 output; else the expert-batched kernel */
    st = gq_qmv_mma_fits(&a) ? gq_launch_qmv_mma(&a, true, (cudaStream_t)stream)
                             : gq_launch_bf16_f32out(&a, (cudaStream_t)stream);
    return st ? fp4moe_error_context(st, "gather_qmm_cuda (bf16 x, f32 y, E=%d N=%d K=%d B=%d)", a.E, a.N,
                                     a.K, a.B)
              : FP4MOE_OK;
}
