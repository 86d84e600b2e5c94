/* Model-side helpers shared by several commands: synthetic models (bench, serve), the chat
 * template of a model directory and its special tokens (chat, serve), sampling defaults and stop
 * ids from generation_config.json (chat, serve). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"
#include "fp4moe/tokenizer.h"

/* ---- synthetic models ------------------------------------------------------------------------ */

/* The directory of the running executable (malloc'd), or NULL. */
static char *exe_dir(void) {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
    if (n <= 0) return NULL;
    buf[n] = '\0';
    char *slash = strrchr(buf, '/');
    if (!slash) return NULL;
    *slash = '\0';
    return strdup(buf);
}

/* CONFIG: a config.json path, a directory holding one, or the name of a config shipped under
 * configs/ (looked up from the working directory and from the executable's directory, its
 * parent and grandparent). */
static int load_config(const char *name, fp4moe_config *cfg, char **used) {
    char *cands[8] = {0};
    int n = 0;
    char rel[1024];
    cands[n++] = strdup(name);
    snprintf(rel, sizeof rel, "configs/%s.json", name);
    cands[n++] = strdup(rel);
    char *ed = exe_dir();
    if (ed) {
        const char *ups[] = {"", "/..", "/../.."};
        for (int i = 0; i < 3; i++) {
            snprintf(rel, sizeof rel, "%s%s/configs/%s.json", ed, ups[i], name);
            cands[n++] = strdup(rel);
        }
        free(ed);
    }
    int st = fp4moe_set_error(FP4MOE_EIO, "synthetic: no config '%s' (a config.json path, a model directory, "
                              "or a name under configs/)", name);
    for (int i = 0; i < n && st == FP4MOE_EIO; i++) {
        if (!cands[i] || access(cands[i], R_OK)) continue;
        if (cli_is_dir(cands[i])) {
            st = fp4moe_config_load(cands[i], cfg);
        } else {
            char *text = NULL;
            st = cli_read_text(cands[i], 1 << 24, &text);
            if (!st) st = fp4moe_config_parse(text, cands[i], cfg);
            free(text);
        }
        if (!st) *used = strdup(cands[i]);
    }
    for (int i = 0; i < n; i++) free(cands[i]);
    return st;
}

static void on_gen_progress(void *ctx, int64_t done, int64_t total) {
    cli_progress *p = ctx;
    p->total = total;
    cli_progress_update(p, done, NULL);
}

int cli_synthetic_quiet(const char *name, uint64_t seed, fp4moe_device dev, fp4moe_model **out) {
    fp4moe_config cfg;
    char *path = NULL;
    int st = load_config(name, &cfg, &path);
    free(path);
    if (st) return st;
    fp4moe_synthetic_options o = {.device = dev, .seed = seed};
    st = fp4moe_model_synthetic(&cfg, &o, out);
    fp4moe_config_free(&cfg);
    return st;
}

int cli_load_share_quiet(const char *dir, int quantize, fp4moe_device dev, int world, int rank, fp4moe_model **out) {
    fp4moe_config cfg;
    int st = fp4moe_config_load(dir, &cfg); /* E, for the share */
    if (st) return st;
    fp4moe_load_options lo;
    fp4moe_load_options_default(&lo);
    lo.quantize = quantize;
    lo.device = dev;
    lo.expert_share = 1;
    fp4moe_ep_range(cfg.n_experts, world, rank, &lo.expert_lo, &lo.expert_hi);
    fp4moe_config_free(&cfg);
    return fp4moe_model_load(dir, &lo, out);
}

int cli_load_synthetic(const char *cmd, const char *name, uint64_t seed, fp4moe_device dev, fp4moe_model **out) {
    fp4moe_config cfg;
    char *path = NULL;
    int st = load_config(name, &cfg, &path);
    if (st) return cli_fail(cmd, st);
    fp4moe_synthetic_options o = {.device = dev, .seed = seed};
    cli_progress bar;
    cli_progress_start(&bar, dev == FP4MOE_DEVICE_CUDA ? "generating weights on the GPU" : "generating weights", 0);
    o.progress = on_gen_progress;
    o.progress_ctx = &bar;
    const double t0 = cli_now();
    st = fp4moe_model_synthetic(&cfg, &o, out);
    cli_progress_finish(&bar);
    fp4moe_config_free(&cfg);
    if (st) {
        free(path);
        return cli_fail(cmd, st);
    }
    fp4moe_model_stats s;
    fp4moe_model_get_stats(*out, &s);
    const fp4moe_config *c = fp4moe_model_config(*out);
    fprintf(stderr, "%s: synthetic %s (%s) on %s in %.2f s: %lld layers (%s), %.3g B params (%.3g B active), "
            "%lld NVFP4 linears\n", cmd, name, path, fp4moe_device_name(dev), cli_now() - t0,
            (long long)c->n_layers, c->layer_types, (double)s.params_total * 1e-9,
            (double)s.params_active * 1e-9, (long long)s.n_nvfp4_linears);
    free(path);
    return FP4MOE_EXIT_OK;
}

/* ---- chat templates ---------------------------------------------------------------------------- */

/* tokenizer_config.json at path p as a JSON object; NULL when there is none (*bad 0) or when it cannot be used - not
 * readable, not JSON, not an object - (*bad 1, the error set naming the file and why). */
static cJSON *tokenizer_config(const char *p, int *bad) {
    *bad = 0;
    if (!p || access(p, F_OK) != 0) return NULL;
    char *text = NULL;
    if (cli_read_text(p, 64 << 20, &text)) {
        *bad = 1;
        return NULL;
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithOpts(text, &end, 1);
    if (!j || !cJSON_IsObject(j)) {
        *bad = 1;
        if (j) fp4moe_set_error(FP4MOE_EFORMAT, "%s: not a JSON object", p);
        else fp4moe_set_error(FP4MOE_EFORMAT, "%s: not valid JSON (at byte %lld)", p,
                              (long long)(end && end >= text ? end - text : 0));
        cJSON_Delete(j);
        j = NULL;
    }
    free(text);
    return j;
}

/* The template text (malloc'd) from the sources above; NULL with a message when there is none. */
char *cli_load_chat_template(const char *model, const char *override, char **where) {
    char *text = NULL;
    if (where) *where = NULL;
    if (override) {
        if (cli_read_utf8_text("chat template", override, 16 << 20, &text)) return NULL;
        if (where) *where = strdup(override);
        return text;
    }
    char *p = cli_join(model, "chat_template.jinja");
    if (p && access(p, R_OK) == 0) {
        if (cli_read_utf8_text("chat template", p, 16 << 20, &text)) {
            free(p);
            return NULL;
        }
        if (where) *where = p;
        else free(p);
        return text;
    }
    free(p);
    p = cli_join(model, "tokenizer_config.json");
    int bad = 0;
    cJSON *j = tokenizer_config(p, &bad);
    if (bad) {
        free(p);
        return NULL; /* the file is there but unusable: its error, not "no chat template" */
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "chat_template");
    if (t && !cJSON_IsString(t) && !cJSON_IsArray(t)) {
        fp4moe_set_error(FP4MOE_EFORMAT, "%s: \"chat_template\" must be a string or a list of {\"name\", \"template\"}, "
                         "not %s", p, cJSON_IsNumber(t) ? "a number" : cJSON_IsObject(t) ? "an object" :
                         cJSON_IsBool(t) ? "a boolean" : "null");
        cJSON_Delete(j);
        free(p);
        return NULL;
    }
    if (cJSON_IsString(t)) {
        text = strdup(t->valuestring);
    } else if (cJSON_IsArray(t)) {
        const cJSON *e;
        cJSON_ArrayForEach(e, t) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *tt = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (cJSON_IsString(name) && !strcmp(name->valuestring, "default") && cJSON_IsString(tt))
                text = strdup(tt->valuestring);
        }
    }
    if (!text)
        fp4moe_set_error(FP4MOE_EINVAL, "model %s has no chat template (no chat_template.jinja, no "
                         "\"chat_template\" in tokenizer_config.json): give one with --chat-template FILE",
                         model);
    else if (where && p && (*where = malloc(strlen(p) + 20)))
        sprintf(*where, "%s (chat_template)", p);
    cJSON_Delete(j);
    free(p);
    return text;
}

/* bos_token / eos_token of tokenizer_config.json (a string or {"content": ...}) into the context. */
void cli_template_special_tokens(const char *dir, cJSON *ctx) {
    char *p = cli_join(dir, "tokenizer_config.json");
    int bad = 0;
    cJSON *j = tokenizer_config(p, &bad);
    if (bad)
        fprintf(stderr, "fp4moe: warning: %s; the template's bos_token / eos_token / pad_token are empty strings\n",
                fp4moe_last_error());
    const char *keys[] = {"bos_token", "eos_token", "pad_token"};
    for (int i = 0; i < 3; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, keys[i]);
        if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
        cJSON_AddStringToObject(ctx, keys[i], cJSON_IsString(v) ? v->valuestring : "");
    }
    cJSON_Delete(j);
    free(p);
}


int cli_ids_in_vocab(const char *dir, const fp4moe_tokenizer *tok, const int32_t *ids, int64_t n, int64_t V,
                     const char *what) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] >= 0 && ids[i] < V) continue;
        const char *piece = tok ? fp4moe_tokenizer_id_to_token(tok, ids[i]) : NULL;
        char why[160] = "";
        if (tok)
            snprintf(why, sizeof why, "; the tokenizer has %lld: tokenizer.json does not belong to this model",
                     (long long)fp4moe_tokenizer_vocab_size(tok));
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: token %lld of %s is id %d%s%s%s, outside the model's vocabulary "
                                "of %lld ids (config.json vocab_size%s)", dir, (long long)i, what, (int)ids[i],
                                piece ? " ('" : "", piece ? piece : "", piece ? "')" : "", (long long)V, why);
    }
    return FP4MOE_OK;
}

/* ---- generation_config.json ------------------------------------------------------------------------ */

/* 0: id added (or there already), 1: outside the vocabulary, 2: no room (FP4MOE_MAX_STOP_IDS) */
static int add_stop(fp4moe_sampler_params *sp, int64_t vocab, int64_t id) {
    if (id < 0 || id >= vocab) return 1;
    for (int i = 0; i < sp->n_stop; i++)
        if (sp->stop_ids[i] == id) return 0;
    if (sp->n_stop == FP4MOE_MAX_STOP_IDS) return 2;
    sp->stop_ids[sp->n_stop++] = (int32_t)id;
    return 0;
}

/* A value of generation_config.json (path p) that is not used: a warning naming the file, the key and why. */
static void gen_ignored(const char *p, const char *key, const cJSON *v, const char *why) {
    char *t = v ? cJSON_PrintUnformatted(v) : NULL;
    fprintf(stderr, "fp4moe: warning: %s: %s %s %s: ignored\n", p, key, t ? t : "?", why);
    free(t);
}

/* one eos_token_id value of generation_config.json */
static void gen_stop(const char *p, fp4moe_sampler_params *sp, int64_t vocab, const cJSON *v) {
    char why[96];
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || fabs(v->valuedouble) > 9e15) {
        gen_ignored(p, "eos_token_id", v, "is not an integer token id");
        return;
    }
    const int st = add_stop(sp, vocab, (int64_t)v->valuedouble);
    if (st == 1) {
        snprintf(why, sizeof why, "is not a token id of the vocabulary (0 .. %lld)", (long long)vocab - 1);
        gen_ignored(p, "eos_token_id", v, why);
    } else if (st == 2) {
        snprintf(why, sizeof why, "is one stop id more than the %d kept", FP4MOE_MAX_STOP_IDS);
        gen_ignored(p, "eos_token_id", v, why);
    }
}

/* a sampling default of generation_config.json: the number in [lo, hi] (lo_open: > lo), else a warning */
static int gen_number(const char *p, const cJSON *j, const char *key, double lo, int lo_open, double hi, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v)) return 0;
    char why[64];
    if (cJSON_IsNumber(v) && (lo_open ? v->valuedouble > lo : v->valuedouble >= lo) && v->valuedouble <= hi) {
        *out = v->valuedouble;
        return 1;
    }
    if (hi < 1e300) snprintf(why, sizeof why, "is not a number in %s%g, %g]", lo_open ? "(" : "[", lo, hi);
    else snprintf(why, sizeof why, "is not a number >= %g", lo);
    gen_ignored(p, key, v, why);
    return 0;
}

int cli_generation_defaults(const char *dir, const fp4moe_tokenizer *tok, int64_t vocab, fp4moe_sampler_params *sp) {
    add_stop(sp, vocab, fp4moe_tokenizer_eos_id(tok));
    const char *ends[] = {"<|im_end|>", "<|end_of_text|>", "<|endoftext|>", "</s>"};
    for (int i = 0; i < 4; i++) add_stop(sp, vocab, fp4moe_tokenizer_token_to_id(tok, ends[i]));
    char *p = dir ? cli_join(dir, "generation_config.json") : NULL, *text = NULL;
    int found = 0;
    if (p && access(p, R_OK) == 0 && !cli_read_text(p, 1 << 20, &text)) {
        cJSON *j = cJSON_Parse(text);
        if (!cJSON_IsObject(j)) {
            fprintf(stderr, "fp4moe: warning: %s is not a JSON object; its sampling defaults are ignored\n", p);
        } else {
            found = 1;
            const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, "eos_token_id"), *it;
            if (cJSON_IsArray(v)) cJSON_ArrayForEach(it, v) gen_stop(p, sp, vocab, it);
            else if (v && !cJSON_IsNull(v)) gen_stop(p, sp, vocab, v);
            v = cJSON_GetObjectItemCaseSensitive(j, "do_sample");
            if (v && !cJSON_IsBool(v) && !cJSON_IsNull(v)) gen_ignored(p, "do_sample", v, "is not true or false");
            double d;
            if (cJSON_IsFalse(v)) {
                sp->temperature = 0.0f;
            } else {
                if (gen_number(p, j, "temperature", 0, 0, 1e308, &d)) sp->temperature = (float)d;
                if (gen_number(p, j, "top_p", 0, 1, 1, &d)) sp->top_p = (float)d;
                if (gen_number(p, j, "top_k", 0, 0, 1e308, &d)) sp->top_k = (int64_t)d;
                if (gen_number(p, j, "min_p", 0, 0, 1, &d)) sp->min_p = (float)d;
            }
        }
        cJSON_Delete(j);
    }
    free(text);
    free(p);
    return found;
}

/* ---- sampling options ------------------------------------------------------------------------------ */

int cli_sampling_check(const char *cmd, cli_sampling *s) {
    if (!(s->top_p > 0.0 && s->top_p <= 1.0)) return cli_usage_error(cmd, "--top-p must be in (0, 1]");
    if (s->top_k < 0) return cli_usage_error(cmd, "--top-k must be >= 0");
    if (!(s->min_p >= 0.0 && s->min_p <= 1.0)) return cli_usage_error(cmd, "--min-p must be in [0, 1]");
    /* (as floats: the sampler's type; 1e39 would be inf there, 1e-50 zero) */
    if (!(s->temp >= 0.0 && isfinite((float)s->temp))) return cli_usage_error(cmd, "--temp must be >= 0 (and < 3.4e38)");
    if (!(s->repeat_penalty >= 1e-6 && s->repeat_penalty < 1e6))
        return cli_usage_error(cmd, "--repeat-penalty must be in [1e-6, 1e6) (1: off)");
    if (s->repeat_last_n < 1) return cli_usage_error(cmd, "--repeat-last-n must be >= 1");
    if (!(fabs(s->presence_penalty) <= 2.0)) return cli_usage_error(cmd, "--presence-penalty must be in [-2, 2]");
    if (!(fabs(s->frequency_penalty) <= 2.0)) return cli_usage_error(cmd, "--frequency-penalty must be in [-2, 2]");
    if (s->seed == INT64_MIN) {   /* a random seed, printed so that the run can be repeated */
        FILE *ur = fopen("/dev/urandom", "rb");
        uint64_t r = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
        if (ur) {
            if (fread(&r, sizeof r, 1, ur) != 1) r ^= 0x9E3779B97F4A7C15ull;
            fclose(ur);
        }
        s->seed = (int64_t)(r >> 11) + 1;          /* < 2^53: exact as a double (generate --json prints it as an integer) */
        if (s->temp > 0.0) fprintf(stderr, "%s: seed %lld (repeat with --seed %lld)\n", cmd, (long long)s->seed,
                                   (long long)s->seed);
    } else if (s->seed < 0) {
        return cli_usage_error(cmd, "--seed must be >= 0");
    }
    return FP4MOE_EXIT_OK;
}

void cli_sampling_params(const cli_sampling *s, const char *dir, const fp4moe_tokenizer *tok, int64_t vocab,
                         int no_stop, fp4moe_sampler_params *sp) {
    fp4moe_sampler_params_default(sp);
    if (tok && !no_stop) cli_generation_defaults(dir, tok, vocab, sp);   /* its sampling fields are reset below */
    sp->temperature = (float)s->temp;
    sp->top_p = (float)s->top_p;
    sp->top_k = s->top_k;
    sp->min_p = (float)s->min_p;
    sp->seed = (uint64_t)s->seed;
    sp->repeat_penalty = (float)s->repeat_penalty;
    sp->repeat_last_n = s->repeat_last_n;
    sp->presence_penalty = (float)s->presence_penalty;
    sp->frequency_penalty = (float)s->frequency_penalty;
}
