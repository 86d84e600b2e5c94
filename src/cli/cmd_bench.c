/* fp4moe bench -m DIR: prefill and decode speed of a nemotron_h model on the CPU.
 * A fixed synthetic prompt (ids from a seeded generator, no tokenizer needed) is prefilled, then
 * gen-tokens are decoded greedily; repeated `repeats` times from an empty cache. Reports prefill
 * tok/s and decode tok/s (median over the repeats) and an FNV-1a hash of the generated ids (the
 * same in every repeat, or the run fails: greedy decoding is deterministic). */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "common/error.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"

#define CMD "bench"

typedef struct {
    const char *model, *dtype, *route;
    int64_t prompt_tokens, gen_tokens, repeats, chunk;
    int json, no_quantize;
} bench_args;

typedef struct {
    double prefill_s, decode_s;
    uint64_t hash;
} bench_run;

static uint64_t fnv1a(uint64_t h, int32_t id) {
    for (int i = 0; i < 4; i++) {
        h ^= (uint64_t)((uint32_t)id >> (8 * i) & 0xFF);
        h *= 0x100000001B3ull;
    }
    return h;
}

/* Deterministic prompt ids in [3, V) (0..2 are usually pad/bos/eos). */
static void synthetic_prompt(int32_t *ids, int64_t n, int64_t V) {
    uint64_t x = 0x2545F4914F6CDD1Dull;
    for (int64_t i = 0; i < n; i++) {
        x ^= x >> 12; x ^= x << 25; x ^= x >> 27;
        ids[i] = (int32_t)(V > 3 ? 3 + (int64_t)((x * 0x2545F4914F6CDD1Dull) >> 33) % (V - 3) : 0);
    }
}

static int one_run(fp4moe_session *s, const int32_t *prompt, const bench_args *a, int64_t V,
                   float *logits, bench_run *r) {
    fp4moe_session_reset(s);
    double t0 = cli_now();
    int st = fp4moe_session_forward(s, prompt, a->prompt_tokens, logits, 0);
    r->prefill_s = cli_now() - t0;
    r->hash = 0xCBF29CE484222325ull;
    t0 = cli_now();
    for (int64_t i = 0; !st && i < a->gen_tokens; i++) {
        int32_t id = fp4moe_argmax(logits, V);
        r->hash = fnv1a(r->hash, id);
        st = fp4moe_session_forward(s, &id, 1, logits, 0);
    }
    r->decode_s = cli_now() - t0;
    return st;
}

static int cmp_double(const void *x, const void *y) {
    const double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double median(double *v, int64_t n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void report(const bench_args *a, const fp4moe_model *m, const bench_run *runs) {
    const int64_t R = a->repeats;
    double *pf = malloc((size_t)R * sizeof *pf), *dc = malloc((size_t)R * sizeof *dc);
    for (int64_t i = 0; i < R; i++) {
        pf[i] = (double)a->prompt_tokens / runs[i].prefill_s;
        dc[i] = (double)a->gen_tokens / runs[i].decode_s;
    }
    char hash[24];
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)runs[0].hash);
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", a->model);
        cJSON_AddStringToObject(o, "format", fp4moe_quant_mode_name(fp4moe_model_format(m)));
        cJSON_AddStringToObject(o, "dtype", a->dtype);
        cJSON_AddStringToObject(o, "route", a->route);
        cJSON_AddNumberToObject(o, "threads", omp_get_max_threads());
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)a->prompt_tokens);
        cJSON_AddNumberToObject(o, "gen_tokens", (double)a->gen_tokens);
        cJSON_AddNumberToObject(o, "repeats", (double)R);
        cJSON_AddItemToObject(o, "prefill_tok_s", cJSON_CreateDoubleArray(pf, (int)R));
        cJSON_AddItemToObject(o, "decode_tok_s", cJSON_CreateDoubleArray(dc, (int)R));
        cJSON_AddNumberToObject(o, "prefill_tok_s_median", median(pf, R));
        cJSON_AddNumberToObject(o, "decode_tok_s_median", median(dc, R));
        cJSON_AddStringToObject(o, "gen_ids_fnv1a", hash);
        char *s = cJSON_Print(o);
        printf("%s\n", s);
        free(s);
        cJSON_Delete(o);
    } else {
        printf("model          %s (%s)\n", a->model, fp4moe_quant_mode_name(fp4moe_model_format(m)));
        printf("setup          %lld prompt tokens, %lld generated, %lld repeats, %s activations, "
               "route %s, %d threads\n", (long long)a->prompt_tokens, (long long)a->gen_tokens,
               (long long)R, a->dtype, a->route, omp_get_max_threads());
        printf("prefill        %.2f tok/s (median)\n", median(pf, R));
        printf("decode         %.2f tok/s (median)\n", median(dc, R));
        printf("gen ids hash   %s (FNV-1a 64)\n", hash);
    }
    free(pf);
    free(dc);
}

static int bench(const bench_args *a) {
    fp4moe_dtype dt;
    fp4moe_route route;
    int rc = cli_parse_dtype(CMD, a->dtype, &dt);
    if (rc) return rc;
    if (fp4moe_route_parse(a->route, &route))
        return cli_usage_error(CMD, "--route must be auto, qmv, batched or dequant_gemm");
    fp4moe_model *m = NULL;
    if ((rc = cli_load_model(CMD, a->model, !a->no_quantize, &m))) return rc;
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.act_dtype = dt;
    so.route = route;
    so.interrupt = cli_install_sigint();
    if (a->chunk > 0) so.max_chunk = a->chunk;
    const int64_t V = fp4moe_model_config(m)->vocab;
    fp4moe_session *s = NULL;
    int32_t *prompt = malloc((size_t)a->prompt_tokens * sizeof *prompt);
    float *logits = malloc((size_t)V * sizeof *logits);
    bench_run *runs = calloc((size_t)a->repeats, sizeof *runs);
    int st = prompt && logits && runs ? fp4moe_session_new(m, &so, &s) : FP4MOE_ENOMEM;
    if (!st) synthetic_prompt(prompt, a->prompt_tokens, V);
    for (int64_t i = 0; !st && i < a->repeats; i++) {
        st = one_run(s, prompt, a, V, logits, &runs[i]);
        if (!st && runs[i].hash != runs[0].hash)
            st = fp4moe_set_error(FP4MOE_EFORMAT, "repeat %lld generated other tokens than "
                                  "repeat 0: greedy decoding is not deterministic", (long long)i);
        if (!st && !a->json)
            fprintf(stderr, "%s: repeat %lld: prefill %.3f s, decode %.3f s\n", CMD, (long long)i,
                    runs[i].prefill_s, runs[i].decode_s);
    }
    rc = st ? cli_fail(CMD, st) : FP4MOE_EXIT_OK;
    if (!st) report(a, m, runs);
    free(runs);
    free(logits);
    free(prompt);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    bench_args a = {.prompt_tokens = 512, .gen_tokens = 128, .repeats = 3, .dtype = "f32", .route = "auto"};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory"},
        {"--prompt-tokens", NULL, CLI_INT, &a.prompt_tokens, "N", "prompt length (default 512)"},
        {"--gen-tokens", NULL, CLI_INT, &a.gen_tokens, "N", "tokens decoded after the prompt (default 128)"},
        {"--repeats", NULL, CLI_INT, &a.repeats, "N", "runs; speeds are medians (default 3)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32)"},
        {"--route", NULL, CLI_STRING, &a.route, "R", "gather_qmm route: auto, qmv, batched, dequant_gemm (default auto)"},
        {"--chunk", NULL, CLI_INT, &a.chunk, "N", "prefill chunk in tokens (default 256)"},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense"},
        {"--json", NULL, CLI_FLAG, &a.json, NULL, "print one JSON object on stdout"},
    };
    const cli_spec spec = {CMD, "fp4moe bench -m DIR [options]",
                           "Measures prefill and decode speed (median tok/s over the repeats) on a fixed\n"
                           "synthetic prompt, and hashes the greedy token ids.",
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!a.model) return cli_usage_error(CMD, "-m DIR is required");
    if (a.prompt_tokens < 1 || a.gen_tokens < 1 || a.repeats < 1)
        return cli_usage_error(CMD, "--prompt-tokens, --gen-tokens and --repeats must be >= 1");
    return bench(&a);
}
