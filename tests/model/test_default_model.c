/* The shipped default model (models/nemotron-h-tiny-moe, MLX nvfp4) against transformers.
 *
 * Reference: tests/golden/default/reference.json, made by scripts/make_default_golden.py with
 * transformers 5.17 NemotronHForCausalLM in fp32 on the CPU, holding the model's NVFP4 weights
 * decoded in numpy (so both sides compute with the same weights):
 *   - prompt_ids: a fixed English prompt (45 tokens: 45 x top-4 = 180 >= FP4MOE_BATCHED_MIN_ROWS
 *     sorted rows, so prefill takes the expert-batched gather_qmm route unless it is switched off)
 *     and gen_ids, its 32-token greedy continuation (full recompute each step);
 *   - perplexity of heldout_short.txt (the start of the held-out text) under fp4moe's rule.
 * Tests:
 *   1. fp4moe's tokenizer encodes the prompt text to the same ids as HF tokenizers.
 *   2. fp4moe (f32 activations; prefill, then cached decode) continues greedily with gen_ids.
 *   3. the continuation is identical with FP4MOE_GATHER_EXPERT_BATCHED=0 (qmv) and =1, and the
 *      prefill logits of the two routes agree within the model tolerance (model_test.h).
 *   4. `fp4moe perplexity --json` (the executable next to this test) gives the reference ppl
 *      within 1e-3 relative, over the same number of scored tokens.
 *   5. the FP8 KV cache stays close to the f32 one (logits, greedy ids, perplexity).
 * A broken NVFP4 decode, global scale or expert offset changes the argmax within a few tokens (the
 * smallest top-1/top-2 logit gap of the reference continuation is ~0.15, recorded in the file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "testutil.h"

#include <sys/wait.h>

#include <cjson/cJSON.h>

#include "fp4moe/tokenizer.h"
#include "model_test.h"

#define MODEL_DIR "models/nemotron-h-tiny-moe"
#define REF_DIR "tests/golden/default"
#define PPL_RTOL 1e-3

typedef struct {
    cJSON *json;
    const char *prompt;
    int32_t *prompt_ids, *gen_ids;
    int64_t T, n;
    double ppl, ppl_all, tokens_scored;
    int64_t ctx;
    fp4moe_model *m;
    char cli[4096];
} fixture;

static fixture g;

static int32_t *json_ids(const cJSON *a, int64_t *n) {
    assert_true(cJSON_IsArray(a));
    *n = cJSON_GetArraySize(a);
    int32_t *ids = malloc((size_t)*n * sizeof *ids);
    for (int64_t i = 0; i < *n; i++) ids[i] = (int32_t)cJSON_GetArrayItem(a, (int)i)->valuedouble;
    return ids;
}

static double json_num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    if (!cJSON_IsNumber(v)) fail_msg("reference.json: no number '%s'", key);
    return v->valuedouble;
}

static void greedy(fp4moe_dtype act, int32_t *out, float *prefill_logits) {
    const int64_t V = fp4moe_model_config(g.m)->vocab;
    fp4moe_session *s = mt_session(g.m, act, FP4MOE_ROUTE_AUTO, 0);
    if (prefill_logits) {
        mt_forward(s, g.prompt_ids, g.T, prefill_logits, 1);
        fp4moe_session_reset(s);
    }
    mt_greedy(s, g.prompt_ids, g.T, V, g.n, out);
    fp4moe_session_free(s);
}

static void expect_ids(const int32_t *got, const char *what) {
    for (int64_t i = 0; i < g.n; i++)
        if (got[i] != g.gen_ids[i])
            fail_msg("%s: greedy token %lld is %d, transformers chose %d", what, (long long)i,
                     got[i], g.gen_ids[i]);
}

static void test_tokenizer_prompt(void **state) {
    fp4moe_tokenizer *tok = NULL;
    if (fp4moe_tokenizer_load(MODEL_DIR, &tok)) fail_msg("tokenizer: %s", fp4moe_last_error());
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(fp4moe_tokenizer_encode(tok, g.prompt, (int64_t)strlen(g.prompt), 0, &ids, &n), 0);
    assert_int_equal(n, g.T);
    for (int64_t i = 0; i < n; i++) assert_int_equal(ids[i], g.prompt_ids[i]);
    free(ids);
    fp4moe_tokenizer_free(tok);
}

static void test_greedy_matches_transformers(void **state) {
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    int32_t *out = malloc((size_t)g.n * sizeof *out);
    for (int64_t i = 0; i < g.n; i++) out[i] = -1;
    greedy(FP4MOE_F32, out, NULL);
    expect_ids(out, "f32, default routes");
    free(out);
}

static void test_greedy_batched_vs_qmv(void **state) {
    const fp4moe_config *c = fp4moe_model_config(g.m);
    assert_true(g.T * c->top_k >= FP4MOE_BATCHED_MIN_ROWS);  /* prefill is eligible for batched */
    const int64_t V = c->vocab;
    int32_t *on = malloc((size_t)g.n * sizeof *on), *off = malloc((size_t)g.n * sizeof *off);
    float *lg_on = mt_poisoned(g.T * V), *lg_off = mt_poisoned(g.T * V);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "1");
    greedy(FP4MOE_F32, on, lg_on);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", "0");
    greedy(FP4MOE_F32, off, lg_off);
    tu_setenv("FP4MOE_GATHER_EXPERT_BATCHED", NULL);
    for (int64_t i = 0; i < g.n; i++)
        if (on[i] != off[i])
            fail_msg("greedy token %lld: %d with the expert-batched route, %d with qmv", (long long)i,
                     on[i], off[i]);
    expect_ids(on, "FP4MOE_GATHER_EXPERT_BATCHED=1");
    const double err = mt_max_err(lg_on, lg_off, g.T, V);
    if (!(err <= MT_RTOL_F32)) fail_msg("prefill logits, batched vs qmv: rel err %.3g > %.3g", err, MT_RTOL_F32);
    free(on);
    free(off);
    free(lg_on);
    free(lg_off);
}

/* Positions t < T (rows of V logits) where a and b have the same argmax (lowest id on ties). */
static int64_t argmax_agree(const float *a, const float *b, int64_t T, int64_t V) {
    int64_t agree = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t ia = 0, ib = 0;
        for (int64_t v = 1; v < V; v++) {
            if (a[t * V + v] > a[t * V + ia]) ia = v;
            if (b[t * V + v] > b[t * V + ib]) ib = v;
        }
        agree += ia == ib;
    }
    return agree;
}

/* W4A8 (cpu_act q8) on the real model: the prefill logits stay close to the f32 ones and the greedy
 * choices mostly agree (int8 activations move a logit by ~1% of the row's range; the reference
 * continuation's smallest top-1/top-2 gap is ~0.15, so a few flips are expected, not many), and a
 * broken W4A8 kernel (a dropped correction, wrong scale) moves them far outside these bounds. */
/* Prefill logits of the reference prompt with session options o (lo) next to the f32 reference
 * (lf, default options, f32 activations): within rel_err, argmax equal at >= 90% of positions.
 * Returns the session (for more checks) when keep, else frees it. */
static fp4moe_session *close_to_f32(const char *what, const fp4moe_session_options *o, double rel_err, int keep) {
    const int64_t V = fp4moe_model_config(g.m)->vocab;
    float *lf = mt_poisoned(g.T * V), *lo = mt_poisoned(g.T * V);
    fp4moe_session *s = mt_session(g.m, FP4MOE_F32, FP4MOE_ROUTE_AUTO, 0);
    mt_forward(s, g.prompt_ids, g.T, lf, 1);
    fp4moe_session_free(s);
    assert_int_equal(fp4moe_session_new(g.m, o, &s), FP4MOE_OK);
    mt_forward(s, g.prompt_ids, g.T, lo, 1);
    const int64_t agree = argmax_agree(lf, lo, g.T, V);
    const double err = mt_max_err(lo, lf, g.T, V);
    fprintf(stderr, "%s vs f32 prefill logits: rel err %.3g, argmax agrees at %lld of %lld positions\n", what, err,
            (long long)agree, (long long)g.T);
    if (!(err <= rel_err)) fail_msg("%s prefill logits: rel err %.3g vs f32 > %g", what, err, rel_err);
    if (agree < g.T * 9 / 10) fail_msg("%s argmax agrees with f32 at %lld of %lld positions", what, (long long)agree, (long long)g.T);
    free(lf);
    free(lo);
    if (keep) return s;
    fp4moe_session_free(s);
    return NULL;
}

static void test_q8_close_to_f32(void **state) {
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.cpu_act = FP4MOE_CPU_ACT_Q8;
    close_to_f32("q8", &o, 0.05, 0);
}

/* Runs the fp4moe executable with argv (NULL-terminated, argv[0] ignored); stdout into a malloc'd
 * string; returns the exit code (-1 when it did not exit normally). */
static int run_cli(char *const argv[], char **out) {
    char path[] = "/tmp/fp4moe-default-model-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (dup2(fd, 1) < 0) _exit(127);
        execv(g.cli, argv);
        _exit(127);
    }
    close(fd);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    *out = mt_read_file(path);
    remove(path);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void test_perplexity_cli(void **state) {
    if (access(g.cli, X_OK)) fail_msg("%s not found: build the fp4moe_cli target", g.cli);
    char ctx[32];
    snprintf(ctx, sizeof ctx, "%lld", (long long)g.ctx);
    char *const argv[] = {g.cli, "perplexity", "-m", MODEL_DIR, "--cpu-act", "float", "--file", REF_DIR "/heldout_short.txt",
                          "--ctx", ctx, "--json", NULL};
    char *out = NULL;
    const int rc = run_cli(argv, &out);
    if (rc != 0) fail_msg("fp4moe perplexity exited with %d; stdout: %.2000s", rc, out);
    cJSON *o = cJSON_Parse(out);
    if (!o) fail_msg("fp4moe perplexity --json: not JSON: %.2000s", out);
    const double ppl = json_num(o, "ppl"), ppl_all = json_num(o, "ppl_all");
    assert_int_equal((int64_t)json_num(o, "tokens_scored"), (int64_t)g.tokens_scored);
    fprintf(stderr, "perplexity: fp4moe %.6f, transformers %.6f (rel %.2g); all: %.6f vs %.6f\n", ppl,
            g.ppl, fabs(ppl - g.ppl) / g.ppl, ppl_all, g.ppl_all);
    if (!(fabs(ppl - g.ppl) <= PPL_RTOL * g.ppl))
        fail_msg("ppl %.6f, reference %.6f: relative difference over %g", ppl, g.ppl, PPL_RTOL);
    if (!(fabs(ppl_all - g.ppl_all) <= PPL_RTOL * g.ppl_all))
        fail_msg("ppl_all %.6f, reference %.6f: relative difference over %g", ppl_all, g.ppl_all, PPL_RTOL);
    cJSON_Delete(o);
    free(out);
}

/* The FP8 KV cache (kv_dtype FP8: E4M3 with a scale per token and kv head) on the real model: the
 * prefill logits stay close to the f32 cache's, the greedy choices mostly agree, the greedy
 * continuation of the reference prompt's first tokens is unchanged, and `fp4moe perplexity
 * --kv-cache-dtype fp8` over heldout_short stays within KV_FP8_PPL_RTOL of the reference (a cache
 * read without its scales, the kv_fp8_scale fault, moves all of these far outside). */
#define KV_FP8_PPL_RTOL 0.01
static void test_fp8_kv_close_to_f32(void **state) {
    const int64_t V = fp4moe_model_config(g.m)->vocab;
    fp4moe_session_options o;
    fp4moe_session_options_default(&o);
    o.kv_dtype = FP4MOE_KV_FP8;
    fp4moe_session *s = close_to_f32("fp8 KV", &o, 0.05, 1);
    fp4moe_session_reset(s);
    int32_t *out = malloc((size_t)g.n * sizeof *out);
    mt_greedy(s, g.prompt_ids, g.T, V, g.n, out);
    fp4moe_session_free(s);
    int64_t same = 0;
    while (same < g.n && out[same] == g.gen_ids[same]) same++;
    fprintf(stderr, "fp8 KV: greedy continuation equals transformers' for %lld of %lld tokens\n", (long long)same,
            (long long)g.n);
    if (same < 8) fail_msg("fp8 KV: the greedy continuation leaves transformers' at token %lld", (long long)same);
    free(out);
    /* perplexity over the held-out text, through the command line */
    char ctx[32];
    snprintf(ctx, sizeof ctx, "%lld", (long long)g.ctx);
    char *const argv[] = {g.cli, "perplexity", "-m", MODEL_DIR, "--cpu-act", "float", "--kv-cache-dtype", "fp8", "--file",
                          REF_DIR "/heldout_short.txt", "--ctx", ctx, "--json", NULL};
    char *txt = NULL;
    const int rc = run_cli(argv, &txt);
    if (rc != 0) fail_msg("fp4moe perplexity --kv-cache-dtype fp8 exited with %d; stdout: %.2000s", rc, txt);
    cJSON *j = cJSON_Parse(txt);
    if (!j) fail_msg("not JSON: %.2000s", txt);
    const double ppl = json_num(j, "ppl");
    fprintf(stderr, "perplexity with the fp8 KV cache: %.6f, reference (f32) %.6f: %+.3f%%\n", ppl, g.ppl,
            100.0 * (ppl - g.ppl) / g.ppl);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(j, "kv_cache_dtype")), "fp8");
    if (!(fabs(ppl - g.ppl) <= KV_FP8_PPL_RTOL * g.ppl))
        fail_msg("fp8 KV ppl %.6f, reference %.6f: relative difference over %g", ppl, g.ppl, KV_FP8_PPL_RTOL);
    cJSON_Delete(j);
    free(txt);
}

static int setup(void **state) {
    if (access(MODEL_DIR "/model.safetensors", R_OK) || access(REF_DIR "/reference.json", R_OK)) {
        fprintf(stderr, "default model or reference missing (run from the repository root)\n");
        return -1;
    }
    char *text = mt_read_file(REF_DIR "/reference.json");
    g.json = cJSON_Parse(text);
    free(text);
    if (!g.json) return -1;
    g.prompt = cJSON_GetStringValue(cJSON_GetObjectItem(g.json, "prompt"));
    g.prompt_ids = json_ids(cJSON_GetObjectItem(g.json, "prompt_ids"), &g.T);
    g.gen_ids = json_ids(cJSON_GetObjectItem(g.json, "gen_ids"), &g.n);
    const cJSON *p = cJSON_GetObjectItem(g.json, "perplexity");
    g.ppl = json_num(p, "ppl");
    g.ppl_all = json_num(p, "ppl_all");
    g.tokens_scored = json_num(p, "tokens_scored");
    g.ctx = (int64_t)json_num(p, "ctx");
    if (!g.prompt || g.T < 1 || g.n < 1) return -1;

    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    if (fp4moe_model_load(MODEL_DIR, &o, &g.m)) {
        fprintf(stderr, "cannot load %s: %s\n", MODEL_DIR, fp4moe_last_error());
        return -1;
    }
    if (fp4moe_model_format(g.m) != FP4MOE_QUANT_MLX_NVFP4) {
        fprintf(stderr, "%s is not MLX nvfp4\n", MODEL_DIR);
        return -1;
    }
    ssize_t n = readlink("/proc/self/exe", g.cli, sizeof g.cli - 16);
    if (n <= 0) return -1;
    g.cli[n] = '\0';
    strcpy(strrchr(g.cli, '/') + 1, "fp4moe");
    return 0;
}

static int teardown(void **state) {
    fp4moe_model_free(g.m);
    free(g.prompt_ids);
    free(g.gen_ids);
    cJSON_Delete(g.json);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenizer_prompt),
        cmocka_unit_test(test_greedy_matches_transformers),
        cmocka_unit_test(test_greedy_batched_vs_qmv),
        cmocka_unit_test(test_q8_close_to_f32),
        cmocka_unit_test(test_perplexity_cli),
        cmocka_unit_test(test_fp8_kv_close_to_f32),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
