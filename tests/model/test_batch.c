/* The batched runtime on the CPU (include/fp4moe/model.h "batch"): 1, 3 and 17 sequences of random
 * prompt lengths joining and leaving at different steps, prefill chunks next to decode tokens,
 * slots reused, snapshot/restore in the middle: every sequence's greedy ids equal the ids it gets
 * alone (f32; also with W4A8 and with the FP8 KV cache). Bad items (pool exhaustion, unknown sequence, bad token, a sequence twice, a full
 * step) fail alone: the others in the same step go on and still match their solo runs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "batch_test.h"
#include "model_test.h"

static fp4moe_model *load_default(void) {
    fp4moe_model *m = NULL;
    if (fp4moe_model_load("models/nemotron-h-tiny-moe", NULL, &m)) fail_msg("%s", fp4moe_last_error());
    return m;
}

/* first..last of: 1 sequence; 3 in 3 slots; 17 in 17 slots; 17 in 5 slots (reused) */
static void scenarios_range(fp4moe_model *m, const char *name, size_t first, size_t last) {
    char label[96];
    const struct { int n; int64_t slots; uint64_t seed; int snap; } cases[] = {
        {1, 1, 1, 0}, {3, 3, 2, 1}, {17, 17, 3, 1}, {17, 5, 4, 1},
    };
    for (size_t i = first; i <= last && i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(label, sizeof label, "%s n=%d slots=%lld", name, cases[i].n, (long long)cases[i].slots);
        assert_int_equal(bt_scenario(m, FP4MOE_DEVICE_CPU, FP4MOE_F32, cases[i].n, cases[i].slots, cases[i].seed,
                                     cases[i].snap, label), 0);
    }
}

static void scenarios(fp4moe_model *m, const char *name) { scenarios_range(m, name, 0, 3); }

static void test_golden_a(void **state) {
    fp4moe_model *m = mt_load("tiny-a-mlx", 1);
    scenarios(m, "tiny-a-mlx");
    fp4moe_model_free(m);
}

static void test_golden_b(void **state) {
    fp4moe_model *m = mt_load("tiny-b-mlx", 1);
    scenarios(m, "tiny-b-mlx");
    fp4moe_model_free(m);
}

static void test_default_model(void **state) {
    fp4moe_model *m = load_default();
    scenarios(m, "default model");
    fp4moe_model_free(m);
}

/* W4A8 (cpu_act q8): rows are quantized one by one and both q8 routes add the same integer sums in
 * the same order, so batched ids equal solo ids here too. */
static void test_default_model_q8(void **state) {
    (void)state;
    fp4moe_model *m = load_default();
    bt_cpu_act = FP4MOE_CPU_ACT_Q8;
    scenarios_range(m, "default model q8", 1, 1); /* mixed prefill + decode steps */
    scenarios_range(m, "default model q8", 3, 3); /* and slots reused */
    bt_cpu_act = FP4MOE_CPU_ACT_FLOAT;
    fp4moe_model_free(m);
}

/* The FP8 KV cache: each token's rows are quantized alone, so batched ids equal solo ids too (the
 * solo sessions use the FP8 cache as well; its accuracy: tests/model/test_default_model.c). */
static void test_default_model_fp8_kv(void **state) {
    (void)state;
    fp4moe_model *m = load_default();
    bt_kv_dtype = FP4MOE_KV_FP8;
    scenarios_range(m, "default model fp8 KV", 1, 1);
    scenarios_range(m, "default model fp8 KV", 3, 3);
    bt_kv_dtype = FP4MOE_KV_AUTO;
    fp4moe_model_free(m);
}

/* A snapshot restored into a second sequence continues exactly like the first (bitwise logits),
 * with the f32 and with the FP8 KV cache; a snapshot of one cache type is refused by the other. */
static void snapshot_case(fp4moe_kv_dtype kv) {
    fp4moe_model *m = load_default();
    const int64_t V = fp4moe_model_config(m)->vocab;
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.max_seqs = 2;
    o.kv_dtype = kv;
    fp4moe_batch *b;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_OK);
    int64_t a, c;
    assert_int_equal(fp4moe_batch_add(b, &a), FP4MOE_OK);
    int32_t prompt[45], cont[7] = {5, 77, 300, 1024, 9, 4000, 12};
    for (int i = 0; i < 45; i++) prompt[i] = (i * 131 + 7) % (int)V;
    fp4moe_batch_item it = {.seq = a, .tokens = prompt, .n = 45};
    assert_int_equal(fp4moe_batch_step(b, &it, 1), FP4MOE_OK);
    assert_int_equal(it.status, FP4MOE_OK);
    fp4moe_snapshot *sn;
    assert_int_equal(fp4moe_batch_snapshot(b, a, &sn), FP4MOE_OK);
    assert_int_equal(fp4moe_snapshot_pos(sn), 45);
    assert_true(fp4moe_snapshot_bytes(sn) > 0);
    float *la = mt_poisoned(7 * V), *lc = mt_poisoned(7 * V);
    it = (fp4moe_batch_item){.seq = a, .tokens = cont, .n = 7, .logits = FP4MOE_LOGITS_ALL, .out_logits = la};
    assert_int_equal(fp4moe_batch_step(b, &it, 1), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add_from_snapshot(b, sn, &c), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_pos(b, c), 45);
    it = (fp4moe_batch_item){.seq = c, .tokens = cont, .n = 7, .logits = FP4MOE_LOGITS_ALL, .out_logits = lc};
    assert_int_equal(fp4moe_batch_step(b, &it, 1), FP4MOE_OK);
    assert_memory_equal(la, lc, (size_t)(7 * V) * sizeof(float));
    /* a snapshot of another model is refused */
    fp4moe_model *m2 = mt_load("tiny-a-mlx", 1);
    fp4moe_batch *b2;
    assert_int_equal(fp4moe_batch_new(m2, NULL, &b2), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add_from_snapshot(b2, sn, &c), FP4MOE_EINVAL);
    fp4moe_batch_free(b2);
    fp4moe_model_free(m2);
    /* nor into a batch of the same model with the other KV cache type */
    fp4moe_batch_options o3 = o;
    o3.kv_dtype = kv == FP4MOE_KV_FP8 ? FP4MOE_KV_AUTO : FP4MOE_KV_FP8;
    assert_int_equal(fp4moe_batch_new(m, &o3, &b2), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add_from_snapshot(b2, sn, &c), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "KV cache type"));
    fp4moe_batch_free(b2);
    fp4moe_snapshot_free(sn);
    free(la);
    free(lc);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

static void test_snapshot_bitwise(void **state) {
    (void)state;
    snapshot_case(FP4MOE_KV_AUTO);
    snapshot_case(FP4MOE_KV_FP8);
}

/* Greedy ids of prompt + G tokens in a fresh session (the solo reference). */
static void solo_ids(const fp4moe_model *m, const int32_t *prompt, int64_t L, int64_t G, int32_t *ids) {
    bt_seq q = {.prompt = (int32_t *)prompt, .L = L, .G = G, .solo = ids};
    bt_solo(m, FP4MOE_DEVICE_CPU, FP4MOE_F32, &q);
}

static void test_errors_isolated(void **state) {
    fp4moe_model *m = load_default();
    const int64_t V = fp4moe_model_config(m)->vocab;
    fp4moe_batch_options o;
    fp4moe_batch_options_default(&o);
    o.max_seqs = 2;
    o.max_kv_tokens = 64;           /* two pages of 32 tokens */
    o.max_step_tokens = 48;
    fp4moe_batch *b;
    assert_int_equal(fp4moe_batch_new(m, &o, &b), FP4MOE_OK);
    int64_t a, c, d;
    assert_int_equal(fp4moe_batch_add(b, &a), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add(b, &c), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add(b, &d), FP4MOE_EOVERFLOW);          /* max_seqs */
    assert_non_null(strstr(fp4moe_last_error(), "max_seqs"));
    int32_t pa[40], pc[10], bad[2] = {1, (int32_t)V}, ref[8], got[8];
    for (int i = 0; i < 40; i++) pa[i] = (i * 37 + 3) % (int)V;
    for (int i = 0; i < 10; i++) pc[i] = (i * 11 + 5) % (int)V;
    solo_ids(m, pa, 40, 8, ref);
    /* step 1: a's prompt takes both pages; c is refused (pool), a bad token, a sequence twice, an
     * unknown sequence: only a runs */
    fp4moe_batch_item it[5] = {
        {.seq = a, .tokens = pa, .n = 40, .out_token = &got[0]},
        {.seq = c, .tokens = bad, .n = 2},
        {.seq = c, .tokens = pc, .n = 8},
        {.seq = a, .tokens = pc, .n = 1},
        {.seq = 12345, .tokens = pc, .n = 1},
    };
    assert_int_equal(fp4moe_batch_step(b, it, 5), FP4MOE_OK);
    assert_int_equal(it[0].status, FP4MOE_OK);
    assert_int_equal(it[1].status, FP4MOE_EINVAL);
    assert_non_null(strstr(it[1].error, "outside"));
    assert_int_equal(it[2].status, FP4MOE_EOVERFLOW);
    assert_non_null(strstr(it[2].error, "KV cache pool exhausted"));
    assert_int_equal(it[3].status, FP4MOE_EINVAL);
    assert_non_null(strstr(it[3].error, "twice"));
    assert_int_equal(it[4].status, FP4MOE_EINVAL);
    assert_int_equal(fp4moe_batch_pos(b, c), 0);                            /* c untouched */
    int64_t used, pool;
    fp4moe_batch_kv_usage(b, &used, &pool);
    assert_int_equal(used, 64);
    assert_int_equal(pool, 64);
    /* a decodes on; c keeps asking and keeps failing alone; a step too large fails alone */
    int32_t big[49] = {0};
    for (int i = 1; i < 8; i++) {
        fp4moe_batch_item s2[2] = {{.seq = a, .tokens = &got[i - 1], .n = 1, .out_token = &got[i]},
                                   {.seq = c, .tokens = i == 3 ? big : pc, .n = i == 3 ? 49 : 1}};
        assert_int_equal(fp4moe_batch_step(b, s2, 2), FP4MOE_OK);
        assert_int_equal(s2[0].status, FP4MOE_OK);
        assert_int_equal(s2[1].status, FP4MOE_EOVERFLOW);
    }
    assert_memory_equal(got, ref, sizeof ref);
    /* after a leaves, c runs */
    assert_int_equal(fp4moe_batch_remove(b, a), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_remove(b, a), FP4MOE_EINVAL);
    fp4moe_batch_item s3 = {.seq = c, .tokens = pc, .n = 10};
    assert_int_equal(fp4moe_batch_step(b, &s3, 1), FP4MOE_OK);
    assert_int_equal(s3.status, FP4MOE_OK);
    assert_int_equal(fp4moe_batch_pos(b, c), 10);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

/* What an embedder's mistakes get (a new-user trial, session 34): NULL or out-of-range arguments of the batch,
 * session, sampler and tokenizer-stream calls return errors that name the argument, never crash; *out is NULL
 * after a failed constructor; a failed sampler init leaves a sampler that fp4moe_sampler_free takes. */
static void test_api_misuse(void **state) {
    fp4moe_model *m = load_default();
    fp4moe_batch *b = (fp4moe_batch *)&b;   /* not NULL: must be set to NULL */
    assert_int_equal(fp4moe_batch_new(NULL, NULL, &b), FP4MOE_EINVAL);
    assert_null(b);
    assert_non_null(strstr(fp4moe_last_error(), "NULL model"));
    fp4moe_model *m2 = (fp4moe_model *)&m2;
    assert_int_equal(fp4moe_model_load(NULL, NULL, &m2), FP4MOE_EINVAL);
    assert_null(m2);
    assert_int_equal(fp4moe_batch_new(m, NULL, &b), FP4MOE_OK);
    int64_t a;
    assert_int_equal(fp4moe_batch_add(b, &a), FP4MOE_OK);
    fp4moe_batch_item it = {.seq = a, .tokens = NULL, .n = 2};
    assert_int_equal(fp4moe_batch_step(b, &it, -1), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "< 0"));
    assert_int_equal(fp4moe_batch_step(b, &it, 1), FP4MOE_OK);
    assert_int_equal(it.status, FP4MOE_EINVAL);
    assert_non_null(strstr(it.error, "NULL tokens"));
    assert_int_equal(fp4moe_batch_step(b, NULL, 0), FP4MOE_OK);            /* nothing to run */
    assert_int_equal(fp4moe_batch_remove(NULL, a), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "NULL batch"));
    assert_int_equal(fp4moe_batch_pos(b, a), 0);
    assert_int_equal(fp4moe_session_pos(NULL), -1);
    fp4moe_sampler smp;
    memset(&smp, 0x5a, sizeof smp);                                          /* stack garbage */
    assert_int_equal(fp4moe_sampler_init_params(&smp, fp4moe_model_config(m)->vocab, NULL), FP4MOE_EINVAL);
    fp4moe_sampler_free(&smp);                                               /* zeroed by the failed init */
    assert_int_equal(fp4moe_sampler_init(&smp, fp4moe_model_config(m)->vocab, 0.0f, 1.0f, 1), FP4MOE_OK);
    assert_int_equal(fp4moe_sample(&smp, NULL), -1);
    assert_non_null(strstr(fp4moe_last_error(), "NULL logits"));
    assert_int_equal(fp4moe_sample(NULL, NULL), -1);
    fp4moe_sampler_free(&smp);
    fp4moe_sampler_free(&smp);
    fp4moe_tokenizer_stream_free(NULL);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

/* A growing pool (max_kv_tokens <= 0) keeps every sequence's rows when it moves. */
static void test_pool_growth(void **state) {
    fp4moe_model *m = load_default();
    const int64_t V = fp4moe_model_config(m)->vocab;
    int32_t p[300], ref[4], got[4];
    for (int i = 0; i < 300; i++) p[i] = (i * 53 + 1) % (int)V;
    solo_ids(m, p, 300, 4, ref);
    fp4moe_batch *b;
    assert_int_equal(fp4moe_batch_new(m, NULL, &b), FP4MOE_OK);            /* starts with 32 pages */
    int64_t a, c;
    assert_int_equal(fp4moe_batch_add(b, &a), FP4MOE_OK);
    assert_int_equal(fp4moe_batch_add(b, &c), FP4MOE_OK);
    for (int64_t t = 0; t < 300; t += 100) {                                   /* grows twice on the way */
        fp4moe_batch_item it[2] = {{.seq = a, .tokens = p + t, .n = 100, .out_token = &got[0]},
                                   {.seq = c, .tokens = p + t, .n = 100}};
        assert_int_equal(fp4moe_batch_step(b, it, 2), FP4MOE_OK);
        assert_int_equal(it[0].status | it[1].status, FP4MOE_OK);
    }
    for (int i = 1; i < 4; i++) {
        fp4moe_batch_item it = {.seq = a, .tokens = &got[i - 1], .n = 1, .out_token = &got[i]};
        assert_int_equal(fp4moe_batch_step(b, &it, 1), FP4MOE_OK);
    }
    assert_memory_equal(got, ref, sizeof ref);
    int64_t used, pool;
    fp4moe_batch_kv_usage(b, &used, &pool);
    assert_true(pool >= 600 && used >= 600);
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_a),       cmocka_unit_test(test_golden_b),
        cmocka_unit_test(test_default_model),  cmocka_unit_test(test_default_model_q8),
        cmocka_unit_test(test_snapshot_bitwise), cmocka_unit_test(test_default_model_fp8_kv),
        cmocka_unit_test(test_errors_isolated), cmocka_unit_test(test_pool_growth),
        cmocka_unit_test(test_api_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
