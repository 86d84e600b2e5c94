/* CUDA ops of MoE routing: the nemotron_h router (sigmoid, correction bias for choice only, grouped
 * top-k with lower-id ties, normalisation, routed scaling), the stable counting sort of
 * (token, slot) rows by expert, the gather of rows into expert order, and the fp32 combine.
 * Formulas: spec NEMOTRON_H.md "MoE", src/kernels/cpu/ops_moe.c (same tie rules, same order of
 * the weight arithmetic). Everything stays on the device: no host round trip between the router
 * and gather_qmm. Contracts: ops_cuda.h. */
#include <math.h>

#include "kernels/cuda/ops_cuda.h"

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

/* One warp per token. Shared memory per warp: choice[E], group score[G] (floats), taken[E] and
 * group taken[G] (bytes). */
__global__ void __launch_bounds__(ROUTER_WARPS * 32)
router_kernel(cuda_router_cfg r, const float *logits, int T, int32_t *ids, float *wts) {
    extern __shared__ float sm[];
    const int E = (int)r.E, G = (int)r.n_group, k = (int)r.k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = blockIdx.x * ROUTER_WARPS + warp;
    const size_t per_warp = ((size_t)(E + G) * 4 + (size_t)(E + G) + 15) & ~(size_t)15;
    float *choice = (float *)((char *)sm + warp * per_warp), *gscore = choice + E;
    unsigned char *taken = (unsigned char *)(gscore + G), *gtaken = taken + E;
    if (t >= T) return; /* warp-uniform; no block-wide barrier below */
    const float *lg = logits + (int64_t)t * E;
    for (int e = lane; e < E; e += 32) {
        choice[e] = __fadd_rn(sigmoid_f(lg[e]), r.bias ? r.bias[e] : 0.0f);
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
            wt[j] = sigmoid_f(lg[e]); /* the weight is s, never the choice score */
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
}

extern "C" int cuda_router_topk(void *stream, const cuda_router_cfg *r, const float *logits, int64_t T,
                                int32_t *ids, float *wts) {
    if (T <= 0) return FP4MOE_OK;
    if (r->E < 1 || r->E > 4096 || r->k < 1 || r->k > r->E || r->n_group < 1 || r->E % r->n_group ||
        r->topk_group < 1 || r->topk_group > r->n_group)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op router: E=%lld (at most 4096), k=%lld, "
                                "n_group=%lld, topk_group=%lld", (long long)r->E, (long long)r->k,
                                (long long)r->n_group, (long long)r->topk_group);
    const size_t per_warp = ((size_t)(r->E + r->n_group) * 5 + 15) & ~(size_t)15;
    router_kernel<<<ops_blocks(T, ROUTER_WARPS), ROUTER_WARPS * 32, ROUTER_WARPS * per_warp,
                    (cudaStream_t)stream>>>(*r, logits, (int)T, ids, wts);
    OPS_LAUNCH_CHECK("router top-k");
    return FP4MOE_OK;
}

/* ---- stable counting sort by expert --------------------------------------------------------------- */

#define SORT_THREADS 1024

/* One block of W warps; warp w owns the contiguous rows [w*chunk, (w+1)*chunk).
 *  1. cnt[w][e] = rows of warp w with expert e (shared-memory atomics; order does not matter);
 *  2. cnt[w][e] := start of those rows in the output: experts in order, within an expert the warps
 *     in order (an exclusive scan over (e, w));
 *  3. each warp walks its rows in order, 32 at a time: rows with equal experts in one step are
 *     ranked by lane (__match_any_sync), so the order within an expert is the row order. */
__global__ void __launch_bounds__(SORT_THREADS)
sort_kernel(const int32_t *ids, int B, int E, uint32_t *row_of, uint32_t *idx, uint32_t *pos_of) {
    extern __shared__ int cnt[]; /* W x E, then start[E] */
    const int W = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int *start = cnt + W * E;
    const int chunk = (B + W - 1) / W, b_lo = min(B, warp * chunk), b_hi = min(B, b_lo + chunk);
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
        start[e] = run; /* total for now */
    }
    __syncthreads();
    if (warp == 0) { /* exclusive scan of the totals over experts */
        int carry = 0;
        for (int base = 0; base < E; base += 32) {
            const int e = base + lane, v = e < E ? start[e] : 0;
            int incl = v;
            for (int o = 1; o < 32; o <<= 1) {
                const int u = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += u;
            }
            if (e < E) start[e] = carry + incl - v;
            carry += __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
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

extern "C" int cuda_sort_by_expert(void *stream, const int32_t *ids, int64_t B, int64_t E,
                                   uint32_t *row_of, uint32_t *idx, uint32_t *pos_of) {
    if (B <= 0) return FP4MOE_OK;
    int W = (int)(12288 / (E > 0 ? E : 1)) - 1; /* (W + 1) * E ints in 48 KiB */
    if (W > SORT_THREADS / 32) W = SORT_THREADS / 32;
    if (E < 1 || W < 1 || B > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op sort by expert: E=%lld (at most 6143), "
                                "B=%lld", (long long)E, (long long)B);
    const size_t smem = (size_t)(W + 1) * (size_t)E * sizeof(int);
    sort_kernel<<<1, W * 32, smem, (cudaStream_t)stream>>>(ids, (int)B, (int)E, row_of, idx, pos_of);
    OPS_LAUNCH_CHECK("sort by expert");
    return FP4MOE_OK;
}

/* ---- gather rows / combine ---------------------------------------------------------------------- */

__global__ void gather_rows_kernel(const uint16_t *x, int64_t H, const uint32_t *row_of, int64_t k,
                                   uint16_t *xs) {
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
    gather_rows_kernel<<<(unsigned)B, 128, 0, (cudaStream_t)stream>>>(x, H, row_of, k, xs);
    OPS_LAUNCH_CHECK("gather rows");
    return FP4MOE_OK;
}

__global__ void combine_kernel(const uint16_t *ys, int64_t H, const uint32_t *pos_of, const float *wts,
                               int64_t k, uint16_t *out) {
    const int64_t t = blockIdx.x;
    for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
        float o = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const float w = wts[t * k + j];
            const float y = ops_bf16_to_f32(ys[(int64_t)pos_of[t * k + j] * H + i]);
            o = __fadd_rn(o, __fmul_rn(w, y));
        }
        out[t * H + i] = ops_f32_to_bf16(o);
    }
}

extern "C" int cuda_moe_combine(void *stream, const uint16_t *ys, int64_t H, const uint32_t *pos_of,
                                const float *wts, int64_t T, int64_t k, uint16_t *out) {
    if (T <= 0) return FP4MOE_OK;
    combine_kernel<<<(unsigned)T, 256, 0, (cudaStream_t)stream>>>(ys, H, pos_of, wts, k, out);
    OPS_LAUNCH_CHECK("moe combine");
    return FP4MOE_OK;
}
