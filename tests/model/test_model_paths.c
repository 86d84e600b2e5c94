/* Properties of the forward pass that need no reference: chunked prefill, one-token decode and
 * whole-prompt prefill agree (Mamba conv/SSM state and KV cache carried correctly); the greedy
 * output is the same with the gather_qmm expert-batched route on and off (routes differ only in
 * fp32 summation order); MoE prefill really takes the expert-batched route; quantize-on-load
 * produces exactly the bytes of the MLX nvfp4 checkpoint written by scripts/make_golden.py from
 * the same weights (spec NVFP4.md section 3, two independent implementations). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "testutil.h"

#include "model/model_internal.h"
#include "model_test.h"

/* All-position logits of the prompt with a given chunk size (1 = token by token through decode). */
static float *prompt_logits(const fp4moe_model *m, const mt_ref *r, int64_t chunk, fp4moe_route route) {
    fp4moe_session *s = mt_session(m, FP4MOE_F32, route, chunk > 1 ? chunk : 0);
    float *lg = mt_poisoned(r->T * r->V);
    if (chunk == 1) {
        for (int64_t t = 0; t < r->T; t++) mt_forward(s, &r->prompt[t], 1, lg + t * r->V, 0);
    } else {
        mt_forward(s, r->prompt, r->T, lg, 1);
    }
    assert_int_equal(fp4moe_session_pos(s), r->T);
    fp4moe_session_free(s);
    return lg;
}

static void chunks_agree(const char *dir, const char *ref_name) {
    mt_ref r;
    mt_ref_open(ref_name, &r);
    fp4moe_model *m = mt_load(dir, 1);
    float *whole = prompt_logits(m, &r, 256, FP4MOE_ROUTE_AUTO);
    const int64_t chunks[] = {1, 7, 16, 39};
    for (size_t i = 0; i < sizeof chunks / sizeof chunks[0]; i++) {
        float *part = prompt_logits(m, &r, chunks[i], FP4MOE_ROUTE_AUTO);
        const double e = mt_max_err(part, whole, r.T, r.V);
        print_message("%-12s chunk %2lld vs whole prefill: max rel err %.3g\n", dir,
                      (long long)chunks[i], e);
        assert_true(e <= MT_RTOL_F32);
        free(part);
    }
    /* and both agree with transformers */
    assert_true(mt_max_err(whole, r.logits, r.T, r.V) <= MT_RTOL_F32);
    free(whole);
    fp4moe_model_free(m);
    mt_ref_close(&r);
}

static void test_chunked_prefill_equals_decode(void **state) {
    chunks_agree("tiny-a-mlx", "tiny-a-mlx");
    chunks_agree("tiny-b-mlx", "tiny-b-mlx");
}

/* A session reset really forgets: the same prompt twice gives the same logits. */
static void test_reset(void **state) {
    mt_ref r;
    mt_ref_open("tiny-a-mlx", &r);
    fp4moe_model *m = mt_load("tiny-a-mlx", 1);
    fp4moe_session *s = mt_session(m, FP4MOE_F32, FP4MOE_ROUTE_AUTO, 0);
    float *a = mt_poisoned(r.V), *b = mt_poisoned(r.V);
    mt_forward(s, r.prompt, r.T, a, 0);
    mt_forward(s, r.gen, 5, b, 0);            /* move on */
    fp4moe_session_reset(s);
    assert_int_equal(fp4moe_session_pos(s), 0);
    mt_forward(s, r.prompt, r.T, b, 0);
    assert_memory_equal(a, b, (size_t)r.V * sizeof(float));
    free(a);
    free(b);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    mt_ref_close(&r);
}

static void greedy_with(const fp4moe_model *m, const mt_ref *r, fp4moe_route route, int32_t *ids) {
    fp4moe_session *s = mt_session(m, FP4MOE_F32, route, 0);
    mt_greedy(s, r->prompt, r->T, r->V, r->n, ids);
    fp4moe_session_free(s);
}

/* Greedy ids with the automatic route under FP4MOE_GATHER_EXPERT_BATCHED=0 / =1, and with the
 * routes forced: all identical, and identical to transformers. */
static void routes_agree(const char *dir, const char *ref_name) {
    mt_ref r;
    mt_ref_open(ref_name, &r);
    fp4moe_model *m = mt_load(dir, 1);
    const fp4moe_config *c = fp4moe_model_config(m);
    /* the MoE prefill is sorted with T*k >= 64 rows: the expert-batched route */
    const int64_t B = r.T * c->top_k;
    int64_t l = 0;
    while (m->layers[l].type != FP4MOE_LAYER_MOE) l++;
    assert_true(B >= FP4MOE_BATCHED_MIN_ROWS);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "1");
    assert_int_equal(fp4moe_gather_route_choose_cpu(&m->layers[l].experts_up.q, B, 1), FP4MOE_ROUTE_BATCHED);
    int32_t *on = calloc((size_t)r.n, 4), *off = calloc((size_t)r.n, 4), *f = calloc((size_t)r.n, 4);
    greedy_with(m, &r, FP4MOE_ROUTE_AUTO, on);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
    const fp4moe_route off_route = fp4moe_gather_route_choose_cpu(&m->layers[l].experts_up.q, B, 1);
    greedy_with(m, &r, FP4MOE_ROUTE_AUTO, off);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    print_message("%-12s prefill rows %lld: route %s with FP4MOE_GATHER_EXPERT_BATCHED=1, %s with =0\n",
                  dir, (long long)B, fp4moe_route_name(FP4MOE_ROUTE_BATCHED), fp4moe_route_name(off_route));
    assert_memory_equal(on, r.gen, (size_t)r.n * 4);
    assert_memory_equal(off, r.gen, (size_t)r.n * 4);
    const fp4moe_route forced[] = {FP4MOE_ROUTE_QMV, FP4MOE_ROUTE_BATCHED, FP4MOE_ROUTE_DEQUANT_GEMM};
    for (size_t i = 0; i < 3; i++) {
        greedy_with(m, &r, forced[i], f);
        assert_memory_equal(f, r.gen, (size_t)r.n * 4);
    }
    free(on);
    free(off);
    free(f);
    fp4moe_model_free(m);
    mt_ref_close(&r);
}

static void test_route_on_off_same_greedy(void **state) {
    routes_agree("tiny-a-mlx", "tiny-a-mlx");
    routes_agree("tiny-b-mlx", "tiny-b-mlx");
    routes_agree("tiny-a-modelopt", "tiny-a-modelopt");
}

/* ---- quantize-on-load == the MLX checkpoint's bytes ------------------------------------------- */

static int64_t compare_linear(const op_linear *w, const fp4moe_st_model *mlx, const char *module,
                              const char *what) {
    char name[256];
    snprintf(name, sizeof name, "%s.weight", module);
    const fp4moe_st_tensor *codes = fp4moe_st_model_find(mlx, name);
    snprintf(name, sizeof name, "%s.scales", module);
    const fp4moe_st_tensor *scales = fp4moe_st_model_find(mlx, name);
    assert_non_null(codes);
    assert_non_null(scales);
    assert_true(w->nvfp4);
    assert_null(w->q.global_scale);
    const int64_t n = w->E * w->N * w->K;
    assert_int_equal(codes->nbytes, n / 2);
    assert_int_equal(scales->nbytes, n / 16);
    int64_t diff = 0;
    for (int64_t i = 0; i < n / 2; i++) diff += w->q.codes[i] != ((const uint8_t *)codes->data)[i];
    for (int64_t i = 0; i < n / 16; i++) diff += w->q.scales[i] != ((const uint8_t *)scales->data)[i];
    if (diff) print_message("%s %s: %lld bytes differ\n", what, module, (long long)diff);
    return diff;
}

static void test_quantize_on_load_matches_mlx(void **state) {
    fp4moe_model *m = mt_load("tiny-a-bf16", 1);
    fp4moe_st_model *mlx = NULL;
    assert_int_equal(fp4moe_st_model_open(MT_GOLDEN "/tiny-a-mlx", &mlx), FP4MOE_OK);
    int64_t diff = 0, modules = 0;
    char p[256];
    for (int64_t l = 0; l < m->cfg.n_layers; l++) {
        const layer_weights *w = &m->layers[l];
        struct { const op_linear *lin; const char *name; } mods[] = {
            {&w->in_proj, "in_proj"}, {&w->out_proj, "out_proj"}, {&w->q_proj, "q_proj"},
            {&w->k_proj, "k_proj"}, {&w->v_proj, "v_proj"}, {&w->o_proj, "o_proj"},
            {&w->up, "up_proj"}, {&w->down, "down_proj"}, {&w->shared_up, "shared_experts.up_proj"},
            {&w->shared_down, "shared_experts.down_proj"}, {&w->experts_up, "switch_mlp.fc1"},
            {&w->experts_down, "switch_mlp.fc2"}};
        for (size_t i = 0; i < sizeof mods / sizeof mods[0]; i++) {
            if (!mods[i].lin->N) continue;
            snprintf(p, sizeof p, "backbone.layers.%lld.mixer.%s", (long long)l, mods[i].name);
            diff += compare_linear(mods[i].lin, mlx, p, "tiny-a");
            modules++;
        }
    }
    diff += compare_linear(&m->lm_head, mlx, "lm_head", "tiny-a");
    print_message("quantize-on-load vs MLX file: %lld modules + lm_head, %lld bytes differ\n",
                  (long long)modules, (long long)diff);
    assert_true(modules >= 15);
    assert_int_equal(diff, 0);
    fp4moe_st_model_close(mlx);
    fp4moe_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_prefill_equals_decode),
        cmocka_unit_test(test_reset),
        cmocka_unit_test(test_route_on_off_same_greedy),
        cmocka_unit_test(test_quantize_on_load_matches_mlx),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
