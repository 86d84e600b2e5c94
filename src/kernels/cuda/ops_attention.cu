/* CUDA ops of the attention mixer: appending to the bf16 KV cache, and causal GQA attention without
 * positional encoding (nemotron_h has no RoPE). Formula: spec NEMOTRON_H.md "Attention",
 * src/kernels/cpu/ops_attention.c; here with fp32 scores and an online softmax over tiles of 32
 * keys (flash-attention style; the CPU takes the max over all keys first: the results differ by
 * fp32 rounding only). Decode reads positions and slots from device memory (decode graphs).
 * Contracts: ops_cuda.h.
 *
 * The KV cache is paged: pages of ATT_TILE (32) tokens, one key tile each, found through the
 * sequence's page table (src/backend/backend.h, FW_PAGE). K is stored in bf16, V in fp16 (converted
 * once by the append, saturated at +-65504: P V runs on fp16 tensor cores, whose B operand it is, so
 * the kernels read V as it is stored instead of converting it on every read).
 * Prefill (one sequence's chunk): head_dim 128 with an even query group on Hopper's warpgroup MMA
 * (attn_prefill_wg_kernel; FP4MOE_CUDA_ATTENTION=mma: the next one), head_dim 64 / 128 on mma.sync
 * tensor cores (attn_prefill_mma_kernel);
 * other head sizes: block (query head h, 8 consecutive tokens), one warp per token, K/V tiles staged
 * in shared memory as fp32. Decode (a batch of single-token rows, each its own sequence): head_dim
 * 64 / 128 with nq/nkv <= 16 split-KV on tensor cores (attn_decode_mma_kernel: the group's query
 * heads are the 16 mma rows) plus one combine; other shapes: block per (query head, row), its 8
 * warps take interleaved key tiles straight from global memory and combine in shared memory. */
#include <math.h>
#include <string.h>

#include <cuda_fp16.h>

#include "kernels/cuda/ops_cuda.h"
#include "kernels/cuda/cuda_launch.cuh"
#include "kernels/cuda/mbarrier.cuh"
#include "kernels/cuda/wgmma_rs.cuh"

#define ATT_WARPS 8
#define ATT_TILE 32

/* bf16 -> fp16 of the same value, saturated at +-65504 (round to nearest even below the normal
 * range); exact for bf16 values inside [2^-14, 65504]. */
__device__ __forceinline__ uint16_t fa_bf16_to_f16(uint16_t b) {
    const float f = fminf(fmaxf(ops_bf16_to_f32(b), -65504.0f), 65504.0f);
    return __half_as_ushort(__float2half_rn(f));
}

__device__ __forceinline__ float fa_f16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }

/* ---- KV cache append (paged) ------------------------------------------------------------------ */

/* Row r of k/v goes to position row_pos[r] of slot row_slot[r]: page pages[slot * max_pages +
 * pos / ATT_TILE], row pos % ATT_TILE of it; k as it is (bf16), v converted to fp16. */
__global__ void kv_append_kernel(const uint16_t *k, const uint16_t *v, int64_t n, int64_t kvs,
                                 const int32_t *row_slot, const int32_t *row_pos, const int32_t *pages,
                                 int64_t max_pages, uint16_t *kc, uint16_t *vc) {
    cu_pdl_entry();
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / kvs, d = i % kvs;
        const int pos = row_pos[r];
        const int64_t phys = (int64_t)pages[(int64_t)row_slot[r] * max_pages + pos / ATT_TILE] * ATT_TILE +
                             pos % ATT_TILE;
        kc[phys * kvs + d] = k[i];
        vc[phys * kvs + d] = fa_bf16_to_f16(v[i]);
    }
}

extern "C" int cuda_kv_append(void *stream, const uint16_t *k, const uint16_t *v, int64_t R, int64_t kvs,
                              const int32_t *row_slot, const int32_t *row_pos, const int32_t *pages,
                              int64_t max_pages, uint16_t *k_cache, uint16_t *v_cache) {
    const int64_t n = R * kvs;
    if (n <= 0) return FP4MOE_OK;
    const int64_t b = (n + 255) / 256;
    cu_launch(kv_append_kernel, (unsigned)(b < 65536 ? b : 65536), 256, 0, (cudaStream_t)stream, k, v, n, kvs,
              row_slot, row_pos, pages, max_pages, k_cache, v_cache);
    OPS_LAUNCH_CHECK("kv cache append");
    return FP4MOE_OK;
}

/* ---- prefill ---------------------------------------------------------------------------------- */

/* DPL = output dims per lane (d = lane + 32*i, i < DPL), dh <= 32*DPL. */
template <int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32)
attn_prefill_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages,
                    int P, int T, int nq, int nkv, int dh, float scale, uint16_t *out) {
    cu_pdl_entry();
    extern __shared__ float sm[];
    const int ld = dh + 1;
    float *qs = sm, *Ks = qs + ATT_WARPS * dh, *Vs = Ks + ATT_TILE * ld;
    const int h = blockIdx.x, t0 = blockIdx.y * ATT_WARPS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = t0 + warp;
    const int kh = h / (nq / nkv);
    const int64_t kvs = (int64_t)nkv * dh, qstride = (int64_t)nq * dh;
    for (int i = threadIdx.x; i < ATT_WARPS * dh; i += blockDim.x) {
        const int r = i / dh, d = i % dh;
        qs[i] = t0 + r < T ? ops_bf16_to_f32(q[(int64_t)(t0 + r) * qstride + (int64_t)h * dh + d]) : 0.0f;
    }
    const int nkeys = P + min(t0 + ATT_WARPS, T); /* keys 0 .. P + last token of the block */
#ifdef FP4MOE_INJECT_FAULT_CAUSAL_MASK /* deliberate fault: the token's own key is masked (not for t = P = 0) */
    const int last = P + t > 0 ? P + t - 1 : 0;
#else
    const int last = P + t;                       /* this warp's last visible key */
#endif
    const float *qw = qs + warp * dh;
    float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] = 0.0f;
#ifdef FP4MOE_INJECT_FAULT_KV_BLOCK /* deliberate fault: the first page skipped when there are more */
    const int jstart = nkeys > ATT_TILE && t0 >= ATT_TILE ? ATT_TILE : 0;
#else
    const int jstart = 0;
#endif
    for (int j0 = jstart; j0 < nkeys; j0 += ATT_TILE) {
        __syncthreads(); /* q loaded / previous tile consumed */
        const int64_t page = (int64_t)pages[j0 / ATT_TILE] * ATT_TILE; /* a tile is one page */
        for (int i = threadIdx.x; i < ATT_TILE * dh; i += blockDim.x) {
            const int jj = i / dh, d = i % dh, key = j0 + jj;
            const int64_t src = (page + jj) * kvs + (int64_t)kh * dh + d;
            Ks[jj * ld + d] = key < nkeys ? ops_bf16_to_f32(kc[src]) : 0.0f;
            Vs[jj * ld + d] = key < nkeys ? fa_f16_to_f32(vc[src]) : 0.0f;
        }
        __syncthreads();
        if (t >= T || j0 > last) continue; /* warp-uniform */
        float s = -INFINITY;
        if (j0 + lane <= last) {
            const float *kr = Ks + lane * ld;
            float dot = 0.0f;
            for (int d = 0; d < dh; d++) dot = fmaf(qw[d], kr[d], dot);
            s = dot * scale;
        }
        const float mnew = fmaxf(m, ops_warp_max(s)); /* finite: key j0 <= last is visible */
        const float p = expf(s - mnew), corr = expf(m - mnew);
        l = l * corr + ops_warp_sum(p);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] *= corr;
        const int nj = min(ATT_TILE, last - j0 + 1);
        for (int jj = 0; jj < nj; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
            const float *vr = Vs + jj * ld;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int d = lane + 32 * i;
                if (d < dh) acc[i] = fmaf(pj, vr[d], acc[i]);
            }
        }
        m = mnew;
    }
    if (t >= T) return;
    const float inv = 1.0f / l;
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        if (d < dh) out[(int64_t)t * qstride + (int64_t)h * dh + d] = ops_f32_to_bf16(acc[i] * inv);
    }
}

/* ---- decode ----------------------------------------------------------------------------------- */

/* acc + q[0] * lo(u) + q[1] * hi(u) for a pair of bf16 (low half: the first element). */
__device__ __forceinline__ float dot_bf16x2(const float *q, uint32_t u, float acc) {
    acc = fmaf(q[0], __uint_as_float(u << 16), acc);
    return fmaf(q[1], __uint_as_float(u & 0xffff0000u), acc);
}

template <int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32)
attn_decode_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *row_slot,
                   const int32_t *row_pos, const int32_t *pages_all, int64_t max_pages, int nq, int nkv,
                   int dh, float scale, uint16_t *out) {
    cu_pdl_entry();
    extern __shared__ float sm[];
    float *qs = sm, *part = qs + dh;              /* part: ATT_WARPS x (dh + 2): acc, m, l */
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r = blockIdx.y;                 /* decode row: its own sequence */
    const int kh = h / (nq / nkv);
    const int64_t kvs = (int64_t)nkv * dh;
    const int n = row_pos[r] + 1;                 /* keys 0 .. P */
    const int32_t *pages = pages_all + (int64_t)row_slot[r] * max_pages;
    q += r * (int64_t)nq * dh;
    out += r * (int64_t)nq * dh;
    for (int d = threadIdx.x; d < dh; d += blockDim.x) qs[d] = ops_bf16_to_f32(q[(int64_t)h * dh + d]);
    __syncthreads();
    const bool vec = (dh & 7) == 0;               /* 16-byte loads of 8 bf16 */
    float m = -INFINITY, l = 0.0f, acc[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++) acc[i] = 0.0f;
    for (int j0 = warp * ATT_TILE; j0 < n; j0 += ATT_WARPS * ATT_TILE) {
        const int key = j0 + lane;
        const int64_t page = (int64_t)pages[j0 / ATT_TILE] * ATT_TILE; /* a tile is one page */
        float s = -INFINITY;
        if (key < n) {
            const uint16_t *kr = kc + (page + lane) * kvs + (int64_t)kh * dh;
            float dot = 0.0f;
            if (vec) {
                for (int d = 0; d < dh; d += 8) {
                    const uint4 w = *(const uint4 *)(kr + d);
                    dot = dot_bf16x2(qs + d, w.x, dot);
                    dot = dot_bf16x2(qs + d + 2, w.y, dot);
                    dot = dot_bf16x2(qs + d + 4, w.z, dot);
                    dot = dot_bf16x2(qs + d + 6, w.w, dot);
                }
            } else {
                for (int d = 0; d < dh; d++) dot = fmaf(qs[d], ops_bf16_to_f32(kr[d]), dot);
            }
            s = dot * scale;
        }
        const float mnew = fmaxf(m, ops_warp_max(s)); /* finite: key j0 < n */
        const float p = expf(s - mnew), corr = expf(m - mnew);
        l = l * corr + ops_warp_sum(p);
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[i] *= corr;
        const int nj = min(ATT_TILE, n - j0);
        for (int jj = 0; jj < nj; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, jj);
            const uint16_t *vr = vc + (page + jj) * kvs + (int64_t)kh * dh;
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int d = lane + 32 * i;
                if (d < dh) acc[i] = fmaf(pj, fa_f16_to_f32(vr[d]), acc[i]);
            }
        }
        m = mnew;
    }
    float *pw = part + warp * (dh + 2);
#pragma unroll
    for (int i = 0; i < DPL; i++) {
        const int d = lane + 32 * i;
        if (d < dh) pw[d] = acc[i];
    }
    if (lane == 0) { pw[dh] = m; pw[dh + 1] = l; }
    __syncthreads();
    for (int d = threadIdx.x; d < dh; d += blockDim.x) {
        float M = -INFINITY;
        for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, part[w * (dh + 2) + dh]);
        float L = 0.0f, O = 0.0f;
        for (int w = 0; w < ATT_WARPS; w++) {
            const float *pp = part + w * (dh + 2);
            const float c = expf(pp[dh] - M); /* 0 for a warp that saw no key (m = -inf) */
            L += pp[dh + 1] * c;
            O += pp[d] * c;
        }
        out[(int64_t)h * dh + d] = ops_f32_to_bf16(O / L);
    }
}

/* ---- decode: split-KV, GQA-grouped (flash-decoding) --------------------------------------------- */

/* Each (kv head, row) is cut into up to DEC_SPLITS ranges of whole pages by the row's length alone,
 * so a row gets the same numbers alone or in a batch; attn_decode_mma_kernel (below, with the
 * tensor-core helpers) writes one partial (m, l, o[dh]) per split, attn_combine_kernel merges them. */
#define DEC_SPLITS CUDA_ATT_SPLITS /* fixed: a row's split ranges depend on its length only */
/* Pages per split: the row's pages over DEC_SPLITS splits, but at least 16 pages (the best of 4 / 8 /
 * 16 / 32 measured for 1 and 64 rows: docs/PERFORMANCE.md), so that middle contexts do not spread one
 * page per block and write a partial (dh + 2 floats) per page: with 64 rows at 8,192 tokens those
 * partials were 272 MB a layer, half the K/V bytes. Rows of at most DEC_SHORT_PAGES pages (1,024
 * tokens) take splits of 4 pages (with the 2-warp block below; session 14, same run against torch's
 * SDPA: one row at 512 tokens 0.0111 ms against 0.0117 for 8-page splits of 4 warps; 8-page splits
 * at 2,048 / 8,192 tokens cost 64 rows 17% / 17%, which is why longer rows keep 16). A function of
 * the row's length only, so a row gets the same numbers alone or in a batch. */
#ifndef DEC_SHORT_PAGES /* (macros: bench/gpu-attn-variants.sh measures other rules; docs/GPU-NOTES.md) */
#define DEC_SHORT_PAGES 32 /* rows of at most this many pages take DEC_SHORT_MIN-page splits, */
#endif
#ifndef DEC_SHORT_MIN
#define DEC_SHORT_MIN 4
#endif
#ifndef DEC_MID_PAGES
#define DEC_MID_PAGES 32   /* rows of at most this many pages DEC_MID_MIN-page splits (no middle band: */
#endif                     /* DEC_MID_PAGES == DEC_SHORT_PAGES), */
#ifndef DEC_MID_MIN
#define DEC_MID_MIN 16
#endif
#ifndef DEC_LONG_MIN
#define DEC_LONG_MIN 16    /* longer rows at least DEC_LONG_MIN-page splits */
#endif
__device__ __forceinline__ int dec_pages_per_split(int ntiles, int splits) {
#if DEC_MID_PAGES > DEC_SHORT_PAGES
    const int mn = ntiles <= DEC_SHORT_PAGES ? DEC_SHORT_MIN : ntiles <= DEC_MID_PAGES ? DEC_MID_MIN : DEC_LONG_MIN;
    return max((ntiles + splits - 1) / splits, mn);
#else /* (the measured production form, compiled as it was measured) */
    return max((ntiles + splits - 1) / splits, ntiles <= DEC_SHORT_PAGES ? DEC_SHORT_MIN : DEC_LONG_MIN);
#endif
}

/* out[r][h] = bf16(sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M)) over the splits that hold keys,
 * one block per (head, row): COMB_WARPS warps take interleaved splits, each lane dims lane + 32i,
 * then the warps' sums are added in shared memory (in a fixed order). */
#define COMB_WARPS 8
__global__ void __launch_bounds__(COMB_WARPS * 32)
attn_combine_kernel(const float *part, const int32_t *row_pos, int nq, int dh, int splits, uint16_t *out) {
    cu_pdl_entry();
    __shared__ float sO[COMB_WARPS][256 + 1];
    __shared__ float sM[COMB_WARPS];
    const int h = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int64_t r = blockIdx.y;
    const float *pp = part + (r * nq + h) * (int64_t)splits * (dh + 2);
    const int ntiles = (row_pos[r] + ATT_TILE) / ATT_TILE, per = dec_pages_per_split(ntiles, splits);
    const int used = (ntiles + per - 1) / per;         /* splits with at least one page */
    float M = -INFINITY;
    for (int s = threadIdx.x; s < used; s += blockDim.x) M = fmaxf(M, pp[s * (dh + 2) + dh]);
    M = ops_warp_max(M);
    if (lane == 0) sM[warp] = M;
    __syncthreads();
    M = sM[0];
    for (int w = 1; w < COMB_WARPS; w++) M = fmaxf(M, sM[w]);
    float L = 0.0f, O[8];
#pragma unroll
    for (int i = 0; i < 8; i++) O[i] = 0.0f;
    for (int s = warp; s < used; s += COMB_WARPS) {
        const float *ps = pp + s * (dh + 2);
        const float c = expf(ps[dh] - M);              /* used splits hold keys: m finite */
        L += ps[dh + 1] * c;
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (lane + 32 * i < dh) O[i] += ps[lane + 32 * i] * c;
    }
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (lane + 32 * i < dh) sO[warp][lane + 32 * i] = O[i];
    if (lane == 0) sO[warp][256] = L;
    __syncthreads();
    for (int d = threadIdx.x; d < dh; d += blockDim.x) {
        float Ls = 0.0f, Os = 0.0f;
        for (int w = 0; w < COMB_WARPS; w++) {
            Ls += sO[w][256];
            Os += sO[w][d];
        }
        out[(r * nq + h) * (int64_t)dh + d] = ops_f32_to_bf16(Os / Ls);
    }
}


/* Allows fn `smem` bytes of dynamic shared memory (cudaFuncSetAttribute), once per device: function
 * attributes belong to a device's context, so each GPU of an expert-parallel run sets its own
 * (`done`: a bit per device ordinal; ordinals >= 64 set it on every launch). */
template <typename F>
static int fa_allow_smem(F *fn, size_t smem, unsigned long long *done) {
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) dev = 64;
    if (dev < 64 && (*done >> dev & 1ull)) return FP4MOE_OK;
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess)
        return fp4moe_set_error(FP4MOE_ECUDA, "cuda op attention: %zu bytes of shared memory: %s", smem,
                                cudaGetErrorString(e));
    if (dev < 64) *done |= 1ull << dev;
    return FP4MOE_OK;
}
#define TRY_OPS(x) do { const int rc_ = (x); if (rc_) return rc_; } while (0)

/* ---- prefill on tensor cores (flash attention) -------------------------------------------------- */

/* Block (query head h, FA_ROWS = 128 consecutive tokens of one sequence), 4 warps of 32 query rows
 * each (two m16 row tiles: FlashAttention-2's layout, so that every K and V fragment read from
 * shared memory feeds two mma); the blocks of the last tokens (the most keys) are started first.
 * The block's Q rows are copied into shared memory once (zero beyond T) and read by ldmatrix. Per
 * step of FA_KEYS = 64 keys (two pages): K (bf16) and V (fp16), row-major, copied into shared
 * memory with cp.async, double-buffered (the next step's pages arrive while this one is computed,
 * one barrier per step); S = Q K^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate, K fragments
 * by ldmatrix), the causal mask only on the steps that cross a row's diagonal, online softmax in
 * fp32 (base-2 exponent, scale folded in), then O += P V on tensor cores in fp16 (P rounded to
 * fp16, V fragments by ldmatrix.trans). Fragment layouts: PTX ISA "mma.m16n8k16" (g = lane / 4,
 * t = lane % 4). Measured on the H200 (2026-12-01, a candidate program against the previous
 * one-row-tile kernel, whose 32 KB of shared-memory reads per 0.5 MFLOP a warp made it bound by
 * shared-memory bandwidth): 0.63-1.04x its time at T = 32k .. 512; 32 keys a step or 2 warps a
 * block were slower at T >= 2k. head_dim 128 needs 255 registers (96 bytes spilled). */
#define FA_ROWS 128
#define FA_WARPS 4
#define FA_KEYS 64                 /* keys a step: FA_KEYS / ATT_TILE pages */

template <int DH>
static constexpr size_t fa_smem_bytes() {         /* Q (FA_ROWS rows), 2 stages x (K, V) x FA_KEYS rows; of DH + 8 */
    return ((size_t)FA_ROWS + (size_t)2 * 2 * FA_KEYS) * (DH + 8) * sizeof(uint16_t);
}

__device__ __forceinline__ void fa_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                       uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t fa_pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

/* O += P V in fp16 (P in [0, 1] keeps 11 significant bits instead of bf16's 8; V is bf16, exact in
 * fp16 inside +-65504 and saturated there). */
__device__ __forceinline__ void fa_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t fa_pack_f16(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t *>(&v);
}

/* One key tile (NJ x 8 keys: 4 = a page, 8 = two pages) of the online softmax (base 2) for the two
 * rows a thread holds, g and g + 8 of its warp's 16: sc holds the tile's masked, scaled scores (-inf
 * where masked) in the mma C layout, mx0 / mx1 the thread's own row maxima. The maxima are reduced
 * over the quad that shares a row, m and l updated, o rescaled, sc replaced by p = 2^(s - m). A row
 * with every key so far masked keeps m = -inf and p = 0. */
__device__ __forceinline__ float fa_ex2(float x) { /* 2^x, subnormal results flushed to 0 */
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* FOLD (the prefill kernel): sc and mx0 / mx1 are raw scores (scale not yet applied; -inf where
 * masked): the maxima are scaled here and each p = 2^(s * scale - m) is one FFMA and one
 * ex2.approx.ftz (FlashAttention-2's form). Measured on the H200 (2026-12-02, gpu-attention-peer,
 * same run): prefill 2k / 8k / 32k 0.1463 / 1.943 / 30.00 ms against 0.1498 / 1.991 / 30.81 with a
 * separate scale multiply and exp2f; same worst errors in test_attention_gpu. Otherwise (decode)
 * scale is unused and sc is scaled already. */
template <int NJ, int NT, bool FOLD = false>
__device__ __forceinline__ void fa_softmax_tile(float (&sc)[NJ][4], float mx0, float mx1, float &m0, float &m1,
                                                float &l0, float &l1, float (&o)[NT][4], float scale = 1.0f) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    if (FOLD) {
        mx0 *= scale;
        mx1 *= scale;
    }
    const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
    const float b0 = n0 == -INFINITY ? 0.0f : n0, b1 = n1 == -INFINITY ? 0.0f : n1;
    const float c0 = FOLD ? fa_ex2(m0 - b0) : exp2f(m0 - b0), c1 = FOLD ? fa_ex2(m1 - b1) : exp2f(m1 - b1);
    m0 = n0;
    m1 = n1;
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        if (FOLD) {
            sc[j][0] = fa_ex2(fmaf(sc[j][0], scale, -b0));
            sc[j][1] = fa_ex2(fmaf(sc[j][1], scale, -b0));
            sc[j][2] = fa_ex2(fmaf(sc[j][2], scale, -b1));
            sc[j][3] = fa_ex2(fmaf(sc[j][3], scale, -b1));
        } else {
            sc[j][0] = exp2f(sc[j][0] - b0);
            sc[j][1] = exp2f(sc[j][1] - b0);
            sc[j][2] = exp2f(sc[j][2] - b1);
            sc[j][3] = exp2f(sc[j][3] - b1);
        }
        s0 += sc[j][0] + sc[j][1];
        s1 += sc[j][2] + sc[j][3];
    }
    l0 = l0 * c0 + s0;
    l1 = l1 * c1 + s1;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        o[i][0] *= c0;
        o[i][1] *= c0;
        o[i][2] *= c1;
        o[i][3] *= c1;
    }
}

/* ---- decode on tensor cores: split-KV, the G <= 16 query heads of a kv head as the 16 mma rows ----- */

/* Block (kv head kh, row r, split sp) of DM_WARPS warps; the split's pages (the same ranges as
 * dec_pages_per_split: by the row's length alone) go to the warps in turn. Per page a warp
 * stages K (bf16) and V (fp16, as the cache stores it), row-major, in its own shared buffers, S =
 * Q K^T with mma m16n8k16 (rows = the group's query heads, zero beyond G; K fragments by
 * ldmatrix), online softmax in fp32 (base 2, scale folded in), O += P V on fp16 tensor cores with P
 * split into two fp16 parts (~22 bits) and the V fragments from ldmatrix.trans. The warps' (m, l, o)
 * are merged in shared memory into the split's partial (natural-log m, as the combine kernel
 * reads it). */
#ifndef DM_WARPS /* (a macro: bench/gpu-attn-variants.sh measures others) */
#define DM_WARPS 2 /* 2 warps: 6 blocks an SM instead of 3. Session 14, same run, ms (x torch SDPA): */
#endif             /* 64 rows at 2k 0.0387 (0.86) vs 0.0517 (1.14) for 4 warps; 131k x 1 0.0546 vs 0.0660;
                    * one row at 2k / 8k 0.0207 / 0.0210 vs 0.0152 / 0.0157 (0.72x torch) */

__device__ __forceinline__ void dm_ldmatrix_x4_trans(uint32_t (&r)[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* (lo, hi) -> fp16 pairs hi_part + lo_part with hi_part = fp16(x), lo_part = fp16(x - hi_part). */
__device__ __forceinline__ void dm_split_f16(float lo, float hi, uint32_t &h, uint32_t &l) {
    const __half2 v = __floats2half2_rn(lo, hi);
    const float2 f = __half22float2(v);
    const __half2 r = __floats2half2_rn(lo - f.x, hi - f.y);
    h = *reinterpret_cast<const uint32_t *>(&v);
    l = *reinterpret_cast<const uint32_t *>(&r);
}

__device__ __forceinline__ void fa_ldmatrix_x4(uint32_t (&r)[4], const uint16_t *p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* S (this warp's 16 rows x NJ*8 keys, mma C layout) = Q K^T: qa the rows' A fragments (KS =
 * head_dim / 16 of them), Ks the tile's keys, bf16, row-major with stride LD. The B fragments come
 * from ldmatrix (lane L gives row L % 8 = key j*8 + L % 8 of matrix L / 8 = dims kk*16 + (L/8)*8 for
 * kk, kk + 1: b0, b1 of k-steps kk and kk + 1). */
template <int NJ, int KS, int LD>
__device__ __forceinline__ void fa_scores_tile(float (&sc)[NJ][4], const uint32_t (&qa)[KS][4], const uint16_t *Ks,
                                               int lane) {
#pragma unroll
    for (int j = 0; j < NJ; j++) {
        sc[j][0] = sc[j][1] = sc[j][2] = sc[j][3] = 0.0f;
        const uint16_t *kr = Ks + (j * 8 + (lane & 7)) * LD + (lane >> 3) * 8;
#pragma unroll
        for (int kk = 0; kk < KS; kk += 2) {
            uint32_t b[4];
            fa_ldmatrix_x4(b, kr + kk * 16);
            fa_mma(sc[j], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
            fa_mma(sc[j], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3], b[2], b[3]);
        }
    }
}

/* O (16 rows x NT*8 dims) += P V on fp16 tensor cores: P = the tile's probabilities sc (NJ*8 keys,
 * rounded to fp16; SPLIT: as two fp16 parts hi + lo, ~22 bits), V the tile's values, fp16,
 * row-major with stride LD, whose B fragments come from ldmatrix.trans (lane L gives row L % 8 of
 * matrix L / 8 = keys 16 k2 + (L/8 & 1) * 8 + L % 8, dims i*8 + (L/16) * 8: b0, b1 of dim tiles i
 * and i + 1). */
template <int NJ, int NT, int LD, bool SPLIT>
__device__ __forceinline__ void fa_pv_tile(float (&o)[NT][4], const float (&sc)[NJ][4], const uint16_t *Vs, int lane) {
#pragma unroll
    for (int k2 = 0; k2 < NJ / 2; k2++) {              /* keys 16*k2 .. 16*k2+15 */
        uint32_t ah[4], al[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int h = 0; h < 4; h++) {                  /* A: rows g / g+8 (h odd), keys +8 (h >= 2) */
            const float x = sc[2 * k2 + h / 2][2 * (h & 1)], y = sc[2 * k2 + h / 2][2 * (h & 1) + 1];
            if (SPLIT) dm_split_f16(x, y, ah[h], al[h]);
            else ah[h] = fa_pack_f16(x, y);
        }
        const uint16_t *vrow = Vs + (k2 * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
#pragma unroll
        for (int i = 0; i < NT; i += 2) {
            uint32_t b[4];
            dm_ldmatrix_x4_trans(b, vrow + i * 8);
            fa_mma_f16(o[i], ah[0], ah[1], ah[2], ah[3], b[0], b[1]);
            fa_mma_f16(o[i + 1], ah[0], ah[1], ah[2], ah[3], b[2], b[3]);
            if (SPLIT) {
                fa_mma_f16(o[i], al[0], al[1], al[2], al[3], b[0], b[1]);
                fa_mma_f16(o[i + 1], al[0], al[1], al[2], al[3], b[2], b[3]);
            }
        }
    }
}

template <int DH>
static constexpr size_t dm_smem_bytes() {
    return (size_t)DM_WARPS * 2 * ATT_TILE * (DH + 8) * sizeof(uint16_t);
}

/* Split sp of block (kv head blockIdx.x, row blockIdx.y); false when the split has no page (nor
 * has any later one). */
template <int DH>
__device__ __forceinline__ bool dm_split(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                                         const int32_t *row_slot, const int32_t *row_pos, const int32_t *pages_all,
                                         int64_t max_pages, int nq, int nkv, int G, int splits, float scale_log2,
                                         float *part, uint16_t *dm_smem, int sp) {
    constexpr int LD = DH + 8, KS = DH / 16, NT = DH / 8;
    const int kh = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int64_t r = blockIdx.y;
#ifdef FP4MOE_INJECT_FAULT_CAUSAL_MASK /* deliberate fault (tests must catch it): the current key masked */
    const int n = row_pos[r] > 0 ? row_pos[r] : 1;
#else
    const int n = row_pos[r] + 1;                      /* keys 0 .. P */
#endif
    const int ntiles = (n + ATT_TILE - 1) / ATT_TILE;
    const int per = dec_pages_per_split(ntiles, splits);
    if (sp * per >= ntiles) return false;             /* no page for this split (short contexts) */
#ifdef FP4MOE_INJECT_FAULT_KV_BLOCK /* deliberate fault (tests must catch it): the first page dropped */
    const int t0 = max(sp * per, ntiles > 1 ? 1 : 0), t1 = min(ntiles, sp * per + per);
#else
    const int t0 = sp * per, t1 = min(ntiles, t0 + per);
#endif
    const int32_t *pages = pages_all + (int64_t)row_slot[r] * max_pages;
    const int64_t kvs = (int64_t)nkv * DH;
    const int h0 = kh * G;
    uint16_t *Ks = dm_smem + (size_t)warp * 2 * ATT_TILE * LD, *Vs = Ks + ATT_TILE * LD;
    uint32_t qa[KS][4];                                /* rows g and g + 8 = heads h0 + g, h0 + g + 8 */
    {
        const uint16_t *qa_row = q + (r * nq + h0 + g) * (int64_t)DH, *qb_row = qa_row + 8 * (int64_t)DH;
        const bool va = g < G, vb = g + 8 < G;
#pragma unroll
        for (int kk = 0; kk < KS; kk++) {
            const int d = kk * 16 + 2 * tq;
            qa[kk][0] = va ? *(const uint32_t *)(qa_row + d) : 0u;
            qa[kk][1] = vb ? *(const uint32_t *)(qb_row + d) : 0u;
            qa[kk][2] = va ? *(const uint32_t *)(qa_row + d + 8) : 0u;
            qa[kk][3] = vb ? *(const uint32_t *)(qb_row + d + 8) : 0u;
        }
    }
    float o[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    /* K and V pages are copied with cp.async, one commit group each, so that the next page's K
     * arrives during this page's softmax and P V, and its V during the next S (two groups in flight:
     * wait_group 1 is always "the older of the two") */
    auto load_page = [&](uint16_t *dst, const uint16_t *cache, int tile) {
        const int nj = min(ATT_TILE, n - tile * ATT_TILE);
        const int64_t base = (int64_t)pages[tile] * ATT_TILE;
#pragma unroll 4
        for (int i = lane; i < ATT_TILE * (DH / 8); i += 32) {
            const int jj = i / (DH / 8), c = (i % (DH / 8)) * 8;
            const uint16_t *src = cache + (base + (jj < nj ? jj : 0)) * kvs + (int64_t)kh * DH + c;
            const unsigned d = (unsigned)__cvta_generic_to_shared(dst + jj * LD + c);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(jj < nj ? 16 : 0));
        }
    };
    if (t0 + warp < t1) {
        load_page(Ks, kc, t0 + warp);
        asm volatile("cp.async.commit_group;");
        load_page(Vs, vc, t0 + warp);
        asm volatile("cp.async.commit_group;");
    }
    for (int tile = t0 + warp; tile < t1; tile += DM_WARPS) {
        const int j0 = tile * ATT_TILE, nj = min(ATT_TILE, n - j0), next = tile + DM_WARPS;
        asm volatile("cp.async.wait_group 1;");        /* K of this page */
        __syncwarp();
        float sc[4][4];
        fa_scores_tile<4, KS, LD>(sc, qa, Ks, lane);
        __syncwarp();                                  /* every lane has read Ks */
        if (next < t1) load_page(Ks, kc, next);
        asm volatile("cp.async.commit_group;");
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const bool v = j * 8 + 2 * tq + e < nj;
                sc[j][e] = v ? sc[j][e] * scale_log2 : -INFINITY;
                sc[j][2 + e] = v ? sc[j][2 + e] * scale_log2 : -INFINITY;
                mx0 = fmaxf(mx0, sc[j][e]);
                mx1 = fmaxf(mx1, sc[j][2 + e]);
            }
        fa_softmax_tile<4, NT>(sc, mx0, mx1, m0, m1, l0, l1, o);
        asm volatile("cp.async.wait_group 1;");        /* V of this page */
        __syncwarp();
        /* P = P_hi + P_lo, both fp16: ~22 significant bits of P (the scalar fp32 kernel this replaced
         * kept 24; one fp16 P moved near-tied router choices of the bf16 model) */
        fa_pv_tile<4, NT, LD, true>(o, sc, Vs, lane);
        __syncwarp();                                  /* every lane has read Vs */
        if (next < t1) load_page(Vs, vc, next);
        asm volatile("cp.async.commit_group;");
    }
    asm volatile("cp.async.wait_group 0;");
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    /* merge the warps: o (16 x DH fp32), m, l per warp in the (now free) shared buffers */
    __syncthreads();
    float *So = reinterpret_cast<float *>(dm_smem);   /* [warp][16][DH] */
    float *Sm = So + DM_WARPS * 16 * DH, *Sl = Sm + DM_WARPS * 16;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        const int d = i * 8 + 2 * tq;
        So[(warp * 16 + g) * DH + d] = o[i][0];
        So[(warp * 16 + g) * DH + d + 1] = o[i][1];
        So[(warp * 16 + g + 8) * DH + d] = o[i][2];
        So[(warp * 16 + g + 8) * DH + d + 1] = o[i][3];
    }
    if (tq == 0) {
        Sm[warp * 16 + g] = m0;
        Sm[warp * 16 + g + 8] = m1;
        Sl[warp * 16 + g] = l0;
        Sl[warp * 16 + g + 8] = l1;
    }
    __syncthreads();
    for (int i = tid; i < G * DH; i += DM_WARPS * 32) {
        const int hh = i / DH, d = i % DH;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < DM_WARPS; w++) M = fmaxf(M, Sm[w * 16 + hh]); /* warp 0 holds keys: finite */
        float O = 0.0f, L = 0.0f;
#pragma unroll
        for (int w = 0; w < DM_WARPS; w++) {
            const float c = exp2f(Sm[w * 16 + hh] - M); /* 0 for a warp without pages */
            O += So[(w * 16 + hh) * DH + d] * c;
            L += Sl[w * 16 + hh] * c;
        }
        float *pp = part + (((r * nq) + h0 + hh) * splits + sp) * (int64_t)(DH + 2);
        pp[d] = O;
        if (d == 0) {
            pp[DH] = M * 0.69314718055994531f;         /* base 2 -> natural log */
            pp[DH + 1] = L;
        }
    }
    return true;
}

/* The splits sp = blockIdx.z, blockIdx.z + gridDim.z, ... of (kv head, row) in turn: the grid's z
 * extent follows the batch (dec_grid_splits), so that 64 rows at a short context launch ~2k
 * blocks instead of 32k that mostly find no page; every split's arithmetic is that of its own block
 * before (the same ranges, the same partials). */
template <int DH>
__global__ void __launch_bounds__(DM_WARPS * 32)
attn_decode_mma_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *row_slot,
                       const int32_t *row_pos, const int32_t *pages_all, int64_t max_pages, int nq, int nkv,
                       int G, int splits, float scale_log2, float *part) {
    cu_pdl_entry();
    extern __shared__ __align__(16) uint16_t dm_smem[];
    for (int sp = blockIdx.z; sp < splits; sp += gridDim.z) {
        if (!dm_split<DH>(q, kc, vc, row_slot, row_pos, pages_all, max_pages, nq, nkv, G, splits, scale_log2, part,
                          dm_smem, sp))
            break;                                     /* block-uniform: later splits are empty too */
        __syncthreads();                               /* the merge's reads of shared memory are done */
    }
}

template <int DH>
__global__ void __launch_bounds__(FA_WARPS * 32)
attn_prefill_mma_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P,
                        int T, int nq, int nkv, float scale_log2, uint16_t *out) {
    cu_pdl_entry();
    constexpr int LD = DH + 8, KS = DH / 16, NT = DH / 8, NJ = FA_KEYS / 8, STAGE = 2 * FA_KEYS * LD;
    extern __shared__ __align__(16) uint16_t fa_smem[]; /* Q, then stage s: K at s * STAGE, V after it */
    uint16_t *const Qs = fa_smem, *const stages = fa_smem + FA_ROWS * LD;
    const int h = blockIdx.x, t0 = (gridDim.y - 1 - blockIdx.y) * FA_ROWS, tid = threadIdx.x;
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, tq = lane & 3;
    const int kh = h / (nq / nkv);
    const int64_t kvs = (int64_t)nkv * DH, qstride = (int64_t)nq * DH;
    const int wr0 = t0 + warp * 32;                    /* this warp's first token: rows wr0 .. wr0 + 31 */
    const int nkeys = P + min(t0 + FA_ROWS, T);
    const bool active = wr0 < T;                       /* some row of this warp is a token */
#ifdef FP4MOE_INJECT_FAULT_KV_BLOCK /* deliberate fault (tests must catch it): the first page skipped */
    const int jstart = nkeys > ATT_TILE && t0 >= ATT_TILE ? ATT_TILE : 0;
#else
    const int jstart = 0;
#endif
    /* Q rows (zero beyond T) into shared memory, in the first cp.async group */
    for (int i = tid; i < FA_ROWS * (DH / 8); i += FA_WARPS * 32) {
        const int rr = i / (DH / 8), c = (i % (DH / 8)) * 8, t = t0 + rr;
        const uint16_t *src = q + (int64_t)(t < T ? t : 0) * qstride + (int64_t)h * DH + c;
        const unsigned dq = (unsigned)__cvta_generic_to_shared(Qs + rr * LD + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dq), "l"(src), "r"(t < T ? 16 : 0));
    }
    /* the next step's K and V are copied (cp.async) while this step is computed; rows past the last
     * key (also a whole page past it) are zero-filled, so that P V never meets stale values */
    auto load_step = [&](int stage, int j0) {
        uint16_t *Ks = stages + stage * STAGE, *Vs = Ks + FA_KEYS * LD;
        for (int i = tid; i < FA_KEYS * (DH / 8); i += FA_WARPS * 32) {
            const int jj = i / (DH / 8), c = (i % (DH / 8)) * 8, key = j0 + jj;
            const bool v = key < nkeys;
            const int64_t off = v ? ((int64_t)pages[key / ATT_TILE] * ATT_TILE + key % ATT_TILE) * kvs + (int64_t)kh * DH + c : 0;
            const unsigned dk = (unsigned)__cvta_generic_to_shared(Ks + jj * LD + c);
            const unsigned dv = (unsigned)__cvta_generic_to_shared(Vs + jj * LD + c);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dk), "l"(kc + off), "r"(v ? 16 : 0));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dv), "l"(vc + off), "r"(v ? 16 : 0));
        }
    };
    if (jstart < nkeys) load_step(0, jstart);
    asm volatile("cp.async.commit_group;");
    float o[2][NT][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int i = 0; i < NT; i++) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.0f;
    float m[2][2] = {{-INFINITY, -INFINITY}, {-INFINITY, -INFINITY}}, l[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    /* ldmatrix addresses of this lane: Q rows (A fragments: row lane % 16, dims + (lane / 16) * 8),
     * K rows (B: key lane % 8, dims + (lane / 8) * 8), V rows (B by .trans) */
    const uint16_t *qrow = Qs + (warp * 32 + (lane & 15)) * LD + (lane >> 4) * 8;
    const int koff = (lane & 7) * LD + (lane >> 3) * 8;
    const int voff = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;
    for (int j0 = jstart, it = 0; j0 < nkeys; j0 += FA_KEYS, it++) {
        const int stage = it & 1;
        if (j0 + FA_KEYS < nkeys) load_step(stage ^ 1, j0 + FA_KEYS);
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group 1;");        /* this step (and Q; the next may be in flight) */
        __syncthreads();
        if (active && j0 <= P + wr0 + 31) {            /* some row of this warp sees a key of the step */
            const uint16_t *Ks = stages + stage * STAGE, *Vs = Ks + FA_KEYS * LD;
            float sc[2][NJ][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int j = 0; j < NJ; j++) sc[mt][j][0] = sc[mt][j][1] = sc[mt][j][2] = sc[mt][j][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KS; kk += 2) {       /* S = Q K^T, two k-steps of 16 dims at a time */
                uint32_t qa[2][2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    fa_ldmatrix_x4(qa[mt][0], qrow + mt * 16 * LD + kk * 16);
                    fa_ldmatrix_x4(qa[mt][1], qrow + mt * 16 * LD + kk * 16 + 16);
                }
#pragma unroll
                for (int j = 0; j < NJ; j++) {
                    uint32_t b[4];
                    fa_ldmatrix_x4(b, Ks + j * 8 * LD + koff + kk * 16);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        fa_mma(sc[mt][j], qa[mt][0][0], qa[mt][0][1], qa[mt][0][2], qa[mt][0][3], b[0], b[1]);
                        fa_mma(sc[mt][j], qa[mt][1][0], qa[mt][1][1], qa[mt][1][2], qa[mt][1][3], b[2], b[3]);
                    }
                }
            }
            const bool full = j0 + FA_KEYS - 1 <= P + wr0; /* every key visible to every row of the warp */
#pragma unroll
            for (int mt = 0; mt < 2; mt++) {
                float mx0 = -INFINITY, mx1 = -INFINITY;
                if (full) {
#pragma unroll
                    for (int j = 0; j < NJ; j++) {
                        mx0 = fmaxf(mx0, fmaxf(sc[mt][j][0], sc[mt][j][1]));
                        mx1 = fmaxf(mx1, fmaxf(sc[mt][j][2], sc[mt][j][3]));
                    }
                } else {                               /* the diagonal: mask, scale, row maxima */
                    const int pa = P + wr0 + mt * 16 + g, pb = pa + 8; /* keys <= pos are visible */
#pragma unroll
                    for (int j = 0; j < NJ; j++)
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            const int key = j0 + j * 8 + 2 * tq + e;
#ifdef FP4MOE_INJECT_FAULT_CAUSAL_MASK /* deliberate fault: a row's own key is masked (not key 0) */
                            const bool va = key <= pa && (key < pa || key == 0), vb = key <= pb && (key < pb || key == 0);
#else
                            const bool va = key <= pa, vb = key <= pb;
#endif
                            sc[mt][j][e] = va ? sc[mt][j][e] : -INFINITY; /* raw: scaled in the exponent */
                            sc[mt][j][2 + e] = vb ? sc[mt][j][2 + e] : -INFINITY;
                            mx0 = fmaxf(mx0, sc[mt][j][e]);
                            mx1 = fmaxf(mx1, sc[mt][j][2 + e]);
                        }
                }
                fa_softmax_tile<NJ, NT, true>(sc[mt], mx0, mx1, m[mt][0], m[mt][1], l[mt][0], l[mt][1], o[mt],
                                                     scale_log2);
            }
#pragma unroll
            for (int k2 = 0; k2 < NJ / 2; k2++) {      /* O += P V, keys 16*k2 .. 16*k2+15 */
                uint32_t ah[2][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int hh = 0; hh < 4; hh++)     /* A: rows g / g+8 (hh odd), keys +8 (hh >= 2) */
                        ah[mt][hh] = fa_pack_f16(sc[mt][2 * k2 + hh / 2][2 * (hh & 1)], sc[mt][2 * k2 + hh / 2][2 * (hh & 1) + 1]);
#pragma unroll
                for (int i = 0; i < NT; i += 2) {
                    uint32_t b[4];
                    dm_ldmatrix_x4_trans(b, Vs + k2 * 16 * LD + voff + i * 8);
#pragma unroll
                    for (int mt = 0; mt < 2; mt++) {
                        fa_mma_f16(o[mt][i], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], b[0], b[1]);
                        fa_mma_f16(o[mt][i + 1], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();                               /* every warp is done with this stage */
    }
    asm volatile("cp.async.wait_group 0;");
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        float l0 = l[mt][0], l1 = l[mt][1];
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
        const int ra = wr0 + mt * 16 + g, rb = ra + 8;
#pragma unroll
        for (int i = 0; i < NT; i++) {
            const int d = i * 8 + 2 * tq;
            if (ra < T) *(uint32_t *)(out + (int64_t)ra * qstride + (int64_t)h * DH + d) = fa_pack(o[mt][i][0] * i0, o[mt][i][1] * i0);
            if (rb < T) *(uint32_t *)(out + (int64_t)rb * qstride + (int64_t)h * DH + d) = fa_pack(o[mt][i][2] * i1, o[mt][i][3] * i1);
        }
    }
}

template <int DH>
static int launch_prefill_mma(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages,
                              int P, int T, int nq, int nkv, uint16_t *out, cudaStream_t st) {
    static unsigned long long done = 0;
    constexpr size_t smem = fa_smem_bytes<DH>();
    TRY_OPS(fa_allow_smem(attn_prefill_mma_kernel<DH>, smem, &done));
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)DH);
    const dim3 grid((unsigned)nq, ops_blocks(T, FA_ROWS));
    cu_launch(attn_prefill_mma_kernel<DH>, grid, FA_WARPS * 32, smem, st, q, kc, vc, pages, P, T, nq, nkv, scale_log2,
              out);
    OPS_LAUNCH_CHECK("attention (prefill, tensor cores)");
    return FP4MOE_OK;
}

/* ---- prefill on wgmma (head_dim 128): FlashAttention-3's structure ---------------------------------
 * Block = (query heads 2x, 2x + 1 of one kv group, 64 tokens t0 .. t0 + 63), 3 warpgroups: warpgroup 0
 * the producer (cp.async of each 128-key step's K and V rows into a K ring and a V ring of WA_STAGES;
 * completion signalled by cp.async.mbarrier.arrive.noinc on the slot's "full" barrier), warpgroups 1
 * and 2 the consumers, one query head each (so both see the same keys and share every K / V tile).
 * A consumer's step j: S = Q K_j^T (8 x wgmma m64n128k16, both operands in shared memory), issued
 * together with O += P_{j-1} V_{j-1} (8 x wgmma m64n128k16, P from registers in fp16, V fp16
 * MN-major); then K_j is released (its "empty" barrier), the online softmax of S_j (base 2, the scale
 * folded into the exponent's FFMA, as the mma.sync kernel) runs while the P V products are in
 * flight; then V_{j-1} is released and O rescaled. The two consumers take turns issuing their
 * products (named barriers 3 and 4, WA_PINGPONG), so that one's softmax runs beside the other's
 * products. Every consumer thread arrives on the empty barriers and every wait comes before the
 * step's wgmma.fence: a divergent path among the wgmma makes ptxas serialise them (C7520).
 * Registers: setmaxnreg 40 (producer) / 232 (consumers); ptxas: 168, no spills. Shared memory (no
 * swizzle, 8 x 16-byte core matrices): Q 2 x 64 x 128, K and V 128 x 128 a slot: 160 KB at 2 slots.
 * Layouts and descriptor strides: those checked by the session-10 candidate (docs/PERFORMANCE.md,
 * "lbo = K direction"). Measured on the H200 (docs/PERFORMANCE.md, session 12): 0.80 / 0.98 / 0.90 /
 * 0.89x the mma.sync kernel's time at T = 512 / 2k / 8k / 32k (334 TFLOP/s at 32k); 3 slots or no
 * ping-pong measured no faster. Sources: PTX ISA "wgmma.mma_async", "mbarrier",
 * "cp.async.mbarrier.arrive", "setmaxnreg"; FlashAttention-3 (Shah et al., 2024), algorithm 1 (warp
 * specialisation), 2 (intra-warpgroup overlap of softmax and GEMMs) and the ping-pong schedule. */
#define WA_ROWS 64                /* tokens a block (a consumer warpgroup's wgmma M) */
#define WA_KEYS 128               /* keys a step */
#define WA_DH 128
#define WA_KVBYTES (WA_KEYS * WA_DH * 2)  /* one K or V tile: 32 KB */
#ifndef WA_STAGES
#define WA_STAGES 2               /* K / V ring depth */
#endif
#ifndef WA_PINGPONG
#define WA_PINGPONG 1             /* the consumers take turns issuing their products (named barriers) */
#endif
#define WA_SMEM (WA_STAGES * 2 * WA_KVBYTES + 4 * WA_STAGES * 8)

/* byte offset of 16-byte piece (row, 8-element chunk c) of a tile of R rows: core matrix (c, row / 8)
 * at (c * R / 8 + row / 8) * 128, its row at 16 x (row % 8) */
template <int R> __device__ __forceinline__ uint32_t wa_off(int row, int c) {
    return (uint32_t)((c * (R / 8) + (row >> 3)) * 128 + (row & 7) * 16);
}
/* o (accumulators) and p (A operands) of wgmma in flight stay in their registers until after the wait
 * (the compiler sees an asm statement as done when issued): they are "read and written" here */
__device__ __forceinline__ void wa_keep(float (&o)[64], uint32_t (&p)[8][4]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(o[i])::"memory");
#pragma unroll
    for (int k = 0; k < 8; k++)
#pragma unroll
        for (int x = 0; x < 4; x++) asm volatile("" : "+r"(p[k][x])::"memory");
    __syncwarp();
}

__device__ __forceinline__ void wa_keep_s(float (&s)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(s[i])::"memory");
}

__global__ void __launch_bounds__(384, 1)
attn_prefill_wg_kernel(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P,
                       int T, int nq, int nkv, float scale_log2, uint16_t *out) {
    cu_pdl_entry();
    extern __shared__ __align__(1024) uint8_t wa_smem[];
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(wa_smem);
    /* Q tiles, the K ring, the V ring, then the barriers: K full, V full, K empty, V empty (WA_STAGES each) */
    constexpr int NS = WA_STAGES;
    const uint32_t sk = sbase, sv = sk + NS * WA_KVBYTES, bars = sv + NS * WA_KVBYTES;
    auto full_k = [&](int st) { return bars + 8 * st; };
    auto full_v = [&](int st) { return bars + 8 * (NS + st); };
    auto empty_k = [&](int st) { return bars + 8 * (2 * NS + st); };
    auto empty_v = [&](int st) { return bars + 8 * (3 * NS + st); };
    const int wg = threadIdx.x >> 7, tid = threadIdx.x & 127;
    const int t0 = (gridDim.y - 1 - blockIdx.y) * WA_ROWS;         /* the longest blocks first */
    const int G = nq / nkv, kh = (2 * blockIdx.x) / G;
    const int64_t kvs = (int64_t)nkv * WA_DH, qstride = (int64_t)nq * WA_DH;
    const int nkeys = P + min(t0 + WA_ROWS, T), nb = (nkeys + WA_KEYS - 1) / WA_KEYS;
#if defined(FP4MOE_INJECT_FAULT_KV_BLOCK) || defined(FP4MOE_INJECT_FAULT_WG_KV_BLOCK) /* deliberate fault
    (tests must catch it; the _WG_ form in this kernel only): the first page skipped */
    const int kstart = nkeys > ATT_TILE && t0 >= ATT_TILE ? ATT_TILE : 0;
#else
    const int kstart = 0;
#endif
    if (threadIdx.x == 0)
        for (int i = 0; i < 4 * NS; i++) cu_mbar_init(bars + 8 * i, 128 * (i < 2 * NS ? 1 : 2));
    __syncthreads();
    if (wg == 0) { /* producer: key kstart + j * 128 + tid of step j, its K and V rows (16 pieces each) */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        for (int j = 0; j < nb; j++) {
            const int st = j % NS, par = (j / NS - 1) & 1;
            const int key = kstart + j * WA_KEYS + tid;
            const bool v = key < nkeys;
            const int64_t off = v ? ((int64_t)pages[key / ATT_TILE] * ATT_TILE + key % ATT_TILE) * kvs + (int64_t)kh * WA_DH : 0;
            const uint32_t o16 = wa_off<WA_KEYS>(tid, 0);
            if (j >= NS) cu_mbar_wait(empty_k(st), par);
#pragma unroll
            for (int c = 0; c < WA_DH / 8; c++)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sk + st * WA_KVBYTES + o16 + c * (WA_KEYS / 8) * 128),
                             "l"(kc + off + c * 8), "r"(v ? 16 : 0) : "memory");
            cu_mbar_arrive_cp_async(full_k(st));
            if (j >= NS) cu_mbar_wait(empty_v(st), par);
#pragma unroll
            for (int c = 0; c < WA_DH / 8; c++)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sv + st * WA_KVBYTES + o16 + c * (WA_KEYS / 8) * 128),
                             "l"(vc + off + c * 8), "r"(v ? 16 : 0) : "memory");
            cu_mbar_arrive_cp_async(full_v(st));
        }
        asm volatile("cp.async.wait_all;" ::: "memory");
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int c = wg - 1, h = 2 * blockIdx.x + c, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    uint32_t qa[WA_DH / 16][4]; /* the A fragments of the warp's 16 rows (zero beyond T) */
    {
        const int r0 = t0 + warp * 16 + g, r1 = r0 + 8;
        const uint16_t *q0 = q + (int64_t)(r0 < T ? r0 : 0) * qstride + (int64_t)h * WA_DH;
        const uint16_t *q1 = q + (int64_t)(r1 < T ? r1 : 0) * qstride + (int64_t)h * WA_DH;
#pragma unroll
        for (int kk = 0; kk < WA_DH / 16; kk++) {
            const int d = kk * 16 + 2 * tq;
            qa[kk][0] = r0 < T ? *(const uint32_t *)(q0 + d) : 0u;
            qa[kk][1] = r1 < T ? *(const uint32_t *)(q1 + d) : 0u;
            qa[kk][2] = r0 < T ? *(const uint32_t *)(q0 + d + 8) : 0u;
            qa[kk][3] = r1 < T ? *(const uint32_t *)(q1 + d + 8) : 0u;
        }
    }

    float o[64], s[64];
#pragma unroll
    for (int i = 0; i < 64; i++) o[i] = s[i] = 0.0f;
    uint32_t p[8][4];
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;
    const int ra = t0 + warp * 16 + g, rb = ra + 8;            /* this thread's two tokens */
    const int pa = P + ra, pb = P + rb;                        /* their last visible keys */
    /* S = Q K_j^T issued (the stage's data first made visible to the async proxy) */
    /* the stages' data: K_j (ks), V_j (vs) waited for and made visible to the async proxy (wgmma) */
    auto wait_k = [&](int j) { cu_mbar_wait(full_k(j % NS), (j / NS) & 1); };
    auto wait_v = [&](int j) { cu_mbar_wait(full_v(j % NS), (j / NS) & 1); };
    auto issue_s = [&](int j) {
        const uint32_t ks = sk + (j % NS) * WA_KVBYTES;
#pragma unroll
        for (int kk = 0; kk < WA_DH / 16; kk++)
            wg_rs<128, false>::mma(s, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                                   wg_desc(ks + kk * 2 * (WA_KEYS / 8) * 128, (WA_KEYS / 8) * 128, 128), kk > 0);
        wg_commit();
    };
    /* O += P V_j issued */
    auto issue_pv = [&](int j) {
        const uint32_t vs = sv + (j % NS) * WA_KVBYTES;
#pragma unroll
        for (int k2 = 0; k2 < WA_KEYS / 16; k2++)
            wg_rs_mn<128>::mma(o, p[k2][0], p[k2][1], p[k2][2], p[k2][3], wg_desc(vs + k2 * 256, 128, (WA_KEYS / 8) * 128), 1);
        wg_commit();
    };
    /* the online softmax of S_j (done): m, l updated, s = its probabilities, (c0, c1) the rows' rescale
     * factors of O */
    float c0, c1;
    auto softmax = [&](int j) {
        const int j0 = kstart + j * WA_KEYS;
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (j0 + WA_KEYS - 1 <= P + t0) { /* every key visible to every row of the block */
#pragma unroll
            for (int i = 0; i < 16; i++) {
                mx0 = fmaxf(mx0, fmaxf(s[4 * i], s[4 * i + 1]));
                mx1 = fmaxf(mx1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
            }
        } else {
#pragma unroll
            for (int i = 0; i < 16; i++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = j0 + i * 8 + 2 * tq + e;
#if defined(FP4MOE_INJECT_FAULT_CAUSAL_MASK) || defined(FP4MOE_INJECT_FAULT_WG_CAUSAL_MASK) /* deliberate
                    fault: a row's own key is masked (not key 0); the _WG_ form in this kernel only */
                    const bool va = key <= pa && (key < pa || key == 0), vb = key <= pb && (key < pb || key == 0);
#else
                    const bool va = key <= pa, vb = key <= pb;
#endif
                    s[4 * i + e] = va ? s[4 * i + e] : -INFINITY;
                    s[4 * i + 2 + e] = vb ? s[4 * i + 2 + e] : -INFINITY;
                    mx0 = fmaxf(mx0, s[4 * i + e]);
                    mx1 = fmaxf(mx1, s[4 * i + 2 + e]);
                }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float n0 = fmaxf(m0, mx0 * scale_log2), n1 = fmaxf(m1, mx1 * scale_log2);
        const float b0 = n0 == -INFINITY ? 0.0f : n0, b1 = n1 == -INFINITY ? 0.0f : n1;
        c0 = fa_ex2(m0 - b0);
        c1 = fa_ex2(m1 - b1);
        m0 = n0;
        m1 = n1;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            const float e0 = fa_ex2(fmaf(s[4 * i], scale_log2, -b0)), e1 = fa_ex2(fmaf(s[4 * i + 1], scale_log2, -b0));
            const float e2 = fa_ex2(fmaf(s[4 * i + 2], scale_log2, -b1)), e3 = fa_ex2(fmaf(s[4 * i + 3], scale_log2, -b1));
            s0 += e0 + e1;
            s1 += e2 + e3;
            s[4 * i] = e0;
            s[4 * i + 1] = e1;
            s[4 * i + 2] = e2;
            s[4 * i + 3] = e3;
        }
        l0 = l0 * c0 + s0;
        l1 = l1 * c1 + s1;
    };
    auto take_p = [&]() { /* P (fp16 A fragments: rows g (0, 2), g + 8 (1, 3), keys + 8 (2, 3)) from s */
#pragma unroll
        for (int i = 0; i < 16; i++) {
            p[i >> 1][(i & 1) * 2] = fa_pack_f16(s[4 * i], s[4 * i + 1]);
            p[i >> 1][(i & 1) * 2 + 1] = fa_pack_f16(s[4 * i + 2], s[4 * i + 3]);
        }
    };
    /* ping-pong (FlashAttention-3): consumer c issues its products after named barrier 3 + c, then lets
     * the other one go (barrier 4 - c), so that one's softmax runs beside the other's products.
     * Consumer 0 goes first; consumer 1 skips its last "go" (the counts then match; consumer 0's last one
     * comes after its wait, outside the products' pipeline stage, where a divergent path serialises them). */
    auto my_turn = [&]() {
        if (WA_PINGPONG) asm volatile("bar.sync %0, 256;" ::"r"(3 + c) : "memory");
    };
    auto your_turn = [&]() {
        if (WA_PINGPONG) asm volatile("bar.arrive %0, 256;" ::"r"(4 - c) : "memory");
    };
    if (c == 1) your_turn();
    wait_k(0);
    wg_fence_async_smem();
    my_turn();
    wg_fence();
    issue_s(0);
    your_turn();
    wg_wait<0>();
    wa_keep_s(s);
    cu_mbar_arrive(empty_k(0)); /* (every consumer thread: no divergent path among the wgmma) */
    softmax(0);
    take_p();
    for (int j = 1; j < nb; j++) { /* S_j and P_{j-1} V_{j-1} in flight together; the softmax of S_j */
        wait_k(j);
        wait_v(j - 1);
        wg_fence_async_smem();
        my_turn();
        wg_fence();
        issue_s(j);
        issue_pv(j - 1);
        your_turn();
        wg_wait<1>(); /* S_j done (P V of step j - 1 may still run): K_j is free */
        wa_keep_s(s);
        cu_mbar_arrive(empty_k(j % NS));
        softmax(j);
        wg_wait<0>(); /* P V of step j - 1 done: V_{j-1} is free, O may be rescaled */
        wa_keep(o, p);
        cu_mbar_arrive(empty_v((j - 1) % NS));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            o[4 * i] *= c0;
            o[4 * i + 1] *= c0;
            o[4 * i + 2] *= c1;
            o[4 * i + 3] *= c1;
        }
        take_p();
    }
    wait_v(nb - 1);
    wg_fence_async_smem();
    my_turn();
    wg_fence(); /* o and p were written */
    issue_pv(nb - 1);
    wg_wait<0>();
    if (c == 0) your_turn();
    wa_keep(o, p);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float i0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, i1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        const int d = i * 8 + 2 * tq;
        if (ra < T) *(uint32_t *)(out + (int64_t)ra * qstride + (int64_t)h * WA_DH + d) = fa_pack(o[4 * i] * i0, o[4 * i + 1] * i0);
        if (rb < T) *(uint32_t *)(out + (int64_t)rb * qstride + (int64_t)h * WA_DH + d) = fa_pack(o[4 * i + 2] * i1, o[4 * i + 3] * i1);
    }
}

static int launch_prefill_wg(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages, int P,
                             int T, int nq, int nkv, uint16_t *out, cudaStream_t st) {
    static unsigned long long done = 0;
    TRY_OPS(fa_allow_smem(attn_prefill_wg_kernel, WA_SMEM, &done));
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)WA_DH);
    const dim3 grid((unsigned)(nq / 2), ops_blocks(T, WA_ROWS));
    cu_launch(attn_prefill_wg_kernel, grid, 384, WA_SMEM, st, q, kc, vc, pages, P, T, nq, nkv, scale_log2, out);
    OPS_LAUNCH_CHECK("attention (prefill, wgmma)");
    return FP4MOE_OK;
}

/* ---- launch ----------------------------------------------------------------------------------- */

template <int DPL>
static int launch_prefill(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *pages,
                          int P, int T, int nq, int nkv, int dh, uint16_t *out, cudaStream_t st) {
    const float scale = 1.0f / sqrtf((float)dh);
    const size_t smem = ((size_t)ATT_WARPS * dh + (size_t)2 * ATT_TILE * (dh + 1)) * sizeof(float);
    if (smem > 48 * 1024) {
        const cudaError_t e = cudaFuncSetAttribute(attn_prefill_kernel<DPL>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess)
            return fp4moe_set_error(FP4MOE_ECUDA, "cuda op attention: %zu bytes of shared memory: %s",
                                    smem, cudaGetErrorString(e));
    }
    const dim3 grid((unsigned)nq, ops_blocks(T, ATT_WARPS));
    cu_launch(attn_prefill_kernel<DPL>, grid, ATT_WARPS * 32, smem, st, q, kc, vc, pages, P, T, nq, nkv, dh, scale,
              out);
    OPS_LAUNCH_CHECK("attention (prefill)");
    return FP4MOE_OK;
}

template <int DPL>
static int launch_decode(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *row_slot,
                         const int32_t *row_pos, const int32_t *pages, int64_t max_pages, int R, int nq,
                         int nkv, int dh, uint16_t *out, cudaStream_t st) {
    const float scale = 1.0f / sqrtf((float)dh);
    const size_t smem = ((size_t)dh + (size_t)ATT_WARPS * (dh + 2)) * sizeof(float);
    cu_launch(attn_decode_kernel<DPL>, dim3((unsigned)nq, (unsigned)R), ATT_WARPS * 32, smem, st, q, kc, vc, row_slot,
              row_pos, pages, max_pages, nq, nkv, dh, scale, out);
    OPS_LAUNCH_CHECK("attention (decode)");
    return FP4MOE_OK;
}

static int check_shape(int64_t T, int64_t nq, int64_t nkv, int64_t dh) {
    if (dh < 1 || dh > 256 || nkv < 1 || nq % nkv || nq > 65535 || T > (int64_t)65535 * ATT_WARPS)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op attention: head_dim=%lld (at most 256), "
                                "%lld query heads over %lld kv heads, %lld tokens", (long long)dh,
                                (long long)nq, (long long)nkv, (long long)T);
    return FP4MOE_OK;
}

extern "C" int cuda_attention_prefill(void *stream, const uint16_t *q, const uint16_t *k_cache,
                                      const uint16_t *v_cache, const int32_t *pages, int64_t P, int64_t T,
                                      int64_t nq, int64_t nkv, int64_t dh, uint16_t *out) {
    if (T <= 0) return FP4MOE_OK;
    const int e = check_shape(T, nq, nkv, dh);
    if (e) return e;
    cudaStream_t st = (cudaStream_t)stream;
    const int p = (int)P, t = (int)T, a = (int)nq, b = (int)nkv, d = (int)dh;
    if (T <= (int64_t)65535 * FA_ROWS && ((uintptr_t)q & 15) == 0) { /* tensor cores: the family's head sizes; */
        /* Q is copied in 16-byte pieces (rows of nq * dh bf16: 16-byte multiples for dh 64 / 128) */
        /* the wgmma kernel pairs two query heads of one kv head in a block */
        if (dh == 128 && a % 2 == 0 && (a / b) % 2 == 0 && T <= (int64_t)65535 * WA_ROWS &&
            strcmp(env_get(ENV_CUDA_ATTENTION), "mma"))
            return launch_prefill_wg(q, k_cache, v_cache, pages, p, t, a, b, out, st);
        if (dh == 128) return launch_prefill_mma<128>(q, k_cache, v_cache, pages, p, t, a, b, out, st);
        if (dh == 64) return launch_prefill_mma<64>(q, k_cache, v_cache, pages, p, t, a, b, out, st);
    }
    if (dh <= 32) return launch_prefill<1>(q, k_cache, v_cache, pages, p, t, a, b, d, out, st);
    if (dh <= 64) return launch_prefill<2>(q, k_cache, v_cache, pages, p, t, a, b, d, out, st);
    if (dh <= 128) return launch_prefill<4>(q, k_cache, v_cache, pages, p, t, a, b, d, out, st);
    return launch_prefill<8>(q, k_cache, v_cache, pages, p, t, a, b, d, out, st);
}

extern "C" int cuda_attention_decode(void *stream, const uint16_t *q, const uint16_t *k_cache,
                                     const uint16_t *v_cache, const int32_t *row_slot, const int32_t *row_pos,
                                     const int32_t *pages, int64_t max_pages, int64_t R, int64_t nq,
                                     int64_t nkv, int64_t dh, uint16_t *out) {
    if (R <= 0) return FP4MOE_OK;
    const int e = check_shape(1, nq, nkv, dh);
    if (e) return e;
    if (R > 65535) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op attention: %lld decode rows", (long long)R);
    cudaStream_t st = (cudaStream_t)stream;
    const int r = (int)R, a = (int)nq, b = (int)nkv, d = (int)dh;
    if (dh <= 32) return launch_decode<1>(q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, r, a, b, d, out, st);
    if (dh <= 64) return launch_decode<2>(q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, r, a, b, d, out, st);
    if (dh <= 128) return launch_decode<4>(q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, r, a, b, d, out, st);
    return launch_decode<8>(q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, r, a, b, d, out, st);
}

/* The decode grid's z extent: DEC_SPLITS for few rows (one block a split, the most parallelism for
 * one long row), fewer as rows are added (~2,048 blocks), each block then taking several splits. */
#ifndef DEC_GRID_BLOCKS
#define DEC_GRID_BLOCKS 2048
#endif
static unsigned dec_grid_splits(int nkv, int R) {
    const int64_t rows = (int64_t)nkv * R, z = (DEC_GRID_BLOCKS + rows - 1) / rows;
    return (unsigned)(z < 1 ? 1 : z > DEC_SPLITS ? DEC_SPLITS : z);
}

template <int DH>
static int launch_split_mma(int G, const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *row_slot,
                            const int32_t *row_pos, const int32_t *pages, int64_t max_pages, int R, int nq, int nkv,
                            float *part, uint16_t *out, cudaStream_t st) {
    static unsigned long long done = 0;
    constexpr size_t smem = dm_smem_bytes<DH>();
    TRY_OPS(fa_allow_smem(attn_decode_mma_kernel<DH>, smem, &done));
    const float scale_log2 = 1.4426950408889634f / sqrtf((float)DH);
    cu_launch(attn_decode_mma_kernel<DH>, dim3((unsigned)nkv, (unsigned)R, dec_grid_splits(nkv, R)), DM_WARPS * 32,
              smem, st, q, kc, vc, row_slot, row_pos, pages, max_pages, nq, nkv, G, DEC_SPLITS, scale_log2, part);
    OPS_LAUNCH_CHECK("attention (decode, split keys, tensor cores)");
    cu_launch(attn_combine_kernel, dim3((unsigned)nq, (unsigned)R), COMB_WARPS * 32, 0, st, part, row_pos, nq, DH,
              DEC_SPLITS, out);
    OPS_LAUNCH_CHECK("attention (decode, combine)");
    return FP4MOE_OK;
}

extern "C" size_t cuda_attention_decode_scratch(int64_t R, int64_t nq, int64_t dh) {
    return (size_t)(R * nq * DEC_SPLITS * (dh + 2)) * sizeof(float);
}

extern "C" int cuda_attention_decode_split(void *stream, const uint16_t *q, const uint16_t *k_cache,
                                           const uint16_t *v_cache, const int32_t *row_slot,
                                           const int32_t *row_pos, const int32_t *pages, int64_t max_pages,
                                           int64_t R, int64_t nq, int64_t nkv, int64_t dh, float *scratch,
                                           uint16_t *out) {
    if (R <= 0) return FP4MOE_OK;
    const int e = check_shape(1, nq, nkv, dh);
    if (e) return e;
    if (R > 65535) return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "cuda op attention: %lld decode rows", (long long)R);
    const int G = (int)(nq / nkv);
    cudaStream_t st = (cudaStream_t)stream;
    if (G <= 16 && dh == 64)
        return launch_split_mma<64>(G, q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, (int)R, (int)nq,
                                    (int)nkv, scratch, out, st);
    if (G <= 16 && dh == 128)
        return launch_split_mma<128>(G, q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, (int)R, (int)nq,
                                     (int)nkv, scratch, out, st);
    /* other head sizes and group sizes: the per-head kernel */
    return cuda_attention_decode(stream, q, k_cache, v_cache, row_slot, row_pos, pages, max_pages, R, nq, nkv, dh, out);
}
