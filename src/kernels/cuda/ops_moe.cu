/* CUDA ops of MoE routing: the nemotron_h router (sigmoid, correction bias for choice only, grouped
 * top-k with lower-id ties, normalisation, routed scaling), the stable counting sort of
 * (token, slot) rows by expert, the gather of rows into expert order, and the fp32 combine.
 * Formulas: spec NEMOTRON_H.md "MoE", src/kernels/cpu/ops_moe.c (same tie rules, same order of
 * the weight arithmetic). Everything stays on the device: no host round trip between the router
 * and gather_qmm. Contracts: ops_cuda.h. */
#include <math.h>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/cuda_launch.cuh"

/* ---- router ----------------------------------------------------------------------------------- */

#define ROUTER_WARPS 4

/* The free entry (taken[i] == 0) of v[0..n) with the largest value, lowest index on ties, across
 * the warp (every lane gets it); -1 when none is free. Same answer as the CPU's argmax_free. */
__device__ int warp_argmax_free(const float *v, const unsigned char *taken, int n) {
    const int lane = threadIdx.x & 31;
    int bi = -1;
    float bv = 0.0f;
    for (int i = lane; i < n; i += 32)
        if (!taken[i] && (bi < 0 || v[i] > bv)) { bi = i; bv = v[i]; }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) { bi = oi; bv = ov; }
    }
    return bi;
}

__device__ __forceinline__ float sigmoid_f(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

/* Shared memory of one warp of the router: sig[E], choice[E], group score[G] (floats), taken[E]
 * and group taken[G] (bytes), 16-byte aligned. */
__host__ __device__ inline size_t router_warp_smem(int64_t E, int64_t G) {
    return ((size_t)E * 4 + (size_t)(E + G) * 5 + 15) & ~(size_t)15;
}

/* The logit of token t, expert e: logits[t][e] (read with ld.global.cg: in the fused route kernel other
 * blocks wrote them), or with planes (cuda_matmul_bf16x3_planes: rows of 3E, P0 | P1 | P2) P0 + (P1 + P2),
 * the small ones first (the caller stores it as the logits' output). */
__device__ __forceinline__ float router_logit(const float *logits, const float *planes, int E, int t, int e) {
    if (!planes) return __ldcg(logits + (int64_t)t * E + e);
    const float *p = planes + (int64_t)t * 3 * E;
#ifdef FP4MOE_INJECT_FAULT_PLANES /* deliberate fault (tests must catch it): the second plane read for the third */
    return __ldg(p + e) + (__ldg(p + E + e) + __ldg(p + E + e));
#else
    return __ldg(p + e) + (__ldg(p + E + e) + __ldg(p + 2 * E + e));
#endif
}

#define ROUTER_REG_SLOTS 8 /* router_token_reg: experts per lane (E <= 256) */

/* router_token for one group (n_group 1) and E <= 32 * ROUTER_REG_SLOTS, with the scores in
 * registers: lane L holds experts L, L + 32, ... (the order in which warp_argmax_free visits them,
 * so the same expert wins every round, ties included), all logits and biases are loaded before any
 * is used (one memory latency, where the general path's stores to scratch - which the compiler
 * cannot prove apart from the logits - may hold each lane's next load back), and a round of the
 * top-k reads no shared memory (measured: 7.5 -> 6.1 us for a decode token, docs/GPU-NOTES.md).
 * Same arithmetic and order as router_token's general path, hence the same ids and weights. */
__device__ __forceinline__ void router_token_reg(const cuda_router_cfg &r, const float *logits, int t, int32_t *ids,
                                                 float *wts, const float *planes, float *lout) {
    const int E = (int)r.E, k = (int)r.k, lane = threadIdx.x & 31;
    float lv[ROUTER_REG_SLOTS], bv[ROUTER_REG_SLOTS], sig[ROUTER_REG_SLOTS], ch[ROUTER_REG_SLOTS];
#pragma unroll
    for (int i = 0; i < ROUTER_REG_SLOTS; i++) {
        const int e = lane + 32 * i;
        lv[i] = e < E ? router_logit(logits, planes, E, t, e) : 0.0f;
        bv[i] = e < E && r.bias ? __ldg(r.bias + e) : 0.0f;
    }
    if (planes) /* the logits' output, after every load */
#pragma unroll
        for (int i = 0; i < ROUTER_REG_SLOTS; i++)
            if (lane + 32 * i < E) lout[(int64_t)t * E + lane + 32 * i] = lv[i];
    unsigned freem = 0; /* bit i: expert lane + 32 i exists and is not taken */
#pragma unroll
    for (int i = 0; i < ROUTER_REG_SLOTS; i++) {
        sig[i] = sigmoid_f(lv[i]);
        ch[i] = __fadd_rn(sig[i], bv[i]);
        if (lane + 32 * i < E) freem |= 1u << i;
    }
    float sum = 0.0f;
    int32_t *it = ids + (int64_t)t * k;
    float *wt = wts + (int64_t)t * k;
    for (int j = 0; j < k; j++) {
        int bi = -1;
        float best = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTER_REG_SLOTS; i++) /* ascending expert ids, as warp_argmax_free */
            if ((freem >> i & 1u) && (bi < 0 || ch[i] > best)) { bi = lane + 32 * i; best = ch[i]; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
#ifdef FP4MOE_INJECT_FAULT_ROUTE_TIE /* deliberate fault (tests must catch it): ties to the higher id */
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi > bi))) { bi = oi; best = ov; }
#else
            if (oi >= 0 && (bi < 0 || ov > best || (ov == best && oi < bi))) { bi = oi; best = ov; }
#endif
        }
        /* lane 0's winner (the lanes agree unless scores are NaN; the general path uses lane 0's):
         * its owner lane clears it and hands out its s */
        bi = __shfl_sync(0xffffffffu, bi, 0);
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < ROUTER_REG_SLOTS; i++)
            if (bi == lane + 32 * i) { freem &= ~(1u << i); s = sig[i]; }
        s = __shfl_sync(0xffffffffu, s, bi & 31);
        if (lane == 0) {
            it[j] = bi;
            wt[j] = s; /* the weight is s, never the choice score */
            sum = __fadd_rn(sum, s);
        }
    }
    if (lane == 0)
        for (int j = 0; j < k; j++) {
            float x = wt[j];
            if (r.norm_topk_prob) x = __fdiv_rn(x, __fadd_rn(sum, 1e-20f));
            wt[j] = __fmul_rn(x, r.scaling);
        }
    __syncwarp();
}

/* The router of token t by one warp (every lane calls it), scratch: router_warp_smem bytes. The
 * logits are read once (router_logit: from logits, or summed from planes and written to lout). */
__device__ __forceinline__ void router_token(const cuda_router_cfg &r, const float *logits, int t, int32_t *ids, float *wts,
                             char *scratch, const float *planes = nullptr, float *lout = nullptr) {
    const int E = (int)r.E, G = (int)r.n_group, k = (int)r.k;
    const int lane = threadIdx.x & 31;
    if (G <= 1 && E <= 32 * ROUTER_REG_SLOTS) {
        router_token_reg(r, logits, t, ids, wts, planes, lout);
        return;
    }
    float *sig = (float *)scratch, *choice = sig + E, *gscore = choice + E;
    unsigned char *taken = (unsigned char *)(gscore + G), *gtaken = taken + E;
    for (int e = lane; e < E; e += 32) { /* the logits read once: no memory round trip per choice */
        const float v = router_logit(logits, planes, E, t, e);
        if (planes) lout[(int64_t)t * E + e] = v;
        sig[e] = sigmoid_f(v);
        choice[e] = __fadd_rn(sig[e], r.bias ? r.bias[e] : 0.0f);
        taken[e] = 0;
    }
    __syncwarp();
    if (G > 1) { /* keep the topk_group groups with the best sum of their top-2 choice scores */
        const int per = E / G;
        for (int g = lane; g < G; g += 32) {
            float a = -INFINITY, b = -INFINITY;
            for (int e = g * per; e < (g + 1) * per; e++) {
                const float v = choice[e];
                if (v > a) { b = a; a = v; }
                else if (v > b) b = v;
            }
            gscore[g] = a + b;
            gtaken[g] = 0;
        }
        __syncwarp();
        for (int j = 0; j < (int)r.topk_group; j++) {
            const int g = warp_argmax_free(gscore, gtaken, G);
            if (lane == 0 && g >= 0) gtaken[g] = 1;
            __syncwarp();
        }
        for (int e = lane; e < E; e += 32)
            if (!gtaken[e / per]) choice[e] = -INFINITY;
        __syncwarp();
    }
    float sum = 0.0f;
    int32_t *it = ids + (int64_t)t * k;
    float *wt = wts + (int64_t)t * k;
    for (int j = 0; j < k; j++) {
        const int e = warp_argmax_free(choice, taken, E);
        if (lane == 0) {
            taken[e] = 1;
            it[j] = e;
            wt[j] = sig[e]; /* the weight is s, never the choice score */
            sum = __fadd_rn(sum, wt[j]);
        }
        __syncwarp();
    }
    if (lane == 0)
        for (int j = 0; j < k; j++) {
            float w = wt[j];
            if (r.norm_topk_prob) w = __fdiv_rn(w, __fadd_rn(sum, 1e-20f));
            wt[j] = __fmul_rn(w, r.scaling);
        }
    __syncwarp();
}

/* One warp per token; planes: the logits as three planes (router_logit), written to lout. */
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_kernel(cuda_router_cfg r, const float *logits, int T, int32_t *ids, float *wts, const float *planes,
              float *lout) {
    cu_pdl_entry();
    extern __shared__ float sm[];
    const int warp = threadIdx.x >> 5, t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return; /* warp-uniform; no block-wide barrier below */
    router_token(r, logits, t, ids, wts, (char *)sm + warp * router_warp_smem(r.E, r.n_group), planes, lout);
}

/* The router configurations the device router handles. */
static bool router_cfg_ok(const cuda_router_cfg *r) {
    return r->E >= 1 && r->E <= 4096 && r->k >= 1 && r->k <= r->E && r->n_group >= 1 && r->E % r->n_group == 0 &&
           r->topk_group >= 1 && r->topk_group <= r->n_group;
}

/* router_kernel over T tokens: from logits, or (planes) from the three planes, writing lout */
static int router_launch(void *stream, const cuda_router_cfg *r, const float *logits, int64_t T, int32_t *ids,
                         float *wts, const float *planes, float *lout) {
    if (T <= 0) return FP4MOE_OK;
    if (!router_cfg_ok(r))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op router: E=%lld (at most 4096), k=%lld, "
                                "n_group=%lld, topk_group=%lld", (long long)r->E, (long long)r->k,
                                (long long)r->n_group, (long long)r->topk_group);
    const size_t per_warp = router_warp_smem(r->E, r->n_group);
    cu_launch(router_kernel, ops_blocks(T, ROUTER_WARPS), ROUTER_WARPS * 32, ROUTER_WARPS * per_warp,
              (cudaStream_t)stream, *r, logits, (int)T, ids, wts, planes, lout);
    OPS_LAUNCH_CHECK("router top-k");
    return FP4MOE_OK;
}

extern "C" int cuda_router_topk(void *stream, const cuda_router_cfg *r, const float *logits, int64_t T,
                                int32_t *ids, float *wts) {
    return router_launch(stream, r, logits, T, ids, wts, nullptr, nullptr);
}

/* ---- stable counting sort by expert --------------------------------------------------------------- */

#define SORT_THREADS 1024
/* rows a sort may have: B plus a block's stride stays below 2^31 in the kernels' int row arithmetic */
#define SORT_MAX_ROWS (0x7fffffff - 4096)

/* Warp-level exclusive scan over experts, run by one full warp: out[e] = sum over e' < e of in[e'],
 * plus add[e] when add is non-NULL, for e < E (shared memory; out may alias in: each lane reads its
 * entry before it writes it). */
__device__ __forceinline__ void sort_warp_exclusive_scan(const int *in, const int *add, int *out, int E) {
    const int lane = threadIdx.x & 31;
    int carry = 0;
    for (int b0 = 0; b0 < E; b0 += 32) {
        const int e = b0 + lane, v = e < E ? in[e] : 0;
        int incl = v;
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += u;
        }
        if (e < E) out[e] = carry + incl - v + (add ? add[e] : 0);
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
}

/* The expert runs (gq_runs: starts[E + 1], tile_off[E + 1] for row tile mt, the work counter zeroed) of the whole
 * sort from start[e] (shared: the exclusive sum of the rows of experts < e over all B rows), by one full warp. */
struct sort_runs {
    int *buf; /* NULL: none */
    int mt;
};
__device__ __forceinline__ void sort_write_runs(const int *start, int B, int E, sort_runs rr) {
    const int lane = threadIdx.x & 31;
    int *starts = rr.buf, *tile_off = rr.buf + E + 1;
    int carry = 0;
    for (int b0 = 0; b0 < E; b0 += 32) {
        const int e = b0 + lane;
        int v = 0;
        if (e < E) {
            const int next = e + 1 < E ? start[e + 1] : B, len = next - start[e];
            starts[e] = start[e];
#ifdef FP4MOE_INJECT_FAULT_SORT_RUNS /* deliberate fault (tests must catch it): every expert one tile short */
            v = len > rr.mt ? (len + rr.mt - 1) / rr.mt - 1 : len > 0;
#else
            v = (len + rr.mt - 1) / rr.mt;
#endif
        }
        int incl = v;
        for (int o = 1; o < 32; o <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += u;
        }
        if (e < E) tile_off[e] = carry + incl - v;
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
    if (lane == 0) {
        starts[E] = B;
        tile_off[E] = carry;
        tile_off[E + 1] = 0; /* the gather kernels' work counter */
    }
}

/* Rows [lo, hi) by one block of W warps; warp w owns the contiguous rows [lo + w*chunk, lo + (w+1)*chunk).
 *  1. cnt[w][e] = rows of warp w with expert e (shared-memory atomics; order does not matter);
 *  2. cnt[w][e] := start of those rows in the output: experts in order, within an expert the warps
 *     in order (an exclusive scan over (e, w)), plus base[e] when given (the position of the rows
 *     [lo, hi) of expert e in the whole output), else plus the exclusive scan of the totals (lo = 0,
 *     hi = B: the whole sort);
 *  3. each warp walks its rows in order, 32 at a time: rows with equal experts in one step are
 *     ranked by lane (__match_any_sync), so the order within an expert is the row order. */
__device__ void sort_rows(const int32_t *ids, int lo, int hi, int E, const int *base, uint32_t *row_of, uint32_t *idx,
                          uint32_t *pos_of, int *cnt /* shared: (W + 1) x E */, int B = 0, sort_runs rr = {nullptr, 0}) {
    const int W = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int *start = cnt + W * E;
    const int chunk = (hi - lo + W - 1) / W, b_lo = min(hi, lo + warp * chunk), b_hi = min(hi, b_lo + chunk);
    for (int i = threadIdx.x; i < W * E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    int *mine = cnt + warp * E;
    for (int b = b_lo + lane; b < b_hi; b += 32) atomicAdd(&mine[ids[b]], 1);
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) { /* per expert: exclusive over warps */
        int run = 0;
        for (int w = 0; w < W; w++) {
            const int c = cnt[w * E + e];
            cnt[w * E + e] = run;
            run += c;
        }
        start[e] = base ? base[e] : run; /* without base: the total for now */
    }
    __syncthreads();
    if (!base && warp == 0) sort_warp_exclusive_scan(start, nullptr, start, E); /* over the totals */
    __syncthreads();
    /* rr (the whole sort, or block 0 of the many-block one, whose base is the whole sort's): the runs */
    if (rr.buf && warp == 0) sort_write_runs(start, B, E, rr);
    for (int i = threadIdx.x; i < W * E; i += blockDim.x) cnt[i] += start[i % E];
    __syncthreads();
    const unsigned lt = (1u << lane) - 1u;
    for (int b0 = b_lo; b0 < b_hi; b0 += 32) {
        const int b = b0 + lane;
        const bool valid = b < b_hi;
        const int e = valid ? ids[b] : E + lane; /* invalid lanes: keys no valid lane has */
        const unsigned peers = __match_any_sync(0xffffffffu, e);
        int p = 0;
        if (valid) p = mine[e] + __popc(peers & lt);
        __syncwarp();
        if (valid && (peers >> lane) == 1u) mine[e] += __popc(peers); /* the last of its peers */
        __syncwarp();
        if (valid) {
            row_of[p] = (uint32_t)b;
            idx[p] = (uint32_t)e;
            pos_of[b] = (uint32_t)p;
        }
    }
}

/* The whole sort of B rows by one block. */
__device__ void sort_block(const int32_t *ids, int B, int E, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of,
                           int *cnt /* shared: (W + 1) x E */, sort_runs rr = {nullptr, 0}) {
    sort_rows(ids, 0, B, E, nullptr, row_of, idx, pos_of, cnt, B, rr);
}

__global__ void __launch_bounds__(SORT_THREADS)
sort_kernel(const int32_t *ids, int B, int E, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of, sort_runs rr) {
    cu_pdl_entry();
    extern __shared__ int cnt[]; /* W x E, then start[E] */
    sort_block(ids, B, E, row_of, idx, pos_of, cnt, rr);
}

/* The same sort by many blocks (prefill-sized B): block j places the rows [j*chunk, (j+1)*chunk). Each
 * block counts every row's expert itself (tot[e]) and those before its rows (before[e]) - B reads a
 * block, no scratch and no second launch - so that its rows of expert e start at base[e] = (rows of
 * experts < e) + before[e]; then sort_rows. The same output as sort_kernel: the order within an expert
 * is the row order. ids must not alias pos_of (cuda_sort_local's trick needs the one-block form).
 * Measured (H200, 30B-A3B routing, 128 experts): the one-block sort took 10.8 / 27.6 us a call at 512 /
 * 2,048 tokens (3,072 / 12,288 rows, 32 warps on one SM). */
#define SORT_MB_THREADS 256
#define SORT_MB_ROWS 1024 /* rows a block places, at least */
#define SORT_MB_BLOCKS 64 /* blocks at most (each reads all B rows) */
#define SORT_MB_MAX_E 1024 /* (3 + 9) x E ints of shared memory */
__global__ void __launch_bounds__(SORT_MB_THREADS)
sort_multi_kernel(const int32_t *ids, int B, int E, int chunk, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of,
                  sort_runs rr) {
    cu_pdl_entry();
    extern __shared__ int ssm[]; /* tot[E], before[E], base[E], then sort_rows' (W + 1) x E */
    int *tot = ssm, *before = ssm + E, *base = ssm + 2 * E;
    const int64_t lo64 = (int64_t)blockIdx.x * chunk; /* int64: lo + chunk may pass 2^31 for the last block */
    const int lo = (int)min((int64_t)B, lo64), hi = (int)min((int64_t)B, lo64 + chunk);
    for (int i = threadIdx.x; i < 2 * E; i += blockDim.x) ssm[i] = 0;
    __syncthreads();
    for (int b = threadIdx.x; b < B; b += blockDim.x) {
        const int e = ids[b];
        atomicAdd(&tot[e], 1);
        if (b < lo) atomicAdd(&before[e], 1);
    }
    __syncthreads();
    if (threadIdx.x < 32) /* base = exclusive scan of the totals + before */
#ifdef FP4MOE_INJECT_FAULT_SORT_BASE /* deliberate fault (tests must catch it): the earlier blocks' rows not counted */
        sort_warp_exclusive_scan(tot, nullptr, base, E);
#else
        sort_warp_exclusive_scan(tot, before, base, E);
#endif
    __syncthreads();
    if (blockIdx.x > 0) rr.buf = nullptr; /* block 0's base (nothing before it) is the whole sort's start */
    sort_rows(ids, lo, hi, E, base, row_of, idx, pos_of, ssm + 3 * E, B, rr);
}

static int sort_by_expert(void *stream, const int32_t *ids, int64_t B, int64_t E, uint32_t *row_of, uint32_t *idx,
                          uint32_t *pos_of, sort_runs rr) {
    if (B <= 0) return FP4MOE_OK;
    int W = (int)(12288 / (E > 0 ? E : 1)) - 1; /* (W + 1) * E ints in 48 KiB */
    if (W > SORT_THREADS / 32) W = SORT_THREADS / 32;
    /* at most one warp per 64 rows: a decode step's 6 rows take one warp, not 32 (the result is
     * the same for every W: the sort is stable) */
    if (W > (B + 63) / 64) W = (int)((B + 63) / 64);
    if (E < 1 || W < 1 || B > SORT_MAX_ROWS)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op sort by expert: E=%lld (at most 6143), "
                                "B=%lld (at most %d)", (long long)E, (long long)B, SORT_MAX_ROWS);
    if (B >= 2 * SORT_MB_ROWS && E <= SORT_MB_MAX_E && (const void *)ids != (const void *)pos_of) {
        int64_t chunk = (B + SORT_MB_BLOCKS - 1) / SORT_MB_BLOCKS;
        if (chunk < SORT_MB_ROWS) chunk = SORT_MB_ROWS;
        const size_t smem_mb = (size_t)(3 + SORT_MB_THREADS / 32 + 1) * (size_t)E * sizeof(int);
        cu_launch(sort_multi_kernel, ops_blocks(B, (int)chunk), SORT_MB_THREADS, smem_mb, (cudaStream_t)stream, ids,
                  (int)B, (int)E, (int)chunk, row_of, idx, pos_of, rr);
        OPS_LAUNCH_CHECK("sort by expert (blocks)");
        return FP4MOE_OK;
    }
    const size_t smem = (size_t)(W + 1) * (size_t)E * sizeof(int);
    cu_launch(sort_kernel, 1, W * 32, smem, (cudaStream_t)stream, ids, (int)B, (int)E, row_of, idx, pos_of, rr);
    OPS_LAUNCH_CHECK("sort by expert");
    return FP4MOE_OK;
}

extern "C" int cuda_sort_by_expert(void *stream, const int32_t *ids, int64_t B, int64_t E,
                                   uint32_t *row_of, uint32_t *idx, uint32_t *pos_of) {
    return sort_by_expert(stream, ids, B, E, row_of, idx, pos_of, sort_runs{nullptr, 0});
}

/* local ids (int) of received global experts, clamped into [0, E) */
__global__ void local_ids_kernel(const uint32_t *ids, int64_t B, int64_t lo, int64_t E, int32_t *out) {
    cu_pdl_entry();
    for (int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; b < B; b += (int64_t)gridDim.x * blockDim.x) {
        const int64_t e = (int64_t)ids[b] - lo;
        out[b] = (int32_t)(e < 0 ? 0 : e >= E ? E - 1 : e);
    }
}

extern "C" int cuda_sort_local(void *stream, const uint32_t *ids, int64_t B, int64_t lo, int64_t E,
                               uint32_t *row_of, uint32_t *idx, uint32_t *pos_of) {
    if (B <= 0) return FP4MOE_OK;
    if (E < 1) return fp4moe_set_error(FP4MOE_EINVAL, "cuda op sort_local: %lld rows for no expert", (long long)B);
    /* the local ids live in pos_of: sort_block reads ids[b] only in the thread that later writes
     * pos_of[b] (its counting pass, then its ranking pass reads ids[b] before writing pos_of[b]) */
    int32_t *l = (int32_t *)pos_of;
    cu_launch(local_ids_kernel, ops_blocks(B, 256) < 1024 ? ops_blocks(B, 256) : 1024, 256, 0, (cudaStream_t)stream,
              ids, B, lo, E, l);
    OPS_LAUNCH_CHECK("sort_local (local ids)");
    return cuda_sort_by_expert(stream, l, B, E, row_of, idx, pos_of);
}

/* ---- routing for decode-sized steps ------------------------------------------------------------ */

#define ROUTE_WARPS 8   /* warps per block of the route tail kernel */
#ifndef ROUTE_LOGITS_WARPS
#define ROUTE_LOGITS_WARPS 16 /* warps per block of the logits kernel */
#endif
#ifndef ROUTE_PARTS
#define ROUTE_PARTS 16  /* warps per expert in the logits kernel (each a contiguous part of H) */
#endif
#define ROUTE_MAX_T 16  /* tokens of the decode route (register accumulators per lane) */
static_assert(ROUTE_LOGITS_WARPS % ROUTE_PARTS == 0, "an expert's parts in one block");

/* logits (T x E) = x (T x H fp32) @ W^T for T <= ROUTE_MAX_T: ROUTE_PARTS warps per expert (16: one
 * expert a block of 16 warps, 42 float4 of a 2688-wide row a warp, i.e. one load round a lane; 4
 * parts in 8-warp blocks took 8.5 us for E = 128, ncu) each dot
 * a contiguous part of the fp32 weight row with the T rows of x (float4 loads, lane partial sums
 * in a fixed order, a warp reduction), the parts added in order: deterministic. cuBLAS's GEMV
 * took two launches (dot + reduce) for this. H % 4 == 0, x and W 16-byte aligned. */
#ifndef ROUTE_PRE
#define ROUTE_PRE 4 /* float4 of W a lane loads before the PDL wait (all of them for H <= 8,192) */
#endif

/* The block's expert e, its weight row (as H / 4 float4; row 0 for e >= E) and the warp's part
 * [lo, hi) of it (hi = lo for e >= E) */
__device__ __forceinline__ const float4 *route_part(const float *W, int E, int H, int &e, int &lo, int &hi) {
    const int warp = threadIdx.x >> 5, H4 = H / 4, per = (H4 + ROUTE_PARTS - 1) / ROUTE_PARTS;
    e = blockIdx.x * (ROUTE_LOGITS_WARPS / ROUTE_PARTS) + warp / ROUTE_PARTS;
    lo = (warp % ROUTE_PARTS) * per;
    hi = e < E ? min(H4, lo + per) : lo;
    return reinterpret_cast<const float4 *>(W) + (int64_t)(e < E ? e : 0) * H4;
}

/* The logits kernel's PDL entry: the lane's first ROUTE_PRE float4 of its part of the weight row
 * (lo + lane, lo + lane + 32, ... below hi) loaded before the wait, i.e. while the RMSNorm that
 * makes x still runs. The router weights are uploaded once and never written by a kernel, so
 * reading them early is exact (cuda_launch.cuh's contract: a *_pdl_entry prologue reads only such
 * memory). */
struct route_wpre {
    float4 v[ROUTE_PRE];
};
__device__ __forceinline__ route_wpre route_logits_pdl_entry(const float *W, int E, int H) {
    route_wpre wpre;
    int e, lo, hi;
    const float4 *w = route_part(W, E, H, e, lo, hi);
#pragma unroll
    for (int j = 0; j < ROUTE_PRE; j++) {
        const int i = lo + (int)(threadIdx.x & 31) + 32 * j;
        if (i < hi) wpre.v[j] = __ldg(w + i);
    }
    cu_pdl_entry();
    return wpre;
}

/* acc[t] += w . x[t][4i .. 4i+3] for the T rows, one fma chain in a fixed order */
__device__ __forceinline__ void route_dot4(float (&acc)[ROUTE_MAX_T], float4 wv, const float4 *x4, int T, int H4,
                                           int i) {
#pragma unroll
    for (int t = 0; t < ROUTE_MAX_T; t++) {
        if (t < T) {
            const float4 xv = __ldg(x4 + (int64_t)t * H4 + i);
            acc[t] = fmaf(wv.w, xv.w, fmaf(wv.z, xv.z, fmaf(wv.y, xv.y, fmaf(wv.x, xv.x, acc[t]))));
        }
    }
}

__global__ void __launch_bounds__(ROUTE_LOGITS_WARPS * 32)
route_logits_kernel(const float *__restrict__ x, int T, const float *__restrict__ W, int E, int H,
                    float *__restrict__ logits) {
    const route_wpre wpre = route_logits_pdl_entry(W, E, H);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, pi = warp % ROUTE_PARTS, H4 = H / 4;
    int e, lo, hi;
    const float4 *w = route_part(W, E, H, e, lo, hi);
    __shared__ float part[ROUTE_LOGITS_WARPS][ROUTE_MAX_T];
    if (e < E) {
        float acc[ROUTE_MAX_T];
#pragma unroll
        for (int t = 0; t < ROUTE_MAX_T; t++) acc[t] = 0.0f;
        const float4 *x4 = reinterpret_cast<const float4 *>(x);
#pragma unroll
        for (int j = 0; j < ROUTE_PRE; j++) { /* the preloaded weights, then the rest: the same order */
            const int i = lo + lane + 32 * j;
            if (i < hi) route_dot4(acc, wpre.v[j], x4, T, H4, i);
        }
#pragma unroll 2
        for (int i = lo + lane + 32 * ROUTE_PRE; i < hi; i += 32) route_dot4(acc, __ldg(w + i), x4, T, H4, i);
#pragma unroll
        for (int t = 0; t < ROUTE_MAX_T; t++) {
            if (t < T) { /* warp-uniform: no reductions of unused accumulators */
                const float v = ops_warp_sum(acc[t]);
                if (lane == 0) part[warp][t] = v;
            }
        }
    }
    __syncthreads();
    if (e < E && pi == 0 && lane < T) {
        float v = part[warp][lane];
        for (int p = 1; p < ROUTE_PARTS; p++) v += part[warp + p][lane];
        logits[(int64_t)lane * E + e] = v;
    }
}

/* The stable sort of B <= 32 rows by expert in one warp (lane b holds row b): the position of row b
 * is the number of rows with a smaller expert, or the same expert and a smaller row. */
__device__ void sort_warp(const int32_t *ids, int B, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of) {
    const int lane = threadIdx.x & 31;
    const int e = lane < B ? ids[lane] : 0x7fffffff;
    int p = 0;
    for (int j = 0; j < B; j++) {
        const int ej = __shfl_sync(0xffffffffu, e, j);
#ifdef FP4MOE_INJECT_FAULT_ROUTE_SORT /* deliberate fault (tests must catch it): unstable within an expert */
        p += ej < e || (ej == e && j > lane);
#else
        p += ej < e || (ej == e && j < lane);
#endif
    }
    if (lane < B) {
        row_of[p] = (uint32_t)lane;
        idx[p] = (uint32_t)e;
        pos_of[lane] = (uint32_t)p;
    }
}

/* Shared scratch of route_tail_kernel before its ids and weights: the larger of the warps' router
 * scratch and sort_block's (ROUTE_WARPS + 1) x E counters; 16-byte multiple. */
__host__ __device__ inline size_t route_scratch_bytes(int64_t E, int64_t G) {
    const size_t a = ROUTE_WARPS * router_warp_smem(E, G), b = (size_t)(ROUTE_WARPS + 1) * (size_t)E * sizeof(int);
    return ((a > b ? a : b) + 15) & ~(size_t)15;
}

/* One block: the top-k of each token (router_token, warp per token), then the sort of the T * k
 * rows (one warp for <= 32 rows, else sort_block), ids and weights kept in shared memory between
 * the two (a chain of global round trips otherwise). */
__global__ void __launch_bounds__(ROUTE_WARPS * 32)
route_tail_kernel(cuda_router_cfg r, int T, const float *logits, int32_t *ids, float *wts, uint32_t *row_of,
                  uint32_t *idx, uint32_t *pos_of, sort_runs rr) {
    cu_pdl_entry();
    extern __shared__ __align__(16) char route_sm[];
    const int warp = threadIdx.x >> 5, B = T * (int)r.k;
    int32_t *sids = (int32_t *)(route_sm + route_scratch_bytes(r.E, r.n_group));
    float *swts = (float *)(sids + B);
    for (int t = warp; t < T; t += ROUTE_WARPS)
        router_token(r, logits, t, sids, swts, route_sm + warp * router_warp_smem(r.E, r.n_group));
    __syncthreads();
    for (int i = threadIdx.x; i < B; i += blockDim.x) {
        ids[i] = sids[i];
        wts[i] = swts[i];
    }
    if (B <= 32) {
        if (warp == 0) sort_warp(sids, B, row_of, idx, pos_of);
    } else {
        sort_block(sids, B, (int)r.E, row_of, idx, pos_of, (int *)route_sm, rr);
    }
}

extern "C" int cuda_moe_route(const cuda_ops *o, const cuda_router_cfg *r, const float *x, const uint16_t *xb,
                              int64_t T, const float *W, const uint16_t *W3, int64_t H, float *logits, int32_t *ids,
                              float *wts, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of, gq_runs *runs) {
    if (runs) runs->idx = nullptr;
    if (T <= 0) return FP4MOE_OK;
    /* the expert runs of idx for the gathers that follow (block sorts only: <= 32 rows take the qmv) */
    const int64_t B = T * r->k;
    sort_runs rr = {nullptr, 0};
    if (runs && runs->buf && runs->cap_e >= r->E && B > 32 && r->E > 1) rr = {runs->buf, gather_qmm_cuda_row_tile(B, r->E)};
    const size_t smem = route_scratch_bytes(r->E, r->n_group) + (size_t)(T * r->k) * 8;
    const bool small = T <= ROUTE_MAX_T && smem <= 48 * 1024 && H <= 0x7fffffff && H % 4 == 0 &&
                       ((uintptr_t)x & 15) == 0 && ((uintptr_t)W & 15) == 0 && router_cfg_ok(r);
    if (!small) {
        /* prefill: on bf16 tensor cores (x is the bf16 normed state; W in three exact bf16 planes). Measured on
         * the H200 (session 24, Nsight Compute, 23 layers): 512 tokens 0.430 ms (cuBLAS fp32 SGEMM split in K +
         * the parts' sum) -> 0.249 (bf16 GEMM + the planes' sum), 2,048 tokens 1.036 -> 0.338; prefill +1.1% /
         * +1.5% end to end with the dense-call change of the same session (docs/PERFORMANCE.md) */
        int st = FP4MOE_OK;
        const int64_t rows = xb && W3 ? cuda_bf16x3_rows(o, r->E) : 0;
        if (rows >= 1) {
            /* the planes' sum in the top-k kernel (one launch less a layer than a sum kernel: the same logits) */
            for (int64_t t0 = 0; t0 < T && !st; t0 += rows) {
                const int64_t n = T - t0 < rows ? T - t0 : rows;
                st = cuda_matmul_bf16x3_planes(o, xb + t0 * H, n, W3, r->E, H);
                if (!st) st = router_launch(o->stream, r, nullptr, n, ids + t0 * r->k, wts + t0 * r->k, o->split_ws,
                                            logits + t0 * r->E);
            }
        } else {
            st = cuda_matmul_f32(o, x, T, W, r->E, H, logits);
            if (!st) st = cuda_router_topk(o->stream, r, logits, T, ids, wts);
        }
        if (!st) st = sort_by_expert(o->stream, ids, T * r->k, r->E, row_of, idx, pos_of, rr);
        if (!st && rr.buf) *runs = gq_runs{runs->buf, runs->cap_e, idx, B, r->E, rr.mt, nullptr, 0, runs->done, runs->done_n};
        return st;
    }
    cudaStream_t st = (cudaStream_t)o->stream;
    cu_launch(route_logits_kernel, ops_blocks(r->E, ROUTE_LOGITS_WARPS / ROUTE_PARTS), ROUTE_LOGITS_WARPS * 32, 0, st,
              x, (int)T, W, (int)r->E, (int)H, logits);
    OPS_LAUNCH_CHECK("moe route (router logits)");
    cu_launch(route_tail_kernel, 1, ROUTE_WARPS * 32, smem, st, *r, (int)T, logits, ids, wts, row_of, idx, pos_of, rr);
    OPS_LAUNCH_CHECK("moe route (top-k and sort)");
    if (rr.buf) *runs = gq_runs{runs->buf, runs->cap_e, idx, B, r->E, rr.mt, nullptr, 0, runs->done, runs->done_n};
    return FP4MOE_OK;
}

/* ---- gather rows / combine ---------------------------------------------------------------------- */

__global__ void gather_rows_kernel(const uint16_t *x, int64_t H, const uint32_t *row_of, int64_t k,
                                   uint16_t *xs) {
    cu_pdl_entry();
    const int64_t p = blockIdx.x, src = (int64_t)(row_of[p] / (uint32_t)k);
    const uint16_t *in = x + src * H;
    uint16_t *out = xs + p * H;
    if ((H & 7) == 0) { /* 16-byte pieces (rows start 16-byte aligned: H*2 is a multiple of 16) */
        for (int64_t i = threadIdx.x; i < H / 8; i += blockDim.x)
            ((uint4 *)out)[i] = ((const uint4 *)in)[i];
    } else {
        for (int64_t i = threadIdx.x; i < H; i += blockDim.x) out[i] = in[i];
    }
}

extern "C" int cuda_gather_rows(void *stream, const uint16_t *x, int64_t H, const uint32_t *row_of,
                                int64_t B, int64_t k, uint16_t *xs) {
    if (B <= 0) return FP4MOE_OK;
    if (B > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op gather rows: B=%lld", (long long)B);
    cu_launch(gather_rows_kernel, (unsigned)B, 128, 0, (cudaStream_t)stream, x, H, row_of, k, xs);
    OPS_LAUNCH_CHECK("gather rows");
    return FP4MOE_OK;
}

/* Row t's k slots into shared memory: weight sw[j], expert output row sy[j] (the combine kernels). */
__device__ __forceinline__ void combine_slots(const uint16_t *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                                              int64_t k, int64_t t, float *sw, const uint16_t **sy) {
    for (int64_t j = threadIdx.x; j < k; j += blockDim.x) {
        sw[j] = wts[t * k + j];
        sy[j] = ys + (int64_t)pos_of[t * k + j] * H;
    }
    __syncthreads();
}

/* out[t] = sum over j (in order) of wts[t, j] * ys[pos_of[t, j]]: the k (position, weight) pairs of
 * the row read once into shared memory, and COMBINE_U elements of a slot loaded at once (one memory
 * round trip per element and slot before: 24 us for one decode row). */
#define COMBINE_MAX_K 64
#define COMBINE_U 4 /* elements per thread and batch */
#define COMBINE_J 8 /* slots per batch */
__global__ void combine_kernel(const uint16_t *__restrict__ ys, int64_t H, const uint32_t *__restrict__ pos_of,
                               const float *__restrict__ wts, int64_t k, uint16_t *__restrict__ out) {
    cu_pdl_entry();
    __shared__ float sw[COMBINE_MAX_K];
    __shared__ const uint16_t *sy[COMBINE_MAX_K];
    const int64_t t = blockIdx.x;
    combine_slots(ys, H, pos_of, wts, k, t, sw, sy);
    const int64_t step = blockDim.x;
    for (int64_t i0 = threadIdx.x; i0 < H; i0 += step * COMBINE_U) { /* COMBINE_U elements a batch */
        float o[COMBINE_U];
#pragma unroll
        for (int u = 0; u < COMBINE_U; u++) o[u] = 0.0f;
        for (int64_t j0 = 0; j0 < k; j0 += COMBINE_J) { /* COMBINE_J slots' loads in flight, summed in order */
            uint16_t v[COMBINE_J][COMBINE_U];
#pragma unroll
            for (int j = 0; j < COMBINE_J; j++)
#pragma unroll
                for (int u = 0; u < COMBINE_U; u++)
                    v[j][u] = j0 + j < k && i0 + u * step < H ? sy[j0 + j][i0 + u * step] : 0;
#pragma unroll
            for (int j = 0; j < COMBINE_J; j++)
                if (j0 + j < k)
#pragma unroll
                    for (int u = 0; u < COMBINE_U; u++)
                        o[u] = __fadd_rn(o[u], __fmul_rn(sw[j0 + j], ops_bf16_to_f32(v[j][u])));
        }
#pragma unroll
        for (int u = 0; u < COMBINE_U; u++)
            if (i0 + u * step < H) out[t * H + i0 + u * step] = ops_f32_to_bf16(o[u]);
    }
}

/* The same for prefill rows with H % 4 == 0 and 8-byte aligned ys / out: a thread's 4 consecutive
 * elements in one 8-byte load a slot (a quarter of the load instructions of combine_kernel's 2-byte
 * loads), COMBINE_J slots' loads in flight, the same products and sums in the same order (bitwise equal). */
__global__ void combine_vec_kernel(const uint16_t *__restrict__ ys, int64_t H, const uint32_t *__restrict__ pos_of,
                                   const float *__restrict__ wts, int64_t k, uint16_t *__restrict__ out) {
    cu_pdl_entry();
    __shared__ float sw[COMBINE_MAX_K];
    __shared__ const uint16_t *sy[COMBINE_MAX_K];
    const int64_t t = blockIdx.x;
    combine_slots(ys, H, pos_of, wts, k, t, sw, sy);
    for (int64_t q = threadIdx.x; q < H / 4; q += blockDim.x) {
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int64_t j0 = 0; j0 < k; j0 += COMBINE_J) {
            uint2 v[COMBINE_J];
#pragma unroll
            for (int j = 0; j < COMBINE_J; j++)
                v[j] = j0 + j < k ? *reinterpret_cast<const uint2 *>(sy[j0 + j] + 4 * q) : make_uint2(0u, 0u);
#pragma unroll
            for (int j = 0; j < COMBINE_J; j++)
                if (j0 + j < k) {
                    const float wj = sw[j0 + j];
                    o[0] = __fadd_rn(o[0], __fmul_rn(wj, ops_bf16_to_f32((uint16_t)(v[j].x & 0xffffu))));
                    o[1] = __fadd_rn(o[1], __fmul_rn(wj, ops_bf16_to_f32((uint16_t)(v[j].x >> 16))));
                    o[2] = __fadd_rn(o[2], __fmul_rn(wj, ops_bf16_to_f32((uint16_t)(v[j].y & 0xffffu))));
                    o[3] = __fadd_rn(o[3], __fmul_rn(wj, ops_bf16_to_f32((uint16_t)(v[j].y >> 16))));
                }
        }
        uint2 r;
        r.x = (uint32_t)ops_f32_to_bf16(o[0]) | ((uint32_t)ops_f32_to_bf16(o[1]) << 16);
        r.y = (uint32_t)ops_f32_to_bf16(o[2]) | ((uint32_t)ops_f32_to_bf16(o[3]) << 16);
        *reinterpret_cast<uint2 *>(out + t * H + 4 * q) = r;
    }
}

extern "C" int cuda_moe_combine(void *stream, const uint16_t *ys, int64_t H, const uint32_t *pos_of,
                                const float *wts, int64_t T, int64_t k, uint16_t *out) {
    if (T <= 0) return FP4MOE_OK;
    if (k < 1 || k > COMBINE_MAX_K)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op moe combine: top-k %lld (1..%d)", (long long)k,
                                COMBINE_MAX_K);
    /* decode-sized steps: 1024 threads a row (fewer batches of loads per thread) */
#ifndef COMBINE_SMALL_THREADS
#define COMBINE_SMALL_THREADS 1024
#endif
    if (T > 64 && H % 4 == 0 && (uintptr_t)ys % 8 == 0 && (uintptr_t)out % 8 == 0)
        cu_launch(combine_vec_kernel, (unsigned)T, 256, 0, (cudaStream_t)stream, ys, H, pos_of, wts, k, out);
    else
        cu_launch(combine_kernel, (unsigned)T, T <= 64 ? COMBINE_SMALL_THREADS : 256, 0, (cudaStream_t)stream, ys, H,
                  pos_of, wts, k, out);
    OPS_LAUNCH_CHECK("moe combine");
    return FP4MOE_OK;
}
