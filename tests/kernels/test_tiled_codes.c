/* The tiled layout's code arrangement (src/kernels/tiled_codes.h), checked on the CPU on every one of the
 * 2^32 code words: tc_pairs of the arranged word equals the checkpoint decode of the word (all four bf16x2
 * pairs, bit for bit), and tc_unarrange undoes tc_arrange. The GPU kernels compile the same functions; that
 * they use them where they should is checked on the GPU (tests/gpu/test_ops_gpu.c: every route on the tiled
 * layout bitwise equal to the checkpoint layout). Deliberate faults: FP4MOE_INJECT_FAULT_TILED_CODES (one
 * multiplier term of the fourth pair dropped) and FP4MOE_INJECT_FAULT_TILED_SIGN (a negative block scale's
 * sign not folded into the codes) must fail here.
 * The block scales' encoding (tc_scale_code, tc_block_word and the multipliers): every code with every scale
 * byte gives the checkpoint's product bit for bit (signed zeros included), and the bf16 / f16 / fp32
 * multipliers are the exact values of |scale| * 2^118 / 2^7 / 1. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/tiled_codes.h"

#ifdef FP4MOE_INJECT_FAULT_TILED_CODES
static void pairs_under_test(uint32_t a, uint32_t p[4]) {
    tc_pairs(a, p);
    p[3] = ((tc_rotl6(a) & 0x001B001Bu) * 0x1080u) & TC_MASK; /* 2^2 dropped */
}
#else
static void pairs_under_test(uint32_t a, uint32_t p[4]) { tc_pairs(a, p); }
#endif

static int word_ok(uint32_t w) {
    const uint32_t a = tc_arrange(w);
    uint32_t p[4];
    pairs_under_test(a, p);
    return (tc_unarrange(a) == w) & (p[0] == tc_pair_ref(w, 0)) & (p[1] == tc_pair_ref(w, 1)) &
           (p[2] == tc_pair_ref(w, 2)) & (p[3] == tc_pair_ref(w, 3));
}

/* every word (a branch-free count over 2^16 x 2^16, which the compiler vectorizes); the first mismatch is
 * reported with the word */
static void test_every_word(void **state) {
    (void)state;
    uint64_t bad = 0;
    for (uint32_t hi = 0; hi < 0x10000u; hi++) {
        uint32_t b = 0;
        for (uint32_t lo = 0; lo < 0x10000u; lo++) b += (uint32_t)!word_ok(hi << 16 | lo);
        bad += b;
    }
    if (bad) {
        uint32_t w = 0;
        while (word_ok(w)) w++;
        fail_msg("%llu of 2^32 code words wrong, the first 0x%08x (%s)", (unsigned long long)bad, w,
                 tc_unarrange(tc_arrange(w)) != w ? "tc_unarrange(tc_arrange(w)) != w" : "a decoded pair");
    }
}

/* the arrangement is a permutation of the 32 bits (each bit to a distinct bit), the one in the header's comment */
static void test_bit_positions(void **state) {
    (void)state;
    static const int pos[8][4] = {{6, 7, 8, 15},     {3, 4, 5, 12},     {0, 1, 2, 9},      {30, 26, 27, 29},
                                  {22, 23, 24, 31}, {19, 20, 21, 28}, {16, 17, 18, 25}, {14, 10, 11, 13}};
    uint32_t seen = 0;
    for (int c = 0; c < 8; c++)
        for (int j = 0; j < 4; j++) {
            const uint32_t a = tc_arrange(1u << (4 * c + j));
            assert_int_equal(a, 1u << pos[c][j]);
            seen |= a;
        }
    assert_int_equal(seen, 0xffffffffu);
}

/* spec NVFP4.md section 1 */
static double e4m3_value(uint32_t b) {
    const int e = (int)((b >> 3) & 15u), m = (int)(b & 7u);
    const double v = e == 0 ? m / 8.0 * ldexp(1.0, -6) : (1.0 + m / 8.0) * ldexp(1.0, e - 7);
    return (b & 0x80u) ? -v : v;
}
static double e2m1_value(uint32_t c) {
    static const double t[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
    return (c & 8u) ? -t[c & 7u] : t[c & 7u];
}
static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
/* the f16 bits of a positive normal value exact in f16 */
static uint32_t f16_bits(double v) {
    int ex;
    const double fr = frexp(v, &ex); /* v = fr 2^ex, fr in [0.5, 1) */
    return (uint32_t)(ex - 1 + 15) << 10 | (uint32_t)((fr * 2.0 - 1.0) * 1024.0);
}

/* every code (16) with every finite scale byte (254): the tiled product equals the checkpoint's, bit for bit
 * as fp32 (signed zeros too), and the kernels' bf16 / f16 / fp32 multipliers are exactly |s| 2^118, |s| 2^7
 * and |s| */
static void test_scales(void **state) {
    (void)state;
    for (uint32_t b = 0; b < 256; b++) {
        if ((b & 0x7fu) == 0x7fu) continue; /* NaN: refused by the loader */
        const double s = e4m3_value(b);
        const uint32_t code = tc_scale_code(b);
        assert_true(code <= 151u);
        assert_true((code == 0) == (s == 0.0));
        const float sf = tc_scale_f32(code);
        if (f32_bits(sf) != f32_bits((float)fabs(s))) fail_msg("scale byte 0x%02x: |s| %.9g, got %.9g", b, fabs(s), sf);
        for (uint32_t c = 0; c < 16; c++) {
            const uint32_t w = tc_block_word(c * 0x11111111u, b); /* the code in all 8 places */
            for (int k = 0; k < 8; k++) assert_int_equal((w >> (4 * k)) & 15u, w & 15u);
            const float ref = (float)(e2m1_value(c) * s), got = (float)(e2m1_value(w & 15u) * (double)sf);
            if (f32_bits(ref) != f32_bits(got))
                fail_msg("code %u, scale byte 0x%02x: checkpoint product %g (0x%08x), tiled %g (0x%08x)", c, b, ref,
                         f32_bits(ref), got, f32_bits(got));
        }
        if (code) {
            const uint32_t bf = f32_bits((float)(fabs(s) * ldexp(1.0, 118))) >> 16, hf = f16_bits(fabs(s) * 128.0);
            assert_int_equal(f32_bits((float)(fabs(s) * ldexp(1.0, 118))) & 0xffffu, 0); /* exact in bf16 */
            for (int k = 0; k < 4; k++) { /* byte k of the word, in both halves */
                const uint32_t v = code << (8 * k) | (0x5au << (8 * ((k + 1) & 3))), sel = 0x4040u | (uint32_t)k * 0x101u;
                const uint32_t pb = tc_scale_bf16x2(v, sel), ph = tc_scale_f16x2(v, sel);
                if (pb != (bf | bf << 16) || ph != (hf | hf << 16))
                    fail_msg("scale byte 0x%02x (code %u, byte %d): bf16x2 0x%08x (want 0x%08x), f16x2 0x%08x (want 0x%08x)",
                             b, code, k, pb, bf | bf << 16, ph, hf | hf << 16);
            }
        }
    }
    /* two codes a word: bytes 0, 1 -> halves 0, 1; bytes 2, 3 likewise */
    const uint32_t v = tc_scale_code(0x38) | tc_scale_code(0x7e) << 8 | tc_scale_code(0x01) << 16 | tc_scale_code(0x45) << 24;
    assert_int_equal(tc_scale_bf16x2(v, 0x4140), (f32_bits(0x1p118f) >> 16) | (f32_bits(448.0f * 0x1p118f) >> 16) << 16);
    assert_int_equal(tc_scale_f16x2(v, 0x4342), f16_bits(0x1p-9 * 128.0) | f16_bits(e4m3_value(0x45) * 128.0) << 16);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bit_positions),
        cmocka_unit_test(test_every_word),
        cmocka_unit_test(test_scales),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
