/* gather_qmm on the CPU: the oracle against a hand-computed case, invalid arguments, route names,
 * and the route predicate with its environment switches (spec NVFP4.md section 4). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "testutil.h"

/* Two experts of 2 x 16 weights, worked out by hand:
 *   expert 1 row 0: codes 0x21 (even k: code 1 = 0.5, odd k: code 2 = 1.0), scale 0x38 (1.0), gs 4
 *   expert 1 row 1: codes 0x9F (even k: code 15 = -6, odd k: code 9 = -0.5), scale 0x01 (2^-9), gs 4
 *   expert 0 rows:  codes 0x77 (6 everywhere), scale 0x08 (2^-6), gs 0.25; row 1 scale 0 (zero)
 * x = 1, 2, ..., 16: sum over even k of x = 64, over odd k = 72.
 *   y[., 0] for expert 1 = 4 * (0.5*64 + 1.0*72)           = 416
 *   y[., 1] for expert 1 = 4 * 2^-9 * (-6*64 - 0.5*72)    = -3.28125
 *   y[., 0] for expert 0 = 0.25 * 2^-6 * 6 * (64 + 72)     = 3.1875
 *   y[., 1] for expert 0 = 0 (scale byte 0)
 * Row 2 has idx 2 >= E: zeros. */
static void hand_case(fp4moe_nvfp4_weights *w, uint8_t codes[32], uint8_t scales[4], float gs[2]) {
    for (int i = 0; i < 8; i++) {
        codes[0 * 8 + i] = 0x77; /* expert 0 row 0 */
        codes[1 * 8 + i] = 0x77; /* expert 0 row 1 */
        codes[2 * 8 + i] = 0x21; /* expert 1 row 0 */
        codes[3 * 8 + i] = 0x9F; /* expert 1 row 1 */
    }
    scales[0] = 0x08; scales[1] = 0x00; scales[2] = 0x38; scales[3] = 0x01;
    gs[0] = 0.25f; gs[1] = 4.0f;
    *w = (fp4moe_nvfp4_weights){codes, scales, gs, 2, 2, 16};
}

static void test_reference_hand_computed(void **state) {
    uint8_t codes[32], scales[4];
    float gs[2], x[3 * 16];
    fp4moe_nvfp4_weights w;
    hand_case(&w, codes, scales, gs);
    for (int b = 0; b < 3; b++)
        for (int k = 0; k < 16; k++) x[b * 16 + k] = (float)(k + 1);
    const uint32_t idx[3] = {1, 0, 2};
    const double want[6] = {416.0, -3.28125, 3.1875, 0.0, 0.0, 0.0};
    double y[6];
    for (int d = 0; d < 3; d++) { /* x = 1..16 is exact in f32, f16 and bf16 */
        const fp4moe_dtype dt = (fp4moe_dtype)d;
        uint16_t xh[48];
        const void *xp = x;
        if (dt != FP4MOE_F32) {
            fp4moe_from_f32(x, 48, dt, xh);
            xp = xh;
        }
        assert_int_equal(fp4moe_gather_qmm_ref_f64(&w, xp, dt, idx, 3, y), FP4MOE_OK);
        for (int i = 0; i < 6; i++) assert_true(y[i] == want[i]);
    }
    /* the routes agree with the hand result too (f32: all these values are exact) */
    for (int r = FP4MOE_ROUTE_QMV; r <= FP4MOE_ROUTE_DEQUANT_GEMM; r++) {
        const uint32_t sidx[3] = {0, 1, 2};
        const double swant[6] = {3.1875, 0.0, 416.0, -3.28125, 0.0, 0.0};
        float ys[3 * 2];
        tu_poison(ys, FP4MOE_F32, 6);
        assert_int_equal(fp4moe_gather_qmm_cpu_route(&w, x, FP4MOE_F32, sidx, 3, 1, (fp4moe_route)r, ys),
                         FP4MOE_OK);
        for (int i = 0; i < 6; i++) assert_true(ys[i] == swant[i]);
    }
}

static void expect_error(int st, int want, const char *needle) {
    assert_int_equal(st, want);
    const char *msg = fp4moe_last_error();
    assert_non_null(msg);
    if (!strstr(msg, needle)) fail_msg("error message '%s' does not mention '%s'", msg, needle);
}

static void test_invalid_arguments(void **state) {
    uint8_t codes[32], scales[4];
    float gs[2], x[64] = {1}, y[64];
    double y64[64];
    const uint32_t idx[4] = {0, 0, 1, 1}, unsorted[4] = {1, 0, 1, 0};
    fp4moe_nvfp4_weights w, bad;
    hand_case(&w, codes, scales, gs);

    expect_error(fp4moe_gather_qmm_cpu(NULL, x, FP4MOE_F32, idx, 4, 1, y), FP4MOE_EINVAL, "w");
    bad = w; bad.K = 24;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "K=24");
    bad = w; bad.K = 0;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "K=0");
    bad = w; bad.E = 0;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "E=0");
    bad = w; bad.N = -3;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "N=-3");
    bad = w; bad.codes = NULL;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "codes");
    bad = w; bad.scales = NULL;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "scales");
    expect_error(fp4moe_gather_qmm_cpu(&w, NULL, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EINVAL, "x");
    expect_error(fp4moe_gather_qmm_cpu(&w, x, FP4MOE_F32, NULL, 1, 1, y), FP4MOE_EINVAL, "idx");
    expect_error(fp4moe_gather_qmm_cpu(&w, x, FP4MOE_F32, idx, 1, 1, NULL), FP4MOE_EINVAL, "y");
    expect_error(fp4moe_gather_qmm_cpu(&w, x, FP4MOE_F32, idx, -1, 1, y), FP4MOE_EINVAL, "B=-1");
    expect_error(fp4moe_gather_qmm_cpu(&w, x, (fp4moe_dtype)7, idx, 1, 1, y), FP4MOE_EINVAL, "dtype");
    expect_error(fp4moe_gather_qmm_ref_f64(&w, x, FP4MOE_F32, idx, -1, y64), FP4MOE_EINVAL, "B=-1");
    /* sizes whose products overflow int64 */
    bad = w; bad.E = (int64_t)1 << 40; bad.N = (int64_t)1 << 20; bad.K = (int64_t)1 << 16;
    expect_error(fp4moe_gather_qmm_cpu(&bad, x, FP4MOE_F32, idx, 1, 1, y), FP4MOE_EOVERFLOW, "overflows");
    expect_error(fp4moe_gather_qmm_cpu(&w, x, FP4MOE_F32, idx, INT64_MAX / 8, 1, y), FP4MOE_EOVERFLOW,
                 "overflows");
    /* routes that need sorted input */
    expect_error(fp4moe_gather_qmm_cpu_route(&w, x, FP4MOE_F32, unsorted, 4, 0, FP4MOE_ROUTE_BATCHED, y),
                 FP4MOE_EINVAL, "sorted");
    expect_error(fp4moe_gather_qmm_cpu_route(&w, x, FP4MOE_F32, unsorted, 4, 0, FP4MOE_ROUTE_DEQUANT_GEMM, y),
                 FP4MOE_EINVAL, "sorted");
    /* a broken "sorted" promise is detected, not an out-of-bounds access */
    expect_error(fp4moe_gather_qmm_cpu_route(&w, x, FP4MOE_F32, unsorted, 4, 1, FP4MOE_ROUTE_BATCHED, y),
                 FP4MOE_EINVAL, "not sorted");
    expect_error(fp4moe_gather_qmm_cpu_route(&w, x, FP4MOE_F32, unsorted, 4, 1, (fp4moe_route)9, y),
                 FP4MOE_EINVAL, "route");
    /* B = 0 is legal and touches nothing, even with NULL x / idx / y */
    assert_int_equal(fp4moe_gather_qmm_cpu(&w, NULL, FP4MOE_BF16, NULL, 0, 1, NULL), FP4MOE_OK);
    assert_int_equal(fp4moe_gather_qmm_cpu_route(&w, NULL, FP4MOE_F16, NULL, 0, 1, FP4MOE_ROUTE_BATCHED, NULL),
                     FP4MOE_OK);
}

static void test_route_names(void **state) {
    for (int r = 0; r <= FP4MOE_ROUTE_DEQUANT_GEMM; r++) {
        fp4moe_route back;
        assert_int_equal(fp4moe_route_parse(fp4moe_route_name((fp4moe_route)r), &back), FP4MOE_OK);
        assert_int_equal(back, r);
    }
    fp4moe_route out;
    expect_error(fp4moe_route_parse("gemm", &out), FP4MOE_EINVAL, "gemm");
    assert_string_equal(fp4moe_route_name((fp4moe_route)17), "?");
}

static void test_route_predicate(void **state) {
    uint8_t codes[32], scales[4];
    float gs[2];
    fp4moe_nvfp4_weights w;
    hand_case(&w, codes, scales, gs);
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    const int64_t min = FP4MOE_BATCHED_MIN_ROWS;
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, min, 1), FP4MOE_ROUTE_BATCHED);
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 1), FP4MOE_ROUTE_BATCHED);
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, min - 1, 1), FP4MOE_ROUTE_QMV);
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 0), FP4MOE_ROUTE_QMV);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 1), FP4MOE_ROUTE_QMV);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "1");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 1), FP4MOE_ROUTE_BATCHED);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    tu_setenv("FP4MOE_GATHER_ROUTE", "dequant_gemm");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 6, 1), FP4MOE_ROUTE_DEQUANT_GEMM);
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 6, 0), FP4MOE_ROUTE_QMV); /* not legal unsorted */
    tu_setenv("FP4MOE_GATHER_ROUTE", "qmv");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 1), FP4MOE_ROUTE_QMV);
    tu_setenv("FP4MOE_GATHER_ROUTE", "batched");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 1, 1), FP4MOE_ROUTE_BATCHED);
    tu_setenv("FP4MOE_GATHER_ROUTE", "nonsense");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&w, 40000, 1), FP4MOE_ROUTE_BATCHED);
    tu_setenv("FP4MOE_GATHER_ROUTE", NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_hand_computed),
        cmocka_unit_test(test_invalid_arguments),
        cmocka_unit_test(test_route_names),
        cmocka_unit_test(test_route_predicate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
