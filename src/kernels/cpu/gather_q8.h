/* Internal: the W4A8 activation quantizer and the lane layout shared by the CPU q8 kernels
 * (gather_cpu.h, q8_* fields). Static inline, so that each kernel file compiles it with its own
 * instruction set; every step is an exact IEEE operation (max, division, round-to-nearest-even),
 * so the int8 values and scales are bit-identical on every ISA and equal to fp4moe_q8_quantize.
 *
 * Quantization (docs: include/fp4moe/gather_qmm.h, "W4A8"): per activation row, per block of 16
 * elements (the NVFP4 weight block), d = max|x| / 127 in fp32 and q = round_half_even(x / d)
 * clamped to [-127, 127] (q = 0 where d = 0; a block holding a NaN or an infinity: q = 0, d = NaN).
 *
 * Layout, for a kernel with group size G (a multiple of 16; K is padded to Kp = roundup(K, G)
 * with zero activations): group g holds elements [gG, gG + G); its first G/2 bytes are the even
 * elements gG + 2i, the last G/2 the odd ones gG + 2i + 1 (i < G/2) -- the order in which the low
 * and the high nibbles of G/2 NVFP4 code bytes come out of one AND and one shift. "Lane" l < G/8
 * of a group covers bytes [4l, 4l + 4) of each half: even and odd elements 8l .. 8l + 7 of the
 * group, all in block l / 2. Per lane the row also keeps its block's d (xs, fp32) and the
 * correction -12 * sum(q over the lane's 8 elements) (xc, int32), because the weights are stored
 * as unsigned bytes u = 2 * e2m1 + 12 (0..24) for the u8 x s8 dot instructions:
 *     sum(q * 2 * e2m1) = sum(q * u) + xc.
 * A weight row decoded for the q8 kernels: wq (Kp bytes u, the same order; padding u = 12) and
 * ws (Kp / 8 fp32 per row: e4m3(block scale) / 2 of the lane's block; padding 0), so that
 *     y = sum over lanes of float(sum(q * u) + xc) * (ws * xs). */
#ifndef FP4MOE_KERNELS_CPU_GATHER_Q8_H
#define FP4MOE_KERNELS_CPU_GATHER_Q8_H

#include <math.h>
#include <stdint.h>

static inline int64_t q8_padded_k(int64_t K, int G) { return (K + G - 1) / G * G; }

/* One block of 16 activations -> q (16 int8) and the returned scale d. A NaN or infinite activation makes
 * d NaN and q zeros, so that every product with the block is NaN (as in float mode, where the NaN reaches the
 * logits and the forward reports it); max and a clamped round would hide it (NaN -> a finite int8). */
static inline float q8_quantize_block(const float *x, int8_t *q) {
    float amax = 0.0f;
    for (int i = 0; i < 16; i++) {
        const float a = fabsf(x[i]);
        amax = (a > amax || a != a) ? a : amax; /* a NaN, once taken, stays (a > NaN is false) */
    }
    if (!(amax <= 3.4028235e38f)) { /* NaN or infinity */
        for (int i = 0; i < 16; i++) q[i] = 0;
        return NAN;
    }
    const float d = amax / 127.0f;
    for (int i = 0; i < 16; i++) {
        float v = d > 0.0f ? nearbyintf(x[i] / d) : 0.0f;
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        q[i] = (int8_t)v;
    }
    return d;
}

/* One row x (K fp32, K % 16 == 0) -> xq (Kp int8), xs and xc (Kp / 8 each) in the layout of
 * group size G. */
static inline void q8_quantize_row(const float *x, int64_t K, int G, int8_t *xq, float *xs, int32_t *xc) {
    const int64_t Kp = q8_padded_k(K, G);
    for (int64_t g0 = 0; g0 < Kp; g0 += G) {
        int8_t *q = xq + g0;
        for (int64_t b = 0; b < G / 16; b++) {
            const int64_t k0 = g0 + 16 * b;
            int8_t qb[16] = {0};
            const float d = k0 < K ? q8_quantize_block(x + k0, qb) : 0.0f;
            /* block b = lanes 2b, 2b + 1: even / odd elements 16b + 2i (+1), i < 8 */
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < 8; i++) {
                q[8 * b + i] = qb[2 * i];
                q[G / 2 + 8 * b + i] = qb[2 * i + 1];
                if (i < 4) s0 += qb[2 * i] + qb[2 * i + 1];
                else s1 += qb[2 * i] + qb[2 * i + 1];
            }
            const int64_t l = g0 / 8 + 2 * b;
#ifdef FP4MOE_INJECT_FAULT_Q8_OFFSET /* deliberate fault (tests must catch it): no -12 * sum(q) */
            s0 = s1 = 0;
#endif
            xs[l] = xs[l + 1] = d;
            xc[l] = -12 * s0;
            xc[l + 1] = -12 * s1;
        }
    }
}

#endif
