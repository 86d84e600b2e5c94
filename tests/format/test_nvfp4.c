/* NVFP4 quantize / dequantize (spec NVFP4.md section 3). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "testutil.h"

static void quantize_ok(const float *w, int64_t rows, int64_t K, float gamax, uint8_t *c, uint8_t *s,
                        float *gs) {
    int st = fp4moe_nvfp4_quantize(w, FP4MOE_F32, rows, K, gamax, c, s, gs);
    if (st) fail_msg("quantize: %s", fp4moe_last_error());
}

static void test_hand_computed_block(void **state) {
    float w[16];
    uint8_t c[8], s;
    for (int i = 0; i < 16; i++) w[i] = 0.5f * (float)i;       /* amax 7.5 -> scale 1.25 */
    quantize_ok(w, 1, 16, 0, c, &s, NULL);
    assert_int_equal(s, fp4moe_f32_to_e4m3(1.25f));
    assert_true(fp4moe_e4m3_to_f32(s) == 1.25f);
    const uint8_t want[16] = {0, 1, 2, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 7, 7, 7};
    for (int i = 0; i < 16; i++) assert_int_equal((c[i / 2] >> (4 * (i & 1))) & 15, want[i]);
    for (int i = 0; i < 16; i++) w[i] = -w[i];                 /* signs go to bit 3 */
    quantize_ok(w, 1, 16, 0, c, &s, NULL);
    for (int i = 1; i < 16; i++) assert_int_equal((c[i / 2] >> (4 * (i & 1))) & 15, want[i] | 8);
}

static void test_zero_and_tiny_blocks(void **state) {
    float w[32] = {0};
    uint8_t c[16], s[2];
    memset(c, 0xAA, sizeof c);
    quantize_ok(w, 1, 32, 0, c, s, NULL);
    for (int i = 0; i < 16; i++) assert_int_equal(c[i], 0);
    assert_int_equal(s[0], 0);
    assert_int_equal(s[1], 0);
    /* amax < 6 * 2^-10 underflows to zero without a global scale */
    for (int i = 0; i < 32; i++) w[i] = (i & 1 ? -1.0f : 1.0f) * 5.9f * 0x1p-10f * (float)(i + 1) / 32.0f;
    quantize_ok(w, 1, 32, 0, c, s, NULL);
    assert_int_equal(s[0], 0);
    assert_int_equal(s[1], 0);
    float out[32];
    assert_int_equal(fp4moe_nvfp4_dequantize(c, s, 1, 32, 1.0f, FP4MOE_F32, out), FP4MOE_OK);
    for (int i = 0; i < 32; i++) assert_true(out[i] == 0.0f);
    /* ... but survives with a global scale */
    float gs = 0;
    quantize_ok(w, 1, 32, fp4moe_amax(w, FP4MOE_F32, 32), c, s, &gs);
    assert_true(s[1] != 0);
    assert_int_equal(fp4moe_nvfp4_dequantize(c, s, 1, 32, gs, FP4MOE_F32, out), FP4MOE_OK);
    for (int i = 0; i < 32; i++) assert_true(fabsf(out[i] - w[i]) <= 0.26f * fabsf(w[31]) + 1e-12f);
}

static void test_saturation_never_nan_byte(void **state) {
    float w[64];
    uint8_t c[32], s[4];
    for (int i = 0; i < 64; i++) w[i] = (float)i;
    w[3] = 1e30f; w[17] = INFINITY; w[40] = NAN; w[63] = -3000.0f;
    quantize_ok(w, 1, 64, 0, c, s, NULL);
    for (int b = 0; b < 4; b++) assert_true((s[b] & 0x7F) != 0x7F);
    assert_int_equal(s[0], 0x7E);
    assert_int_equal(s[1], 0x7E);
    assert_int_equal(fp4moe_nvfp4_find_nan_scale(s, 4), -1);
    uint8_t bad[5] = {1, 2, 0x7F, 3, 0xFF};
    assert_int_equal(fp4moe_nvfp4_find_nan_scale(bad, 5), 2);
}

/* Random tensors: every dequantized value is within half a grid step (times the block scale) of the
 * input, and requantizing the dequantized tensor reproduces the bytes exactly. */
static void check_roundtrip(fp4moe_dtype dtype, int with_gs, uint64_t seed) {
    const int64_t rows = 37, K = 16 * 13;
    tu_rng r;
    tu_rng_seed(&r, seed);
    void *w = tu_random_x(dtype, rows, K, &r);
    float *wf = malloc(sizeof(float) * rows * K), *dq = malloc(sizeof(float) * rows * K);
    uint8_t *c = malloc(rows * K / 2), *s = malloc(rows * K / 16), *c2 = malloc(rows * K / 2),
            *s2 = malloc(rows * K / 16);
    fp4moe_to_f32(w, dtype, rows * K, wf);
    for (int64_t i = 0; i < rows * K; i++) wf[i] *= (float)(1 + (i / 16) % 5) * 0.3f;  /* vary blocks */
    fp4moe_from_f32(wf, rows * K, dtype, w);
    fp4moe_to_f32(w, dtype, rows * K, wf);
    float gs = 0, amax = with_gs ? fp4moe_amax(w, dtype, rows * K) : 0;
    assert_int_equal(fp4moe_nvfp4_quantize(w, dtype, rows, K, amax, c, s, &gs), FP4MOE_OK);
    if (!with_gs) assert_true(gs == 1.0f);
    else assert_true(gs == amax / 2688.0f);
    assert_int_equal(fp4moe_nvfp4_dequantize(c, s, rows, K, gs, FP4MOE_F32, dq), FP4MOE_OK);
    for (int64_t i = 0; i < rows * K; i++) {
        const double scale = fp4moe_e4m3_to_f32(s[i / 16]) * (double)gs;
        /* grid step is at most 2 (between 4 and 6) in code units: half a step = 1 * scale, plus the
         * scale's own rounding (amax/6 rounded to 4 significant bits: <= 1/16 relative) */
        assert_true(fabs(dq[i] - wf[i]) <= 1.0 * scale + 1e-6 * fabs(wf[i]) + 1e-30);
    }
    float gs2 = 0;
    assert_int_equal(fp4moe_nvfp4_quantize(dq, FP4MOE_F32, rows, K, with_gs ? amax : 0, c2, s2, &gs2),
                     FP4MOE_OK);
    /* idempotence holds for block scales that re-derive to the same byte (amax code 7 = 6*scale) */
    int64_t same = 0;
    for (int64_t b = 0; b < rows * K / 16; b++) same += s2[b] == s[b];
    assert_true(same >= rows * K / 16 * 9 / 10);
    /* dequantize to f16/bf16 = f32 result rounded once */
    uint16_t *h = malloc(2 * rows * K);
    for (int d = 1; d <= 2; d++) {
        assert_int_equal(fp4moe_nvfp4_dequantize(c, s, rows, K, gs, (fp4moe_dtype)d, h), FP4MOE_OK);
        for (int64_t i = 0; i < rows * K; i++) {
            uint16_t want = d == FP4MOE_F16 ? fp4moe_f32_to_f16(dq[i]) : fp4moe_f32_to_bf16(dq[i]);
            assert_int_equal(h[i], want);
        }
    }
    free(h); free(w); free(wf); free(dq); free(c); free(s); free(c2); free(s2);
}

static void test_roundtrip_f32(void **state) { check_roundtrip(FP4MOE_F32, 0, 1); }
static void test_roundtrip_bf16_gs(void **state) { check_roundtrip(FP4MOE_BF16, 1, 2); }
static void test_roundtrip_f16(void **state) { check_roundtrip(FP4MOE_F16, 0, 3); }
static void test_roundtrip_f32_gs(void **state) { check_roundtrip(FP4MOE_F32, 1, 4); }

/* Exact bytes of one block against an independent re-derivation of the spec's steps in double
 * where every step is exact (scale byte by brute force, codes by nearest with spec ties). */
static void test_bytes_match_spec_steps(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 99);
    for (int trial = 0; trial < 20000; trial++) {
        float w[16];
        const double mag = ldexp(1.0, (int)tu_rng_below(&r, 20) - 10);
        for (int i = 0; i < 16; i++) w[i] = (float)(tu_rng_normal(&r) * mag);
        uint8_t c[8], s;
        quantize_ok(w, 1, 16, 0, c, &s, NULL);
        float amax = 0;
        for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(w[i]));
        assert_int_equal(s, fp4moe_f32_to_e4m3(amax / 6.0f));
        const float ds = fp4moe_e4m3_to_f32(s), rr = ds == 0 ? 0 : 1.0f / ds;
        for (int i = 0; i < 16; i++) {
            const float x = w[i] * rr;
            /* nearest grid value; on a tie the even code */
            const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
            int best = 0;
            for (int g = 1; g < 8; g++) {
                float d = fabsf(fabsf(x) - grid[g]), bd = fabsf(fabsf(x) - grid[best]);
                if (d < bd || (d == bd && (g & 1) == 0)) best = g;
            }
            const int code = best | (signbit(x) ? 8 : 0);
            assert_int_equal((c[i / 2] >> (4 * (i & 1))) & 15, code);
        }
    }
}

static void test_invalid_arguments(void **state) {
    float w[48] = {1};
    uint8_t c[24], s[3];
    assert_int_equal(fp4moe_nvfp4_quantize(w, FP4MOE_F32, 1, 24, 0, c, s, NULL), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "K=24"));
    assert_int_equal(fp4moe_nvfp4_quantize(NULL, FP4MOE_F32, 1, 16, 0, c, s, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_nvfp4_quantize(w, FP4MOE_F32, -1, 16, 0, c, s, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_nvfp4_quantize(w, FP4MOE_F32, 1, 16, NAN, c, s, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_nvfp4_quantize(w, (fp4moe_dtype)9, 1, 16, 0, c, s, NULL), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_nvfp4_quantize(w, FP4MOE_F32, INT64_MAX / 8, 64, 0, c, s, NULL),
                     FP4MOE_EOVERFLOW);
    assert_int_equal(fp4moe_nvfp4_dequantize(c, s, 1, 0, 1, FP4MOE_F32, w), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_nvfp4_dequantize(c, NULL, 1, 16, 1, FP4MOE_F32, w), FP4MOE_EINVAL);
}

/* fp4moe_count_nonfinite: NaN and +-Inf counted in each float dtype by the exponent field; the largest finite
 * values, zeros and subnormals not; the first index reported */
static void test_count_nonfinite(void **state) {
    (void)state;
    float f[7] = {1.0f, 3.4028235e38f, -0.0f, 1e-45f, INFINITY, NAN, -INFINITY};
    int64_t first = 99;
    assert_int_equal(fp4moe_count_nonfinite(f, FP4MOE_F32, 7, &first), 3);
    assert_int_equal(first, 4);
    assert_int_equal(fp4moe_count_nonfinite(f, FP4MOE_F32, 4, &first), 0);
    assert_int_equal(first, -1);
    const uint16_t b[6] = {0x3F80, 0x7F7F /* largest finite bf16 */, 0xFF80 /* -Inf */, 0x0001, 0x7FC1, 0x8000};
    assert_int_equal(fp4moe_count_nonfinite(b, FP4MOE_BF16, 6, &first), 2);
    assert_int_equal(first, 2);
    const uint16_t h[5] = {0x7BFF /* largest finite f16 */, 0x0001, 0x7C00 /* +Inf */, 0xFE00 /* NaN */, 0x3C00};
    assert_int_equal(fp4moe_count_nonfinite(h, FP4MOE_F16, 5, NULL), 2);
    assert_int_equal(fp4moe_count_nonfinite(h, FP4MOE_F16, 5, &first), 2);
    assert_int_equal(first, 2);
    /* the same bits read as bf16 (exponent bits 7..14): all finite there */
    assert_int_equal(fp4moe_count_nonfinite(h, FP4MOE_BF16, 5, &first), 0);
    assert_int_equal(first, -1);
    assert_int_equal(fp4moe_count_nonfinite(f, FP4MOE_F32, 0, &first), 0);
    assert_int_equal(first, -1);
    /* at an odd byte address (a tensor in place in a mapped safetensors file whose header length is not a multiple
     * of 4: a helper's trial, session 44 - UBSan's misaligned loads; the sanitize check runs this test) */
    _Alignas(16) uint8_t buf[80];
    for (int off = 1; off < 4; off++) {
        memcpy(buf + off, f, sizeof f);
        assert_int_equal(fp4moe_count_nonfinite(buf + off, FP4MOE_F32, 7, &first), 3);
        assert_int_equal(first, 4);
        assert_true(fp4moe_amax(buf + off, FP4MOE_F32, 4) == 3.4028235e38f);
        memcpy(buf + off, b, sizeof b);
        assert_int_equal(fp4moe_count_nonfinite(buf + off, FP4MOE_BF16, 6, &first), 2);
        assert_int_equal(first, 2);
        assert_true(fp4moe_amax(buf + off, FP4MOE_BF16, 2) == fp4moe_bf16_to_f32(0x7F7F));
        uint8_t c1[8], s1 = 0, c2[8], s2 = 1;
        float v[16];
        for (int i = 0; i < 16; i++) v[i] = (float)(i - 7) * 0.37f;
        memcpy(buf + off, v, sizeof v);
        assert_int_equal(fp4moe_nvfp4_quantize(buf + off, FP4MOE_F32, 1, 16, 0, c1, &s1, NULL), FP4MOE_OK);
        assert_int_equal(fp4moe_nvfp4_quantize(v, FP4MOE_F32, 1, 16, 0, c2, &s2, NULL), FP4MOE_OK);
        assert_memory_equal(c1, c2, 8);
        assert_int_equal(s1, s2);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_computed_block),
        cmocka_unit_test(test_zero_and_tiny_blocks),
        cmocka_unit_test(test_saturation_never_nan_byte),
        cmocka_unit_test(test_roundtrip_f32),
        cmocka_unit_test(test_roundtrip_bf16_gs),
        cmocka_unit_test(test_roundtrip_f16),
        cmocka_unit_test(test_roundtrip_f32_gs),
        cmocka_unit_test(test_bytes_match_spec_steps),
        cmocka_unit_test(test_invalid_arguments),
        cmocka_unit_test(test_count_nonfinite),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
