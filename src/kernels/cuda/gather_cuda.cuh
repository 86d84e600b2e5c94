/* Internal: pieces shared by the CUDA gather_qmm routes (the .cu files of src/kernels/cuda).
 * Contract: docs/spec/NVFP4.md section 4 and include/fp4moe/gather_qmm.h.
 *
 * Number tricks used by the kernels (all exact; spec section 1: every e2m1 * e4m3 product is exact
 * in bf16 and fp16):
 *  - E2M1 code c = s e1 e0 m. Written into an fp16 as (mag << 9) | (s << 15) it reads as
 *    e2m1(c) * 2^-14 (e1e0 lands in the exponent, m in the top mantissa bit; e1e0 = 0 is the
 *    subnormal 0.5 case, which matches). Into a bf16 as (mag << 6) | (s << 15): e2m1(c) * 2^-126.
 *    Into an fp32 as (mag << 22) | (s << 31): e2m1(c) * 2^-126.
 *  - The kernels multiply these by the E4M3 block scale times a power of two chosen so that nothing
 *    overflows or underflows, and undo that power of two (exactly) in the epilogue together with
 *    the global scale. */
#ifndef FP4MOE_KERNELS_CUDA_GATHER_CUDA_CUH
#define FP4MOE_KERNELS_CUDA_GATHER_CUDA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>

#include "common/error.h"
#include "fp4moe/gather_qmm.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/tiled_codes.h"
#include "kernels/cuda/ops_cuda.h"

/* One gather_qmm call, device pointers; sizes already validated to fit in int. */
struct gq_args {
    const uint8_t *codes;   /* E*N*(K/2) bytes */
    const uint8_t *scales;  /* E*N*(K/16) E4M3 bytes */
    const float *gs;        /* E fp32 decode multipliers, or NULL */
    int E, N, K;
    const void *x;          /* B x K of the activation dtype */
    void *y;                /* B x N of the same dtype */
    const uint32_t *idx;    /* B expert indices */
    int B;
    int relu2;              /* epilogue: y = relu(y)^2, each rounded to the output dtype (bf16/f16) */
    int tiled;              /* 1: codes holds the tiled layout (gq_relayout_tiled; scales unused) */
    int xbcast;             /* 1: every row reads x row 0 (gather_qmm_cuda_x1; the qmv mma kernel only) */
    const uint32_t *xrow;   /* NULL, or B entries: row b reads x row xrow[b] / xdiv (gather_qmm_cuda_rows; the
                               expert-batched kernels only) */
    int xdiv;
    const int *runs;        /* NULL, or the expert runs of idx made beforehand (gq_runs.buf, for row tile runs_mt) */
    int runs_mt;
    const int *e1_pairs;    /* NULL, or (E = 1, idx all 0) the pair table of cuda_ops.e1_runs, B + 1 pairs at least */
};

/* The x row that sorted row b reads: b, or xrow[b] / xdiv (gq_args.xrow) */
__device__ __forceinline__ int64_t gq_x_row(const uint32_t *xrow, int xdiv, int64_t b) {
#ifdef FP4MOE_INJECT_FAULT_XROW /* deliberate fault (tests must catch it): the previous sorted row's source */
    return xrow ? (int64_t)(__ldg(xrow + (b > 0 ? b - 1 : 0)) / (uint32_t)xdiv) : b;
#else
    return xrow ? (int64_t)(__ldg(xrow + b) / (uint32_t)xdiv) : b;
#endif
}

/* ---- the tiled weight layout (the CUDA backend's, FP4MOE_CUDA_WEIGHT_LAYOUT=tiled) -------------
 * Expert e's weights as pieces of GQ_TILE_PIECE bytes, one per (16-feature tile, 128-K step), in
 * the order [e][tile][step]: the codes of rows r = tile*16 + lane/4 (16 bytes a lane, lanes in
 * order: 512 bytes), then of rows r + 8 (512 bytes), then a 4-byte scale word a lane (the E4M3
 * block scales 2c, 2c+1 of row r, then of row r + 8, as tiled scale codes; c = 4 step + lane % 4 the lane's 32-K chunk);
 * zeros past N and past K. Lane (g, t) of a warp reads exactly its own 16 + 16 + 4 bytes: the
 * qmv (tensor cores) and expert-batched kernels give every lane the rows g, g + 8 and chunk
 * 4 step + t. Measured on the H200 (bench/gpu_qmv_tiled, 2026-12-02): the decode qmv 0.89-0.92x the
 * time of the checkpoint layout's, bitwise equal. Each 4-byte code word is stored with its bits arranged
 * (src/kernels/tiled_codes.h: tc_arrange) so that the bf16 kernels decode its four code pairs with 8
 * instructions instead of 13 (tc_pairs; the same bits as the checkpoint word's decode), and each scale byte
 * re-encoded (tc_scale_code: the packed bf16 / f16 multiplier from a byte permute and an IMAD) with the
 * scale's sign and zero folded into its block's codes (tc_block_word; the same products, signed zeros too).
 * K % 32 == 0. */
#define GQ_TILE_PIECE 1152
__host__ __device__ __forceinline__ int64_t gq_tiled_nsteps(int64_t K) { return (K / 32 + 3) / 4; }
__host__ __device__ __forceinline__ int64_t gq_tiled_expert_bytes(int64_t N, int64_t K) {
    return ((N + 15) / 16) * gq_tiled_nsteps(K) * GQ_TILE_PIECE;
}
/* The piece (expert we, 16-feature tile, step) of a tiled weight. */
__device__ __forceinline__ const uint8_t *gq_tiled_piece(const uint8_t *codes, int64_t we, int64_t tile, int64_t step,
                                                         int N, int K) {
    return codes + ((we * ((N + 15) / 16) + tile) * gq_tiled_nsteps(K) + step) * GQ_TILE_PIECE;
}

/* ---- deliberate faults (FP4MOE_INJECT_FAULT, see src/kernels/gather_common.h) ---------------- */
__host__ __device__ __forceinline__ int64_t cu_weight_expert(int64_t e, int64_t E) {
#ifdef FP4MOE_INJECT_FAULT_EXPERT_OFFSET /* deliberate fault (tests must catch it): shifted expert */
    return e + 1 < E ? e + 1 : (e > 0 ? e - 1 : e);
#else
    (void)E;
    return e;
#endif
}

__device__ __forceinline__ float cu_expert_gs(const float *gs, int64_t e) {
#ifdef FP4MOE_INJECT_FAULT_GLOBAL_SCALE /* deliberate fault (tests must catch it): gs dropped */
    (void)gs; (void)e;
    return 1.0f;
#else
    return gs ? gs[e] : 1.0f;
#endif
}

/* ---- E4M3 and E2M1 decoding -------------------------------------------------------------- */
/* E4M3 byte -> float (hardware cvt on sm_89+). */
__device__ __forceinline__ float cu_e4m3_to_float(uint32_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
    return __half2float(__half(h));
}

/* Codes i and i+4 of the 8 in word w (code j in bits 4j..4j+3), as an fp16x2 bit pattern
 * (low half: code i) holding e2m1 * 2^-14. */
template <int I>
__device__ __forceinline__ uint32_t cu_e2m1x2_f16(uint32_t w) {
    const uint32_t v = w >> (4 * I);
    return ((v & 0x00070007u) << 9) | ((v & 0x00080008u) << 12);
}
/* Same as a bf16x2 bit pattern holding e2m1 * 2^-126. */
template <int I>
__device__ __forceinline__ uint32_t cu_e2m1x2_bf16(uint32_t w) {
    const uint32_t v = w >> (4 * I);
    return ((v & 0x00070007u) << 6) | ((v & 0x00080008u) << 12);
}
/* v4 decode (docs/GPU-NOTES.md, round 4): the same bf16x2 pattern as cu_e2m1x2_bf16 with one integer
 * multiply instead of two shift-and-mask pairs. A code v (4 bits) times 0x1040 = v << 6 | v << 12
 * (no overlap, no carries): bits 6..8 hold the magnitude (bits 6..9 of v << 6) and bit 15 the sign
 * (bit 3 of v << 12); one mask keeps those. Two codes 16 bits apart do this side by side. Pairs
 * 0 and 1 read w, pairs 2 and 3 read w >> 8 (the caller shifts once per word). */
template <int I>
__device__ __forceinline__ uint32_t cu_e2m1x2_bf16_mul(uint32_t w, uint32_t w8) {
    if (I == 0) return ((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;
    if (I == 1) return ((w & 0x00F000F0u) * 0x104u) & 0x81C081C0u;
    if (I == 2) return ((w8 & 0x000F000Fu) * 0x1040u) & 0x81C081C0u;
    return ((w8 & 0x00F000F0u) * 0x104u) & 0x81C081C0u;
}
/* v4 f16 decode by byte permutes: the fp16 pattern of a code (mag << 9 | s << 15, e2m1 * 2^-14)
 * has a zero low byte and the high byte hb = s << 7 | mag << 1. lo_hb(w) holds the high bytes of
 * codes 0, 2, 4, 6 (byte j: code 2j), hi_hb(w) those of codes 1, 3, 5, 7; one byte permute against
 * zero then builds an fp16x2 from two of them: [0, hb_a, 0, hb_b]. */
__device__ __forceinline__ uint32_t cu_e2m1_hb_lo(uint32_t w) {
    return ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);
}
__device__ __forceinline__ uint32_t cu_e2m1_hb_hi(uint32_t w) {
    return ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);
}
/* bytes 2P, 2P+1 of hb as the low and high fp16 of a pair (P = 0 or 1) */
template <int P> __device__ __forceinline__ uint32_t cu_hb_pair_f16(uint32_t hb) {
    return __byte_perm(hb, 0u, P == 0 ? 0x1404u : 0x3424u);
}

/* bf16x2 a * b, round to nearest (exact where the kernels use it: e2m1 * e4m3 products). */
__device__ __forceinline__ uint32_t cu_mul_bf16x2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
/* The E4M3 scale byte sb as a bf16x2 pair holding s * 2^118 (< 2^127, exact); times a code pair of
 * cu_e2m1x2_bf16[_mul] (e2m1 * 2^-126) it gives e2m1 * s * 2^-8, exact, normal. */
__device__ __forceinline__ uint32_t cu_scale2_bf16(uint32_t sb) {
    const __nv_bfloat162 h = __float2bfloat162_rn(cu_e4m3_to_float(sb) * 0x1p118f);
    return *reinterpret_cast<const uint32_t *>(&h);
}
/* f16x2 a * b, round to nearest (exact where the kernels use it). */
__device__ __forceinline__ uint32_t cu_mul_f16x2(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
/* d += A (16 x 16, row) * B (16 x 8, col): mma.sync m16n8k16, f16 inputs, fp32 accumulators. */
__device__ __forceinline__ void cu_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                           uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
/* d += A (16 x 16, row) * B (16 x 8, col): mma.sync m16n8k16, bf16 inputs, fp32 accumulators. */
__device__ __forceinline__ void cu_mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* Code i of word w as an fp32 holding e2m1 * 2^-126. */
__device__ __forceinline__ float cu_e2m1_f32(uint32_t w, int i) {
    const uint32_t v = w >> (4 * i);
    return __uint_as_float(((v & 7u) << 22) | ((v & 8u) << 28));
}

/* ---- loads --------------------------------------------------------------------------------- */
/* Weights are read once per row-tile: stream them past L1 (read-only path, no L1 allocation). */
__device__ __forceinline__ uint4 cu_ld_stream16(const void *p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}
__device__ __forceinline__ uint2 cu_ld_stream8(const void *p) {
    uint2 r;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

/* ---- activation / output element access ----------------------------------------------------- */
__device__ __forceinline__ float cu_to_float(float v) { return v; }
__device__ __forceinline__ float cu_to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float cu_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T cu_from_float(float v);
template <> __device__ __forceinline__ float cu_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half cu_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 cu_from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

/* An output element: v rounded to T; with relu2, then relu(.)^2 rounded again (the separate relu2
 * op's arithmetic on the rounded value, so fusing it changes no bit). */
template <typename T> __device__ __forceinline__ T cu_out(float v, int relu2) {
    T r = cu_from_float<T>(v);
    if (relu2) {
#ifdef FP4MOE_INJECT_FAULT_RELU2_EPILOGUE /* deliberate fault (tests must catch it): relu^2 of the unrounded v */
        const float f = v, p = f > 0.0f ? f : 0.0f;
#else
        const float f = cu_to_float(r), p = f > 0.0f ? f : 0.0f;
#endif
        r = cu_from_float<T>(__fmul_rn(p, p));
    }
    return r;
}

/* ---- host side ----------------------------------------------------------------------------- */
/* Checks a CUDA runtime status; on failure sets the fp4moe error ("gather_qmm_cuda: <what>: <msg>")
 * and returns FP4MOE_ECUDA from the calling function. */

/* Rows per row-tile of the expert-batched kernel for this call (8, 32 or 64 by the mean run length,
 * see gather_batched.cu); the runs kernel counts tiles with the same value. */
int gq_batched_row_tile(const gq_args *a, fp4moe_dtype dtype);

/* The expert-batched kernel with bf16 x and fp32 y (a.y: B x N floats): the lm_head's prefill rows,
 * whose logits stay fp32 (decode-sized rows: gq_launch_qmv_mma with f32out). Same arithmetic per
 * row as the bf16 route (bf16 products, fp32 accumulation). */
int gq_launch_bf16_f32out(const gq_args *a, cudaStream_t st);

/* Computes on the device, without host synchronisation:
 *   starts[e] = first row b with idx[b] >= e, for e in [0, E]   (idx sorted: expert e's run is
 *               rows [starts[e], starts[e+1]); rows [starts[E], B) are out of range),
 *   tile_off[e] = sum over e' < e of ceil(run length of e' / row_tile), e in [0, E] (if non-NULL),
 *   tile_off[E + 1] = 0: the work counter of the expert-batched kernels' dynamic item order (so
 *               tile_off has E + 2 ints).
 * A broken "sorted" promise gives wrong runs but never an out-of-bounds access. */
int gq_launch_runs(const gq_args *a, int row_tile, int *starts, int *tile_off, cudaStream_t st);
/* As gq_launch_runs, but a run's remainder (n % row_tile for a run of n rows) of 1 .. row_tile / 2 rows is split off:
 *   tile_off[e] = sum over e' < e of (n(e') / row_tile + (n(e') % row_tile > row_tile / 2)): expert e's row_tile
 *               tiles from starts[e] (a remainder over row_tile / 2 rows their last, short, tile);
 *   rem_off[e]  = the number of experts e' < e with 1 <= n(e') % row_tile <= row_tile / 2: expert e's remainder
 *               (rows starts[e] + n(e) / row_tile * row_tile .. starts[e + 1]) one tile of row_tile / 2 rows;
 *   tile_off[E + 1] = rem_off[E + 1] = 0 (the two launches' work counters). tile_off and rem_off: E + 2 ints each. */
int gq_launch_runs_split(const gq_args *a, int row_tile, int *starts, int *tile_off, int *rem_off, cudaStream_t st);


/* A MoE layer's up projection u (x -> h with relu^2; x through u->xrow or not) and down projection d (h -> y) in ONE
 * launch (gather_batched.cu, gq_moe_w32_kernel): h and y bitwise those of gq_launch_batched(u) then (d). Only where
 * both would run the 32-row w32 kernel on the runs made beforehand: bf16, tiled, K % 64 == 0, E > 1, the same idx /
 * B / E, d->x == u->y, u->runs == d->runs with runs_mt 32 and the row tile of (B, E) 32; done: done_n >=
 * gq_moe_done_ints(B, E) ints of device memory, zero (the kernel leaves them zero). Elsewhere FP4MOE_EUNSUPPORTED
 * (the caller makes the two calls); FP4MOE_ECUDA on a launch failure. */
int64_t gq_moe_done_ints(int64_t B, int64_t E);
int gq_launch_moe_pair(const gq_args *u, const gq_args *d, int *done, int64_t done_n, cudaStream_t st);

/* A MoE layer's up projection u (x -> h with relu^2; x: T rows (token rows, read through u->xrow / u->xdiv) or, without
 * xrow, B rows, of u->K bf16) and down projection d (h -> y, B x d->N bf16) on 128-row x 256-feature tiles
 * (gather_big.cuh): y bitwise that of gq_launch_batched(u) then (d). split: a run's remainder of 1-64 rows (past its
 * whole 128-row tiles) on the 64-row wgmma kernel, through h (u->y: only those rows of h are written); the other rows'
 * up projection output goes to a per-call scratch in the big kernel's permuted order (split false: all of it, h not
 * written). A per-call scratch of T x gb_pad(u->K) + B x gb_pad(u->N) bf16 and the runs of idx (gq_launch_runs_split
 * / gq_launch_runs with row tile 128, made here; u->runs is not read). gq_moe_big_fits: bf16
 * tiled weights with 16-byte aligned codes, u->K and d->K multiples of 64, N even, d->K == u->N, one E / B / idx,
 * d->xrow null, x 16-byte aligned; elsewhere gq_launch_moe_big gives FP4MOE_EUNSUPPORTED, as it does when the scratch
 * cannot be allocated (the caller's two calls need none). FP4MOE_ECUDA on a failed launch. */
bool gq_moe_big_fits(const gq_args *u, const gq_args *d);
int gq_launch_moe_big(const gq_args *u, const gq_args *d, int64_t T, bool split, cudaStream_t st);

/* Route launchers (arguments already validated; FP4MOE_OK or FP4MOE_ECUDA with a message). */
int gq_launch_qmv(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st);
/* qmv v5 (gather_qmv.cu): decode-sized (B <= 32) bf16 batches with K % 32 == 0 on tensor cores;
 * gq_launch_qmv takes it for bf16 where gq_qmv_mma_fits; f32out: y is B x N floats (the lm_head). */
bool gq_qmv_mma_fits(const gq_args *a);
int gq_launch_qmv_mma(const gq_args *a, bool f32out, cudaStream_t st);
int gq_launch_batched(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st);
/* "qmv, tiled by 8 rows": the qmv route for sorted f16/bf16 input with B >= FP4MOE_BATCHED_MIN_ROWS.
 * The expert-batched kernel with GQ_QMV_TILE_ROWS-row tiles:
 * an expert's weights are re-read for every 8 rows of its run, and every output element is bitwise
 * equal to gq_launch_batched's (gather_batched.cu says why), so the route switch
 * FP4MOE_GATHER_EXPERT_BATCHED does not change the numbers on this path. */
#define GQ_QMV_TILE_ROWS 8
int gq_launch_qmv_tiled(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st);
/* Whether a sorted call runs gq_dense_kg_kernel (gather_batched.cu: bf16 plain linears of KG_MIN_ROWS..64 rows,
 * N >= 2,048, K % 64 == 0), which launch_tiled (gq_launch_batched, gq_launch_qmv_tiled) takes for every row tile:
 * the qmv route sends such calls there too, so that both routes give the same bits. */
bool gq_dense_kg_fits(const gq_args *a, fp4moe_dtype dtype);
/* E stacked (N, K) NVFP4 weights (checkpoint layout: codes E*N*K/2, scales E*N*K/16 bytes) into the
 * tiled layout at out (E * gq_tiled_expert_bytes(N, K) bytes). K % 32 == 0. Asynchronous. */
int gq_relayout_tiled(const uint8_t *codes, const uint8_t *scales, int64_t E, int64_t N, int64_t K, uint8_t *out,
                      cudaStream_t st);
int gq_run_dequant_gemm(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st);
/* dequant_gemm for a plain linear (E = 1, bf16, every row's idx 0, so no runs): the weights
 * dequantized into dq (grown here, outside graph captures only), one cublasGemmEx on `blas` (bound
 * to st) with the global scale read from device memory and beta from d_zero (a device 0.0f); no
 * host synchronisation, capturable. Same arithmetic as gq_run_dequant_gemm. wbf16 (or NULL): the
 * weights already dequantized (cuda_nvfp4_dequant_bf16), read in place of dq. */
int gq_dense_dequant_gemm(const gq_args *a, cudaStream_t st, void *blas, gq_dense_scratch *dq, const void *wbf16,
                          const float *d_zero);

/* cudaMallocAsync on the stream (from the device's default pool, whose release threshold is raised
 * once per device so that small per-call buffers are reused, not re-mapped after each sync). */
int gq_scratch_alloc(void **p, size_t bytes, cudaStream_t st);
int gq_scratch_free(void *p, cudaStream_t st);

#endif
