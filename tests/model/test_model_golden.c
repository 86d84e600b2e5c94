/* The nemotron_h forward pass against transformers (scripts/make_golden.py): logits of every prompt
 * position, decode logits with the reference tokens fed back, identical greedy tokens; for each
 * checkpoint format (dense bf16/f32 kept dense, quantized on load, MLX nvfp4, ModelOpt NVFP4).
 * On the NVFP4 paths the reference is transformers run on the dequantized weights.
 * Tolerance: model_test.h (MT_RTOL_F32, MT_RTOL_BF16). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "model_test.h"

/* Prompt logits (all rows), then the reference continuation fed token by token (decode path):
 * every step's logits within rtol of the reference. Returns the worst errors through *pe, *de. */
static void check_logits(fp4moe_session *s, const mt_ref *r, double rtol, const char *what) {
    float *lg = mt_poisoned(r->T * r->V);
    fp4moe_session_reset(s);
    mt_forward(s, r->prompt, r->T, lg, 1);
    const double pe = mt_max_err(lg, r->logits, r->T, r->V);
    double de = 0.0;
    for (int64_t i = 1; i < r->n; i++) {     /* step_logits[i] follow prompt + gen[0..i) */
        for (int64_t v = 0; v < r->V; v++) lg[v] = NAN;
        mt_forward(s, &r->gen[i - 1], 1, lg, 0);
        de = fmax(de, mt_row_err(lg, r->step_logits + i * r->V, r->V));
    }
    print_message("%-28s prefill max rel err %.3g, decode %.3g (rtol %.3g)\n", what, pe, de, rtol);
    free(lg);
    assert_true(pe <= rtol);
    assert_true(de <= rtol);
}

static void check_greedy(fp4moe_session *s, const mt_ref *r, const char *what) {
    int32_t *ids = calloc((size_t)r->n, sizeof *ids);
    mt_greedy(s, r->prompt, r->T, r->V, r->n, ids);
    int64_t same = 0;
    while (same < r->n && ids[same] == r->gen[same]) same++;
    print_message("%-28s greedy: %lld of %lld tokens as transformers\n", what, (long long)same,
                  (long long)r->n);
    assert_int_equal(same, r->n);
    free(ids);
}

/* One golden model directory against one reference, fp32 activations: logits and greedy. */
static void golden_case(const char *dir, int quantize, const char *ref_name) {
    mt_ref r;
    mt_ref_open(ref_name, &r);
    fp4moe_model *m = mt_load(dir, quantize);
    assert_int_equal(fp4moe_model_config(m)->vocab, r.V);
    fp4moe_session *s = mt_session(m, FP4MOE_F32, FP4MOE_ROUTE_AUTO, 0);
    check_logits(s, &r, MT_RTOL_F32, ref_name);
    check_greedy(s, &r, ref_name);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    mt_ref_close(&r);
}

static void test_a_bf16_dense(void **state) { golden_case("tiny-a-bf16", 0, "tiny-a-bf16"); }
static void test_b_f32_dense(void **state) { golden_case("tiny-b-f32", 0, "tiny-b-f32"); }
static void test_a_bf16_quantized_on_load(void **state) { golden_case("tiny-a-bf16", 1, "tiny-a-bf16-q"); }
static void test_b_f32_quantized_on_load(void **state) { golden_case("tiny-b-f32", 1, "tiny-b-f32-q"); }
static void test_a_mlx(void **state) { golden_case("tiny-a-mlx", 1, "tiny-a-mlx"); }
static void test_b_mlx(void **state) { golden_case("tiny-b-mlx", 1, "tiny-b-mlx"); }
static void test_a_modelopt(void **state) { golden_case("tiny-a-modelopt", 1, "tiny-a-modelopt"); }

/* bf16 activations against the fp32 reference. Rounding every matmul input to bf16 moves the router
 * scores by ~1e-2, and where two experts (or, with n_group > 1, two groups) are that close the
 * top-k choice flips: a discontinuity, so a few rows can differ by much more than rounding. The
 * check: every row finite, at least 80% of the rows (prefill positions and decode steps) within
 * MT_RTOL_BF16, and the median row error below MT_RTOL_BF16 / 2. */
static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void bf16_case(const char *dir, int quantize, const char *ref_name) {
    mt_ref r;
    mt_ref_open(ref_name, &r);
    fp4moe_model *m = mt_load(dir, quantize);
    fp4moe_session *s = mt_session(m, FP4MOE_BF16, FP4MOE_ROUTE_AUTO, 0);
    const int64_t rows = r.T + r.n - 1;
    double *err = calloc((size_t)rows, sizeof *err);
    float *lg = mt_poisoned(r.T * r.V);
    mt_forward(s, r.prompt, r.T, lg, 1);
    for (int64_t t = 0; t < r.T; t++) err[t] = mt_row_err(lg + t * r.V, r.logits + t * r.V, r.V);
    for (int64_t i = 1; i < r.n; i++) {
        mt_forward(s, &r.gen[i - 1], 1, lg, 0);
        err[r.T + i - 1] = mt_row_err(lg, r.step_logits + i * r.V, r.V);
    }
    int64_t within = 0;
    for (int64_t i = 0; i < rows; i++) {
        assert_true(isfinite(err[i]));
        within += err[i] <= MT_RTOL_BF16;
    }
    qsort(err, (size_t)rows, sizeof *err, cmp_double);
    print_message("%-16s (bf16 act) median row err %.3g, max %.3g, %lld of %lld rows within %.3g\n",
                  ref_name, err[rows / 2], err[rows - 1], (long long)within, (long long)rows,
                  MT_RTOL_BF16);
    assert_true(within * 5 >= rows * 4);
    assert_true(err[rows / 2] <= MT_RTOL_BF16 / 2);
    free(err);
    free(lg);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    mt_ref_close(&r);
}

static void test_bf16_activations(void **state) {
    bf16_case("tiny-a-bf16", 0, "tiny-a-bf16");
    bf16_case("tiny-b-f32", 1, "tiny-b-f32-q");
    bf16_case("tiny-a-mlx", 1, "tiny-a-mlx");
    bf16_case("tiny-b-mlx", 1, "tiny-b-mlx");
    bf16_case("tiny-a-modelopt", 1, "tiny-a-modelopt");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_bf16_dense),
        cmocka_unit_test(test_b_f32_dense),
        cmocka_unit_test(test_a_bf16_quantized_on_load),
        cmocka_unit_test(test_b_f32_quantized_on_load),
        cmocka_unit_test(test_a_mlx),
        cmocka_unit_test(test_b_mlx),
        cmocka_unit_test(test_a_modelopt),
        cmocka_unit_test(test_bf16_activations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
