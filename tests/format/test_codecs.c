/* Scalar codecs against independent oracles: the spec's E4M3 formula for all 256 bytes, brute-force
 * nearest-grid search for E4M3/E2M1 encoding, the F16C hardware converter for fp16 (when present). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <cmocka.h>

#include "testutil.h"

static uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The spec's formula, written independently of the implementation (double arithmetic). */
static double e4m3_spec(int b) {
    int e = (b >> 3) & 15, m = b & 7;
    double v = e == 0 ? m / 8.0 * pow(2, -6) : (1 + m / 8.0) * pow(2, e - 7);
    return (b & 0x80) ? -v : v;
}

static void test_e4m3_decode_all_bytes(void **state) {
    for (int b = 0; b < 256; b++) {
        float v = fp4moe_e4m3_to_f32((uint8_t)b);
        if ((b & 0x7F) == 0x7F) { assert_true(isnan(v)); continue; }
        assert_true((double)v == e4m3_spec(b));
    }
    assert_true(fp4moe_e4m3_to_f32(0x7E) == 448.0f);
    assert_true(fp4moe_e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(fp4moe_e4m3_to_f32(0x08) == 0x1p-6f);
    assert_true(fp4moe_e4m3_to_f32(0x38) == 1.0f);
}

static void test_e4m3_roundtrip_every_value(void **state) {
    for (int b = 0; b < 256; b++) {
        if ((b & 0x7F) == 0x7F) continue;
        uint8_t e = fp4moe_f32_to_e4m3(fp4moe_e4m3_to_f32((uint8_t)b));
        assert_int_equal(e, b);
    }
}

/* Brute force: nearest finite E4M3 value, ties to the even byte (even mantissa), saturating. */
static uint8_t e4m3_brute(float v) {
    if (isnan(v)) return 0x7E;
    uint8_t sign = signbit(v) ? 0x80 : 0;
    double a = fabs((double)v);
    if (a >= 448) return sign | 0x7E;
    int best = 0;
    double bd = INFINITY;
    for (int b = 0; b <= 0x7E; b++) {
        double d = fabs(e4m3_spec(b) - a);
        if (d < bd || (d == bd && (b & 1) == 0)) { bd = d; best = b; }
    }
    return (uint8_t)(sign | best);
}

static void test_e4m3_encode_sweep(void **state) {
    /* every midpoint and its float neighbours, plus a dense random sweep */
    for (int b = 0; b < 0x7E; b++) {
        float mid = (float)((e4m3_spec(b) + e4m3_spec(b + 1)) / 2);
        float cand[3] = {mid, nextafterf(mid, 0), nextafterf(mid, 1000)};
        for (int i = 0; i < 3; i++) {
            assert_int_equal(fp4moe_f32_to_e4m3(cand[i]), e4m3_brute(cand[i]));
            assert_int_equal(fp4moe_f32_to_e4m3(-cand[i]), e4m3_brute(-cand[i]));
        }
    }
    tu_rng r;
    tu_rng_seed(&r, 7);
    for (int i = 0; i < 200000; i++) {
        float v = (float)ldexp(tu_rng_uniform(&r), (int)tu_rng_below(&r, 24) - 14);
        assert_int_equal(fp4moe_f32_to_e4m3(v), e4m3_brute(v));
    }
}

static void test_e4m3_saturation_nan_subnormal(void **state) {
    assert_int_equal(fp4moe_f32_to_e4m3(448.0f), 0x7E);
    assert_int_equal(fp4moe_f32_to_e4m3(460.0f), 0x7E);
    assert_int_equal(fp4moe_f32_to_e4m3(1e30f), 0x7E);
    assert_int_equal(fp4moe_f32_to_e4m3(INFINITY), 0x7E);
    assert_int_equal(fp4moe_f32_to_e4m3(-INFINITY), 0xFE);
    assert_int_equal(fp4moe_f32_to_e4m3(NAN), 0x7E);
    assert_int_equal(fp4moe_f32_to_e4m3(0x1p-9f), 0x01);
    assert_int_equal(fp4moe_f32_to_e4m3(0x1p-10f), 0x00);            /* tie -> even (0) */
    assert_int_equal(fp4moe_f32_to_e4m3(0x1.8p-9f), 0x02);           /* 1.5 steps -> 2 */
    assert_int_equal(fp4moe_f32_to_e4m3(0x1.fp-7f), 0x08);           /* rounds up into normals */
    assert_int_equal(fp4moe_f32_to_e4m3(0.0f), 0x00);
    for (int i = 0; i < 1 << 20; i++) {   /* no input ever produces the NaN byte */
        float v = from_bits((uint32_t)i * 4099u);
        uint8_t e = fp4moe_f32_to_e4m3(v);
        assert_true((e & 0x7F) != 0x7F);
    }
}

static void test_e2m1_values_and_ties(void **state) {
    const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++) {
        float v = fp4moe_e2m1_to_f32((uint8_t)c);
        assert_true(fabsf(v) == grid[c & 7]);
        assert_int_equal(signbit(v) != 0, c >= 8);
        assert_int_equal(fp4moe_f32_to_e2m1(v), c);   /* round trip, -0 -> 8 */
    }
    const float tie_in[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    const float tie_out[7] = {0, 1, 1, 2, 2, 4, 4};
    for (int i = 0; i < 7; i++) {
        assert_true(fp4moe_e2m1_to_f32(fp4moe_f32_to_e2m1(tie_in[i])) == tie_out[i]);
        assert_true(fp4moe_e2m1_to_f32(fp4moe_f32_to_e2m1(-tie_in[i])) == -tie_out[i]);
        /* just off the tie goes to the nearer value */
        float up = nextafterf(tie_in[i], 10), dn = nextafterf(tie_in[i], 0);
        assert_true(fp4moe_e2m1_to_f32(fp4moe_f32_to_e2m1(up)) > tie_in[i]);
        assert_true(fp4moe_e2m1_to_f32(fp4moe_f32_to_e2m1(dn)) < tie_in[i]);
    }
    assert_int_equal(fp4moe_f32_to_e2m1(7.0f), 7);
    assert_int_equal(fp4moe_f32_to_e2m1(-100.0f), 15);
    assert_int_equal(fp4moe_f32_to_e2m1(INFINITY), 7);
    assert_int_equal(fp4moe_f32_to_e2m1(-0.0f), 8);
    assert_int_equal(fp4moe_f32_to_e2m1(-0.1f), 8);   /* sign kept when rounding to zero */
}

/* fp16: against the F16C instruction where available, else against a double-based oracle. */
#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("f16c"))) static uint16_t f16c_encode(float f) {
    return (uint16_t)__builtin_ia32_vcvtps2ph((__attribute__((vector_size(16))) float){f, 0, 0, 0}, 0)[0];
}
__attribute__((target("f16c"))) static float f16c_decode(uint16_t h) {
    typedef short v8hi __attribute__((vector_size(16)));
    v8hi v = {(short)h, 0, 0, 0, 0, 0, 0, 0};
    return __builtin_ia32_vcvtph2ps(v)[0];
}
#define HAVE_F16C_ORACLE 1
#include <cpuid.h>
/* CPUID leaf 1, ECX bit 29 (gcc and clang alike; clang 14 lacks __builtin_cpu_supports("f16c")). */
static int cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && ((c >> 29) & 1);
}
#endif

static void test_f16(void **state) {
#ifdef HAVE_F16C_ORACLE
    if (!cpu_has_f16c()) skip();
    for (uint32_t h = 0; h < 65536; h++) {
        float a = fp4moe_f16_to_f32((uint16_t)h), b = f16c_decode((uint16_t)h);
        if (isnan(b)) { assert_true(isnan(a)); continue; }
        assert_int_equal(bits(a), bits(b));
    }
    tu_rng r;
    tu_rng_seed(&r, 11);
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)tu_rng_u64(&r);
        if (i & 1) u = (u & 0x80000000u) | (0x33000000u + (u % 0x14800000u)); /* f16 range focus */
        float f = from_bits(u);
        uint16_t a = fp4moe_f32_to_f16(f), b = f16c_encode(f);
        if (isnan(f)) { assert_true((a & 0x7C00) == 0x7C00 && (a & 0x3FF)); continue; }
        if (a != b) fail_msg("f16 encode of %a (0x%08x): got 0x%04x want 0x%04x", f, u, a, b);
    }
#else
    skip();
#endif
}

static void test_bf16(void **state) {
    tu_rng r;
    tu_rng_seed(&r, 13);
    for (int i = 0; i < 2000000; i++) {
        uint32_t u = (uint32_t)tu_rng_u64(&r);
        if (i % 3 == 0) u = (u & 0xFFFF0000u) | 0x8000u;   /* exact ties */
        float f = from_bits(u);
        uint16_t h = fp4moe_f32_to_bf16(f);
        if (isnan(f)) { assert_true(isnan(fp4moe_bf16_to_f32(h))); continue; }
        /* oracle: the nearer of truncation and truncation+1 ulp, ties to even (in double) */
        uint16_t lo = (uint16_t)(u >> 16), hi = (uint16_t)(lo + 1);
        double dl = fabs((double)fp4moe_bf16_to_f32(lo) - f), dh = fabs((double)fp4moe_bf16_to_f32(hi) - f);
        if ((lo & 0x7F80) == 0x7F80 && (lo & 0x7F) == 0x7F) dh = INFINITY;  /* would become NaN */
        uint16_t want = dl < dh ? lo : dh < dl ? hi : ((lo & 1) ? hi : lo);
        if ((lo & 0x7FFF) == 0x7F7F) want = dl >= 0x1p119 ? hi : lo;  /* past max + half ulp: Inf */
        if (h != want) fail_msg("bf16 of %a: got 0x%04x want 0x%04x", f, h, want);
    }
    assert_int_equal(fp4moe_f32_to_bf16(1.0f), 0x3F80);
    assert_true(isnan(fp4moe_bf16_to_f32(fp4moe_f32_to_bf16(NAN))));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_decode_all_bytes),
        cmocka_unit_test(test_e4m3_roundtrip_every_value),
        cmocka_unit_test(test_e4m3_encode_sweep),
        cmocka_unit_test(test_e4m3_saturation_nan_subnormal),
        cmocka_unit_test(test_e2m1_values_and_ties),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
