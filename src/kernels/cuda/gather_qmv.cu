/* The qmv gather_qmm route: decode and unsorted batches, any activation dtype. bf16 batches of
 * <= 32 rows with K % 32 == 0 take the tensor-core kernel (v5, gq_qmv_mma_kernel, below); the
 * others the fp32 CUDA-core FMA kernel described here (v4).
 * Contract: docs/spec/NVFP4.md section 4; notes: docs/GPU-NOTES.md.
 *
 * Rows are taken in chunks of 32 (one warp-wide load of idx). Inside a chunk a *segment* is a run of
 * consecutive rows with the same expert, cut every QMV_G rows; the warp finds the segments with two
 * ballots (no pre-pass, no host round trip). A warp computes NF (2 or 4) output features for one segment:
 * its lanes stream weight rows n, n+1 of the segment's expert in 16-byte pieces (2 NVFP4 blocks; 8-byte
 * pieces when K % 32 != 0), decode each code once to fp32 and use it for all rows of the segment,
 * then reduce across the warp. Blocks of 8 warps cover 8 consecutive features (so the x rows of the
 * segment are read from L1 after the first warp); blockIdx.x also selects which segments of the
 * chunk the block handles (segment slot), so that the segments of one chunk - e.g. the 6 experts
 * of one decode token - run in parallel. Rows with idx >= E are written as zeros. */
#include <limits.h>

#include "kernels/cuda/gather_cuda.cuh"
#include "kernels/cuda/cuda_launch.cuh"

#define QMV_WARPS 8  /* warps per block = consecutive output features */
#define QMV_CHUNK 32 /* rows per chunk */
#define QMV_G 8      /* rows per segment at most (accumulators per lane), B > 32 */
#define QMV_SLOTS 8  /* segments of a chunk handled in parallel */
#define FULL 0xffffffffu

/* 16 consecutive activations (one NVFP4 block) as fp32. */
__device__ __forceinline__ void qmv_load_x16(const float *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float4 q = __ldg(reinterpret_cast<const float4 *>(p) + i);
        v[4 * i] = q.x; v[4 * i + 1] = q.y; v[4 * i + 2] = q.z; v[4 * i + 3] = q.w;
    }
}
__device__ __forceinline__ void qmv_load_x16(const __nv_bfloat16 *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p) + i);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) { /* bf16 -> fp32 is a 16-bit shift */
            v[8 * i + 2 * j] = __uint_as_float(w[j] << 16);
            v[8 * i + 2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    }
}
__device__ __forceinline__ void qmv_load_x16(const __half *p, float (&v)[16]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const uint4 q = __ldg(reinterpret_cast<const uint4 *>(p) + i);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[j]));
            v[8 * i + 2 * j] = f.x;
            v[8 * i + 2 * j + 1] = f.y;
        }
    }
}

/* v4 (round 4, docs/GPU-NOTES.md): one NVFP4 block (code words w0, w1; E4M3 scale byte sb) as 16
 * fp32 weights e2m1 * scale * 2^-8 (exact): code pairs (i, i+4) as bf16x2 patterns by one integer
 * multiply each (cu_e2m1x2_bf16_mul, e2m1 * 2^-126), one packed multiply by scale * 2^118 (exact,
 * as in the batched route), then each bf16 half is an fp32 by a shift or a mask. 2.6 integer ops
 * + 0.5 packed multiplies per weight instead of ~4 ops + 1 fp32 multiply, and the decode is done
 * once per block and feature, not once per row. */
__device__ __forceinline__ void qmv_decode16(uint32_t w0, uint32_t w1, uint32_t sb, float (&wv)[16]) {
    const uint32_t s = cu_scale2_bf16(sb);
    const uint32_t w[2] = {w0, w1};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const uint32_t w8 = w[h] >> 8;
        const uint32_t p[4] = {cu_e2m1x2_bf16_mul<0>(w[h], w8), cu_e2m1x2_bf16_mul<1>(w[h], w8),
                               cu_e2m1x2_bf16_mul<2>(w[h], w8), cu_e2m1x2_bf16_mul<3>(w[h], w8)};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t d = cu_mul_bf16x2(p[i], s);
            wv[8 * h + i] = __uint_as_float(d << 16);             /* code 8h + i */
            wv[8 * h + i + 4] = __uint_as_float(d & 0xffff0000u); /* code 8h + i + 4 */
        }
    }
}

/* One segment (rows b0 .. b0+len-1, expert e < E, len <= G), output features n0 .. n0+NF-1 (those
 * < N). The lane's weight pieces are loaded QMV_PM at a time, all before any is used (for the
 * Nemotron K one batch covers the whole row: one memory latency per warp). Weights decode as
 * (e2m1 * 2^-126) * (scale * 2^100) = e2m1 * scale * 2^-26 (exact, fp32 normal); the epilogue
 * multiplies by 2^26 and the global scale. */
#define QMV_PM 3 /* pieces per lane in flight per feature */
template <typename T, int BPL, int G, int NF, int V>
__device__ __forceinline__ void qmv_segment(const gq_args &a, const T *__restrict__ x, T *__restrict__ y,
                                            uint32_t e, int64_t b0, int len, int n0, int lane) {
    const int K = a.K, KB = K >> 4;
    const uint8_t *codes[NF], *scales[NF];
#pragma unroll
    for (int f = 0; f < NF; f++) {
        const int64_t wrow = cu_weight_expert(e, a.E) * a.N + min(n0 + f, a.N - 1);
        codes[f] = a.codes + wrow * (K >> 1);
        scales[f] = a.scales + wrow * KB;
    }
    float acc[NF][G];
#pragma unroll
    for (int f = 0; f < NF; f++)
#pragma unroll
        for (int r = 0; r < G; r++) acc[f][r] = 0.0f;

    for (int kc = lane * BPL; kc < KB; kc += 32 * BPL * QMV_PM) {
        uint32_t cw[QMV_PM][NF][2 * BPL], cs[QMV_PM][NF];
#pragma unroll
        for (int p = 0; p < QMV_PM; p++) { /* issue every load of this batch first */
            const int kb = kc + p * 32 * BPL;
#pragma unroll
            for (int f = 0; f < NF; f++) {
                if (kb < KB) {
                    if constexpr (BPL == 2) {
                        const uint4 q = cu_ld_stream16(codes[f] + (int64_t)kb * 8);
                        cw[p][f][0] = q.x; cw[p][f][1] = q.y; cw[p][f][2] = q.z; cw[p][f][3] = q.w;
                        cs[p][f] = __ldg(scales[f] + kb) | (uint32_t)__ldg(scales[f] + kb + 1) << 8;
                    } else {
                        const uint2 q = cu_ld_stream8(codes[f] + (int64_t)kb * 8);
                        cw[p][f][0] = q.x; cw[p][f][1] = q.y;
                        cs[p][f] = __ldg(scales[f] + kb);
                    }
                }
            }
        }
#pragma unroll
        for (int p = 0; p < QMV_PM; p++) {
            const int kb = kc + p * 32 * BPL;
            if (kb >= KB) break;
#pragma unroll
            for (int bi = 0; bi < BPL; bi++) {
                const int64_t k0 = (int64_t)(kb + bi) * 16;
                if constexpr (V == 4 && G == 1) { /* decode: one row, x shared by the NF features */
                    float xv[16];
                    qmv_load_x16(x + b0 * K + k0, xv);
#pragma unroll
                    for (int f = 0; f < NF; f++) {
                        float wv[16];
                        qmv_decode16(cw[p][f][2 * bi], cw[p][f][2 * bi + 1], (cs[p][f] >> (8 * bi)) & 0xffu, wv);
#pragma unroll
                        for (int j = 0; j < 16; j++) acc[f][0] = fmaf(xv[j], wv[j], acc[f][0]);
                    }
                } else if constexpr (V == 4) { /* weights decoded once, used by every row */
                    float wv[NF][16];
#pragma unroll
                    for (int f = 0; f < NF; f++)
                        qmv_decode16(cw[p][f][2 * bi], cw[p][f][2 * bi + 1], (cs[p][f] >> (8 * bi)) & 0xffu, wv[f]);
#pragma unroll
                    for (int r = 0; r < G; r++) {
                        if (r < len) {
                            float xv[16];
                            qmv_load_x16(x + (b0 + r) * K + k0, xv);
#pragma unroll
                            for (int f = 0; f < NF; f++)
#pragma unroll
                                for (int j = 0; j < 16; j++) acc[f][r] = fmaf(xv[j], wv[f][j], acc[f][r]);
                        }
                    }
                } else { /* v3 */
#pragma unroll
                    for (int r = 0; r < G; r++) {
                        if (r < len) {
                            float xv[16];
                            qmv_load_x16(x + (b0 + r) * K + k0, xv);
#pragma unroll
                            for (int f = 0; f < NF; f++) {
                                const float s = cu_e4m3_to_float((cs[p][f] >> (8 * bi)) & 0xffu) * 0x1p100f;
#pragma unroll
                                for (int j = 0; j < 16; j++)
                                    acc[f][r] = fmaf(xv[j], cu_e2m1_f32(cw[p][f][2 * bi + (j >> 3)], j & 7) * s, acc[f][r]);
                            }
                        }
                    }
                }
            }
        }
    }
    const float mult = cu_expert_gs(a.gs, e) * (V == 4 ? 0x1p8f : 0x1p26f);
#pragma unroll
    for (int r = 0; r < G; r++) {
        if (r < len) {
#pragma unroll
            for (int f = 0; f < NF; f++) {
                float v = acc[f][r];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
                if (lane == 0 && n0 + f < a.N) y[(b0 + r) * a.N + n0 + f] = cu_out<T>(v * mult, a.relu2);
            }
        }
    }
}

template <typename T, int BPL, int G, int NF, int V>
__global__ void __launch_bounds__(QMV_WARPS * 32, 2) gq_qmv_kernel(gq_args a, int slots) {
    cu_pdl_entry();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nblk = (a.N + QMV_WARPS * NF - 1) / (QMV_WARPS * NF);
    const int slot = blockIdx.x / nblk;
    const int n = ((blockIdx.x % nblk) * QMV_WARPS + warp) * NF; /* first of NF features */
    if (n >= a.N) return; /* whole warp; no block-wide barriers below */
    const T *x = static_cast<const T *>(a.x);
    T *y = static_cast<T *>(a.y);
    for (int64_t c0 = (int64_t)blockIdx.y * QMV_CHUNK; c0 < a.B; c0 += (int64_t)gridDim.y * QMV_CHUNK) {
        const int nrows = (int)min((int64_t)QMV_CHUNK, (int64_t)a.B - c0);
        const bool valid = lane < nrows;
        const uint32_t v = valid ? __ldg(a.idx + c0 + lane) : 0xffffffffu;
        const uint32_t prev = __shfl_up_sync(FULL, v, 1);
        const uint32_t heads = __ballot_sync(FULL, valid && (lane == 0 || v != prev));
        const int run0 = 31 - __clz(heads & (FULL >> (31 - lane))); /* start of this lane's run */
        uint32_t segs = __ballot_sync(FULL, valid && ((lane - run0) % G) == 0);
        for (int i = 0; i < slot && segs; i++) segs &= segs - 1; /* skip to this block's first */
        while (segs) {
            const int s = __ffs(segs) - 1;
            const uint32_t rest = segs & (segs - 1);
            const int len = (rest ? __ffs(rest) - 1 : nrows) - s;
            const uint32_t e = __shfl_sync(FULL, v, s);
            const int64_t b0 = c0 + s;
            if (e >= (uint32_t)a.E) {
                if (lane < len)
                    for (int f = 0; f < NF && n + f < a.N; f++)
                        y[(b0 + lane) * a.N + n + f] = cu_from_float<T>(0.0f);
            } else {
                qmv_segment<T, BPL, G, NF, V>(a, x, y, e, b0, len, n, lane);
            }
            for (int i = 0; i < slots && segs; i++) segs &= segs - 1;
        }
    }
}

/* ---- v5: decode-sized bf16 batches on tensor cores ------------------------------------------------
 * For B <= QMV_CHUNK rows, bf16 x, K % 32 == 0 (docs/GPU-NOTES.md "qmv v5"). Operands swapped
 * against the batched kernel: the weights are the A operand (16 output features = the 16 rows of
 * mma.m16n8k16), the segment's rows (<= 8 rows of one expert) the 8 columns of B. A block of
 * QMMA_WARPS warps computes one (segment slot, 16-feature tile); its warps split K (warp w takes
 * the 128-wide K steps w, w + QMMA_WARPS, ...) and their partial tiles are summed in shared memory
 * in warp order (deterministic). In a step, lane (r = lane / 4, q = lane % 4) streams 16 code
 * bytes (32 codes, K range 32c .. 32c+31 with c = 4 * step + q) of feature rows r and r + 8 and
 * reads the same 32 activations of its segment row r. The sum over K does not care which k goes
 * to which mma position, so a code word (8 codes, one block scale) feeds two mmas directly:
 * A pairs (i, i+4) by one integer multiply each (cu_e2m1x2_bf16_mul), one packed multiply by the
 * block scale, and the matching x pairs by byte permutes. 4 integer ops + 1 packed multiply per
 * weight pair and one mma per 8 weights per lane, against 4 + 1 + 2 extractions + 2 FFMA per pair
 * of the fp32 v4 kernel. Each weight product is exact in fp32 (as in the batched kernel), the
 * accumulation is the tensor core's fp32. Rows with idx >= E are zeros. */
#ifndef QMMA_PM
#define QMMA_PM 1    /* K steps of codes in flight per warp */
#endif
#ifndef QMMA_MINB
#define QMMA_MINB 8  /* launch bounds: blocks of 4 warps per SM (x 4 / W for W warps) */
#endif
#ifndef QMMA_WPSM
#define QMMA_WPSM 16 /* warps per SM the grid should reach before a block takes more warps */
#endif
#define QMMA_WARPS W

/* The 4 scale bytes of chunk c (blocks 2c, 2c+1 of rows a and b), packed a0 | a1 << 8 | b0 << 16 | b1 << 24. */
__device__ __forceinline__ uint32_t qmma_scale_bytes(const uint8_t *sa, const uint8_t *sb, int c) {
    return (uint32_t)__ldg(sa + 2 * c) | (uint32_t)__ldg(sa + 2 * c + 1) << 8 | (uint32_t)__ldg(sb + 2 * c) << 16 |
           (uint32_t)__ldg(sb + 2 * c + 1) << 24;
}

/* One K step of a lane: code words wa (row a) and wb (row b), their scale bytes sraw, the 32
 * activations at xp (NULL: zeros), into the m16n8 accumulator tile. */
template <bool TL>
__device__ __forceinline__ void qmma_step(float (&acc)[4], const uint4 wa, const uint4 wb, uint32_t sraw,
                                          const __nv_bfloat16 *xp) {
    uint4 xv[4] = {};
    if (xp) {
#pragma unroll
        for (int j = 0; j < 4; j++) xv[j] = __ldg(reinterpret_cast<const uint4 *>(xp) + j);
    }
    uint32_t sc[4]; /* the scale of each block, as a bf16 pair (s, s) */
    if constexpr (TL) { /* the tiled layout's scale codes: a byte permute and an IMAD each (tiled_codes.h) */
        sc[0] = tc_scale_bf16x2(sraw, 0x4040u); sc[1] = tc_scale_bf16x2(sraw, 0x4141u);
        sc[2] = tc_scale_bf16x2(sraw, 0x4242u); sc[3] = tc_scale_bf16x2(sraw, 0x4343u);
    } else {
        sc[0] = cu_scale2_bf16(sraw & 0xffu); sc[1] = cu_scale2_bf16((sraw >> 8) & 0xffu);
        sc[2] = cu_scale2_bf16((sraw >> 16) & 0xffu); sc[3] = cu_scale2_bf16(sraw >> 24);
    }
    const uint32_t wA[4] = {wa.x, wa.y, wa.z, wa.w};
    const uint32_t wB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { /* code word j: codes 32c + 8j .. +7, block 2c + j/2 */
        const uint32_t sA = sc[j >> 1], sB = sc[2 + (j >> 1)];
        uint32_t ca[4], cb[4]; /* code pairs (i, i+4): tiled words by tc_pairs (src/kernels/tiled_codes.h) */
        if constexpr (TL) {
#ifdef FP4MOE_INJECT_FAULT_TILED_CODES /* deliberate fault (tests must catch it): the checkpoint decode */
            const uint32_t a8 = wA[j] >> 8, b8 = wB[j] >> 8;
            ca[0] = cu_e2m1x2_bf16_mul<0>(wA[j], a8); ca[1] = cu_e2m1x2_bf16_mul<1>(wA[j], a8);
            ca[2] = cu_e2m1x2_bf16_mul<2>(wA[j], a8); ca[3] = cu_e2m1x2_bf16_mul<3>(wA[j], a8);
            cb[0] = cu_e2m1x2_bf16_mul<0>(wB[j], b8); cb[1] = cu_e2m1x2_bf16_mul<1>(wB[j], b8);
            cb[2] = cu_e2m1x2_bf16_mul<2>(wB[j], b8); cb[3] = cu_e2m1x2_bf16_mul<3>(wB[j], b8);
#else
            tc_pairs(wA[j], ca);
            tc_pairs(wB[j], cb);
#endif
        } else {
            const uint32_t a8 = wA[j] >> 8, b8 = wB[j] >> 8;
            ca[0] = cu_e2m1x2_bf16_mul<0>(wA[j], a8); ca[1] = cu_e2m1x2_bf16_mul<1>(wA[j], a8);
            ca[2] = cu_e2m1x2_bf16_mul<2>(wA[j], a8); ca[3] = cu_e2m1x2_bf16_mul<3>(wA[j], a8);
            cb[0] = cu_e2m1x2_bf16_mul<0>(wB[j], b8); cb[1] = cu_e2m1x2_bf16_mul<1>(wB[j], b8);
            cb[2] = cu_e2m1x2_bf16_mul<2>(wB[j], b8); cb[3] = cu_e2m1x2_bf16_mul<3>(wB[j], b8);
        }
        const uint32_t pa0 = cu_mul_bf16x2(ca[0], sA), pa1 = cu_mul_bf16x2(ca[1], sA);
        const uint32_t pa2 = cu_mul_bf16x2(ca[2], sA), pa3 = cu_mul_bf16x2(ca[3], sA);
        const uint32_t pb0 = cu_mul_bf16x2(cb[0], sB), pb1 = cu_mul_bf16x2(cb[1], sB);
        const uint32_t pb2 = cu_mul_bf16x2(cb[2], sB), pb3 = cu_mul_bf16x2(cb[3], sB);
        /* x[8j .. 8j+7] of the lane's 32 as 4 bf16 pairs; B pairs (i, i+4) */
        const uint32_t X[4] = {xv[j].x, xv[j].y, xv[j].z, xv[j].w};
        cu_mma_bf16(acc, pa0, pb0, pa1, pb1, __byte_perm(X[0], X[2], 0x5410), __byte_perm(X[0], X[2], 0x7632));
        cu_mma_bf16(acc, pa2, pb2, pa3, pb3, __byte_perm(X[1], X[3], 0x5410), __byte_perm(X[1], X[3], 0x7632));
    }
}

#ifndef QMMA_PDL_PREFETCH
#define QMMA_PDL_PREFETCH 1 /* 0: no weight prefetch before the PDL wait (measured variant) */
#endif

#ifndef QMMA_WPRE
#define QMMA_WPRE 1 /* K steps of a warp's tiled weights read into registers before the PDL wait (0: none; 2
                       * spills 212 bytes within the launch bounds' 64 registers) */
#endif
#define QMMA_WPRE_N (QMMA_WPRE > 0 ? QMMA_WPRE : 1)

/* A warp's first QMMA_WPRE K steps of tiled weights (steps warp, warp + W, ...: the kernel's order),
 * read before the wait. */
struct qmma_wpre {
    uint4 wa[QMMA_WPRE_N], wb[QMMA_WPRE_N];
    uint32_t sr[QMMA_WPRE_N];
};

/* The kernel's PDL entry. pf (set by the launcher for a plain linear, E = 1): bit 0 set, bit 1 when
 * launched with PDL. The weights are read before the wait, i.e. under PDL while the previous kernel
 * (a norm, the conv, a combine: little DRAM traffic) still runs. Weights are uploaded once and never
 * written by a kernel, so reading them early is safe; x, idx and y are touched only after
 * cu_pdl_entry(). Two parts:
 * - tiled weights (pf bit 0, with or without PDL, so that the tests run this path): each warp's
 *   first QMMA_WPRE pieces into registers (returned; with E = 1 every segment of the block uses the
 *   same ones, so they serve all of them). For the decode linears of nemotron_h (16 warps, K <= 4096:
 *   at most 2 steps a warp) that is half or more of the block's weights.
 * - (pf bit 1) the slot-0 block of a tile also asks for the tile's whole weight range (16 rows x K/2 bytes,
 *   one contiguous range; tiled: the tile's pieces) into L2 by one cp.async.bulk.prefetch.L2 (what
 *   the registers do not hold, e.g. the lm_head's 6 steps a warp). PTX ISA
 *   "cp.async.bulk.prefetch": 16-byte aligned address (gq_qmv_mma_fits: codes % 16 == 0) and size
 *   (K % 32 == 0). */
__device__ __forceinline__ qmma_wpre qmma_pdl_entry(const gq_args &a, int pf) {
    qmma_wpre wp = {};
#if QMMA_PDL_PREFETCH
    if ((pf & 2) && threadIdx.x == 0) {
        const int ntile = (a.N + 15) >> 4;
        if ((int)(blockIdx.x / ntile) == 0) {
            const int tile = (int)(blockIdx.x % ntile), n0 = tile * 16, rows = min(16, a.N - n0);
            const uint8_t *p = a.tiled ? gq_tiled_piece(a.codes, 0, tile, 0, a.N, a.K) : a.codes + (int64_t)n0 * (a.K >> 1);
            const uint32_t bytes = a.tiled ? (uint32_t)(gq_tiled_nsteps(a.K) * GQ_TILE_PIECE)
                                           : (uint32_t)rows * (uint32_t)(a.K >> 1);
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
        }
    }
#endif
#if QMMA_WPRE
    if ((pf & 1) && a.tiled) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (int)(blockDim.x >> 5);
        const int ntile = (a.N + 15) >> 4, nsteps = (int)gq_tiled_nsteps(a.K);
        const uint8_t *tb = gq_tiled_piece(a.codes, cu_weight_expert(0, a.E), (int)(blockIdx.x % ntile), 0, a.N, a.K);
#pragma unroll
        for (int j = 0; j < QMMA_WPRE; j++) {
#ifdef FP4MOE_INJECT_FAULT_QMMA_WPRE /* deliberate fault (tests must catch it): a warp's pieces shifted by one */
            const int stp = warp + j * nw + 1;
#else
            const int stp = warp + j * nw;
#endif
            if (stp < nsteps) {
                const uint8_t *sp = tb + (int64_t)stp * GQ_TILE_PIECE;
                wp.wa[j] = cu_ld_stream16(sp + lane * 16);
                wp.wb[j] = cu_ld_stream16(sp + 512 + lane * 16);
                wp.sr[j] = __ldg(reinterpret_cast<const uint32_t *>(sp + 1024) + lane);
            }
        }
    }
#endif
    cu_pdl_entry();
    return wp;
}

/* The x row of sorted row s + r: that row, or row 0 for every row (a.xbcast: one token's routed
 * experts read the token's row itself, with no gathered copy). */
__device__ __forceinline__ int64_t qmma_xrow(const gq_args &a, int s, int r) {
#ifdef FP4MOE_INJECT_FAULT_XBCAST /* deliberate fault (tests must catch it): segments after the first read row 1 */
    if (a.xbcast) return s > 0 ? 1 : 0;
#else
    if (a.xbcast) return 0;
#endif
    return (int64_t)(s + r);
}

/* TL: the weights in the tiled layout (gather_cuda.cuh): a lane's step is two 16-byte loads and one
 * 4-byte load from one 1,152-byte piece; the same decode, mma chain, warp order and epilogue, so the
 * same bits as the checkpoint layout's (bench/gpu_qmv_tiled measured it so). */
template <typename TY, int W, bool TL>
__global__ void __launch_bounds__(W * 32, (QMMA_MINB * 4 / W) > 0 ? (QMMA_MINB * 4 / W) : 1)
gq_qmv_mma_kernel(gq_args a, int slots, int pf) {
    const qmma_wpre wp = qmma_pdl_entry(a, pf);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, r = lane >> 2, q = lane & 3;
    const int ntile = (a.N + 15) >> 4;
    const int n0 = (int)(blockIdx.x % ntile) * 16, slot = (int)(blockIdx.x / ntile);
    const int K = a.K, KB = K >> 4, nchunk = K >> 5, nsteps = (nchunk + 3) >> 2;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    TY *y = static_cast<TY *>(a.y);
    __shared__ float red[QMMA_WARPS - 1][4][32];
    /* the segments of the rows (every warp of the block finds the same ones) */
    const int nrows = a.B;
    const bool valid = lane < nrows;
    const uint32_t v = valid ? __ldg(a.idx + lane) : 0xffffffffu;
    const uint32_t prev = __shfl_up_sync(FULL, v, 1);
    const uint32_t heads = __ballot_sync(FULL, valid && (lane == 0 || v != prev));
    const int run0 = 31 - __clz(heads & (FULL >> (31 - lane)));
    uint32_t segs = __ballot_sync(FULL, valid && ((lane - run0) % 8) == 0);
    for (int i = 0; i < slot && segs; i++) segs &= segs - 1;
    while (segs) {
        const int s = __ffs(segs) - 1;
        const uint32_t rest = segs & (segs - 1);
        const int len = (rest ? __ffs(rest) - 1 : nrows) - s;
        const uint32_t e = __shfl_sync(FULL, v, s);
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (TL && e < (uint32_t)a.E) {
            const uint8_t *tb = gq_tiled_piece(a.codes, cu_weight_expert(e, a.E), n0 >> 4, 0, a.N, K);
            const bool hasx = r < len;
            const __nv_bfloat16 *xr = x + qmma_xrow(a, s, hasx ? r : 0) * K;
            int stp = warp;
#if QMMA_WPRE
            if (pf & 1) { /* E = 1: the pieces read before the wait (qmma_pdl_entry) are this segment's too */
#pragma unroll
                for (int j = 0; j < QMMA_WPRE; j++, stp += QMMA_WARPS)
                    if (stp < nsteps) {
                        const int c = stp * 4 + q;
                        qmma_step<true>(acc, wp.wa[j], wp.wb[j], wp.sr[j], c < nchunk && hasx ? xr + (int64_t)c * 32 : nullptr);
                    }
            }
#else
            (void)wp;
#endif
            for (; stp < nsteps; stp += QMMA_WARPS) {
                const uint8_t *sp = tb + (int64_t)stp * GQ_TILE_PIECE;
                const uint4 wa = cu_ld_stream16(sp + lane * 16), wb = cu_ld_stream16(sp + 512 + lane * 16);
                const uint32_t sr = __ldg(reinterpret_cast<const uint32_t *>(sp + 1024) + lane);
                const int c = stp * 4 + q;
                qmma_step<true>(acc, wa, wb, sr, c < nchunk && hasx ? xr + (int64_t)c * 32 : nullptr);
            }
        } else if (!TL && e < (uint32_t)a.E) {
            const int64_t wrow = cu_weight_expert(e, a.E) * a.N;
            const int fa = min(n0 + r, a.N - 1), fb = min(n0 + r + 8, a.N - 1);
            const uint8_t *ca = a.codes + (wrow + fa) * (int64_t)(K >> 1), *cb = a.codes + (wrow + fb) * (int64_t)(K >> 1);
            const uint8_t *sa = a.scales + (wrow + fa) * (int64_t)KB, *sb = a.scales + (wrow + fb) * (int64_t)KB;
            const bool hasx = r < len;
            const __nv_bfloat16 *xr = x + qmma_xrow(a, s, hasx ? r : 0) * K;
            for (int st0 = warp; st0 < nsteps; st0 += QMMA_WARPS * QMMA_PM) {
                uint4 wa[QMMA_PM], wb[QMMA_PM];
                uint32_t sr[QMMA_PM];
#pragma unroll
                for (int p = 0; p < QMMA_PM; p++) { /* every code load of the batch first */
                    const int c = (st0 + p * QMMA_WARPS) * 4 + q;
                    if (c < nchunk) {
                        wa[p] = cu_ld_stream16(ca + (int64_t)c * 16);
                        wb[p] = cu_ld_stream16(cb + (int64_t)c * 16);
                        sr[p] = qmma_scale_bytes(sa, sb, c);
                    } else {
                        wa[p] = wb[p] = make_uint4(0u, 0u, 0u, 0u); /* zero codes: zero A */
                        sr[p] = 0u;
                    }
                }
#pragma unroll
                for (int p = 0; p < QMMA_PM; p++) {
                    const int stp = st0 + p * QMMA_WARPS;
                    if (stp >= nsteps) break; /* warp-uniform */
                    const int c = stp * 4 + q;
                    qmma_step<false>(acc, wa[p], wb[p], sr[p], c < nchunk && hasx ? xr + (int64_t)c * 32 : nullptr);
                }
            }
        }
        /* the partial tiles of the warps, summed in warp order */
        if (warp > 0)
#pragma unroll
            for (int i = 0; i < 4; i++) red[warp - 1][i][lane] = acc[i];
        __syncthreads();
        if (warp == 0) {
#pragma unroll
            for (int w = 1; w < QMMA_WARPS; w++)
#pragma unroll
                for (int i = 0; i < 4; i++) acc[i] += red[w - 1][i][lane];
            const float mult = e < (uint32_t)a.E ? cu_expert_gs(a.gs, e) * 0x1p8f : 0.0f;
#pragma unroll
            for (int i = 0; i < 4; i++) { /* c0, c1: feature r, rows 2q, 2q+1; c2, c3: feature r + 8 */
                const int f = n0 + r + (i >> 1) * 8, t = 2 * q + (i & 1);
                if (t < len && f < a.N) y[(int64_t)(s + t) * a.N + f] = cu_out<TY>(e < (uint32_t)a.E ? acc[i] * mult : 0.0f, a.relu2);
            }
        }
        __syncthreads(); /* red is reused by the next segment */
        for (int i = 0; i < slots && segs; i++) segs &= segs - 1;
    }
}

bool gq_qmv_mma_fits(const gq_args *a) {
    return a->B <= QMV_CHUNK && (a->K % 32) == 0 && ((uintptr_t)a->codes & 15) == 0 &&
           ((uintptr_t)a->x & 15) == 0;
}

/* Warps per block (K split W ways): enough warps in the grid to fill the GPU (~16 per SM) when
 * there are few 16-feature tiles (the dense decode linears: out_proj has 168), never more than the
 * K steps. */
template <typename TY>
static int launch_mma(const gq_args *a, int slots, cudaStream_t st) {
    int dev = 0, sms = 0;
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetDevice(&dev), "cudaGetDevice");
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                    "cudaDeviceGetAttribute");
    const int64_t blocks = (int64_t)((a->N + 15) / 16) * slots;
    const int nsteps = (a->K / 32 + 3) / 4;
#ifdef QMMA_FIXED_W
    const int w = QMMA_FIXED_W;
#else
    int w = 4;
    while (w < 16 && blocks * w < (int64_t)QMMA_WPSM * sms && 2 * w <= nsteps) w *= 2;
#endif
    const unsigned grid = (unsigned)blocks;
    const int pf = a->E == 1 ? 1 | (cu_pdl_on(st) ? 2 : 0) : 0; /* qmma_pdl_entry: weights before the wait */
    if (a->tiled) {
        if (w == 16) cu_launch(gq_qmv_mma_kernel<TY, 16, true>, grid, 16 * 32, 0, st, *a, slots, pf);
        else if (w == 8) cu_launch(gq_qmv_mma_kernel<TY, 8, true>, grid, 8 * 32, 0, st, *a, slots, pf);
        else cu_launch(gq_qmv_mma_kernel<TY, 4, true>, grid, 4 * 32, 0, st, *a, slots, pf);
    } else {
        if (w == 16) cu_launch(gq_qmv_mma_kernel<TY, 16, false>, grid, 16 * 32, 0, st, *a, slots, pf);
        else if (w == 8) cu_launch(gq_qmv_mma_kernel<TY, 8, false>, grid, 8 * 32, 0, st, *a, slots, pf);
        else cu_launch(gq_qmv_mma_kernel<TY, 4, false>, grid, 4 * 32, 0, st, *a, slots, pf);
    }
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the qmv (mma) kernel");
    return FP4MOE_OK;
}

int gq_launch_qmv_mma(const gq_args *a, bool f32out, cudaStream_t st) {
    const int slots = a->B < QMV_SLOTS ? a->B : QMV_SLOTS;
    const int64_t ntile = (a->N + 15) / 16;
    if (ntile * slots > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: qmv grid too large (N=%d)", a->N);
    return f32out ? launch_mma<float>(a, slots, st) : launch_mma<__nv_bfloat16>(a, slots, st);
}

template <typename T, int G, int NF, int V>
static int launch_g(const gq_args *a, cudaStream_t st) {
    const int64_t chunks = ((int64_t)a->B + QMV_CHUNK - 1) / QMV_CHUNK;
    const int slots = a->B < QMV_SLOTS ? a->B : QMV_SLOTS;
    const int64_t nblk = (a->N + QMV_WARPS * NF - 1) / (QMV_WARPS * NF);
    if (nblk * slots > 0x7fffffff)
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: qmv grid too large (N=%d)", a->N);
    const dim3 grid((unsigned)(nblk * slots), (unsigned)(chunks < 65535 ? chunks : 65535));
    const bool v16 = (a->K % 32) == 0 && ((uintptr_t)a->codes & 15) == 0;
    if (v16) cu_launch(gq_qmv_kernel<T, 2, G, NF, V>, grid, QMV_WARPS * 32, 0, st, *a, slots);
    else cu_launch(gq_qmv_kernel<T, 1, G, NF, V>, grid, QMV_WARPS * 32, 0, st, *a, slots);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the qmv kernel");
    return FP4MOE_OK;
}

/* Decode-sized batches (B <= 32): segments of one row and 4 features per warp (more weight bytes in
 * flight per warp, fewer waves); larger batches: segments of up to 8 rows sharing each weight
 * load, 2 features per warp. */
template <typename T>
static int launch(const gq_args *a, cudaStream_t st) {
    return a->B <= QMV_CHUNK ? launch_g<T, 1, 4, 4>(a, st) : launch_g<T, QMV_G, 2, 4>(a, st);
}

int gq_launch_qmv(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    if (a->tiled) { /* only the tensor-core qmv reads the tiled layout */
        if (dtype == FP4MOE_BF16 && gq_qmv_mma_fits(a)) return gq_launch_qmv_mma(a, false, st);
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: tiled weights on the qmv route need bf16 x, "
                                "at most %d rows and K %% 32 == 0 (B=%d K=%d)", QMV_CHUNK, a->B, a->K);
    }
    switch (dtype) {
    case FP4MOE_F32: return launch<float>(a, st);
    case FP4MOE_F16: return launch<__half>(a, st);
    default:
        if (gq_qmv_mma_fits(a)) return gq_launch_qmv_mma(a, false, st);
        return launch<__nv_bfloat16>(a, st);
    }
}

/* ---- the tiled layout (gather_cuda.cuh) ---------------------------------------------------------- */

/* Thread (e, tile, step, lane) writes the lane's 16 + 16 code bytes and its scale word. */
__global__ void gq_relayout_kernel(const uint8_t *__restrict__ codes, const uint8_t *__restrict__ scales, int64_t E,
                                   int N, int K, uint8_t *__restrict__ out) {
    cu_pdl_entry();
    const int64_t ntile = (N + 15) >> 4, nchunk = K >> 5, nsteps = gq_tiled_nsteps(K), KB = K >> 4;
    const int64_t total = E * ntile * nsteps * 32;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        const int lane = (int)(i & 31), r = lane >> 2, q = lane & 3;
        const int64_t piece = i >> 5; /* (e * ntile + tile) * nsteps + step */
        const int64_t step = piece % nsteps, tile = (piece / nsteps) % ntile, e = piece / nsteps / ntile;
        const int64_t c = step * 4 + q, fa = tile * 16 + r, fb = fa + 8;
        uint4 wa = make_uint4(0, 0, 0, 0), wb = make_uint4(0, 0, 0, 0);
        uint32_t a0 = 0, a1 = 0, b0 = 0, b1 = 0; /* E4M3 scale bytes: blocks 2c, 2c + 1 of rows fa, fb */
        if (c < nchunk) {
            if (fa < N) {
                wa = *reinterpret_cast<const uint4 *>(codes + (e * N + fa) * (int64_t)(K >> 1) + c * 16);
                a0 = scales[(e * N + fa) * KB + 2 * c];
                a1 = scales[(e * N + fa) * KB + 2 * c + 1];
            }
            if (fb < N) {
                wb = *reinterpret_cast<const uint4 *>(codes + (e * N + fb) * (int64_t)(K >> 1) + c * 16);
                b0 = scales[(e * N + fb) * KB + 2 * c];
                b1 = scales[(e * N + fb) * KB + 2 * c + 1];
            }
        }
        /* the scales re-encoded, their sign and zero folded into the codes (tiled_codes.h) */
        uint32_t sr = tc_scale_code(a0) | tc_scale_code(a1) << 8 | tc_scale_code(b0) << 16 | tc_scale_code(b1) << 24;
#ifdef FP4MOE_INJECT_FAULT_TILED_SCALE /* deliberate fault (tests must catch it): rows r / r + 8 scales swapped */
        sr = sr >> 16 | sr << 16;
#endif
        uint8_t *p = out + piece * GQ_TILE_PIECE;
        wa = make_uint4(tc_arrange(tc_block_word(wa.x, a0)), tc_arrange(tc_block_word(wa.y, a0)),
                        tc_arrange(tc_block_word(wa.z, a1)), tc_arrange(tc_block_word(wa.w, a1)));
        wb = make_uint4(tc_arrange(tc_block_word(wb.x, b0)), tc_arrange(tc_block_word(wb.y, b0)),
                        tc_arrange(tc_block_word(wb.z, b1)), tc_arrange(tc_block_word(wb.w, b1)));
        *reinterpret_cast<uint4 *>(p + lane * 16) = wa;
        *reinterpret_cast<uint4 *>(p + 512 + lane * 16) = wb;
        *reinterpret_cast<uint32_t *>(p + 1024 + lane * 4) = sr;
    }
}

int gq_relayout_tiled(const uint8_t *codes, const uint8_t *scales, int64_t E, int64_t N, int64_t K, uint8_t *out,
                      cudaStream_t st) {
    if (K % 32 != 0 || N <= 0 || E <= 0 || N > INT_MAX || K > INT_MAX || ((uintptr_t)codes & 15) || ((uintptr_t)out & 15))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: tiled layout of E=%lld N=%lld K=%lld (K %% 32 "
                                "== 0 and 16-byte aligned codes needed)", (long long)E, (long long)N, (long long)K);
    cu_launch(gq_relayout_kernel, 2048, 256, 0, st, codes, scales, E, (int)N, (int)K, out);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the tiled-layout kernel");
    return FP4MOE_OK;
}

extern "C" int64_t cuda_nvfp4_tiled_expert_bytes(int64_t N, int64_t K) { return gq_tiled_expert_bytes(N, K); }

extern "C" int cuda_nvfp4_relayout_tiled(void *stream, const uint8_t *codes, const uint8_t *scales, int64_t E,
                                         int64_t N, int64_t K, void *out) {
    return gq_relayout_tiled(codes, scales, E, N, K, (uint8_t *)out, (cudaStream_t)stream);
}
