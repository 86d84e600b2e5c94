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

#endif
