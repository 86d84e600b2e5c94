/* The tiled layout's code arrangement (src/kernels/tiled_codes.h), checked on the CPU on every one of the
 * 2^32 code words: tc_pairs of the arranged word equals the checkpoint decode of the word (all four bf16x2
 * pairs, bit for bit), and tc_unarrange undoes tc_arrange. The GPU kernels compile the same functions; that
 * they use them where they should is checked on the GPU (tests/gpu/test_ops_gpu.c: every route on the tiled
 * layout bitwise equal to the checkpoint layout). Deliberate fault: FP4MOE_INJECT_FAULT_TILED_CODES (one
 * multiplier term of the fourth pair dropped) must fail here. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bit_positions),
        cmocka_unit_test(test_every_word),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
