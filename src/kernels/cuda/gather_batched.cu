/* The expert-batched gather_qmm route on tensor cores (sorted idx; f16 / bf16 activations).
 * Contract: docs/spec/NVFP4.md section 4; design notes and measurements: docs/GPU-NOTES.md.
 *
 * Work item = (expert e, row-tile of e's run, N-tile of 64 output features). The runs kernel
 * (gather_qmm_cuda.cu) finds each expert's run [starts[e], starts[e+1]) and the prefix sum of
 * row-tiles per expert on the device - or the router's sort made them with idx (gq_runs: one MoE
 * layer's up and down projections then launch no runs kernel; H100, session 33: prefill 512 + 128
 * 32,898 -> 33,318 tok/s, 2,048 + 32 48,929 -> 49,628, 64-sequence decode 5,269 -> 5,319, the same
 * bits; docs/PERFORMANCE.md); this kernel is a persistent grid that walks the items in
 * the order (expert, N-tile, row-tile), so the row-tiles of one weight tile run side by side and
 * a weight tile comes from HBM once per row-tile at most (from L2 after the first).
 *
 * Per item, 8 warps (32-row tiles; 4 warps for 64- and 8-row tiles); warp w owns features n0 + 16w .. +15,
 * (bf16 calls on tiled weights run their 32-row tiles on gq_batched_w32_kernel, 32 features a warp,
 * and their 64-row tiles on wgmma: both below, bitwise the same outputs)
 * the mma M side. The run's token rows are the mma N side (n8 tiles; a step specialised on the
 * number of n8 tiles the run fills, so no mma is issued for empty ones). K advances in steps of 128
 * (8 NVFP4 blocks):
 *  - thread (g = lane/4, t = lane%4) copies, for its rows g and g+8, blocks 2t and 2t+1 of the step
 *    (16 code bytes each, one cp.async) and the 4-byte word holding their scale bytes into a private
 *    shared-memory ring, 3 steps ahead (fast path, K % 64 == 0; otherwise 8-byte register loads one
 *    step ahead);
 *  - codes become f16x2/bf16x2 pairs by bit operations (gather_cuda.cuh), pair i of a 32-bit word
 *    holding codes (i, i+4), times the block scale (one packed multiply per pair, exact); words of the
 *    tiled layout are stored with their bits arranged so that the bf16 pairs take 8 instructions a word
 *    instead of 13 (src/kernels/tiled_codes.h, bt_dec4::pairs_tl; the same pairs, bit for bit);
 *  - the mma's k16 slots of thread t therefore hold K indices 32t + {8q + i, 8q + i + 4}; the x tile
 *    in shared memory is stored with the same permutation (four byte-permutes per 16-byte piece
 *    when it is written) so that one 16-byte shared load gives the B fragments of two k16 steps;
 *  - fp32 accumulators; global scale and the power of two of the scale trick in the epilogue.
 * Kernel version 4 (v3 was measured against it in round 4, docs/GPU-NOTES.md) decodes with fewer instructions
 * (bt_dec4: one integer multiply per bf16 pair, byte permutes for f16 pairs, one paired E4M3
 * convert per row and step); everything else is shared.
 * Rows of a partial last n8 tile read a copy of the run's last row (results discarded); K past the
 * end is zero in both operands; features past N read row N-1 (results discarded).
 *
 * "qmv, tiled by 8 rows" (gq_launch_qmv_tiled): the qmv route for sorted input with B >=
 * FP4MOE_BATCHED_MIN_ROWS runs this same kernel with 8-row tiles, i.e. it re-reads an expert's
 * weights for every 8 rows of its run (the naive baseline the expert-batched route is measured
 * against). One output element's arithmetic does not depend on the row tile: the same decode and
 * block-scale products, the same K order (steps of 128, then k16 steps 0..7, one mma chain per
 * element, fp32 accumulator from 0, no split-K), the same epilogue (acc * gs * 2^kshift, one
 * rounding to T). Only the neighbours in the tile change, and an mma output element depends only
 * on its A row, B column and C element. So route qmv and route batched give bitwise identical
 * outputs on sorted input (tests/gpu/test_gather_qmm_gpu.c checks it), and greedy decoding does
 * not change with FP4MOE_GATHER_EXPERT_BATCHED. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "kernels/cuda/gather_cuda.cuh"
#include "kernels/cuda/cuda_launch.cuh"
#include "kernels/cuda/wgmma_rs.cuh"

#define BT_KSTEP 128   /* K per pipeline step */
#define BT_XROW 288    /* bytes per token row of the x tile: 256 + swizzle room + padding */

/* f16 or bf16: the code bit trick, the scale power of two, the packed multiply and the mma. */
template <typename T> struct bt_ops;

template <> struct bt_ops<__half> {
    static constexpr float kUndo = 128.0f; /* A = e2m1*2^-14 * (s*2^7) = e2m1*s*2^-7 */
    template <int I> __device__ static uint32_t code2(uint32_t w) { return cu_e2m1x2_f16<I>(w); }
    __device__ static uint32_t scale2(float s) {
        const __half2 h = __float2half2_rn(s * 128.0f); /* s <= 448: s*2^7 <= 57344, exact */
        return *reinterpret_cast<const uint32_t *>(&h);
    }
    __device__ static uint32_t mul2(uint32_t a, uint32_t b) { return cu_mul_f16x2(a, b); }
    __device__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                               uint32_t b0, uint32_t b1) {
        cu_mma_f16(d, a0, a1, a2, a3, b0, b1);
    }
};

template <> struct bt_ops<__nv_bfloat16> {
    static constexpr float kUndo = 256.0f; /* A = e2m1*2^-126 * (s*2^118) = e2m1*s*2^-8 */
    template <int I> __device__ static uint32_t code2(uint32_t w) { return cu_e2m1x2_bf16<I>(w); }
    __device__ static uint32_t scale2(float s) {
        const __nv_bfloat162 h = __float2bfloat162_rn(s * 0x1p118f); /* < 2^127, exact */
        return *reinterpret_cast<const uint32_t *>(&h);
    }
    __device__ static uint32_t mul2(uint32_t a, uint32_t b) { return cu_mul_bf16x2(a, b); }
    __device__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                               uint32_t b0, uint32_t b1) {
        cu_mma_bf16(d, a0, a1, a2, a3, b0, b1);
    }
};

/* v4 (round 4, docs/GPU-NOTES.md): the A pairs of a code word and the scale pair with fewer
 * instructions. pairs(): word w -> the four A operand pairs p[0..3]; k16 step 2q of word q uses
 * (p0, p1), step 2q+1 uses (p2, p3), and the x tile holds the same K pairs (xstage::store).
 *  - bf16: pairs (i, i+4) as in v3, by one integer multiply per pair (cu_e2m1x2_bf16_mul); a word of the
 *    tiled layout by pairs_tl (tc_pairs: 8 instructions a word; session 32 on the H200: the w32 gather
 *    0.360 -> 0.341 ms at 512 tokens, prefill 512 +3.7%, decode +5.2%, docs/PERFORMANCE.md);
 *  - f16: pairs (0,2), (4,6), (1,3), (5,7) from the high bytes of the codes and a byte permute.
 * scales(): the two E4M3 scale bytes of a thread's row (low byte: block 2t) -> one packed pair
 * (low: block 2t) times the power of two of bt_ops (one paired fp8 convert for both). */
template <typename T> struct bt_dec4;
template <> struct bt_dec4<__half> {
    __device__ static void pairs(uint32_t w, uint32_t (&p)[4]) {
        const uint32_t lo = cu_e2m1_hb_lo(w), hi = cu_e2m1_hb_hi(w);
        p[0] = cu_hb_pair_f16<0>(lo); /* codes 0, 2 */
        p[1] = cu_hb_pair_f16<1>(lo); /* codes 4, 6 */
        p[2] = cu_hb_pair_f16<0>(hi); /* codes 1, 3 */
        p[3] = cu_hb_pair_f16<1>(hi); /* codes 5, 7 */
    }
    /* a word of the tiled layout (tc_arrange): its checkpoint word's pairs */
    __device__ static void pairs_tl(uint32_t a, uint32_t (&p)[4]) { pairs(tc_unarrange(a), p); }
    __device__ static __half2 scales(uint32_t b16) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(b16 & 0xffffu), __NV_E4M3);
        return __hmul2(__half2(h), __float2half2_rn(128.0f)); /* s * 2^7 <= 57344: exact */
    }
    /* the same pair from the tiled layout's scale codes (tiled_codes.h: a byte permute and an IMAD) */
    __device__ static __half2 scales_tl(uint32_t b16) {
        const uint32_t u = tc_scale_f16x2(b16, 0x4140u);
        return *reinterpret_cast<const __half2 *>(&u);
    }
    __device__ static uint32_t lo2(__half2 s) { const __half2 r = __low2half2(s); return *reinterpret_cast<const uint32_t *>(&r); }
    __device__ static uint32_t hi2(__half2 s) { const __half2 r = __high2half2(s); return *reinterpret_cast<const uint32_t *>(&r); }
};
template <> struct bt_dec4<__nv_bfloat16> {
    __device__ static void pairs(uint32_t w, uint32_t (&p)[4]) {
        const uint32_t w8 = w >> 8;
        p[0] = cu_e2m1x2_bf16_mul<0>(w, w8); /* codes 0, 4 */
        p[1] = cu_e2m1x2_bf16_mul<1>(w, w8); /* codes 1, 5 */
        p[2] = cu_e2m1x2_bf16_mul<2>(w, w8); /* codes 2, 6 */
        p[3] = cu_e2m1x2_bf16_mul<3>(w, w8); /* codes 3, 7 */
    }
    /* a word of the tiled layout (tc_arrange): the same four pairs from 8 instructions */
    __device__ static void pairs_tl(uint32_t a, uint32_t (&p)[4]) {
#ifdef FP4MOE_INJECT_FAULT_TILED_CODES /* deliberate fault (tests must catch it): the checkpoint decode */
        pairs(a, p);
#else
        tc_pairs(a, p);
#endif
    }
    __device__ static __nv_bfloat162 scales(uint32_t b16) {
        const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(b16 & 0xffffu), __NV_E4M3);
        const float2 f = __half22float2(__half2(h));
        return __floats2bfloat162_rn(f.x * 0x1p118f, f.y * 0x1p118f); /* < 2^127: exact */
    }
    /* the same pair from the tiled layout's scale codes (tiled_codes.h: a byte permute and an IMAD instead of the
     * 13 instructions of a scale word's conversions above; session 35) */
    __device__ static __nv_bfloat162 scales_tl(uint32_t b16) {
        const uint32_t u = tc_scale_bf16x2(b16, 0x4140u);
        return *reinterpret_cast<const __nv_bfloat162 *>(&u);
    }
    __device__ static uint32_t lo2(__nv_bfloat162 s) {
        const __nv_bfloat162 r = __low2bfloat162(s);
        return *reinterpret_cast<const uint32_t *>(&r);
    }
    __device__ static uint32_t hi2(__nv_bfloat162 s) {
        const __nv_bfloat162 r = __high2bfloat162(s);
        return *reinterpret_cast<const uint32_t *>(&r);
    }
};

/* The four A pairs of a code word: of the tiled layout's arrangement (TL) or of the checkpoint's */
template <typename T, bool TL> __device__ __forceinline__ void bt_pairs(uint32_t w, uint32_t (&p)[4]) {
    if constexpr (TL) bt_dec4<T>::pairs_tl(w, p);
    else bt_dec4<T>::pairs(w, p);
}

/* The packed scale pairs of a step (bt_step's sa / sb) from the two scale bytes of rows g (sw0) and
 * g + 8 (sw1), low byte: block 2t; TL: the tiled layout's scale codes (tiled_codes.h). */
template <typename T, bool TL>
__device__ __forceinline__ void bt_scales4(uint32_t sw0, uint32_t sw1, uint32_t (&sa)[2], uint32_t (&sb)[2]) {
    const auto pa = TL ? bt_dec4<T>::scales_tl(sw0) : bt_dec4<T>::scales(sw0);
    const auto pb = TL ? bt_dec4<T>::scales_tl(sw1) : bt_dec4<T>::scales(sw1);
    sa[0] = bt_dec4<T>::lo2(pa); sa[1] = bt_dec4<T>::hi2(pa);
    sb[0] = bt_dec4<T>::lo2(pb); sb[1] = bt_dec4<T>::hi2(pb);
}

/* One scale byte as fp32: E4M3 (checkpoint layout) or the tiled layout's code (|s|; tiled_codes.h) */
template <bool TL> __device__ __forceinline__ float bt_scale_f32(uint32_t b) {
    return TL ? tc_scale_f32(b) : cu_e4m3_to_float(b);
}

/* One step's weights of one thread: blocks 2t, 2t+1 of rows g (c0) and g+8 (c1), scale bytes. */
struct bt_w {
    uint4 c0, c1;
    uint32_t s0, s1; /* byte 0: block 2t, byte 1: block 2t+1 */
};

/* Slow path (any K % 16, codes 8-byte aligned): 8-byte loads per block into registers. */
__device__ __forceinline__ bt_w bt_load_w(const uint8_t *crow0, const uint8_t *crow1, const uint8_t *srow0,
                                          const uint8_t *srow1, int kb, int KB) {
    bt_w r;
    r.c0 = r.c1 = make_uint4(0, 0, 0, 0);
    r.s0 = r.s1 = 0;
    if (kb < KB) {
        const uint2 a = cu_ld_stream8(crow0 + (int64_t)kb * 8), b = cu_ld_stream8(crow1 + (int64_t)kb * 8);
        r.c0.x = a.x; r.c0.y = a.y; r.c1.x = b.x; r.c1.y = b.y;
        r.s0 = __ldg(srow0 + kb);
        r.s1 = __ldg(srow1 + kb);
    }
    if (kb + 1 < KB) {
        const uint2 a = cu_ld_stream8(crow0 + (int64_t)kb * 8 + 8), b = cu_ld_stream8(crow1 + (int64_t)kb * 8 + 8);
        r.c0.z = a.x; r.c0.w = a.y; r.c1.z = b.x; r.c1.w = b.y;
        r.s0 |= (uint32_t)__ldg(srow0 + kb + 1) << 8;
        r.s1 |= (uint32_t)__ldg(srow1 + kb + 1) << 8;
    }
    return r;
}

/* The x tile of one step: MT token rows x 128 K, in 16-byte pieces (8 elements); thread `tid`
 * stages the pieces of rows tid/16 + i*(THREADS/16) at K offset 8*(tid%16) of every step, so the
 * source pointers are set once per item and only the K offset moves. */
template <typename T, int MT, int THREADS, int V> struct bt_xstage {
    static constexpr int NP = (MT * 16 + THREADS - 1) / THREADS; /* pieces per thread (rows past MT: none staged) */
    const T *src[NP];                            /* NULL: row past the last n8 tile, not staged */
    uint4 v[NP];
    int kc, dst;                                 /* K offset in the step; byte offset of piece 0 */

    /* xrow / xdiv: gq_args' row map (NULL: row b of x) */
    __device__ __forceinline__ void init(const T *x, int64_t row0, int rows, int rows_pad, int K,
                                         const uint32_t *xrow = nullptr, int xdiv = 1) {
        init_tid(threadIdx.x, x, row0, rows, rows_pad, K, xrow, xdiv);
    }
    /* the same with the staging thread's index tid < THREADS given (a group of a larger block) */
    __device__ __forceinline__ void init_tid(unsigned tid, const T *x, int64_t row0, int rows, int rows_pad, int K,
                                             const uint32_t *xrow = nullptr, int xdiv = 1) {
        const int c = tid & 15, grp = c >> 2;
        kc = c * 8;
        /* permuted group of thread t at byte 64t + 16*(t/2): conflict-free fragment loads */
        dst = (tid >> 4) * BT_XROW + grp * 64 + (grp >> 1) * 16 + (c & 3) * 16;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int r = (tid >> 4) + i * (THREADS / 16);
            const int rr = r < rows ? r : rows - 1; /* partial n8 tile: a copy of the last row */
            src[i] = r < rows_pad ? x + gq_x_row(xrow, xdiv, row0 + rr) * K + kc : nullptr;
        }
    }
    /* the pieces at K offset k0 + kc; CG: L2 loads (ld.global.cg) instead of the read-only path - an x written during
     * the kernel (the fused MoE kernel's h) */
    template <bool CG = false> __device__ __forceinline__ void load(int k0, int K) {
        const bool kok = k0 + kc < K;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            v[i] = make_uint4(0, 0, 0, 0); /* K past the end: zeros */
            if (src[i] && kok) {
                const uint4 *p = reinterpret_cast<const uint4 *>(src[i] + k0);
                v[i] = CG ? __ldcg(p) : __ldg(p);
            }
        }
    }
    /* elements (k0..k7) stored as (k0,k4),(k1,k5),(k2,k6),(k3,k7), like the decoded code pairs;
     * v4 f16: (k0,k2),(k4,k6),(k1,k3),(k5,k7) (bt_dec4<__half>) */
    __device__ __forceinline__ void store(uint8_t *xs) const {
        constexpr bool P2 = V == 4 && sizeof(T) == 2 && std::is_same<T, __half>::value;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            if (src[i]) {
                const uint4 w = v[i];
                uint4 o;
                if constexpr (P2) {
                    o.x = __byte_perm(w.x, w.y, 0x5410);
                    o.y = __byte_perm(w.z, w.w, 0x5410);
                    o.z = __byte_perm(w.x, w.y, 0x7632);
                    o.w = __byte_perm(w.z, w.w, 0x7632);
                } else {
                    o.x = __byte_perm(w.x, w.z, 0x5410);
                    o.y = __byte_perm(w.x, w.z, 0x7632);
                    o.z = __byte_perm(w.y, w.w, 0x5410);
                    o.w = __byte_perm(w.y, w.w, 0x7632);
                }
                *reinterpret_cast<uint4 *>(xs + dst + i * (THREADS / 16) * BT_XROW) = o;
            }
        }
    }
};

/* ---- the weight stream ------------------------------------------------------------------ */
#ifndef BT_STAGES
#define BT_STAGES 4 /* cp.async ring: 3 steps of weights in flight per thread (measured at 512 tokens, session 17:
                       3 the same within noise, 6 -1.7%) */
#endif

__device__ __forceinline__ uint32_t bt_smem_addr(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
/* cp.async of 16 (4) bytes; src_bytes = 0 fills zeros and reads nothing. (An L2 evict-first policy on these weight
 * copies, evict-last on the x loads, measured -0.4% / -0.8% at a 2,048-token prefill, session 27: not taken.) */
__device__ __forceinline__ void bt_cp16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void bt_cp4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void bt_cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void bt_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

/* Fast path (K % 64 == 0, codes 16-byte and scales 4-byte aligned): each thread copies its own
 * step data - 16 code bytes of rows g and g+8 and the 4-byte scale word holding its two scale bytes
 * of each row - into a private shared-memory slot of a BT_STAGES ring with cp.async, BT_STAGES-1
 * steps ahead. Private slots: no barrier is needed for the weights.
 * The ring is stored as arrays (bt_slot_soa<J>: the shared-memory addresses of a slot's c0 / c1 code
 * cells and s0 / s1 scale words): codes of rows g [J] x 16 bytes, of rows g + 8 [J] x 16 bytes, scale
 * words s0 [J] x 4 bytes, s1 [J] x 4 bytes - so the 32 lanes of a warp copy into and read from
 * consecutive 16- (4-) byte cells, free of bank conflicts (BT_SLOT_BYTES a slot). Slot j = stage *
 * (slots a stage) + the thread's index. Before, each slot was a 48-byte record (c0, c1, s0, s1):
 * Nsight Compute of the w32 kernel on records (session 22) counted 6x the ideal shared-memory
 * wavefronts on the cp.async copies into them and ~4x on the scale-word reads (a 48-byte stride puts
 * lanes l, l + 8, l + 16, l + 24 on one bank). Measured (docs/PERFORMANCE.md), same bits: session 22,
 * arrays in the w32 and wgmma kernels and gq_batched_kernel's 8- and 32-row tiles: prefill 512 + 128
 * +9.2%, 2,048 + 32 +4.8%, 128 + 64 +6.7%, 64-sequence decode +6.6%; session 23, the 64-row tiles too
 * (the last records): 64-sequence decode +0.9% (5,054.7 vs 5,007.7 tok/s), 128 + 64 prefill +1.0%; ptxas
 * spills 16 bytes in the tiled 64-row bf16 form instead of 36. */
#define BT_SLOT_BYTES 40
__device__ __forceinline__ uint4 bt_lds16(uint32_t a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ uint32_t bt_lds4(uint32_t a) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}

template <int J> struct bt_slot_soa {
    uint32_t a16, a4; /* ring + 16 j (codes of rows g), ring + 32 J + 4 j (scale word s0) */
    __device__ __forceinline__ static bt_slot_soa at(const uint8_t *ring, int j) {
        const uint32_t b = bt_smem_addr(ring);
        return {b + 16 * j, b + 32 * J + 4 * j};
    }
    __device__ __forceinline__ bt_slot_soa operator+(int d) const { return {a16 + 16 * d, a4 + 4 * d}; }
    __device__ __forceinline__ uint32_t c0() const { return a16; }
    __device__ __forceinline__ uint32_t c1() const { return a16 + 16 * J; }
    __device__ __forceinline__ uint32_t s0() const { return a4; }
    __device__ __forceinline__ uint32_t s1() const { return a4 + 4 * J; }
    __device__ __forceinline__ uint4 c0v() const { return bt_lds16(c0()); }
    __device__ __forceinline__ uint4 c1v() const { return bt_lds16(c1()); }
#ifdef FP4MOE_INJECT_FAULT_RING /* deliberate fault (tests must catch it): the next thread's scale word */
    __device__ __forceinline__ uint32_t s0v() const { return bt_lds4(s0() + 4); }
#else
    __device__ __forceinline__ uint32_t s0v() const { return bt_lds4(s0()); }
#endif
    __device__ __forceinline__ uint32_t s1v() const { return bt_lds4(s1()); }
};
template <typename S>
__device__ __forceinline__ void bt_issue(S slot, const uint8_t *crow0, const uint8_t *crow1,
                                         const uint8_t *srow0, const uint8_t *srow1, int step, int t, int KB) {
    const int kb = step * 8 + 2 * t, sb = step * 8 + 4 * (t >> 1);
    const int cb = kb < KB ? 16 : 0, ss = sb < KB ? 4 : 0; /* KB % 4 == 0: a word is in or out */
    const int kbc = kb < KB ? kb : 0, sbc = sb < KB ? sb : 0; /* keep the address valid */
    bt_cp16(slot.c0(), crow0 + (int64_t)kbc * 8, cb);
    bt_cp16(slot.c1(), crow1 + (int64_t)kbc * 8, cb);
    bt_cp4(slot.s0(), srow0 + sbc, ss);
    bt_cp4(slot.s1(), srow1 + sbc, ss);
}

/* Tiled layout (gather_cuda.cuh): the thread's 16 + 16 code bytes and its scale word (blocks 2c, 2c+1
 * of row g in the low half, of row g + 8 in the high half) from the step's piece. */
template <typename S> __device__ __forceinline__ void bt_issue_tiled(S slot, const uint8_t *piece, int lane) {
    bt_cp16(slot.c0(), piece + lane * 16, 16);
    bt_cp16(slot.c1(), piece + 512 + lane * 16, 16);
    bt_cp4(slot.s0(), piece + 1024 + lane * 4, 4);
}

/* A thread's weight stream of one item (fast path): its rows' codes and scales (checkpoint layout) or
 * the step-0 piece of its warp's tile (tiled layout). issue: step `step`'s copies into its ring slot
 * (none past the last step; the caller commits); read: the slot's code words and the thread's two
 * scale bytes of each row. */
template <bool TL> struct bt_wstream {
    const uint8_t *crow0, *crow1, *srow0, *srow1, *tpiece;
    int t, lane, KB;
    template <typename S> __device__ __forceinline__ void issue(S slot, int step, int nsteps) const {
        if (step >= nsteps) return;
        if (TL) bt_issue_tiled(slot, tpiece + (int64_t)step * GQ_TILE_PIECE, lane);
        else bt_issue(slot, crow0, crow1, srow0, srow1, step, t, KB);
    }
    template <typename S>
    __device__ __forceinline__ void read(S sl, uint32_t (&w0)[4], uint32_t (&w1)[4], uint32_t &sw0,
                                         uint32_t &sw1) const {
        const uint4 c0 = sl.c0v(), c1 = sl.c1v();
        const uint32_t s0 = sl.s0v();
        sw0 = TL ? s0 & 0xffffu : s0 >> (16 * (t & 1));
        sw1 = TL ? s0 >> 16 : sl.s1v() >> (16 * (t & 1));
        w0[0] = c0.x; w0[1] = c0.y; w0[2] = c0.z; w0[3] = c0.w;
        w1[0] = c1.x; w1[1] = c1.y; w1[2] = c1.z; w1[3] = c1.w;
    }
};

/* The tiled layout's weight stream of an item (the same copies as bt_issue_tiled): per-thread addresses fixed
 * once - pc = the thread's code cell of rows g in the step-0 piece (piece + 16 lane; rows g + 8 are 512 bytes
 * on), ps = its scale word (piece + 1024 + 4 lane) - so a step adds GQ_TILE_PIECE bytes instead of rebuilding
 * three addresses from the piece (gq_batched_w32_kernel: 1,457 -> 1,435 instructions in the K loop, 164 -> 154
 * registers; gq_batched_wg_kernel's 64-row form with the x changes: 377 -> 325 a step; cuobjdump -sass counts).
 * issue(): step `step`'s copies (none past the last step); issue_next(): the same for steps issued in order
 * 0, 1, 2, ... (pc and ps move a piece on per call: fewer registers where the kernel is near its bound). */
struct bt_tstream {
    const uint8_t *pc, *ps;
    __device__ __forceinline__ static bt_tstream of(const uint8_t *piece, int lane) {
        return {piece + lane * 16, piece + 1024 + lane * 4};
    }
    template <typename S> __device__ __forceinline__ void issue(S slot, int step, int nsteps) const {
        if (step >= nsteps) return;
        const int64_t o = (int64_t)step * GQ_TILE_PIECE;
        bt_cp16(slot.c0(), pc + o, 16);
        bt_cp16(slot.c1(), pc + o + 512, 16);
        bt_cp4(slot.s0(), ps + o, 4);
    }
    template <typename S> __device__ __forceinline__ void issue_next(S slot, int step, int nsteps) {
        if (step >= nsteps) return;
        bt_cp16(slot.c0(), pc, 16);
        bt_cp16(slot.c1(), pc + 512, 16);
        bt_cp4(slot.s0(), ps, 4);
        pc += GQ_TILE_PIECE;
#ifndef FP4MOE_INJECT_FAULT_TSTREAM /* deliberate fault (tests must catch it): the scale words stay at step 0 */
        ps += GQ_TILE_PIECE;
#endif
    }
    template <typename S>
    __device__ __forceinline__ void read(S sl, uint32_t (&w0)[4], uint32_t (&w1)[4], uint32_t &sw0, uint32_t &sw1) const {
        const uint4 c0 = sl.c0v(), c1 = sl.c1v();
        const uint32_t s0 = sl.s0v();
        sw0 = s0 & 0xffffu;
        sw1 = s0 >> 16;
        w0[0] = c0.x; w0[1] = c0.y; w0[2] = c0.z; w0[3] = c0.w;
        w1[0] = c1.x; w1[1] = c1.y; w1[2] = c1.z; w1[3] = c1.w;
    }
};

/* One 128-K step of one warp: 16 features x (8 * NTV) token rows. w0/w1: code words of rows g and
 * g+8 (blocks 2t, 2t+1); sa/sb: their packed scales; xb: this thread's x fragment base. */
template <typename T, int NTV, int MT, int V, bool TL>
__device__ __forceinline__ void bt_step(float (&acc)[MT / 8][4], const uint32_t (&w0)[4], const uint32_t (&w1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], const uint8_t *xb) {
    typedef bt_ops<T> ops;
#pragma unroll
    for (int q = 0; q < 4; q++) { /* word q: codes 8q..8q+7 of the thread's 32; k16 steps 2q, 2q+1 */
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1];
        /* A operand pairs: row g (ra) and row g+8 (rb); v3: codes (i, i+4) of word q; v4: bt_dec4 */
        uint32_t pa[4], pb[4];
        if constexpr (V == 4) {
            bt_pairs<T, TL>(w0[q], pa);
            bt_pairs<T, TL>(w1[q], pb);
        } else {
            const uint32_t u0 = TL ? tc_unarrange(w0[q]) : w0[q], u1 = TL ? tc_unarrange(w1[q]) : w1[q];
            pa[0] = ops::template code2<0>(u0); pa[1] = ops::template code2<1>(u0);
            pa[2] = ops::template code2<2>(u0); pa[3] = ops::template code2<3>(u0);
            pb[0] = ops::template code2<0>(u1); pb[1] = ops::template code2<1>(u1);
            pb[2] = ops::template code2<2>(u1); pb[3] = ops::template code2<3>(u1);
        }
        const uint32_t ra0 = ops::mul2(pa[0], s0), ra1 = ops::mul2(pa[1], s0);
        const uint32_t ra2 = ops::mul2(pa[2], s0), ra3 = ops::mul2(pa[3], s0);
        const uint32_t rb0 = ops::mul2(pb[0], s1), rb1 = ops::mul2(pb[1], s1);
        const uint32_t rb2 = ops::mul2(pb[2], s1), rb3 = ops::mul2(pb[3], s1);
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            const uint4 xf = *reinterpret_cast<const uint4 *>(xb + nt * 8 * BT_XROW + q * 16);
            ops::mma(acc[nt], ra0, rb0, ra1, rb1, xf.x, xf.y); /* k16 step 2q */
            ops::mma(acc[nt], ra2, rb2, ra3, rb3, xf.z, xf.w); /* k16 step 2q+1 */
        }
    }
}

template <typename T, int MT, int V, bool TL>
__device__ __forceinline__ void bt_step_ntv(int ntv, float (&acc)[MT / 8][4], const uint32_t (&w0)[4],
                                            const uint32_t (&w1)[4], const uint32_t (&sa)[2],
                                            const uint32_t (&sb)[2], const uint8_t *xb) {
    /* only the n8 tiles the run has: a specialised step per count (no predicated-off mma) */
    if constexpr (MT == 8) { /* one n8 tile */
        (void)ntv;
        bt_step<T, 1, MT, V, TL>(acc, w0, w1, sa, sb, xb);
    } else {
        switch (ntv) {
        case 1: bt_step<T, 1, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
        case 2: bt_step<T, 2, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
        case 3: bt_step<T, 3, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
        case 4: bt_step<T, 4, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
        default:
            if constexpr (MT > 32) {
                switch (ntv) {
                case 5: bt_step<T, 5, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
                case 6: bt_step<T, 6, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
                case 7: bt_step<T, 7, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
                default: bt_step<T, 8, MT, V, TL>(acc, w0, w1, sa, sb, xb); break;
                }
            }
        }
    }
}

#ifndef BT_MINB32
#define BT_MINB32 2 /* blocks an SM in the launch bounds of the 32-row tiles (3: 85 registers, 20 bytes spilled,
                       -2.2% prefill at 512 tokens on the H200, docs/PERFORMANCE.md session 17) */
#endif
/* warps per block: 8 for 32-row tiles (x staging shared by 128 features), 4 for 64-row tiles and
 * for the 8-row tiles of "qmv, tiled by 8 rows" (8 rows x 16 pieces = one x piece per thread) */
template <int MT> struct bt_cfg {
    static_assert(MT == 8 || MT == 32 || MT == 64, "row tile: 8, 32 or 64");
    static constexpr int WARPS = MT == 32 ? 8 : 4, THREADS = WARPS * 32, NTILE = WARPS * 16;
    static constexpr int XBYTES = 2 * MT * BT_XROW;                     /* double-buffered x tile */
    static constexpr int SMEM = XBYTES + BT_STAGES * THREADS * BT_SLOT_BYTES; /* + the weight ring */
    static constexpr int MINBLOCKS = MT == 32 ? BT_MINB32 : MT == 64 ? 3 : 4; /* 128 / 168 / 128 registers */
};

/* Work item `item` of a persistent grid over (expert, N-tile, row-tile) (NT N-tiles, MT-row tiles):
 * the expert e (the largest with tile_off[e] * NT <= item: it has tiles), its N-tile and first row,
 * and the item's rows (<= MT). SKIP > 0: the tiles start after the run's first n / SKIP * SKIP rows (n: its
 * length) - the remainder of a split run (gq_launch_runs_split with row tile SKIP, rem_off as tile_off). */
struct bt_item {
    int e, ntile, rows;
    int64_t row0;
};
template <int MT, int SKIP = 0>
__device__ __forceinline__ bt_item bt_item_of(int64_t item, int E, int NT, const int *starts, const int *tile_off) {
    int lo = 0, hi = E;
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if ((int64_t)tile_off[mid] * NT <= item) lo = mid;
        else hi = mid;
    }
    bt_item it;
    it.e = lo;
    const int tiles = tile_off[lo + 1] - tile_off[lo];
    const int64_t local = item - (int64_t)tile_off[lo] * NT;
    it.ntile = (int)(local / tiles);
    it.row0 = (int64_t)starts[lo] + (int64_t)(local % tiles) * MT;
    if constexpr (SKIP > 0) it.row0 += (starts[lo + 1] - starts[lo]) / SKIP * SKIP;
    it.rows = (int)min((int64_t)MT, (int64_t)starts[lo + 1] - it.row0);
    return it;
}

/* The order in which a persistent grid's blocks take the items. Static (ctr == nullptr): block b takes
 * items b, b + grid, b + 2 grid, ... Dynamic (ctr = tile_off + E + 1, zeroed by gq_runs_kernel or the sort): a
 * block's first item is blockIdx.x and each next one grid + the counter's next value, so a block that
 * finishes early takes more. Why: the static stride resonates with the item sizes - with 64-row tiles
 * most experts of a 2,048-token call have a full and a short tile, consecutive items alternate
 * between them, and an even stride hands one SM only full tiles and its neighbour only short ones (a
 * simulation of the items put the busiest SM 13-25% above the mean at 2,048 tokens, 3-9% at 512;
 * docs/GPU-NOTES.md, session 21). Measured on the H200 (bench/gpu_gather_wg, production up + down,
 * static -> dynamic): 2,048 tokens 1.32 -> 1.20 ms (uniform routing), 1.23 -> 1.17 (skewed); 8,192 tokens
 * 3.98 -> 3.84; 512 tokens 0.43 both (uniform), 0.490 -> 0.478 (skewed); end to end +2.6% prefill at
 * 2,048 tokens, +0.2% at 512 (+1.0% against the static order; docs/PERFORMANCE.md, session 21). The 8-row tiles and
 * the E = 1 launches keep the static order (launch, sched_counter).
 * Which block computes an item does not change its arithmetic: the outputs are the same bits in both
 * orders (FP4MOE_CUDA_GATHER_SCHED=static gives the static one; test_gather_qmm_gpu compares them).
 * Thread 0 fetches the next item when the block starts one (fetch) and every thread reads it after
 * that item's last barrier (next); the shared slot alternates between two entries, so the write for
 * item i + 2 comes after item i + 1's barriers, i.e. after every thread has read item i's entry. An
 * item must therefore contain at least one __syncthreads after fetch (each kernel has one after the first
 * x tile is stored, before its K loop, and one a K step). */
struct bt_sched {
    int *ctr;
    int par;
    /* total: the call's items. Every item a block starts fetches once, so the fetches number total and the one
     * that gets total - 1 is the last: it sets the counter back to 0 for the next kernel on the same runs (the
     * sort's gq_runs serve the up and the down projection). */
    __device__ __forceinline__ void fetch(int *slot, int64_t total) const {
        if (ctr && threadIdx.x == 0) {
            const int v = atomicAdd(ctr, 1);
            slot[par] = v;
#ifndef FP4MOE_INJECT_FAULT_SCHED_RESET /* deliberate fault (tests must catch it): the counter left at total */
            if ((int64_t)v == total - 1) atomicExch(ctr, 0);
#endif
        }
    }
    __device__ __forceinline__ int64_t next(int64_t item, const int *slot) {
        if (!ctr) return item + gridDim.x;
#ifdef FP4MOE_INJECT_FAULT_SCHED /* deliberate fault (tests must catch it): the counter's value after the increment (an item skipped a fetch) */
        const int64_t v = (int64_t)gridDim.x + slot[par] + 1;
#else
        const int64_t v = (int64_t)gridDim.x + slot[par];
#endif
        par ^= 1;
        return v;
    }
};

/* rows with idx >= E (the sorted tail [starts[E], B) of y, rows of N) are zeros; the grid strides */
template <typename TY>
__device__ __forceinline__ void bt_zero_tail(TY *y, const int *starts, int E, int B, int N) {
    const TY zero = cu_from_float<TY>(0.0f);
    const int64_t end = (int64_t)B * N;
    for (int64_t i = (int64_t)starts[E] * N + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < end;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = zero;
}

/* The epilogue of one warp's 16-feature tile (features nw .. nw + 15) of an MT-row item: thread (g, t)
 * holds features nw + g (acc[nt][h]) and nw + g + 8 (acc[nt][2 + h]) of rows 8 nt + 2t + h; y = acc x
 * mult (global scale x the power of two of the decode), relu^2 if asked, rows < rows and features < N
 * only. */
template <typename TY, int MT>
__device__ __forceinline__ void bt_store_tile(const float (&acc)[MT / 8][4], TY *y, int64_t row0, int rows, int ntv,
                                              int nw, int N, int g, int t, float mult, int relu2) {
    const int na = nw + g, nb = nw + g + 8;
#pragma unroll
    for (int nt = 0; nt < MT / 8; nt++) {
        if (nt < ntv) {
            const int r = nt * 8 + 2 * t;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (r + h < rows) {
                    TY *yr = y + (row0 + r + h) * N;
                    if (na < N) yr[na] = cu_out<TY>(acc[nt][h] * mult, relu2);
                    if (nb < N) yr[nb] = cu_out<TY>(acc[nt][2 + h] * mult, relu2);
                }
            }
        }
    }
}

/* TY: the output type, T or float (the lm_head: bf16 x, fp32 logits). TL: the weights in the tiled
 * layout (FAST only): each thread's step is its own 36 bytes of one piece; the same values reach the
 * same registers, so the same bits. */
template <typename T, typename TY, int MT, bool FAST, int MINB, int V, bool TL = false>
__global__ void __launch_bounds__(bt_cfg<MT>::THREADS, MINB)
gq_batched_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    static_assert(!TL || FAST, "gq_batched_kernel: the tiled layout is read by the fast path only");
    __shared__ int next_item[2];
    bt_sched sch = {ctr, 0};
    typedef bt_cfg<MT> cfg;
    constexpr int THREADS = cfg::THREADS, NTILE = cfg::NTILE;
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t *xs0 = smem, *xs1 = smem + MT * BT_XROW;
    /* + stage * THREADS */
    const auto ring = bt_slot_soa<BT_STAGES * THREADS>::at(smem + cfg::XBYTES, threadIdx.x);
    typedef bt_ops<T> ops;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int N = a.N, K = a.K, KB = K >> 4, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int NT = (N + NTILE - 1) / NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    const T *x = static_cast<const T *>(a.x);
    TY *y = static_cast<TY *>(a.y);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16; /* this thread's fragment base in x tile */

    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item, total);
        const bt_item it = bt_item_of<MT>(item, a.E, NT, starts, tile_off);
        const int e = it.e, rows = it.rows;
        const int64_t row0 = it.row0;
        const int ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
        const int nw = it.ntile * NTILE + warp * 16;

        const int64_t we = cu_weight_expert(e, a.E);
        const int64_t wr0 = we * N + min(nw + g, N - 1), wr1 = we * N + min(nw + g + 8, N - 1);
        const uint8_t *crow0 = a.codes + wr0 * (K >> 1), *crow1 = a.codes + wr1 * (K >> 1);
        const uint8_t *srow0 = a.scales + wr0 * KB, *srow1 = a.scales + wr1 * KB;
        /* tiled: step 0's piece of the warp's 16-feature tile; a tile past N (a block's last warps)
         * reads the last one, as the rows layout reads row N - 1 (results discarded) */
        const uint8_t *tpiece = TL ? gq_tiled_piece(a.codes, we, min(nw >> 4, (N - 1) >> 4), 0, N, K) : nullptr;
        const bt_wstream<TL> ws = {crow0, crow1, srow0, srow1, tpiece, t, lane, KB};

        float acc[MT / 8][4];
#pragma unroll
        for (int i = 0; i < MT / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

        bt_xstage<T, MT, THREADS, V> xr;
        xr.init(x, row0, rows, rows_pad, K, a.xrow, a.xdiv);
        bt_w cur; /* slow path: registers, one step ahead */
        if constexpr (FAST) {
#pragma unroll
            for (int p = 0; p < BT_STAGES - 1; p++) {
                ws.issue(ring + p * THREADS, p, nsteps);
                bt_cp_commit();
            }
        } else {
            cur = bt_load_w(crow0, crow1, srow0, srow1, 2 * t, KB);
        }
        xr.load(0, K);
        xr.store(xs0);
        __syncthreads();

        for (int s = 0; s < nsteps; s++) {
            uint32_t w0[4], w1[4], sa[2], sb[2];
            if constexpr (FAST) {
                bt_cp_wait<BT_STAGES - 2>(); /* this thread's copies of step s have landed */
                uint32_t sw0, sw1;
                ws.read(ring + (s % BT_STAGES) * THREADS, w0, w1, sw0, sw1);
                if constexpr (V == 4) {
                    bt_scales4<T, TL>(sw0, sw1, sa, sb);
                } else {
                    sa[0] = ops::scale2(bt_scale_f32<TL>(sw0 & 0xff));
                    sa[1] = ops::scale2(bt_scale_f32<TL>((sw0 >> 8) & 0xff));
                    sb[0] = ops::scale2(bt_scale_f32<TL>(sw1 & 0xff));
                    sb[1] = ops::scale2(bt_scale_f32<TL>((sw1 >> 8) & 0xff));
                }
                /* refill the slot read in step s-1 with step s + BT_STAGES - 1 */
                const int nxt = s + BT_STAGES - 1;
                ws.issue(ring + (nxt % BT_STAGES) * THREADS, nxt, nsteps);
                bt_cp_commit();
            } else {
                w0[0] = cur.c0.x; w0[1] = cur.c0.y; w0[2] = cur.c0.z; w0[3] = cur.c0.w;
                w1[0] = cur.c1.x; w1[1] = cur.c1.y; w1[2] = cur.c1.z; w1[3] = cur.c1.w;
                if constexpr (V == 4) {
                    const auto pa = bt_dec4<T>::scales(cur.s0), pb = bt_dec4<T>::scales(cur.s1);
                    sa[0] = bt_dec4<T>::lo2(pa); sa[1] = bt_dec4<T>::hi2(pa);
                    sb[0] = bt_dec4<T>::lo2(pb); sb[1] = bt_dec4<T>::hi2(pb);
                } else {
                    sa[0] = ops::scale2(cu_e4m3_to_float(cur.s0 & 0xff));
                    sa[1] = ops::scale2(cu_e4m3_to_float(cur.s0 >> 8));
                    sb[0] = ops::scale2(cu_e4m3_to_float(cur.s1 & 0xff));
                    sb[1] = ops::scale2(cu_e4m3_to_float(cur.s1 >> 8));
                }
                if (s + 1 < nsteps) cur = bt_load_w(crow0, crow1, srow0, srow1, (s + 1) * 8 + 2 * t, KB);
            }
            if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K);
            bt_step_ntv<T, MT, V, TL>(ntv, acc, w0, w1, sa, sb, ((s & 1) ? xs1 : xs0) + xoff);
            if (s + 1 < nsteps) xr.store((s & 1) ? xs0 : xs1);
            __syncthreads();
        }

        /* epilogue: y[row][n] = acc * gs * 2^kshift; C fragment (g, 2t..2t+1) and (g+8, 2t..2t+1) */
        bt_store_tile<TY, MT>(acc, y, row0, rows, ntv, nw, N, g, t, cu_expert_gs(a.gs, e) * ops::kUndo, a.relu2);
    }

    bt_zero_tail(y, starts, a.E, a.B, N);
}

/* ---- 32-row tiles of bf16 calls on tiled weights: 32 output features a warp --------------------
 * For the 32-row tiles of bf16 x and y on the tiled layout with experts (E > 1; the 30B-A3B MoE at
 * 86 .. 1,024 tokens; a plain linear keeps gq_batched_kernel, not measured here) the items run here
 * instead of gq_batched_kernel<.., 32, ..>: a warp owns two 16-feature tiles A and B (its features
 * nw .. nw + 31), so every x fragment load from shared memory feeds 4 mma instead of
 * 2 and a block of 4 warps covers the same 128 features as gq_batched_kernel's 8, staging the x tile
 * with half the threads. Measured on the H200 (bench/gpu_gather_wg.cu, session 18): 0.434 against
 * 0.491 ms for the up + down calls at 512 tokens (0.88x); at 128 tokens (then 8-row tiles in production;
 * 32-row tiles, i.e. this kernel, since session 23) 1.02x and at 2,048+ (64-row wgmma in production)
 * 1.07-1.29x, so only the 32-row tiles take it.
 * Per element the arithmetic is gq_batched_kernel's: the same decode (bt_dec4), block-scale
 * products, k16 order of mma into an fp32 accumulator from 0, and epilogue - so the outputs are
 * bitwise equal to it (and to "qmv, tiled by 8 rows"; test_ops_gpu's tiled_layout compares against
 * the checkpoint layout, which gq_batched_kernel computes). Ring: two slots (tiles A and B) a thread
 * a stage. 3 blocks an SM (launch bounds): 166 registers, no spills; 4 spilled and measured 1.26x, 2
 * the same as 3 (26,466 / 26,427 tok/s prefill at 512 tokens). End to end at 512 + 128 tokens:
 * prefill 24,534 -> 26,427 tok/s (+7.7%), greedy hashes unchanged (docs/PERFORMANCE.md session 18). */
#ifndef BT_W32
#define BT_W32 1 /* 0: the 32-row tiles of bf16 tiled calls on gq_batched_kernel (for measuring, session 18) */
#endif
#define BW_MT 32
/* 4 warps (128 features) a block, 4 blocks (16 warps) an SM with a 3-slot weight ring: ptxas fits the kernel in 128
 * registers (146 with 3 blocks) with 24 bytes spilled outside the K loop, and the ring leaves 4 x 49,152 bytes of
 * shared memory (4 slots would be 4 x 59,392, over the SM's 228 KB); session 18's 4 blocks spilled at 166. Measured
 * in session 30 (H200, 512 + 128 tokens, 3 rounds, medians): prefill 32,059 -> 32,681 tok/s (+1.9%), decode 596.7
 * -> 600.9, greedy hashes equal; -DBW_MINB=3 -DBW_STAGES=4 is the former form. 6 warps (192 features, 2 blocks: a
 * third less x staged per feature) measured -2.8% at a 512-token prefill (session 26): removed. */
#define BW_WARPS 4
#ifndef BW_MINB
#define BW_MINB 4
#endif
#define BW_THREADS (BW_WARPS * 32)
#define BW_NTILE (BW_WARPS * 32)
#define BW_XBYTES (2 * BW_MT * BT_XROW)
#ifndef BW_STAGES
#define BW_STAGES 3 /* the weight ring's depth in this kernel (BT_STAGES, 4, with 3 blocks an SM) */
#endif
#define BW_SMEM (BW_XBYTES + BW_STAGES * BW_THREADS * 2 * BT_SLOT_BYTES)

/* One 128-K step of a warp: tiles A (a0 / a1: code words of its rows g, g + 8; sa / sb: their scale
 * pairs) and B (b0 / b1, ta / tb) x (8 * NTV) token rows; each x fragment load feeds both tiles. */
template <int NTV>
__device__ __forceinline__ void bw_step(float (&aa)[BW_MT / 8][4], float (&ab)[BW_MT / 8][4], const uint32_t (&a0)[4],
                                        const uint32_t (&a1)[4], const uint32_t (&b0)[4], const uint32_t (&b1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], const uint32_t (&ta)[2],
                                        const uint32_t (&tb)[2], const uint8_t *xb) {
    typedef bt_ops<__nv_bfloat16> ops;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t pa[4], pb[4], qa[4], qb[4];
        bt_dec4<__nv_bfloat16>::pairs_tl(a0[q], pa); /* the w32 kernel reads the tiled layout only */
        bt_dec4<__nv_bfloat16>::pairs_tl(a1[q], pb);
        bt_dec4<__nv_bfloat16>::pairs_tl(b0[q], qa);
        bt_dec4<__nv_bfloat16>::pairs_tl(b1[q], qb);
#ifdef FP4MOE_INJECT_FAULT_W32 /* deliberate fault (tests must catch it): tile B's rows g+8 with row g's scales */
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1], u0 = ta[q >> 1], u1 = ta[q >> 1];
        (void)tb;
#else
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1], u0 = ta[q >> 1], u1 = tb[q >> 1];
#endif
        const uint32_t ra0 = ops::mul2(pa[0], s0), ra1 = ops::mul2(pa[1], s0), ra2 = ops::mul2(pa[2], s0),
                       ra3 = ops::mul2(pa[3], s0);
        const uint32_t rb0 = ops::mul2(pb[0], s1), rb1 = ops::mul2(pb[1], s1), rb2 = ops::mul2(pb[2], s1),
                       rb3 = ops::mul2(pb[3], s1);
        const uint32_t va0 = ops::mul2(qa[0], u0), va1 = ops::mul2(qa[1], u0), va2 = ops::mul2(qa[2], u0),
                       va3 = ops::mul2(qa[3], u0);
        const uint32_t vb0 = ops::mul2(qb[0], u1), vb1 = ops::mul2(qb[1], u1), vb2 = ops::mul2(qb[2], u1),
                       vb3 = ops::mul2(qb[3], u1);
#pragma unroll
        for (int nt = 0; nt < NTV; nt++) {
            const uint4 xf = *reinterpret_cast<const uint4 *>(xb + nt * 8 * BT_XROW + q * 16);
            ops::mma(aa[nt], ra0, rb0, ra1, rb1, xf.x, xf.y); /* tile A, k16 step 2q */
            ops::mma(aa[nt], ra2, rb2, ra3, rb3, xf.z, xf.w); /* tile A, k16 step 2q+1 */
            ops::mma(ab[nt], va0, vb0, va1, vb1, xf.x, xf.y); /* tile B */
            ops::mma(ab[nt], va2, vb2, va3, vb3, xf.z, xf.w);
        }
    }
}

__device__ __forceinline__ void bw_step_ntv(int ntv, float (&aa)[BW_MT / 8][4], float (&ab)[BW_MT / 8][4],
                                            const uint32_t (&a0)[4], const uint32_t (&a1)[4], const uint32_t (&b0)[4],
                                            const uint32_t (&b1)[4], const uint32_t (&sa)[2], const uint32_t (&sb)[2],
                                            const uint32_t (&ta)[2], const uint32_t (&tb)[2], const uint8_t *xb) {
    switch (ntv) { /* only the n8 tiles the run has */
    case 1: bw_step<1>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    case 2: bw_step<2>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    case 3: bw_step<3>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    default: bw_step<4>(aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, xb); break;
    }
}

/* (gq_batched_w32_kernel is defined after bw_item, its item body, which the fused MoE kernel below shares) */

/* ---- a MoE layer's up and down projections in one persistent kernel (both on 32-row w32 items) ----------------
 * gq_launch_moe_pair (FP4MOE_CUDA_MOE_FUSED=1, the default): the items of the up projection (x -> h, relu^2) and of
 * the down projection (h -> y) of one MoE layer are ONE queue - all up items, then all down items, each in
 * gq_batched_w32_kernel's (expert, N-tile, row-tile) order - so the down items start while the up projection's last
 * items run, instead of after a kernel boundary. Why: at 512 tokens an up call is ~2,300 items of ~40 us on 528 block
 * slots (4.4 waves) and a down call ~3,200 (6.1 waves); each call ends in a tail in which its SMs run out of items one
 * by one (up to one item's time), and the down call waited for the up call's last item. Each item's arithmetic is
 * gq_batched_w32_kernel's (the same decode, mma order, epilogue), so h and y are bitwise the two calls' (test_ops_gpu
 * test_moe_pair).
 * The dependency: a down item of row tile r reads h's rows of r, written by the up items of r (every up N-tile).
 * An up item publishes after its stores (block barrier, then one thread's fence + atomicAdd on done[r]); a down
 * item issues its first weight copies (they do not need h), then one thread waits with acquire loads until
 * done[r] == the up N-tiles, the block barrier, then h is staged with L2 loads (ld.global.cg: h is written during
 * the kernel, so not the read-only path production's x loads take). No deadlock: every item is taken from the
 * work counter, in order, by a running block (the first item too), so when a down item waits, each up item it
 * needs has been taken by a running block, and up items wait for nothing - however much of the grid is resident. done[r] resets itself: each down item of r adds 1
 * after its wait, and the one that brings it to up + down N-tiles sets it back to 0 (as bt_sched's counter), so
 * the buffer is zero between launches (allocated zeroed with the runs).
 * Measured (session 36, H100, synthetic 30B-A3B shape, FP4MOE_CUDA_MOE_FUSED 1 against 0 in the same call, alternated
 * rounds, the same greedy hashes; docs/PERFORMANCE.md): prefill 512 + 64 tokens 33,316 -> 33,851 tok/s (+1.6%, 5
 * rounds), 128 + 32 10,305 -> 10,596 (+2.8%), 1,024 + 16 43,335 -> 43,767 (+1.0%); 128-sequence decode 7,418 ->
 * 7,566 (+2.0%, its 96+-sequence steps take 32-row tiles). The bench (bench/gpu_gather_wg -DWK_FUSED=1, up + down,
 * the runs made once for both): 512 tokens 0.355 -> 0.351 ms uniform routing, 0.401 -> 0.400 skewed. The same queue on
 * the 64-row wgmma tiles (gq_moe_wg_kernel: gw_item with the wait / publish, 2,048-5,400 tokens) was bitwise right
 * but SLOWER (session 36, H100): prefill 2,048 + 16 49,681 -> 44,269 tok/s (-11%), 4,096 + 8 53,026 -> 47,669
 * (-10%), the bench pair at 2,048 tokens 0.954 -> 1.18 ms - ptxas serialised its wgmma (C7510: the queue's callback
 * was a function call); without the callback 0.977 -> 0.994-1.011 ms, still slower: not kept
 * (bench/patches/moe-wg-fused.diff puts that form back). */
__device__ __forceinline__ int gq_ld_acquire(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* The dependency of a fused item on row tile ti's counter done[ti]: wait(need) - a down item, before it stages h: one
 * thread's acquire loads until every up item of the tile (need: the up N-tiles) published, then the block barrier;
 * publish() - an up item, after its stores: the block barrier, one thread's fence and add; count(last) - a down item,
 * after its wait: one thread's add, the tile's last one (the add that returns last = up + down N-tiles - 1) setting
 * the counter back to 0. */
struct gq_moe_dep {
    int *done;
    int ti;
    __device__ __forceinline__ void wait(int need) const {
        if (threadIdx.x == 0) {
#ifdef FP4MOE_INJECT_FAULT_MOE_WAIT /* deliberate fault (the checks must catch it): no wait */
            (void)gq_ld_acquire(done + ti);
#else
            while (gq_ld_acquire(done + ti) < need) __nanosleep(100);
#endif
        }
        __syncthreads();
    }
    __device__ __forceinline__ void publish() const {
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(done + ti, 1);
        }
    }
    __device__ __forceinline__ void count(int last) const {
        if (threadIdx.x == 0) {
#ifdef FP4MOE_INJECT_FAULT_MOE_RESET /* deliberate fault (tests must catch it): the counter left at up + down N-tiles */
            atomicAdd(done + ti, 1);
#else
            if (atomicAdd(done + ti, 1) == last) atomicExch(done + ti, 0);
#endif
        }
    }
};

/* the row tile of an item (bt_item_of's expert e and first row row0, MT-row tiles): its index in tile_off's order */
template <int MT>
__device__ __forceinline__ int gq_moe_tile(const int *tile_off, const int *starts, int e, int64_t row0) {
#ifdef FP4MOE_INJECT_FAULT_MOE_TILE /* deliberate fault (tests must catch it): every row tile of an expert on one counter */
    (void)starts; (void)row0;
    return tile_off[e];
#else
    return tile_off[e] + (int)((row0 - starts[e]) / MT);
#endif
}

/* The fused queue's scheduler: every item from the work counter ctr, the first too (not blockIdx.x as bt_sched): an
 * item is only ever held by a running block, so a waiting down item's up items are running - whatever part of the
 * grid is resident (another kernel beside it, MPS). A block fetches once more than it runs items (the fetch past the
 * end), so the fetch that returns total + gridDim.x - 1 is the last: it sets the counter back to 0 for the next
 * kernel. The next item is fetched at an item's start (its latency behind the item) into the other slot, read after
 * the item's barriers. */
template <typename F>
__device__ __forceinline__ void gq_moe_queue(int *ctr, int64_t total, F run) {
    __shared__ int slot[2];
    const int64_t fetches = total + gridDim.x;
    auto fetch = [&](int p) {
        if (threadIdx.x == 0) {
            const int v = atomicAdd(ctr, 1);
            slot[p] = v;
            if ((int64_t)v == fetches - 1) atomicExch(ctr, 0);
        }
    };
    fetch(0);
    __syncthreads();
    int par = 0;
    for (int64_t item = slot[0]; item < total; item = slot[par]) {
        fetch(par ^ 1);
        run(item);
        par ^= 1;
    }
}

/* One item of the w32 kernels: a's item `local` of NT N-tiles (bt_item_of over the runs starts / tile_off), 32 rows x
 * 128 features, 32 a warp. DEP: 0 gq_batched_w32_kernel's item; in the fused MoE kernel (gq_moe_w32_kernel, below) 1
 * an up item (publishes its part of the row tile's counter in done), 2 a down item (waits until the row tile's
 * NTu up items published, reads x = h from L2, counts itself; NTu + NTd - 1: the tile's last count). A template, so
 * that each form reads its parameters from the constant bank (a runtime choice between the fused kernel's u and d
 * cost ~15 instructions a K step). */
template <int DEP>
__device__ __forceinline__ void bw_item(const gq_args &a, int64_t local, int NT, const int *starts, const int *tile_off,
                                        uint8_t *smem, int *done = nullptr, int NTu = 0, int NTd = 0) {
    constexpr bool DN = DEP == 2;
    uint8_t *xs0 = smem, *xs1 = smem + BW_MT * BT_XROW;
    const auto ring = bt_slot_soa<BW_STAGES * 2 * BW_THREADS>::at(smem + BW_XBYTES, threadIdx.x);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    const int N = a.N, K = a.K, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const bt_item it = bt_item_of<BW_MT>(local, a.E, NT, starts, tile_off);
    const int e = it.e, rows = it.rows;
    const int64_t row0 = it.row0;
    const gq_moe_dep dep = {done, DEP ? gq_moe_tile<BW_MT>(tile_off, starts, e, row0) : 0};
    const int ntv = (rows + 7) >> 3, rows_pad = ntv * 8;
    const int nw = it.ntile * BW_NTILE + warp * 32;
    const int64_t we = cu_weight_expert(e, a.E);
    const int last_tile = (N - 1) >> 4;
    const uint8_t *pa = gq_tiled_piece(a.codes, we, min(nw >> 4, last_tile), 0, N, K);
    const uint8_t *pb = gq_tiled_piece(a.codes, we, min((nw >> 4) + 1, last_tile), 0, N, K);
    bt_tstream wa = bt_tstream::of(pa, lane), wb = bt_tstream::of(pb, lane);

    float aa[BW_MT / 8][4], ab[BW_MT / 8][4];
#pragma unroll
    for (int i = 0; i < BW_MT / 8; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) aa[i][j] = ab[i][j] = 0.0f;

    bt_xstage<__nv_bfloat16, BW_MT, BW_THREADS, 4> xr;
    xr.init(static_cast<const __nv_bfloat16 *>(a.x), row0, rows, rows_pad, K, a.xrow, a.xdiv);
#pragma unroll
    for (int p = 0; p < BW_STAGES - 1; p++) {
        wa.issue_next(ring + p * 2 * BW_THREADS, p, nsteps);
        wb.issue_next(ring + p * 2 * BW_THREADS + BW_THREADS, p, nsteps);
        bt_cp_commit();
    }
    if (DN) dep.wait(NTu); /* h's rows of the tile: every up item of it done */
    xr.template load<DN>(0, K);
    xr.store(xs0);
    __syncthreads();

    for (int s = 0; s < nsteps; s++) {
        uint32_t a0[4], a1[4], b0[4], b1[4], sa[2], sb[2], ta[2], tb[2], swa0, swa1, swb0, swb1;
        if (s + 1 < nsteps) xr.template load<DN>((s + 1) * BT_KSTEP, K);
        bt_cp_wait<BW_STAGES - 2>();
        const auto sl = ring + (s % BW_STAGES) * 2 * BW_THREADS;
        wa.read(sl, a0, a1, swa0, swa1);
        wb.read(sl + BW_THREADS, b0, b1, swb0, swb1);
        bt_scales4<__nv_bfloat16, true>(swa0, swa1, sa, sb);
        bt_scales4<__nv_bfloat16, true>(swb0, swb1, ta, tb);
        const int nxt = s + BW_STAGES - 1;
        bw_step_ntv(ntv, aa, ab, a0, a1, b0, b1, sa, sb, ta, tb, ((s & 1) ? xs1 : xs0) + xoff);
        if (s + 1 < nsteps) xr.store((s & 1) ? xs0 : xs1);
        wa.issue_next(ring + (nxt % BW_STAGES) * 2 * BW_THREADS, nxt, nsteps);
        wb.issue_next(ring + (nxt % BW_STAGES) * 2 * BW_THREADS + BW_THREADS, nxt, nsteps);
        bt_cp_commit();
        __syncthreads();
    }
    const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    bt_store_tile<__nv_bfloat16, BW_MT>(aa, y, row0, rows, ntv, nw, N, g, t, mult, a.relu2);
    bt_store_tile<__nv_bfloat16, BW_MT>(ab, y, row0, rows, ntv, nw + 16, N, g, t, mult, a.relu2);
    if (DEP == 1) dep.publish(); /* this block's part of h's row tile is written */
    if (DEP == 2) dep.count(NTu + NTd - 1);
}

__global__ void __launch_bounds__(BW_THREADS, BW_MINB)
gq_batched_w32_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    __shared__ int next_item[2];
    bt_sched sch = {ctr, 0};
    extern __shared__ __align__(16) uint8_t smem[];
    const int NT = (a.N + BW_NTILE - 1) / BW_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item, total);
        bw_item<0>(a, item, NT, starts, tile_off, smem);
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, a.N);
}

/* u: the up projection (x -> h, relu^2), d: the down projection (h -> y); the same idx, B, E (runs: starts /
 * tile_off of row tile 32, ctr = tile_off + E + 1 zeroed); done: tile_off[E] ints, zero. */
__global__ void __launch_bounds__(BW_THREADS, BW_MINB)
gq_moe_w32_kernel(gq_args u, gq_args d, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr,
                    int *done) {
    cu_pdl_entry();
    extern __shared__ __align__(16) uint8_t smem[];
    const int tiles = tile_off[u.E];
    const int NTu = (u.N + BW_NTILE - 1) / BW_NTILE, NTd = (d.N + BW_NTILE - 1) / BW_NTILE;
    const int64_t tot_u = (int64_t)tiles * NTu, total = tot_u + (int64_t)tiles * NTd;
    gq_moe_queue(ctr, total, [&](int64_t item) {
        if (item < tot_u) bw_item<1>(u, item, NTu, starts, tile_off, smem, done, NTu, NTd);
        else bw_item<2>(d, item - tot_u, NTd, starts, tile_off, smem, done, NTu, NTd);
    });
    bt_zero_tail(static_cast<__nv_bfloat16 *>(u.y), starts, u.E, u.B, u.N);
    bt_zero_tail(static_cast<__nv_bfloat16 *>(d.y), starts, d.E, d.B, d.N);
}

/* ---- plain linears of a decode batch: one item's K steps over 3 warp groups ------------------------
 * gq_dense_kg_kernel: bf16 calls of a plain linear (E = 1) of KG_MIN_ROWS..64 sorted rows with N >= KG_MIN_N and
 * K % 64 == 0 (the 33-64-sequence decode step's Mamba in / out projections, shared experts and attention q / o;
 * launch_tiled takes it for both routes, FP4MOE_GATHER_EXPERT_BATCHED on or off, and both weight layouts, so
 * the route switch and the layouts keep giving the same bits). One block of KG_GROUPS groups of 4 warps an item
 * of 64 rows x 64 features; group g runs the 64-row step of gq_batched_kernel (the same weight ring, decode, mma
 * order within a step and x tile) over the 128-K steps g, g + KG_GROUPS, g + 2 KG_GROUPS, ... with its own x
 * buffers, ring and named barrier; the groups' fp32 accumulators are then summed in group order (0 + 1 + 2) in
 * shared memory and group 0 runs the epilogue. A weight is decoded once per item, as on 64-row tiles, with 3x
 * the warps on it: the 64-row form was latency-bound there (Nsight Compute, session 23: 1.31 active / 0.35
 * eligible warps a scheduler), the 8-row form decodes every weight 8 times. The sum over K is in 3 chains, so
 * the bits differ from the row tiles' (one kernel for these calls on every route keeps the contracts).
 * Measured (H200, session 24; bench/gpu_dense_b64, ms a call at 64 rows, the 8- / 64-row tiles of gq_batched_kernel
 * alone -> this kernel): in_proj 10,304 x 2,688 0.0447 / 0.0303 -> 0.0313, out_proj 2,688 x 4,096 0.0222 / 0.0327 ->
 * 0.0230, shared up 3,712 x 2,688 0.0200 / 0.0232 -> 0.0167, q 4,096 x 2,688 0.0200 / 0.0232 -> 0.0167; as the row
 * tiles were called (with the runs kernel and a scratch allocation, ~4 us a call) a step's plain linears took 2.94
 * ms, now 2.53 (2 groups: 0.90x of 3's candidate time). End to end (decode tok/s): 64 sequences 5,301 -> 5,536,
 * 40 sequences 3,964 -> 4,352. Not at N = 256 (k, v: 0.0155 against 0.0137 on 8-row tiles: 4 items), hence
 * KG_MIN_N. Rows with idx >= E (a sorted tail) are zeros; the row count is counted from idx in the kernel (no runs
 * kernel), after the first item's K loop (all B rows are multiplied, those past the count not stored). */
#define KG_GROUPS 3
#define KG_MT 64
#define KG_GT 128 /* threads a group */
#define KG_MIN_ROWS 33 /* from here on (up to 64 rows); 33-64 are the calls the qmv route gives the 8-row tiles; from 17
                          measured -1.4% / -0.5% decode at 24 / 32 sequences (session 26) */
#define KG_MIN_N 2048
#define KG_XB (2 * KG_MT * BT_XROW)
#define KG_RB (BT_STAGES * KG_GT * BT_SLOT_BYTES)
#define KG_SMEM (KG_GROUPS * (KG_XB + KG_RB))

__device__ __forceinline__ void kg_bar(int id) { asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(KG_GT) : "memory"); }

template <bool TL>
__global__ void __launch_bounds__(KG_GROUPS * KG_GT, 1) gq_dense_kg_kernel(gq_args a) {
    cu_pdl_entry();
    extern __shared__ __align__(16) uint8_t smem[];
    const int grp = threadIdx.x / KG_GT, tid = threadIdx.x % KG_GT;
    const int lane = threadIdx.x & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    uint8_t *base = smem + grp * (KG_XB + KG_RB);
    uint8_t *xs0 = base, *xs1 = base + KG_MT * BT_XROW;
    const auto ring = bt_slot_soa<BT_STAGES * KG_GT>::at(base + KG_XB, tid);
    const int N = a.N, K = a.K, KB = K >> 4, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const int NT = (N + 63) / 64;
    const int nj = grp < nsteps ? (nsteps - grp + KG_GROUPS - 1) / KG_GROUPS : 0; /* this group's steps */
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const int xoff = g * BT_XROW + t * 64 + (t >> 1) * 16;
    float *red = reinterpret_cast<float *>(smem); /* after the K loop: groups 1.. partials (in group 0's x) */
    static_assert((KG_GROUPS - 1) * 32 * KG_GT * 4 <= KG_XB, "the partials fit group 0's x buffers");

    /* every row is staged and multiplied (a row's bits do not depend on its n8 tile's neighbours); rows: those
     * of expert 0 (sorted idx: the rows with idx < E = 1 come first), counted after the first item's K loop so
     * that the idx load is off the critical path, stored; the rest are zeros */
    const int ntv = (a.B + 7) >> 3, rows_pad = ntv * 8;
    int rows = -1;
    for (int item = blockIdx.x; item < NT; item += gridDim.x) {
        const int nw = item * 64 + warp * 16;
        const int64_t wr0 = min(nw + g, N - 1), wr1 = min(nw + g + 8, N - 1);
        const uint8_t *tpiece = TL ? gq_tiled_piece(a.codes, 0, min(nw >> 4, (N - 1) >> 4), 0, N, K) : nullptr;
        const bt_wstream<TL> ws = {a.codes + wr0 * (K >> 1), a.codes + wr1 * (K >> 1), a.scales + wr0 * KB,
                                   a.scales + wr1 * KB, tpiece, t, lane, KB};
        float acc[KG_MT / 8][4];
#pragma unroll
        for (int i = 0; i < KG_MT / 8; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll
        for (int p = 0; p < BT_STAGES - 1; p++) {
            ws.issue(ring + p * KG_GT, grp + KG_GROUPS * p, nsteps);
            bt_cp_commit();
        }
        bt_xstage<__nv_bfloat16, KG_MT, KG_GT, 4> xr; /* staged by the group's threads */
        xr.init_tid(tid, x, 0, a.B, rows_pad, K, a.xrow, a.xdiv); /* a row map: every entry < T (its promise) */
        if (nj > 0) {
            xr.load(grp * BT_KSTEP, K);
            xr.store(xs0);
        }
        kg_bar(1 + grp);
        for (int j = 0; j < nj; j++) {
            const int s = grp + KG_GROUPS * j;
            uint32_t w0[4], w1[4], sa[2], sb[2], sw0, sw1;
            bt_cp_wait<BT_STAGES - 2>();
            ws.read(ring + (j % BT_STAGES) * KG_GT, w0, w1, sw0, sw1);
            bt_scales4<__nv_bfloat16, TL>(sw0, sw1, sa, sb);
            const int nxt = j + BT_STAGES - 1;
            ws.issue(ring + (nxt % BT_STAGES) * KG_GT, grp + KG_GROUPS * nxt, nsteps);
            bt_cp_commit();
            if (j + 1 < nj) xr.load((s + KG_GROUPS) * BT_KSTEP, K);
            bt_step_ntv<__nv_bfloat16, KG_MT, 4, TL>(ntv, acc, w0, w1, sa, sb, ((j & 1) ? xs1 : xs0) + xoff);
            if (j + 1 < nj) xr.store((j & 1) ? xs0 : xs1);
            kg_bar(1 + grp);
        }
        /* every group is past its K loop: group 0's x buffers take the partials now */
        if (rows < 0) rows = __syncthreads_count(threadIdx.x < (unsigned)a.B && __ldg(a.idx + threadIdx.x) < (uint32_t)a.E);
        else __syncthreads();
        if (grp > 0) {
#pragma unroll
            for (int i = 0; i < KG_MT / 8; i++)
#pragma unroll
                for (int c = 0; c < 4; c++) red[((grp - 1) * 32 + i * 4 + c) * KG_GT + tid] = acc[i][c];
        }
        __syncthreads();
        if (grp == 0) {
#ifdef FP4MOE_INJECT_FAULT_KG /* deliberate fault (tests must catch it): the last group's partial sums lost */
            constexpr int QE = KG_GROUPS - 1;
#else
            constexpr int QE = KG_GROUPS;
#endif
#pragma unroll
            for (int q = 1; q < QE; q++)
#pragma unroll
                for (int i = 0; i < KG_MT / 8; i++)
#pragma unroll
                    for (int c = 0; c < 4; c++) acc[i][c] += red[((q - 1) * 32 + i * 4 + c) * KG_GT + tid];
            bt_store_tile<__nv_bfloat16, KG_MT>(acc, y, 0, rows, ntv, nw, N, g, t,
                                                cu_expert_gs(a.gs, 0) * bt_ops<__nv_bfloat16>::kUndo, a.relu2);
        }
        __syncthreads(); /* the next item's x tile overwrites the partials */
    }
    /* rows with idx >= E: zeros */
    if (rows < 0) rows = __syncthreads_count(threadIdx.x < (unsigned)a.B && __ldg(a.idx + threadIdx.x) < (uint32_t)a.E);
    const __nv_bfloat16 zero = cu_from_float<__nv_bfloat16>(0.0f);
    for (int64_t i = (int64_t)rows * N + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)a.B * N;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = zero;
}

/* The calls gq_dense_kg_kernel takes (launch_tiled, for every route, with or without a row map): see above. */
static bool kg_fits(const gq_args *a, fp4moe_dtype dtype, bool f32out) {
    return !f32out && dtype == FP4MOE_BF16 && a->E == 1 && a->B >= KG_MIN_ROWS && a->B <= KG_MT && a->N >= KG_MIN_N &&
           a->K % 64 == 0 && ((uintptr_t)a->codes & 15) == 0 && ((uintptr_t)a->scales & 3) == 0;
}

template <bool TL> static int launch_kg_t(const gq_args *a, cudaStream_t st) {
    int dev = 0, sms = 0;
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetDevice(&dev), "cudaGetDevice");
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                    "cudaDeviceGetAttribute");
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaFuncSetAttribute(gq_dense_kg_kernel<TL>,
                                                            cudaFuncAttributeMaxDynamicSharedMemorySize, KG_SMEM),
                    "cudaFuncSetAttribute (dynamic shared memory)");
    const int NT = (a->N + 63) / 64;
    cu_launch(gq_dense_kg_kernel<TL>, (unsigned)(NT < sms ? NT : sms), KG_GROUPS * KG_GT, KG_SMEM, st, *a);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the plain-linear kernel (K over 3 warp groups)");
    return FP4MOE_OK;
}
static int launch_kg(const gq_args *a, cudaStream_t st) {
    return a->tiled ? launch_kg_t<true>(a, st) : launch_kg_t<false>(a, st);
}

bool gq_dense_kg_fits(const gq_args *a, fp4moe_dtype dtype) { return kg_fits(a, dtype, false); }

/* 64-row tiles (the wgmma kernel) above this many rows an expert on average. Re-measured in session 39 (H100, prefill
 * 768 / 1,024 / 1,280 / 1,536 + 8 tokens, 2 rounds, synthetic 30B-A3B): the bound at 32 / 40 / 64 against 48 within
 * -2.6% .. +1.4% (two builds of the same code differ by 1.2%) except 32 at 768 tokens (-6.8%); kept. */
#ifndef GQ_ROW_TILE64_RUNS
#define GQ_ROW_TILE64_RUNS 48
#endif
int gq_batched_row_tile(const gq_args *a, fp4moe_dtype dtype) {
    (void)dtype;
    /* 64-row tiles halve the weight re-reads and dequantizations of long runs; 32-row tiles keep
     * more items (and fewer wasted n8 tiles) when runs are short (docs/GPU-NOTES.md); runs of at
     * most 4 rows on average (batched decode: 64 sequences x top-6 over 128 experts is 3 a run)
     * take 8-row tiles, whose 4-warp blocks fit 4 an SM: measured 4,383 against 4,026 aggregate
     * decode tok/s at 64 sequences (docs/PERFORMANCE.md, 2026-12-02). The bound was 8 rows until
     * session 23: at 5-8 rows (a 128-token prefill: 6) the 32-row tiles (the w32 kernel for bf16
     * experts) measured 9,648 against 8,939 tok/s (128 + 64 tokens, +7.9%, same bits). */
    /* (Since session 24, bf16 plain linears of 33-64 rows with N >= 2,048 and K % 64 == 0 run gq_dense_kg_kernel
     * instead, whatever this returns: launch_tiled. The rule below serves the others: f16, smaller N, K % 64 != 0.)
     * A plain linear (E = 1) of 64 rows (the 64-sequence decode step; the automatic route brings no
     * fewer here, 33-63 rows take the qmv route's 8-row tiles) has one 64-row tile, so N / 64 items: up
     * to N = 8,192 (128 items for 132 SMs) the 8-row tiles' 8x as many items win (session 23, Nsight
     * Compute of that step: 24.98 against 31.97 us a call at N = 2,688, 16.2 against 22.8 at N = 256),
     * beyond it not (Mamba in_proj, N = 10,304: 45.9 against 30.7 us; the lm_head's 131,072: 513 against
     * 211). Forced-batched and row-map calls of 5-48 rows follow the same rule (not measured). Which tile
     * computes a row does not change its bits. */
    if (a->E == 1 && a->B <= 64 && a->N <= 8192) return GQ_QMV_TILE_ROWS;
    if ((int64_t)a->B > (int64_t)GQ_ROW_TILE64_RUNS * a->E) return 64;
    return (int64_t)a->B <= 4ll * a->E ? GQ_QMV_TILE_ROWS : 32;
}

/* ---- 64-row tiles of bf16 calls on the warpgroup matrix instruction (wgmma, sm_90a) ------------
 * For experts' runs longer than 32 rows (E > 1, bf16 x and y, fast path, both layouts) the items are computed by
 * wgmma.m64nNk16 instead of mma.sync: measured 0.75-0.78x the mma.sync kernel's time at 2,048 and
 * 8,192 tokens of the 30B-A3B MoE shapes and bitwise equal to it (bench/gpu_gather_wg.cu,
 * docs/PERFORMANCE.md, 2026-12-03); at 32- and 8-row tiles it was not faster (1.02x / 1.12-1.32x),
 * so those keep mma.sync. The arithmetic is the mma.sync kernel's: the same ring of weight copies
 * (bt_issue / bt_issue_tiled), the same decode into the same A registers (the A fragment of
 * wgmma's register form is mma.m16n8k16's for each warp's 16 rows), the same k16 order and fp32
 * accumulation from 0, the same epilogue.
 * Block = GW_WGS warpgroups (4: 512 threads, 256 features; warpgroup: 64, warp: 16 as the mma.sync warp);
 * the item's rows, rounded up to 8, are the N of the instruction (one function per N, so that each
 * has one accumulator set and ptxas keeps the wgmma pipeline: a runtime switch over N inside one
 * loop made it serialize them). The x tile of a 128-K step is stored, through registers, as the
 * K-major core matrices wgmma reads from shared memory (8 rows x 16 bytes each; the K-direction
 * neighbour 128 bytes on = the descriptor's leading byte offset, the next 8 rows 256 bytes on =
 * its stride byte offset; the other reading failed the check, CUTLASS's cute "INTERLEAVE" atom
 * says the same), with the K permutation of the decoded pairs: the 16-byte piece x[32t + 8q ..
 * +7] of a row goes, as 4-byte pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7), to k16 steps 2q, 2q, 2q+1,
 * 2q+1, core matrices 0, 1, 0, 1, byte 4t. A step's 8 wgmma are one commit group, waited for
 * before its x buffer is written again. PTX ISA "wgmma.mma_async", "Matrix Descriptor Format". */
/* Measured against the 2-warpgroup form and removed (session 26, 2,048-token prefill unless said): the K loop
 * unrolled by 2 (uniform descriptors, 325 -> 303 instructions a step: -0.9%), the x pieces by cp.async two steps
 * ahead into a raw ring (-5.2%); 4 warpgroups a block measured -1.3% then, +2.6% in session 39 (below). */
/* GW_WGS warpgroups a block (64 features each): 4 - 256 features an item, 512 threads, one block an SM (127 registers,
 * no spills; 239 instructions a 128-K step a thread against 328: half the x pieces a thread to stage) - and each x
 * tile read from L2 once for 256 features, not 128 (at 8,192 tokens an up + down call reads ~7.8 GB of x tiles and
 * ~4.3 GB of weight tiles from L2 with 2 warpgroups). Measured (session 39, H100, same call, same bits: greedy hashes
 * equal): the MoE layer up + down (bench/gpu_gather_wg, uniform / skew 0.5, two rounds) 2,048 tokens 0.978 / 0.989
 * -> 0.946 / 0.966 ms, 4,096 1.716 / 1.721 -> 1.667 / 1.670, 8,192 3.204 / 3.175 -> 3.110 / 3.117; prefill 2,048
 * tokens 49,944 -> 51,253 tok/s (+2.6%), 4,096 52,784 -> 54,109 (+2.5%), 8,192 53,104 -> 54,374 (+2.4%). (Session 26
 * had measured the 4-warpgroup block 1.3% slower at 2,048 tokens on the H200, before the weight ring's arrays and
 * the fence placement of sessions 22-27.) The wgmma kernel serves experts only (E > 1, launch_dtype), so plain
 * linears and the 32-row w32 tiles (up to 48 rows an expert) are not touched. */
#ifndef GW_WGS
#define GW_WGS 4
#endif
#define GW_THREADS (128 * GW_WGS)
#define GW_NTILE (64 * GW_WGS)
/* Not kept (session 27): the next step's decode overlapping this step's wgmma (three x buffers, a commit group per
 * pair of wgmma, wait_group 1 or 2 after each): ptxas serialises the wgmma ("insufficient register resources") at
 * 128 registers, and at 255 (one block an SM) it takes all of them. */
/* the weight ring's depth in this kernel: BT_STAGES (4) slots of GW_THREADS x 40 bytes; with one block an SM (GW_WGS
 * 4: 32 KB of x buffers + 80 KB of ring) deeper rings fit (5 / 6: 132 / 152 KB) - measured within noise at prefill
 * 2k / 8k (session 40, docs/PERFORMANCE.md) */
#ifndef GW_STAGES
#define GW_STAGES BT_STAGES
#endif
/* MT: the row tile (production: 64; bench/gpu_gather_wg measures 128) */
template <int MT> struct gw_cfg {
    static_assert(MT == 64 || MT == 128, "row tile 64 or 128");
    static constexpr int KS = MT * 32;  /* bytes of one k16 step's B tile: MT / 8 groups x 256 */
    static constexpr int XBYTES = 8 * KS; /* one 128-K step of x: MT rows x 128 bf16 */
    static constexpr int SMEM = 2 * XBYTES + GW_STAGES * GW_THREADS * BT_SLOT_BYTES;
};

__host__ __device__ constexpr uint32_t gw_xoff(int KS, int ks, int c8, int n) {
    return (uint32_t)(ks * KS + (n >> 3) * 256 + c8 * 128 + (n & 7) * 16);
}

/* The x tile's stores of a thread (t = tid % 4, nlo = tid / 4 % 8, q = tid / 32 % 4, nhi = tid / 128): piece i (rows
 * RPI i + 8 nhi + nlo, K offset 32 t + 8 q) at byte gw_xoff(KS, 2q, 0, RPI i + 8 nhi + nlo) + 4 t = that of piece 0
 * (gw_xbase) + PB i, as the 4-byte pairs (x0,x4) (x1,x5) (x2,x6) (x3,x7) of k16 steps 2q, 2q, 2q + 1, 2q + 1, core
 * matrices 0, 1, 0, 1 (gw_xput): one address a step, the rest immediate offsets. */
template <int MT> __device__ __forceinline__ uint8_t *gw_xbase(uint8_t *xs) {
    const int tid = threadIdx.x, t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, nhi = tid >> 7;
    return xs + gw_xoff(gw_cfg<MT>::KS, 2 * q, 0, nhi * 8 + nlo) + 4 * t;
}
/* one piece (x0..x7) at p (its byte in k16 step 2q, core matrix 0; KS: bytes of a k16 step) as the pairs (x0,x4)
 * (x1,x5) (x2,x6) (x3,x7) of k16 steps 2q, 2q, 2q + 1, 2q + 1, core matrices 0, 1, 0, 1 (also bench/gather_big.cuh) */
template <int KS> __device__ __forceinline__ void gw_xput4(uint8_t *p, uint4 w) {
    *reinterpret_cast<uint32_t *>(p) = __byte_perm(w.x, w.z, 0x5410);
    *reinterpret_cast<uint32_t *>(p + 128) = __byte_perm(w.x, w.z, 0x7632);
    *reinterpret_cast<uint32_t *>(p + KS) = __byte_perm(w.y, w.w, 0x5410);
    *reinterpret_cast<uint32_t *>(p + KS + 128) = __byte_perm(w.y, w.w, 0x7632);
}
template <int MT> __device__ __forceinline__ void gw_xput(uint8_t *b, int i, uint4 w) {
    constexpr int KS = gw_cfg<MT>::KS, RPI = GW_THREADS / 16;
    constexpr int PB = gw_xoff(KS, 0, 0, RPI); /* RPI rows = RPI / 8 core-matrix row groups of 256 bytes */
    static_assert(PB == RPI / 8 * 256, "piece i + 1 is RPI rows on");
    gw_xput4<KS>(b + PB * i, w);
}

/* x staging: thread (t = tid % 4, nlo = tid / 4 % 8, q = tid / 32 % 4, nhi = tid / 128) moves the
 * pieces of rows RPI i + 8 nhi + nlo (RPI = GW_THREADS / 16) at K offset 32 t + 8 q of every step (a warp's 4-byte stores
 * fall on 32 banks). */
template <int MT> struct gw_xstage {
    static_assert(MT * 16 % GW_THREADS == 0 && GW_THREADS % 128 == 0, "whole pieces a thread");
    static constexpr int NP = MT * 16 / GW_THREADS; /* pieces a thread */
    static constexpr int RPI = GW_THREADS / 16;     /* rows between a thread's pieces */
    const __nv_bfloat16 *src[NP];
    uint4 v[NP];
    int kc;
    __device__ __forceinline__ void init(const __nv_bfloat16 *x, int64_t row0, int rows, int rows_pad, int K,
                                         const uint32_t *xrow = nullptr, int xdiv = 1) {
        const int tid = threadIdx.x, t = tid & 3, nlo = (tid >> 2) & 7, q = (tid >> 5) & 3, nhi = tid >> 7;
        kc = 32 * t + 8 * q;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            const int r = i * RPI + nhi * 8 + nlo, rr = r < rows ? r : rows - 1;
            src[i] = r < rows_pad ? x + gq_x_row(xrow, xdiv, row0 + rr) * K + kc : nullptr;
        }
    }
    __device__ __forceinline__ void load(int k0, int K) {
        const bool kok = k0 + kc < K;
#pragma unroll
        for (int i = 0; i < NP; i++) {
            v[i] = make_uint4(0, 0, 0, 0);
            if (src[i] && kok) v[i] = __ldg(reinterpret_cast<const uint4 *>(src[i] + k0));
        }
    }
    __device__ __forceinline__ void store(uint8_t *xs) const {
        uint8_t *b = gw_xbase<MT>(xs);
#pragma unroll
        for (int i = 0; i < NP; i++)
            if (src[i]) gw_xput<MT>(b, i, v[i]);
    }
};

/* The x tile's wgmma descriptors (K-major core matrices: leading byte offset 128, stride byte offset 256): dlo =
 * the low word of wg_desc(buffer, 128, 256), computed once per item; the k16 step at `off` bytes into the
 * buffer adds off / 16 to its start address field (the shared window is < 2^18 bytes, so the field does not
 * overflow) - an integer add a wgmma in place of the descriptor's five operations. */
__device__ __forceinline__ uint32_t gw_desc_lo(uint32_t xbuf) { return (uint32_t)wg_desc(xbuf, 128, 256); }
__device__ __forceinline__ uint64_t gw_desc(uint32_t dlo, uint32_t off) {
    return (uint64_t)(dlo + (off >> 4)) | ((uint64_t)(256 >> 4) << 32);
}

/* One 128-K step of a warpgroup: the decode of bt_step (V = 4, bf16) and 8 wgmma, one commit group. */
template <int N, int KS, bool TL>
__device__ __forceinline__ void gw_step(float (&d)[N / 2], const uint32_t (&w0)[4], const uint32_t (&w1)[4],
                                        const uint32_t (&sa)[2], const uint32_t (&sb)[2], uint32_t dlo) {
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t pa[4], pb[4];
        bt_pairs<__nv_bfloat16, TL>(w0[q], pa);
        bt_pairs<__nv_bfloat16, TL>(w1[q], pb);
        const uint32_t s0 = sa[q >> 1], s1 = sb[q >> 1];
        const uint32_t ra0 = cu_mul_bf16x2(pa[0], s0), ra1 = cu_mul_bf16x2(pa[1], s0);
        const uint32_t ra2 = cu_mul_bf16x2(pa[2], s0), ra3 = cu_mul_bf16x2(pa[3], s0);
        const uint32_t rb0 = cu_mul_bf16x2(pb[0], s1), rb1 = cu_mul_bf16x2(pb[1], s1);
        const uint32_t rb2 = cu_mul_bf16x2(pb[2], s1), rb3 = cu_mul_bf16x2(pb[3], s1);
        wg_fence(); /* the A registers were just written */
        wg_rs<N, false>::mma(d, ra0, rb0, ra1, rb1, gw_desc(dlo, 2 * q * KS), 1);
#ifdef FP4MOE_INJECT_FAULT_WG_DESC /* deliberate fault (tests must catch it): k16 step 2q + 1 reads step 2q's x */
        wg_rs<N, false>::mma(d, ra2, rb2, ra3, rb3, gw_desc(dlo, 2 * q * KS), 1);
#else
        wg_rs<N, false>::mma(d, ra2, rb2, ra3, rb3, gw_desc(dlo, (2 * q + 1) * KS), 1);
#endif
    }
    wg_commit();
}

/* The epilogue of a warp's item: thread (g, t) holds features nw + g (acc[4i + h]) and nw + g + 8
 * (acc[4i + 2 + h]) of rows 8i + 2t + h; y = bf16(acc x global scale x kUndo), relu^2 if asked,
 * rows < rows and features < N only. */
template <int N>
__device__ __forceinline__ void gw_store(const gq_args &a, int e, int64_t row0, int rows, int nw, const float (&acc)[N / 2]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, NF = a.N;
    __nv_bfloat16 *y = static_cast<__nv_bfloat16 *>(a.y);
    const float mult = cu_expert_gs(a.gs, e) * bt_ops<__nv_bfloat16>::kUndo;
    const int na = nw + g, nb = nw + g + 8;
#pragma unroll
    for (int i = 0; i < N / 8; i++) {
        const int r = i * 8 + 2 * t;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (r + h < rows) {
                __nv_bfloat16 *yr = y + (row0 + r + h) * NF;
                if (na < NF) yr[na] = cu_out<__nv_bfloat16>(acc[4 * i + h] * mult, a.relu2);
                if (nb < NF) yr[nb] = cu_out<__nv_bfloat16>(acc[4 * i + 2 + h] * mult, a.relu2);
            }
        }
    }
}

/* One item (expert e, rows row0 .. row0 + rows - 1, features from nw for this warp) with N = rows
 * rounded up to 8. */
template <int N, int MT, bool TL>
__device__ __forceinline__ void gw_item(const gq_args &a, int e, int64_t row0, int rows, int nw, uint8_t *smem) {
    typedef gw_cfg<MT> cfg;
    uint8_t *xs0 = smem, *xs1 = smem + cfg::XBYTES;
    const uint32_t xd0 = gw_desc_lo(bt_smem_addr(xs0)), xd1 = gw_desc_lo(bt_smem_addr(xs1));
    const auto ring = bt_slot_soa<GW_STAGES * GW_THREADS>::at(smem + 2 * cfg::XBYTES, threadIdx.x);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int NF = a.N, K = a.K, KB = K >> 4, nsteps = (K + BT_KSTEP - 1) / BT_KSTEP;
    const __nv_bfloat16 *x = static_cast<const __nv_bfloat16 *>(a.x);
    const int64_t we = cu_weight_expert(e, a.E);
    const int64_t wr0 = we * NF + min(nw + g, NF - 1), wr1 = we * NF + min(nw + g + 8, NF - 1);
    const uint8_t *crow0 = a.codes + wr0 * (K >> 1), *crow1 = a.codes + wr1 * (K >> 1);
    const uint8_t *srow0 = a.scales + wr0 * KB, *srow1 = a.scales + wr1 * KB;
    const uint8_t *tpiece = TL ? gq_tiled_piece(a.codes, we, min(nw >> 4, (NF - 1) >> 4), 0, NF, K) : nullptr;
    const auto ws = [&] {
        if constexpr (TL) return bt_tstream::of(tpiece, lane);
        else return bt_wstream<false>{crow0, crow1, srow0, srow1, nullptr, t, lane, KB};
    }();
    /* a warpgroup whose 64 features are all past N (the last N-tile of the up projection's 1,856) skips the
     * products (uniform in it). Measured (session 21, call 4, dynamic order): 2,048-token prefill 43,201 tok/s
     * with it against 41,054 without (and 42,030 with neither change);
     * the same skip per warp in gq_batched_kernel and the w32 kernel cost 1-2% (512-token prefill, 64-sequence
     * decode - even where no warp is idle: the branch around the step changed their code), so they have none. */
    const bool active = (nw & ~63) < NF;

    float acc[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; i++) acc[i] = 0.0f;
    gw_xstage<MT> xr;
    xr.init(x, row0, rows, N, K, a.xrow, a.xdiv);
#pragma unroll
    for (int p = 0; p < GW_STAGES - 1; p++) {
        ws.issue(ring + p * GW_THREADS, p, nsteps);
        bt_cp_commit();
    }
    xr.load(0, K);
    xr.store(xs0);
    wg_fence_async_smem();
    __syncthreads();

    for (int s = 0; s < nsteps; s++) {
        uint32_t w0[4], w1[4], sa[2], sb[2];
        if (s + 1 < nsteps) xr.load((s + 1) * BT_KSTEP, K); /* first (session 27: 2k prefill +0.4%) */
        bt_cp_wait<GW_STAGES - 2>();
        uint32_t sw0, sw1;
        ws.read(ring + (s % GW_STAGES) * GW_THREADS, w0, w1, sw0, sw1);
        bt_scales4<__nv_bfloat16, TL>(sw0, sw1, sa, sb);
        const int nxt = s + GW_STAGES - 1;
        if (active) {
            gw_step<N, cfg::KS, TL>(acc, w0, w1, sa, sb, (s & 1) ? xd1 : xd0);
            wg_wait<0>(); /* this step's products are done: the other x buffer may be written */
        }
        if (s + 1 < nsteps) {
            xr.store((s & 1) ? xs0 : xs1);
            wg_fence_async_smem();
        }
        /* the weight copies of step s + 3 into the slots read in step s - 1, issued after the proxy fence: its
         * MEMBAR.ALL.CTA waits for this thread's outstanding copies, so copies issued before it (as until session 27)
         * had to land within the step. Measured (session 27, H200): 2,048-token prefill 48,054 -> 49,026 tok/s
         * (+2.0%), 512 tokens unchanged (the w32 kernel), the same bits. */
        ws.issue(ring + (nxt % GW_STAGES) * GW_THREADS, nxt, nsteps);
        bt_cp_commit();
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(acc[i])::"memory"); /* read after the wait */

    gw_store<N>(a, e, row0, rows, nw, acc);
    __syncthreads(); /* the x buffers and the ring are reused by the next item */
}

/* gw_item for N = 8 * n8 (1 <= n8 <= MT / 8) */
template <int MT, bool TL>
__device__ __forceinline__ void gw_item_n(int n8, const gq_args &a, int e, int64_t row0, int rows, int nw, uint8_t *smem) {
#define GW_CASE(n) case n: gw_item<8 * n, MT, TL>(a, e, row0, rows, nw, smem); break
    static_assert(MT == 64 || MT == 128, "row tile 64 or 128");
    switch (n8) {
    GW_CASE(1); GW_CASE(2); GW_CASE(3); GW_CASE(4); GW_CASE(5); GW_CASE(6); GW_CASE(7);
    default:
        if constexpr (MT == 64) {
            gw_item<64, MT, TL>(a, e, row0, rows, nw, smem);
        } else {
            switch (n8) {
            GW_CASE(8); GW_CASE(9); GW_CASE(10); GW_CASE(11); GW_CASE(12); GW_CASE(13); GW_CASE(14); GW_CASE(15);
            default: gw_item<MT, MT, TL>(a, e, row0, rows, nw, smem); break;
            }
        }
    }
#undef GW_CASE
}

template <int MT, bool TL, int MINB, int SKIP = 0>
__global__ void __launch_bounds__(GW_THREADS, MINB)
gq_batched_wg_kernel(gq_args a, const int *__restrict__ starts, const int *__restrict__ tile_off, int *ctr) {
    cu_pdl_entry();
    extern __shared__ __align__(128) uint8_t smem[];
    __shared__ int next_item[2];
    bt_sched sch = {ctr, 0};
    const int warp = threadIdx.x >> 5, wg = warp >> 2, wq = warp & 3;
    const int NT = (a.N + GW_NTILE - 1) / GW_NTILE;
    const int64_t total = (int64_t)tile_off[a.E] * NT;
    for (int64_t item = blockIdx.x; item < total; item = sch.next(item, next_item)) {
        sch.fetch(next_item, total);
        const bt_item it = bt_item_of<MT, SKIP>(item, a.E, NT, starts, tile_off);
        gw_item_n<MT, TL>((it.rows + 7) >> 3, a, it.e, it.row0, it.rows, it.ntile * GW_NTILE + wg * 64 + wq * 16, smem);
    }
    bt_zero_tail(static_cast<__nv_bfloat16 *>(a.y), starts, a.E, a.B, a.N);
}

/* A persistent grid for `kernel` (threads, smem dynamic shared memory): blocks an SM by the occupancy
 * calculator, at most `bound` (the items' upper bound). */
template <typename K>
static int persistent_grid(K kernel, int threads, int smem, int64_t bound, unsigned *grid) {
    int dev = 0, sms = 0, occ = 0;
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetDevice(&dev), "cudaGetDevice");
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    /* > 48 KB of dynamic shared memory needs the opt-in (idempotent, cheap) */
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                    "cudaFuncSetAttribute (dynamic shared memory)");
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, smem),
                    "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    int64_t g = (int64_t)sms * (occ > 0 ? occ : 1);
    *grid = (unsigned)(g < bound ? g : bound);
    return FP4MOE_OK;
}

/* The work counter of a launch (bt_sched): tile_off[E + 1] for experts (E > 1), or none (the static order)
 * for plain linears and the lm_head (E = 1: items of one size, nothing to balance) and for
 * FP4MOE_CUDA_GATHER_SCHED=static. Session 21, call 6: with the counter also on E = 1 launches the
 * 64-sequence decode step ran 4,716 tok/s against 4,742 with every launch static (= main before it); this
 * E > 1 rule itself was written after the device budget was spent (for that step it is the static run). */
static int *sched_counter(const gq_args *a, const int *tile_off) {
    if (a->E <= 1 || !strcmp(env_get(ENV_CUDA_GATHER_SCHED), "static")) return nullptr;
    return const_cast<int *>(tile_off) + a->E + 1;
}

/* the wgmma kernel with MT-row tiles (starts / tile_off (E + 2 ints) from gq_launch_runs with row tile MT; SKIP > 0:
 * the remainders of gq_launch_runs_split with row tile SKIP, tile_off its rem_off) */
template <int MT, bool TL, int MINB = (GW_WGS > 2 ? 1 : 2), int SKIP = 0>
static int launch_wg(const gq_args *a, const int *starts, const int *tile_off, cudaStream_t st) {
    const int64_t NT = (a->N + GW_NTILE - 1) / GW_NTILE;
    const int64_t bound = ((int64_t)a->B / MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
    unsigned grid = 0;
    const int rc = persistent_grid(gq_batched_wg_kernel<MT, TL, MINB, SKIP>, GW_THREADS, gw_cfg<MT>::SMEM, bound, &grid);
    if (rc) return rc;
    cu_launch(gq_batched_wg_kernel<MT, TL, MINB, SKIP>, grid, GW_THREADS, gw_cfg<MT>::SMEM, st, *a, starts, tile_off,
              sched_counter(a, tile_off));
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-batched kernel (wgmma)");
    return FP4MOE_OK;
}

/* gq_batched_w32_kernel (starts / tile_off from gq_launch_runs with row tile 32) */
static int launch_w32(const gq_args *a, const int *starts, const int *tile_off, cudaStream_t st) {
    const int64_t NT = (a->N + BW_NTILE - 1) / BW_NTILE;
    const int64_t bound = ((int64_t)a->B / BW_MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
    unsigned grid = 0;
    const int rc = persistent_grid(gq_batched_w32_kernel, BW_THREADS, BW_SMEM, bound, &grid);
    if (rc) return rc;
    cu_launch(gq_batched_w32_kernel, grid, BW_THREADS, BW_SMEM, st, *a, starts, tile_off, sched_counter(a, tile_off));
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-batched kernel (32 features a warp)");
    return FP4MOE_OK;
}

/* gq_moe_w32_kernel; see gq_launch_moe_pair (gather_cuda.cuh) */
static int launch_moe_w32(const gq_args *u, const gq_args *d, int *done, cudaStream_t st) {
    const int64_t NT = (u->N + BW_NTILE - 1) / BW_NTILE + (d->N + BW_NTILE - 1) / BW_NTILE;
    const int64_t bound = ((int64_t)u->B / BW_MT + 1 + (u->E < u->B ? u->E : u->B)) * NT;
    unsigned grid = 0;
    const int rc = persistent_grid(gq_moe_w32_kernel, BW_THREADS, BW_SMEM, bound, &grid);
    if (rc) return rc;
    const int *starts = u->runs, *tile_off = u->runs + u->E + 1;
    cu_launch(gq_moe_w32_kernel, grid, BW_THREADS, BW_SMEM, st, *u, *d, starts, tile_off,
              const_cast<int *>(tile_off) + u->E + 1, done);
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the fused MoE kernel (up + down)");
    return FP4MOE_OK;
}

template <typename T, typename TY, int MT, bool FAST, int V, bool TL = false, int MINB = bt_cfg<MT>::MINBLOCKS>
static int launch(const gq_args *a, const int *starts, const int *tile_off, cudaStream_t st) {
    typedef bt_cfg<MT> cfg;
    /* upper bound on the items: sum over experts of ceil(len/MT) <= B/MT + min(E, B) */
    const int64_t NT = (a->N + cfg::NTILE - 1) / cfg::NTILE;
    const int64_t bound = ((int64_t)a->B / MT + 1 + (a->E < a->B ? a->E : a->B)) * NT;
    unsigned grid = 0;
    const int rc = persistent_grid(gq_batched_kernel<T, TY, MT, FAST, MINB, V, TL>, cfg::THREADS, cfg::SMEM, bound, &grid);
    if (rc) return rc;
    /* 8-row tiles (64-sequence decode steps, "qmv, tiled by 8 rows") keep the static order: their items are
     * short and the dynamic one measured -0.4% / -0.9% on 64-sequence decode (session 21) */
    cu_launch(gq_batched_kernel<T, TY, MT, FAST, MINB, V, TL>, grid, cfg::THREADS, cfg::SMEM, st, *a, starts,
              tile_off, MT == GQ_QMV_TILE_ROWS ? nullptr : sched_counter(a, tile_off));
    FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaGetLastError(), "launch of the expert-batched kernel");
    return FP4MOE_OK;
}

template <typename T, typename TY, int V>
static int launch_dtype(const gq_args *a, int mt, const int *starts, const int *tile_off, cudaStream_t st) {
    /* fast path: cp.async of 16 code bytes and a 4-byte scale word per row and step */
    const bool fast = (a->K % 64) == 0 && ((uintptr_t)a->codes & 15) == 0 && ((uintptr_t)a->scales & 3) == 0;
    /* the wgmma kernel: bf16 in and out, experts (E > 1). A plain linear (E = 1) of 65..255 rows has
     * 2-4 row tiles of 64, i.e. few items of (then) 2 warpgroups for 132 SMs: the mma.sync kernel's 64-feature
     * items measured faster there (at 64 rows, session 10: 64-sequence decode 4,307 vs 4,695 tok/s,
     * docs/PERFORMANCE.md; 64 rows take 8-row tiles up to N = 8,192 since session 23, and bf16 ones of 33-64 rows
     * with N >= 2,048 gq_dense_kg_kernel since session 24: launch_tiled). */
    constexpr bool WGT = std::is_same<T, __nv_bfloat16>::value && std::is_same<TY, __nv_bfloat16>::value;
    const bool WG = WGT && a->E > 1;
    if (a->tiled) { /* the tiled layout: the fast path only */
        if (!fast)
            return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda: tiled weights need K %% 64 == 0 (K=%d)", a->K);
        if (mt == 64 && WG) return launch_wg<64, true>(a, starts, tile_off, st);
        if (mt == 64) return launch<T, TY, 64, true, V, true>(a, starts, tile_off, st);
        if (mt == GQ_QMV_TILE_ROWS) return launch<T, TY, GQ_QMV_TILE_ROWS, true, V, true>(a, starts, tile_off, st);
        if (BT_W32 && WG) return launch_w32(a, starts, tile_off, st); /* 32-row tiles, bf16, experts */
        return launch<T, TY, 32, true, V, true>(a, starts, tile_off, st);
    }
    if (mt == 64 && WG && fast) return launch_wg<64, false>(a, starts, tile_off, st);
    if (mt == 64) return fast ? launch<T, TY, 64, true, V>(a, starts, tile_off, st) : launch<T, TY, 64, false, V>(a, starts, tile_off, st);
    if (mt == GQ_QMV_TILE_ROWS)
        return fast ? launch<T, TY, GQ_QMV_TILE_ROWS, true, V>(a, starts, tile_off, st)
                    : launch<T, TY, GQ_QMV_TILE_ROWS, false, V>(a, starts, tile_off, st);
    return fast ? launch<T, TY, 32, true, V>(a, starts, tile_off, st) : launch<T, TY, 32, false, V>(a, starts, tile_off, st);
}

#ifndef GQ_E1_IN_GRAPHS
#define GQ_E1_IN_GRAPHS 0 /* 1: the plain linears' runs table in graph captures too (measured slower, below) */
#endif
/* The kernel with row tile mt (8, 32 or 64): the runs on the device (or made beforehand), then the tiles. f32out:
 * x is bf16 and y fp32. */
static int launch_tiled(const gq_args *a, fp4moe_dtype dtype, int mt, cudaStream_t st, bool f32out = false) {
    if (kg_fits(a, dtype, f32out)) return launch_kg(a, st); /* whatever the row tile: the same bits on every route */
    /* a plain linear: starts {0, B}, tile offsets {0, tiles} from the table, no runs kernel - in eager launches (the
     * prefill: 128 + 64 tokens +4.6% on the H200, session 33); in a captured decode step (96 sequences) the same
     * measured -4.1%: there the 1-block runs kernel before the persistent grid also held its early (PDL) launch back
     * until the kernel before it (a norm) had finished */
    bool e1 = a->E == 1 && a->e1_pairs;
    if (e1 && !GQ_E1_IN_GRAPHS) {
        cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
        FP4MOE_CUDA_TRY("gather_qmm_cuda", cudaStreamIsCapturing(st, &cs), "cudaStreamIsCapturing");
        e1 = cs == cudaStreamCaptureStatusNone;
    }
    if ((a->runs && a->runs_mt == mt) || e1) { /* runs made beforehand (gq_runs): no scratch, no runs kernel */
#ifdef FP4MOE_INJECT_FAULT_E1_RUNS /* deliberate fault (tests must catch it): the plain linear's last row left out */
        const int *starts = e1 ? a->e1_pairs + 2 * (a->B - 1) : a->runs;
#else
        const int *starts = e1 ? a->e1_pairs + 2 * a->B : a->runs;
#endif
        const int *tile_off = e1 ? a->e1_pairs + 2 * ((a->B + mt - 1) / mt) : a->runs + a->E + 1;
        if (f32out) return launch_dtype<__nv_bfloat16, float, 4>(a, mt, starts, tile_off, st);
        if (dtype == FP4MOE_F16) return launch_dtype<__half, __half, 4>(a, mt, starts, tile_off, st);
        return launch_dtype<__nv_bfloat16, __nv_bfloat16, 4>(a, mt, starts, tile_off, st);
    }
    int *buf = NULL;
    int rc = gq_scratch_alloc((void **)&buf, (2 * (size_t)a->E + 3) * sizeof(int), st); /* starts, tile_off, counter */
    if (rc != FP4MOE_OK) return rc;
    int *starts = buf, *tile_off = buf + a->E + 1;
    rc = gq_launch_runs(a, mt, starts, tile_off, st);
    if (rc == FP4MOE_OK) {
        if (f32out) rc = launch_dtype<__nv_bfloat16, float, 4>(a, mt, starts, tile_off, st);
        else if (dtype == FP4MOE_F16) rc = launch_dtype<__half, __half, 4>(a, mt, starts, tile_off, st);
        else rc = launch_dtype<__nv_bfloat16, __nv_bfloat16, 4>(a, mt, starts, tile_off, st);
    }
    const int rc2 = gq_scratch_free(buf, st);
    return rc != FP4MOE_OK ? rc : rc2;
}

int gq_launch_bf16_f32out(const gq_args *a, cudaStream_t st) {
    return launch_tiled(a, FP4MOE_BF16, gq_batched_row_tile(a, FP4MOE_BF16), st, true);
}

int gq_launch_batched(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    return launch_tiled(a, dtype, gq_batched_row_tile(a, dtype), st);
}

int gq_launch_qmv_tiled(const gq_args *a, fp4moe_dtype dtype, cudaStream_t st) {
    return launch_tiled(a, dtype, GQ_QMV_TILE_ROWS, st);
}

int64_t gq_moe_done_ints(int64_t B, int64_t E) { return B / BW_MT + 1 + (E < B ? E : B); }

int gq_launch_moe_pair(const gq_args *u, const gq_args *d, int *done, int64_t done_n, cudaStream_t st) {
    const bool fast = u->K % 64 == 0 && d->K % 64 == 0 && ((uintptr_t)u->codes & 15) == 0 && ((uintptr_t)d->codes & 15) == 0;
    if (!BT_W32 || !u->tiled || !d->tiled || !fast || u->E < 2 || u->E != d->E || u->B != d->B || u->idx != d->idx ||
        d->x != u->y || !u->relu2 || d->relu2 || d->xrow || !u->runs || u->runs != d->runs || u->runs_mt != BW_MT ||
        d->runs_mt != BW_MT || gq_batched_row_tile(u, FP4MOE_BF16) != BW_MT || !done || done_n < gq_moe_done_ints(u->B, u->E))
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe pair): not two 32-row w32 calls on one set of runs");
    if (!sched_counter(u, u->runs + u->E + 1)) /* FP4MOE_CUDA_GATHER_SCHED=static: the two calls keep that order */
        return fp4moe_set_error(FP4MOE_EUNSUPPORTED, "gather_qmm_cuda (moe pair): FP4MOE_CUDA_GATHER_SCHED=static");
    return launch_moe_w32(u, d, done, st);
}

#include "kernels/cuda/gather_big.cuh" /* gq_launch_moe_big: a MoE layer on 128 x 256 tiles */
