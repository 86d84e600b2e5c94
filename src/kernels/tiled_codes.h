/* Internal: the bit arrangement of the E2M1 codes in the CUDA backend's tiled weight layout
 * (src/kernels/cuda/gather_cuda.cuh), shared by the CUDA kernels and the CPU test that checks it on every
 * one of the 2^32 code words (tests/test_tiled_codes.c).
 *
 * A checkpoint code word w holds 8 E2M1 codes, code c in bits 4c .. 4c+3 (bit 0: mantissa, bits 1-2:
 * exponent, bit 3: sign; spec NVFP4.md). The tensor-core kernels multiply the codes as four bf16x2 pairs
 * p[k] = (code k, code k + 4), k = 0..3, each a bf16 bit pattern holding e2m1 * 2^-126: the magnitude bits
 * of the low code at bits 6-8 and its sign at bit 15, those of the high code at 22-24 and 31 (the mask
 * 0x81C081C0). From a checkpoint word that takes an AND, an integer multiply and an AND a pair, plus one
 * shift a word (cu_e2m1x2_bf16_mul: 13 instructions a word). The tiled layout stores each word with its
 * 32 bits permuted (tc_arrange) so that the same four patterns come out of 8 instructions (tc_pairs):
 *   p0 = A & M                      pair (0, 4) stored at the mask's own bits;
 *   p1 = (A << 3) & M               pair (1, 5) stored 3 bits lower;
 *   p2 = rotl(A, 6) & M             pair (2, 6) stored 6 bits lower;
 *   p3 = ((rotl(A, 6) & 0x001B001B) * 0x1084) & M
 *                                   pair (3, 7) in the 8 bits left over ({10, 11, 13, 14, 26, 27, 29, 30}),
 *                                   moved by one multiply: 0x1084 = 2^2 + 2^7 + 2^12, the three shifts the
 *                                   leftover bits need; the 24 partial products fall on distinct bits
 *                                   (no carries), those outside M are masked off.
 * The patterns are bit for bit those of the checkpoint word's decode, so every kernel keeps its results
 * (the tiled-vs-checkpoint tests compare bitwise). Found by an exhaustive search over three rotations and a
 * multiplier of up to four terms (session 32, docs/GPU-NOTES.md). tc_unarrange is the inverse (for the
 * kernels that need the checkpoint word: the dequantization, the f16 decode). */
#ifndef FP4MOE_KERNELS_TILED_CODES_H
#define FP4MOE_KERNELS_TILED_CODES_H

#include <stdint.h>

#ifdef __CUDACC__
#define TC_FN __host__ __device__ __forceinline__
#else
#define TC_FN static inline
#endif

#define TC_MASK 0x81C081C0u

TC_FN uint32_t tc_rotl6(uint32_t a) {
#if defined(__CUDA_ARCH__)
    return __funnelshift_l(a, a, 6);
#else
    return (a << 6) | (a >> 26);
#endif
}

/* The checkpoint word w in the tiled arrangement: bit 4c + j of w (code c, bit j) moves to bit
 * pos[c][j], pos = {6,7,8,15}, {3,4,5,12}, {0,1,2,9}, {30,26,27,29}, {22,23,24,31}, {19,20,21,28},
 * {16,17,18,25}, {14,10,11,13} - the terms below, grouped by the distance the bits move. */
TC_FN uint32_t tc_arrange(uint32_t w) {
    return ((w & 0x60000000u) >> 19) | ((w & 0x80000000u) >> 18) | ((w & 0x10000000u) >> 14) |
           ((w & 0x07000700u) >> 8) | ((w & 0x08000800u) >> 2) | ((w & 0x00700070u) >> 1) |
           ((w & 0x00800080u) << 5) | ((w & 0x00070007u) << 6) | ((w & 0x00080008u) << 12) |
           ((w & 0x00006000u) << 13) | ((w & 0x00008000u) << 14) | ((w & 0x00001000u) << 18);
}

/* The inverse of tc_arrange. */
TC_FN uint32_t tc_unarrange(uint32_t a) {
    return ((a & 0x40000000u) >> 18) | ((a & 0x20000000u) >> 14) | ((a & 0x0c000000u) >> 13) |
           ((a & 0x80008000u) >> 12) | ((a & 0x01c001c0u) >> 6) | ((a & 0x10001000u) >> 5) |
           ((a & 0x00380038u) << 1) | ((a & 0x02000200u) << 2) | ((a & 0x00070007u) << 8) |
           ((a & 0x00004000u) << 14) | ((a & 0x00002000u) << 18) | ((a & 0x00000c00u) << 19);
}

/* The four bf16x2 code pairs (code k, code k + 4) of an arranged word a, each e2m1 * 2^-126 (see the top) */
TC_FN void tc_pairs(uint32_t a, uint32_t p[4]) {
    const uint32_t r6 = tc_rotl6(a);
    p[0] = a & TC_MASK;
    p[1] = (a << 3) & TC_MASK;
    p[2] = r6 & TC_MASK;
    p[3] = ((r6 & 0x001B001Bu) * 0x1084u) & TC_MASK;
}

/* The same pairs from a checkpoint word (the reference: each code's magnitude to bits 6-8, sign to 15) */
TC_FN uint32_t tc_pair_ref(uint32_t w, int k) {
    const uint32_t v = w >> (4 * k);
    return ((v & 0x00070007u) << 6) | ((v & 0x00080008u) << 12);
}

/* ---- the block scales of the tiled layout ---------------------------------------------------------------
 * Each E4M3 block-scale byte b (spec NVFP4.md section 1) is stored re-encoded, so that the kernels get the
 * packed bf16 / f16 multiplier of a scale pair from two integer instructions (a byte permute and one IMAD)
 * instead of the fp8 -> f16 -> f32 -> bf16 conversions (13 instructions a scale word: session 35,
 * docs/GPU-NOTES.md). Every nonzero finite |e4m3| value is 1.mmm x 2^E with E in -9 .. 8 (the subnormals
 * 0x01..0x07 normalised), so the byte
 *     tc_scale_code(b) = (E + 10) << 3 | mmm        (1 .. 151), and 0 for b = +-0
 * holds it, and the multipliers the kernels use are plain adds on it:
 *     bf16 bits of |s| * 2^118 = code << 4 + 0x7580  (exponent field E + 245 = (E + 10) + 235)
 *     f16 bits of |s| * 2^7    = code << 7 + 0x3000  (exponent field E + 22 = (E + 10) + 12)
 *     fp32 bits of |s|         = code << 20 + 0x3A800000.
 * The scale's sign and zero go into the block's codes instead (tc_block_word, before tc_arrange): a negative
 * scale flips the sign bit of its 16 codes, a zero scale keeps only their sign bits. Every product
 * e2m1(code) * scale is exact in bf16 / f16 / fp32 (spec section 1), and (-c) * |s| = c * (-s), +-0 * |s| =
 * c * (+-0) with the same sign of zero, so the tiled layout's products are bit for bit the checkpoint's,
 * signed zeros included (tests/kernels/test_tiled_codes: every code with every scale byte). The NaN bytes
 * 0x7F / 0xFF (corrupt data, refused by the loader) become 480. */
TC_FN uint32_t tc_scale_code(uint32_t b) {
    const uint32_t e = (b >> 3) & 15u, m = b & 7u;
    if (e) return (e + 3u) << 3 | m; /* E = e - 7 */
    if (m >= 4u) return 3u << 3 | ((m << 1) & 7u); /* m 2^-9 = 1.x 2^-7 */
    if (m >= 2u) return 2u << 3 | ((m << 2) & 7u); /* 1.x 2^-8 */
    return m ? 1u << 3 : 0u;                       /* 2^-9, or zero */
}

/* A checkpoint code word (8 codes of one block) with its block scale's sign and zero folded in (see above). */
TC_FN uint32_t tc_block_word(uint32_t w, uint32_t b) {
#ifndef FP4MOE_INJECT_FAULT_TILED_SIGN /* deliberate fault (tests must catch it): a negative scale's sign lost */
    if (b & 0x80u) w ^= 0x88888888u;
#endif
    if (!(b & 0x7fu)) w &= 0x88888888u;
    return w;
}

/* __byte_perm(v, 0, sel): bytes of v (selector nibbles 0-3) or zero (4) */
TC_FN uint32_t tc_perm0(uint32_t v, uint32_t sel) {
#if defined(__CUDA_ARCH__)
    return __byte_perm(v, 0u, sel);
#else
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) {
        const uint32_t k = (sel >> (4 * i)) & 7u;
        r |= (k < 4 ? (v >> (8 * k)) & 0xffu : 0u) << (8 * i);
    }
    return r;
#endif
}

/* The bf16x2 multiplier (|s| * 2^118) of two scale codes of the word v chosen by the byte-permute selector sel,
 * one for each half: 0x4140 = bytes 0 and 1, 0x4342 = bytes 2 and 3, 0x4k4k = byte k in both halves. */
TC_FN uint32_t tc_scale_bf16x2(uint32_t v, uint32_t sel) { return tc_perm0(v, sel) * 16u + 0x75807580u; }
/* The f16x2 multiplier (|s| * 2^7), as tc_scale_bf16x2 */
TC_FN uint32_t tc_scale_f16x2(uint32_t v, uint32_t sel) { return tc_perm0(v, sel) * 128u + 0x30003000u; }
/* |s| of one scale code, fp32 */
TC_FN float tc_scale_f32(uint32_t code) {
    union { uint32_t u; float f; } r;
    r.u = code ? (code << 20) + 0x3A800000u : 0u;
    return r.f;
}

#endif
