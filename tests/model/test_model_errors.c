/* Every bad input of issue 4 has a clear error naming it: a missing tensor, a misshaped tensor, a
 * NaN scale byte (MLX and ModelOpt), an unknown model_type, an unknown quantization mode (config
 * and hf_quant_config.json), a missing config field, a missing config.json, bad token ids and bad
 * session options. The corrupt checkpoints are copies of the golden models with one change. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <sys/stat.h>
#include <cmocka.h>

#include "model_test.h"

/* One change to a copy of a golden model's tensors. */
typedef struct {
    const char *drop;            /* tensor left out */
    const char *reshape;         /* tensor written with shape new_shape[new_ndim] (same bytes) */
    int new_ndim;
    int64_t new_shape[4];
    const char *patch;           /* tensor whose byte patch_at becomes patch_byte */
    int64_t patch_at;
    uint8_t patch_byte;
} edit;

/* Copies golden model `src` to <tmp>/<dst> with the tensor edit e and config.json text
 * transformed by replacing cfg_from by cfg_to (when cfg_from is non-NULL). Returns the dir. */
static const char *corrupt_copy(const char *src, const char *dst, const edit *e, const char *cfg_from,
                                const char *cfg_to) {
    static char dir[512];
    char path[640], sdir[512];
    snprintf(dir, sizeof dir, "%s/%s", mt_tmpdir(), dst);
    snprintf(sdir, sizeof sdir, MT_GOLDEN "/%s", src);
    mkdir(dir, 0755);
    fp4moe_st_model *st = NULL;
    fp4moe_st_writer *w = NULL;
    assert_int_equal(fp4moe_st_model_open(sdir, &st), FP4MOE_OK);
    assert_int_equal(fp4moe_st_writer_new(&w), FP4MOE_OK);
    uint8_t *patched = NULL;
    for (int64_t i = 0; i < fp4moe_st_model_count(st); i++) {
        const fp4moe_st_tensor *t = fp4moe_st_model_at(st, i);
        const void *data = t->data;
        int ndim = t->ndim;
        const int64_t *shape = t->shape;
        if (e && e->drop && !strcmp(t->name, e->drop)) continue;
        if (e && e->reshape && !strcmp(t->name, e->reshape)) {
            ndim = e->new_ndim;
            shape = e->new_shape;
        }
        if (e && e->patch && !strcmp(t->name, e->patch)) {
            patched = malloc((size_t)t->nbytes);
            memcpy(patched, t->data, (size_t)t->nbytes);
            patched[e->patch_at] = e->patch_byte;
            data = patched;
        }
        assert_int_equal(fp4moe_st_writer_add(w, t->name, t->dtype, ndim, shape, data), FP4MOE_OK);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(fp4moe_st_writer_write(w, path), FP4MOE_OK);
    fp4moe_st_writer_free(w);
    fp4moe_st_model_close(st);
    free(patched);
    const char *side[] = {"config.json", "hf_quant_config.json"};
    for (int i = 0; i < 2; i++) {
        snprintf(path, sizeof path, "%s/%s", sdir, side[i]);
        if (access(path, R_OK)) continue;
        char *text = mt_read_file(path);
        if (cfg_from && strstr(text, cfg_from)) {
            char *t2 = mt_replace(text, cfg_from, cfg_to);
            free(text);
            text = t2;
        }
        snprintf(path, sizeof path, "%s/%s", dir, side[i]);
        mt_write_file(path, text);
        free(text);
    }
    return dir;
}

/* Loading dir fails with status and a message holding every needle. */
static void expect_load_error(const char *dir, int quantize, int status, const char *n1, const char *n2,
                              const char *n3) {
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.quantize = quantize;
    fp4moe_model *m = (fp4moe_model *)&o;   /* must be reset to NULL */
    const int st = fp4moe_model_load(dir, &o, &m);
    print_message("  %s -> %s\n", dir + strlen(mt_tmpdir()), fp4moe_last_error());
    assert_int_equal(st, status);
    assert_null(m);
    const char *needles[3] = {n1, n2, n3};
    for (int i = 0; i < 3; i++)
        if (needles[i]) assert_non_null(strstr(fp4moe_last_error(), needles[i]));
}

static void test_missing_tensor(void **state) {
    edit e = {.drop = "backbone.layers.3.mixer.in_proj.weight"};
    const char *d = corrupt_copy("tiny-a-bf16", "missing", &e, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "missing tensor 'backbone.layers.3.mixer.in_proj.weight'",
                      "layer 3 (mamba)", NULL);
    edit e2 = {.drop = "backbone.layers.5.mixer.experts.7.down_proj.weight"};
    d = corrupt_copy("tiny-a-bf16", "missing-expert", &e2, NULL, NULL);
    expect_load_error(d, 0, FP4MOE_EFORMAT, "missing tensor 'backbone.layers.5.mixer.experts.7.down_proj.weight'",
                      "layer 5 (moe)", NULL);
    edit e3 = {.drop = "backbone.layers.2.mixer.switch_mlp.fc2.scales"};   /* then fc2 reads as dense U32 */
    d = corrupt_copy("tiny-a-mlx", "missing-scales", &e3, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "backbone.layers.2.mixer.switch_mlp.fc2.weight", NULL, NULL);
    edit e4 = {.drop = "backbone.norm_f.weight"};
    d = corrupt_copy("tiny-a-modelopt", "missing-norm", &e4, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "missing tensor 'backbone.norm_f.weight'", NULL, NULL);
}

static void test_misshaped_tensor(void **state) {
    edit e = {.reshape = "backbone.layers.1.mixer.k_proj.weight", .new_ndim = 2, .new_shape = {64, 32}};
    const char *d = corrupt_copy("tiny-a-bf16", "misshaped", &e, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "'backbone.layers.1.mixer.k_proj.weight' has shape [64, 32]",
                      "expected [32, 64]", "layer 1 (attention)");
    edit e2 = {.reshape = "backbone.layers.0.mixer.conv1d.weight", .new_ndim = 3, .new_shape = {192, 2, 2}};
    d = corrupt_copy("tiny-a-mlx", "misshaped-conv", &e2, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "conv1d.weight' has shape [192, 2, 2]", "expected [192, 1, 4]", NULL);
    /* stacked experts of the wrong count (8 -> 4 x 2 "experts" of twice the rows) */
    edit e3 = {.reshape = "backbone.layers.2.mixer.switch_mlp.fc1.weight", .new_ndim = 3, .new_shape = {4, 64, 8}};
    d = corrupt_copy("tiny-a-mlx", "misshaped-experts", &e3, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "switch_mlp.fc1", NULL, NULL);
    /* an MLX checkpoint whose config says another vocabulary: the NVFP4 embedding's logical shape (codes unpacked)
       and its stored U32 shape are both named (the stored one was called "logical" until session 28) */
    d = corrupt_copy("tiny-a-mlx", "mlx-vocab", NULL, "\"vocab_size\": 272", "\"vocab_size\": 280");
    expect_load_error(d, 1, FP4MOE_EFORMAT, "NVFP4 tensor 'backbone.embeddings.weight' has logical shape [272, 64]",
                      "(stored U32 [272, 8])", "expected [280, 64]");
    edit e4 = {.reshape = "backbone.embeddings.weight", .new_ndim = 2, .new_shape = {136, 128}};
    d = corrupt_copy("tiny-a-bf16", "misshaped-embed", &e4, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "'backbone.embeddings.weight' has shape [136, 128]",
                      "expected [272, 64]", NULL);
}

static void test_nan_scale_byte(void **state) {
    /* expert 1, row 3, block 2 of fc1 scales (E, I=32, H/16=4): index 1*128 + 3*4 + 2 = 142 */
    edit e = {.patch = "backbone.layers.2.mixer.switch_mlp.fc1.scales", .patch_at = 142, .patch_byte = 0x7F};
    const char *d = corrupt_copy("tiny-a-mlx", "nan-mlx", &e, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "'backbone.layers.2.mixer.switch_mlp.fc1.scales'",
                      "NaN E4M3 scale byte 0x7F at index 142", "(row 35, block 2)");
    edit e2 = {.patch = "backbone.layers.4.mixer.down_proj.weight_scale", .patch_at = 10, .patch_byte = 0xFF};
    d = corrupt_copy("tiny-a-modelopt", "nan-modelopt", &e2, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "'backbone.layers.4.mixer.down_proj.weight_scale'",
                      "NaN E4M3 scale byte 0xFF at index 10", "layer 4 (mlp)");
    edit e3 = {.patch = "backbone.embeddings.scales", .patch_at = 0, .patch_byte = 0x7F};
    d = corrupt_copy("tiny-a-mlx", "nan-embed", &e3, NULL, NULL);
    expect_load_error(d, 1, FP4MOE_EFORMAT, "'backbone.embeddings.scales'", "0x7F at index 0", NULL);
}

static void test_unknown_model_type(void **state) {
    const char *d = corrupt_copy("tiny-a-bf16", "llama", NULL, "\"nemotron_h\"", "\"llama\"");
    expect_load_error(d, 1, FP4MOE_EUNSUPPORTED, "config.json: unknown model_type 'llama'", NULL, NULL);
}

static void test_unknown_quantization_mode(void **state) {
    const char *d = corrupt_copy("tiny-a-mlx", "mxfp4", NULL, "\"mode\": \"nvfp4\"", "\"mode\": \"mxfp4\"");
    expect_load_error(d, 1, FP4MOE_EUNSUPPORTED, "config.json: unknown quantization mode 'mxfp4'", NULL, NULL);
    /* ModelOpt: hf_quant_config.json and config.json both say quant_algo; change both */
    d = corrupt_copy("tiny-a-modelopt", "fp8", NULL, "\"quant_algo\": \"NVFP4\"", "\"quant_algo\": \"FP8\"");
    expect_load_error(d, 1, FP4MOE_EUNSUPPORTED, "unknown quantization mode: quant_algo 'FP8'", NULL, NULL);
}

static void test_missing_config(void **state) {
    const char *d = corrupt_copy("tiny-a-bf16", "no-field", NULL, "\"ssm_state_size\"", "\"ssm_stat_size\"");
    expect_load_error(d, 1, FP4MOE_EFORMAT, "missing field 'ssm_state_size'", NULL, NULL);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", d);
    remove(path);
    expect_load_error(d, 1, FP4MOE_EIO, "config.json: cannot open", NULL, NULL);
}

static void test_bad_forward_arguments(void **state) {
    fp4moe_model *m = mt_load("tiny-a-mlx", 1);
    fp4moe_session *s = mt_session(m, FP4MOE_F32, FP4MOE_ROUTE_AUTO, 0);
    float lg[272];
    int32_t ids[3] = {5, 272, 7};
    assert_int_equal(fp4moe_session_forward(s, ids, 3, lg, 0), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "token 1 is id 272, outside [0, 272)"));
    ids[1] = -1;
    assert_int_equal(fp4moe_session_forward(s, ids, 3, lg, 0), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_session_forward(s, ids, 0, lg, 0), FP4MOE_EINVAL);
    assert_int_equal(fp4moe_session_pos(s), 0);
    fp4moe_session_free(s);
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.act_dtype = FP4MOE_F16;
    assert_int_equal(fp4moe_session_new(m, &o, &s), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "activation dtype f16"));
    /* enum values out of range: refused at creation, each named (the route was accepted and failed at the first
     * forward before session 31) */
    fp4moe_session_options_default(&o);
    o.route = (fp4moe_route)9;
    assert_int_equal(fp4moe_session_new(m, &o, &s), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "route 9"));
    fp4moe_batch_options bo;
    fp4moe_batch_options_default(&bo);
    bo.route = (fp4moe_route)-1;
    fp4moe_batch *b = NULL;
    assert_int_equal(fp4moe_batch_new(m, &bo, &b), FP4MOE_EINVAL);
    assert_null(b);
    fp4moe_session_options_default(&o);
    o.cpu_act = (fp4moe_cpu_act)7;
    assert_int_equal(fp4moe_session_new(m, &o, &s), FP4MOE_EINVAL);
    fp4moe_load_options lo;
    fp4moe_load_options_default(&lo);
    lo.device = (fp4moe_device)9;
    fp4moe_model *m2 = NULL;
    assert_int_equal(fp4moe_model_load("models/nemotron-h-tiny-moe", &lo, &m2), FP4MOE_EINVAL);
    assert_non_null(strstr(fp4moe_last_error(), "unknown device 9"));
    assert_null(m2);
    assert_string_equal(fp4moe_version(), FP4MOE_VERSION);
    fp4moe_session_options_default(&o);
    o.max_context = 10;
    assert_int_equal(fp4moe_session_new(m, &o, &s), FP4MOE_OK);
    int32_t many[11] = {3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    assert_int_equal(fp4moe_session_forward(s, many, 11, lg, 0), FP4MOE_EOVERFLOW);
    assert_non_null(strstr(fp4moe_last_error(), "context limit 10"));
    fp4moe_session_free(s);
    fp4moe_model_free(m);
}

static void test_interrupt(void **state) {
    fp4moe_model *m = mt_load("tiny-a-mlx", 1);
    volatile sig_atomic_t flag = 1;
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.interrupt = &flag;
    fp4moe_session *s = NULL;
    assert_int_equal(fp4moe_session_new(m, &o, &s), FP4MOE_OK);
    float lg[272];
    int32_t ids[2] = {5, 6};
    assert_int_equal(fp4moe_session_forward(s, ids, 2, lg, 0), FP4MOE_EINTERRUPTED);
    flag = 0;
    fp4moe_session_reset(s);
    assert_int_equal(fp4moe_session_forward(s, ids, 2, lg, 0), FP4MOE_OK);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
}

static int teardown(void **state) {
    mt_rmtree_tmp();
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_tensor),
        cmocka_unit_test(test_misshaped_tensor),
        cmocka_unit_test(test_nan_scale_byte),
        cmocka_unit_test(test_unknown_model_type),
        cmocka_unit_test(test_unknown_quantization_mode),
        cmocka_unit_test(test_missing_config),
        cmocka_unit_test(test_bad_forward_arguments),
        cmocka_unit_test(test_interrupt),
    };
    return cmocka_run_group_tests(tests, NULL, teardown);
}
