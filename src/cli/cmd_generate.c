/* fp4moe generate -m DIR -p TEXT: text generation with a nemotron_h model on the CPU or the GPU.
 * Tokens are streamed to stdout as they come (whole UTF-8 characters only); load time, prefill and
 * decode speeds go to stderr. Ctrl-C stops cleanly (between tokens, or between prefill chunks and
 * layers). Also holds the model loading shared with `fp4moe bench` (cli_load_model). */
#include <cjson/cJSON.h>
#include <pthread.h>
#include <signal.h>
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "server/srv.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/grammar.h"
#include "fp4moe/model.h"
#include "fp4moe/tokenizer.h"

#define CMD "generate"

static volatile sig_atomic_t g_stop;

static void on_sigint(int sig) {
    (void)sig;
    g_stop = 1;
}

/* Ctrl-C sets g_stop (a second Ctrl-C is handled the same way; the loop exits promptly). */
const volatile sig_atomic_t *cli_install_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    g_stop = 0;
    return &g_stop;
}

const volatile sig_atomic_t *cli_install_stop_signals(void) {
    const volatile sig_atomic_t *f = cli_install_sigint();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    return f;
}

int cli_check_interrupt(void) {
    return g_stop ? fp4moe_set_error(FP4MOE_EINTERRUPTED, "interrupted (Ctrl-C)") : FP4MOE_OK;
}

/* ---- loading (shared with bench) ------------------------------------------------------------- */

typedef struct {
    cli_progress bar;
    int64_t last;
} load_progress;

static void on_progress(void *ctx, int64_t done, int64_t total) {
    load_progress *p = ctx;
    if (done < p->last) p->bar.label = "uploading to the GPU"; /* the second pass (device cuda) */
    p->last = done;
    char bar[40];
    const int w = 30, fill = total > 0 ? (int)((double)done / (double)total * w) : 0;
    bar[0] = '[';
    for (int i = 0; i < w; i++) bar[1 + i] = i < fill ? '#' : '.';
    bar[w + 1] = ']';
    bar[w + 2] = '\0';
    p->bar.total = total;
    cli_progress_update(&p->bar, done, bar);
}

/* Why --device auto chose the CPU in a build with a CUDA backend (for the load line), else empty */
static char g_auto_cpu[240];

int cli_load_model(const char *cmd, const char *dir, int quantize, fp4moe_model **out) {
    return cli_load_model_on(cmd, dir, quantize, FP4MOE_DEVICE_CPU, out);
}

int cli_load_model_on(const char *cmd, const char *dir, int quantize, fp4moe_device device,
                      fp4moe_model **out) {
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.quantize = quantize;
    o.device = device;
    load_progress p = {.last = 0};
    cli_progress_start(&p.bar, "loading", 0);
    o.progress = on_progress;
    o.progress_ctx = &p;
    int st = fp4moe_model_load(dir, &o, out);
    if (p.bar.shown && p.bar.tty) fprintf(stderr, "\r\033[K");
    if (st) return cli_fail(cmd, st);
    const fp4moe_config *c = fp4moe_model_config(*out);
    fp4moe_model_stats s;
    fp4moe_model_get_stats(*out, &s);
    char b[32];
    int64_t bytes = s.bytes_embed + s.bytes_lm_head + s.bytes_mamba + s.bytes_attention +
                    s.bytes_moe_experts + s.bytes_moe_shared + s.bytes_moe_router + s.bytes_mlp +
                    s.bytes_norms;
    const int on_gpu = fp4moe_model_on_gpu(*out);
    fprintf(stderr, "%s: loaded %s in %.2f s: %s, %lld layers (%s), %.3g B params (%.3g B active), "
            "%s, %lld NVFP4 + %lld dense linears%s%s%s%s\n", cmd, dir, s.load_seconds,
            fp4moe_quant_mode_name(fp4moe_model_format(*out)), (long long)c->n_layers,
            c->layer_types, (double)s.params_total * 1e-9, (double)s.params_active * 1e-9,
            cli_format_bytes(bytes, b), (long long)s.n_nvfp4_linears, (long long)s.n_dense_linears,
            on_gpu ? ", weights on the GPU" : "", !on_gpu && g_auto_cpu[0] ? ", on the CPU (--device auto: " : "",
            !on_gpu && g_auto_cpu[0] ? g_auto_cpu : "", !on_gpu && g_auto_cpu[0] ? ")" : "");
    if (s.n_dense_unlisted)
        fprintf(stderr, "%s: warning: %lld linear module(s) of this NVFP4 checkpoint are stored dense but its "
                "exclude_modules does not list them (first: %s): quantized weights lost in the export?\n", cmd,
                (long long)s.n_dense_unlisted, s.first_dense_unlisted);
    return FP4MOE_EXIT_OK;
}

int cli_parse_device(const char *cmd, const char *s, fp4moe_device *d) {
    if (fp4moe_device_parse(s, d))
        return cli_usage_error(cmd, "--device must be cpu, cuda or auto (got '%s')", s);
    g_auto_cpu[0] = 0;
    if (*d == FP4MOE_DEVICE_CUDA && fp4moe_cuda_check()) return cli_fail(cmd, FP4MOE_EUNSUPPORTED); /* before any input */
    if (!strcmp(s, "auto") && *d == FP4MOE_DEVICE_CPU && fp4moe_cuda_check() &&
        !strstr(fp4moe_last_error(), "no CUDA backend")) {
        snprintf(g_auto_cpu, sizeof g_auto_cpu, "%s", fp4moe_last_error());
        char *cut = strstr(g_auto_cpu, "; the cpu device");
        if (cut) *cut = 0;
        fp4moe_clear_error();
    }
    return FP4MOE_EXIT_OK;
}

int cli_check_gpus(const char *cmd, int64_t gpus, const char *device_arg, fp4moe_device dev) {
    if (gpus < 1) return FP4MOE_EXIT_OK;
    if (dev != FP4MOE_DEVICE_CUDA) {
        if (device_arg && !strcmp(device_arg, "cpu"))
            return cli_usage_error(cmd, "--gpus needs --device cuda (not --device cpu)");
        fp4moe_cuda_check();
        return cli_error(cmd, FP4MOE_EXIT_FAIL, "--gpus %lld: %s", (long long)gpus, fp4moe_last_error());
    }
    const int n = fp4moe_cuda_device_count();
    if (n < gpus)
        return cli_error(cmd, FP4MOE_EXIT_FAIL, "--gpus %lld: %d CUDA device%s visible%s", (long long)gpus, n,
                         n == 1 ? " is" : "s are", getenv("CUDA_VISIBLE_DEVICES") ? " (CUDA_VISIBLE_DEVICES is set)" : "");
    return FP4MOE_EXIT_OK;
}

/* Model-level summary for `inspect -m DIR`: format, layer pattern, parameters, bytes per component (text on out, or
 * json's "model" object). Loads without quantizing (weights in place). Returns an exit code. */
int cli_model_summary(const char *cmd, const char *dir, FILE *out, cJSON *json) {
    fp4moe_load_options o;
    fp4moe_load_options_default(&o);
    o.quantize = 0;
    fp4moe_model *m = NULL;
    int st = fp4moe_model_load(dir, &o, &m);
    if (st) return cli_fail(cmd, st);
    const fp4moe_config *c = fp4moe_model_config(m);
    fp4moe_model_stats s;
    fp4moe_model_get_stats(m, &s);
    char b[32];
    const struct { const char *name, *key; int64_t bytes; } parts[] = {
        {"embedding", "embedding", s.bytes_embed}, {"lm_head", "lm_head", s.bytes_lm_head},
        {"mamba", "mamba", s.bytes_mamba}, {"attention", "attention", s.bytes_attention},
        {"moe experts", "moe_experts", s.bytes_moe_experts}, {"moe shared", "moe_shared", s.bytes_moe_shared},
        {"moe router", "moe_router", s.bytes_moe_router}, {"mlp", "mlp", s.bytes_mlp}, {"norms", "norms", s.bytes_norms}};
    const size_t np = sizeof parts / sizeof parts[0];
    if (json) {
        cJSON *mo = cJSON_AddObjectToObject(json, "model");
        cJSON_AddStringToObject(mo, "architecture", "nemotron_h");
        cJSON_AddStringToObject(mo, "format", fp4moe_quant_mode_name(fp4moe_model_format(m)));
        cJSON_AddNumberToObject(mo, "layers", (double)c->n_layers);
        cJSON_AddStringToObject(mo, "layer_types", c->layer_types);
        cJSON_AddNumberToObject(mo, "params_total", (double)s.params_total);
        cJSON_AddNumberToObject(mo, "params_active", (double)s.params_active);
        /* in memory after loading (the CPU keeps bf16 tensors as fp32: more than the files hold; the files' tensor
           bytes are inspect's top-level "bytes") */
        cJSON *by = cJSON_AddObjectToObject(mo, "memory_bytes");
        for (size_t i = 0; i < np; i++) cJSON_AddNumberToObject(by, parts[i].key, (double)parts[i].bytes);
        cJSON_AddNumberToObject(mo, "nvfp4_linears", (double)s.n_nvfp4_linears);
        cJSON_AddNumberToObject(mo, "dense_linears", (double)s.n_dense_linears);
    } else {
        fprintf(out, "model:   nemotron_h, %s, %lld layers: %s\n", fp4moe_quant_mode_name(fp4moe_model_format(m)),
                (long long)c->n_layers, c->layer_types);
        fprintf(out, "params:  %lld total, %lld active per token\n", (long long)s.params_total,
                (long long)s.params_active);
        for (size_t i = 0; i < np; i++)
            if (parts[i].bytes) fprintf(out, "  %-12s %s\n", parts[i].name, cli_format_bytes(parts[i].bytes, b));
        fprintf(out, "linears: %lld NVFP4, %lld dense\n", (long long)s.n_nvfp4_linears, (long long)s.n_dense_linears);
    }
    fp4moe_model_free(m);
    return FP4MOE_EXIT_OK;
}

int cli_parse_cpu_act(const char *cmd, const char *s, fp4moe_device dev, fp4moe_cpu_act *ca) {
    const int cuda = dev == FP4MOE_DEVICE_CUDA || (dev == FP4MOE_DEVICE_DEFAULT && fp4moe_cuda_available());
    if (!s) { /* q8 on the CPU: +0.03% perplexity, faster (docs/PERFORMANCE.md, issue 14) */
        *ca = cuda ? FP4MOE_CPU_ACT_FLOAT : FP4MOE_CPU_ACT_Q8;
        return FP4MOE_EXIT_OK;
    }
    if (fp4moe_cpu_act_parse(s, ca)) return cli_usage_error(cmd, "--cpu-act must be float or q8 (got '%s')", s);
    if (cuda && *ca == FP4MOE_CPU_ACT_Q8)
        return cli_usage_error(cmd, "--cpu-act q8 is a CPU mode, and --device %s puts the model on cuda (use "
                               "--device cpu with it)", dev == FP4MOE_DEVICE_CUDA ? "cuda" : "auto");
    return FP4MOE_EXIT_OK;
}

int cli_parse_kv_dtype(const char *cmd, const char *s, fp4moe_device dev, fp4moe_kv_dtype *kv) {
    *kv = FP4MOE_KV_AUTO;
    if (!s) return FP4MOE_EXIT_OK;
    if (fp4moe_kv_dtype_parse(s, kv)) return cli_usage_error(cmd, "--kv-cache-dtype must be auto or fp8 (got '%s')", s);
    if (*kv == FP4MOE_KV_FP8 && dev == FP4MOE_DEVICE_CUDA)
        return cli_usage_error(cmd, "--kv-cache-dtype fp8 runs on the CPU only so far (use --device cpu with it)");
    return FP4MOE_EXIT_OK;
}

int cli_parse_dtype(const char *cmd, const char *s, fp4moe_dtype *dt) {
    if (fp4moe_dtype_parse(s, dt) || (*dt != FP4MOE_F32 && *dt != FP4MOE_BF16))
        return cli_usage_error(cmd, "--dtype must be bf16 or f32 (got '%s')", s);
    return FP4MOE_EXIT_OK;
}

int cli_parse_compute(const char *cmd, const char *device, const char *dtype, const char *cpu_act,
                      fp4moe_device *dev, fp4moe_dtype *dt, fp4moe_cpu_act *ca) {
    int rc = cli_parse_device(cmd, device, dev);
    if (rc) return rc;
    if (*dev == FP4MOE_DEVICE_DEFAULT) *dev = fp4moe_cuda_available() ? FP4MOE_DEVICE_CUDA : FP4MOE_DEVICE_CPU;
    if ((rc = cli_parse_dtype(cmd, dtype ? dtype : (*dev == FP4MOE_DEVICE_CUDA ? "bf16" : "f32"), dt))) return rc;
    return cli_parse_cpu_act(cmd, cpu_act, *dev, ca);
}

/* ---- generate -------------------------------------------------------------------------------- */

typedef struct {
    const char *model, *prompt, *prompt_ids, *dtype, *device, *cpu_act, *kv_cache;
    int64_t n, chunk, ctx, threads, gpus, ep_ranks;
    const char *file;
    cli_sampling smp;
    int no_quantize, ignore_eos, json;
    cli_strings stop;
    const char *json_schema, *json_schema_file; /* structured output */
    int json_object;
} gen_args;

/* "1,2,3" -> ids (malloc'd). */
static int parse_ids(const char *s, int32_t **ids, int64_t *n) {
    int64_t cap = 16, k = 0;
    int32_t *a = malloc((size_t)cap * sizeof *a);
    while (a && *s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > INT32_MAX) break;
        if (k == cap) {
            int32_t *b = realloc(a, (size_t)(cap *= 2) * sizeof *a);
            if (!b) break;
            a = b;
        }
        a[k++] = (int32_t)v;
        s = end;
        if (*s == ',') s++;
        else if (*s) break;
    }
    if (!a || *s || k == 0) {
        free(a);
        return 1;
    }
    *ids = a;
    *n = k;
    return 0;
}

typedef struct gen_state gen_state;
static int emit(fp4moe_tokenizer_stream *ts, gen_state *g, int32_t id);

static void print_speed(const char *what, int64_t n, double dt) {
    fprintf(stderr, "%s: %s: %lld tokens in %.3f s, %.2f tok/s\n", CMD, what, (long long)n, dt,
            dt > 0 ? (double)n / dt : 0.0);
}

struct gen_state {
    fp4moe_model *m;
    fp4moe_tokenizer *tok;
    fp4moe_session *s;
    fp4moe_sampler smp;
    int32_t *prompt;
    int64_t T;
    int64_t ctx;                    /* context limit in tokens, 0: none */
    int64_t piece;                  /* prefill by calls of this many tokens with a progress line (0: one call; EP
                                       runs, whose followers mirror rank 0's calls) */
    float *logits;
    int json;                       /* --json: collect instead of streaming */
    const char *cpu_act;            /* the CPU activation mode in force (for --json) */
    cli_text text;                  /* --json: the generated text */
    int32_t *ids;                   /* --json: the generated ids */
    int64_t n_ids;
    srv_text stop;                  /* --stop strings (none: passes text through) */
    int stopped;                    /* a stop string matched */
    fp4moe_grammar *grammar;        /* --json-schema / --json-schema-file / --json-object (NULL: free text) */
    fp4moe_grammar_vocab *gv;
    fp4moe_grammar_matcher *gm;
    float *mlog;                    /* the logits with the grammar's mask */
};

/* A token: text through the streaming decoder (printed, or kept with --json), or " id" without a
 * tokenizer. */
/* Text that passed the stop strings: printed, or kept with --json. */
static void put_text(gen_state *g, const char *text, size_t len, int final) {
    srv_delta d;
    const int r = final ? srv_text_finish(&g->stop, &d) : srv_text_feed(&g->stop, text, len, &d);
    if (r == 1) g->stopped = 1;
    if (g->json) cli_text_add(&g->text, d.content, d.n_content);
    else fwrite(d.content, 1, d.n_content, stdout);
}

static int emit(fp4moe_tokenizer_stream *ts, gen_state *g, int32_t id) {
    if (g->ids) g->ids[g->n_ids++] = id;
    if (!g->tok) {
        if (!g->json) printf(" %d", id);
    } else {
        const char *text;
        int64_t len;
        int st = fp4moe_tokenizer_stream_push(ts, id, &text, &len);
        if (st) return st;
        put_text(g, text, (size_t)len, 0);
    }
    fflush(stdout);
    return FP4MOE_OK;
}

static void gen_free(gen_state *g) {
    fp4moe_sampler_free(&g->smp);
    fp4moe_session_free(g->s);
    fp4moe_tokenizer_free(g->tok);
    fp4moe_model_free(g->m);
    srv_text_free(&g->stop);
    free(g->prompt);
    free(g->logits);
    free(g->text.s);
    free(g->ids);
    fp4moe_grammar_matcher_free(g->gm);
    fp4moe_grammar_vocab_free(g->gv);
    fp4moe_grammar_free(g->grammar);
    free(g->mlog);
}

/* Tokenizer from the model directory (NULL when it has none and ids are given). */
static int load_tokenizer(const gen_args *a, gen_state *g) {
    char *path = cli_join(a->model, "tokenizer.json");
    const int have = path && access(path, R_OK) == 0;
    free(path);
    if (!have && a->prompt_ids) return FP4MOE_EXIT_OK;
    int st = fp4moe_tokenizer_load(a->model, &g->tok);
    return st ? cli_fail(CMD, st) : FP4MOE_EXIT_OK;
}

static int encode_prompt(const gen_args *a, gen_state *g) {
    if (a->prompt_ids) {
        if (parse_ids(a->prompt_ids, &g->prompt, &g->T))
            return cli_usage_error(CMD, "--prompt-ids must be a list like 1,2,3");
        return FP4MOE_EXIT_OK;
    }
    int st = fp4moe_tokenizer_encode(g->tok, a->prompt, (int64_t)strlen(a->prompt), 1, &g->prompt, &g->T);
    if (st) return cli_fail(CMD, st);
    if (g->T == 0) return cli_usage_error(CMD, "the prompt encodes to no tokens");
    return FP4MOE_EXIT_OK;
}

/* Prefill, then sample/decode up to n tokens, streaming them. */
static int run_generation(const gen_args *a, gen_state *g, const volatile sig_atomic_t *stop) {
    const fp4moe_config *c = fp4moe_model_config(g->m);
    fp4moe_tokenizer_stream ts;
    if (g->tok) fp4moe_tokenizer_stream_init(&ts, g->tok, 1);
    const int32_t eos = g->tok ? fp4moe_tokenizer_eos_id(g->tok) : (int32_t)c->eos_id;
    for (int64_t i = 0; i < g->T; i++) fp4moe_sampler_accept(&g->smp, g->prompt[i]);
    double t0 = cli_now();
    int st = FP4MOE_OK;
    if (g->piece > 0 && g->T > g->piece) {
        /* a long prompt: calls of whole session chunks (the session cuts the same chunks either way: the same
         * results), a percentage on stderr after the first second (cli_progress: redrawn on a terminal, a line
         * every 10 s otherwise) */
        cli_progress bar;
        cli_progress_start(&bar, "generate: prefill", g->T);
        bar.quiet = g->json;
        for (int64_t i = 0; i < g->T && !st; i += g->piece) {
            const int64_t n = g->T - i < g->piece ? g->T - i : g->piece;
            st = fp4moe_session_forward(g->s, g->prompt + i, n, i + n == g->T ? g->logits : NULL, 0);
            char item[64];
            snprintf(item, sizeof item, "%lld / %lld tokens", (long long)(i + n), (long long)g->T);
            cli_progress_update(&bar, i + n, item);
        }
        if (bar.shown && bar.tty) fprintf(stderr, "\r\033[K"); /* (the speed line below says the rest) */
    } else {
        st = fp4moe_session_forward(g->s, g->prompt, g->T, g->logits, 0);
    }
    if (!st && cli_bad_logits(g->logits, c->vocab)) st = fp4moe_set_error(FP4MOE_EFORMAT, CLI_BAD_LOGITS);
    const double t_prefill = cli_now() - t0;
    const int prefilled = !st; /* (Ctrl-C during the prefill: no prefill speed) */
    int64_t produced = 0;
    double t_decode = 0.0;
    const char *reason = "length";
    if (!st) {
        print_speed("prefill", g->T, t_prefill);
        t0 = cli_now();
        while (produced < a->n && !*stop) {
            int32_t id;
            if (g->gm) { /* structured output: the tokens that cannot come next masked, then the sampler */
                memcpy(g->mlog, g->logits, (size_t)c->vocab * sizeof(float));
                if (fp4moe_grammar_mask_logits(g->gm, g->mlog, c->vocab) == 0) {
                    if (!fp4moe_grammar_is_complete(g->gm))
                        st = fp4moe_set_error(FP4MOE_EINVAL, "structured output: no token continues the grammar");
                    reason = "eos";
                    break;
                }
                id = fp4moe_sample(&g->smp, g->mlog);
                if ((st = fp4moe_grammar_accept_token(g->gm, id))) break;
            } else {
                id = fp4moe_sample(&g->smp, g->logits);
            }
            fp4moe_sampler_accept_output(&g->smp, id);
            produced++;
            if (!a->ignore_eos && (id == eos || fp4moe_sampler_is_stop(&g->smp, id))) {
                reason = "eos";
                break;
            }
            if ((st = emit(&ts, g, id))) break;
            if (g->stopped) {
                reason = "stop";
                break;
            }
            if (produced == a->n) break;
            if (g->ctx > 0 && g->T + produced >= g->ctx) {
                fprintf(stderr, "\n%s: stopped at the context limit of %lld tokens (--ctx)\n", CMD, (long long)g->ctx);
                reason = "context";
                break;
            }
            if ((st = fp4moe_session_forward(g->s, &id, 1, g->logits, 0))) break;
            if (cli_bad_logits(g->logits, c->vocab)) {
                st = fp4moe_set_error(FP4MOE_EFORMAT, "the forward produced NaN or infinite logits at token %lld",
                                      (long long)produced);
                break;
            }
        }
        t_decode = cli_now() - t0;
    }
    if (g->tok) {
        const char *text;
        int64_t len;
        if (!g->stopped && !fp4moe_tokenizer_stream_flush(&ts, &text, &len)) put_text(g, text, (size_t)len, 0);
        if (!g->stopped) put_text(g, NULL, 0, 1);
        fp4moe_tokenizer_stream_free(&ts);
    }
    int interrupted = 0;
    if (st == FP4MOE_EINTERRUPTED || *stop) {
        if (produced) fflush(stdout), fputc('\n', stderr); /* the note on a line of its own, not after the text */
        fprintf(stderr, "%s: stopped (Ctrl-C)\n", CMD);
        st = FP4MOE_OK;
        reason = "interrupted";
        interrupted = 1;
    }
    if (!g->json) {
        if (isatty(STDOUT_FILENO)) printf("\n"); /* (in a pipe or file the continuation alone, byte for byte) */
    } else if (!st) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "text", g->text.s ? g->text.s : "");
        cJSON_AddItemToObject(o, "ids", cJSON_CreateIntArray(g->ids, (int)g->n_ids));
        cJSON_AddNumberToObject(o, "prompt_tokens", (double)g->T);
        cJSON_AddNumberToObject(o, "generated_tokens", (double)g->n_ids);
        cJSON_AddStringToObject(o, "finish_reason", reason);
        cJSON_AddStringToObject(o, "device", fp4moe_model_on_gpu(g->m) ? "cuda" : "cpu");
        cJSON_AddStringToObject(o, "cpu_act", g->cpu_act ? g->cpu_act : "float");
        cJSON_AddStringToObject(o, "kv_cache_dtype", a->kv_cache ? a->kv_cache : "auto");
        char seed[32]; /* as an exact integer: cJSON writes numbers with 15 significant digits when they round-trip
                          within its epsilon, which loses the last digit of 16-digit seeds */
        snprintf(seed, sizeof seed, "%lld", (long long)a->smp.seed);
        if (a->smp.temp > 0) cJSON_AddRawToObject(o, "seed", seed);
        else cJSON_AddNullToObject(o, "seed"); /* greedy: no seed takes part */
        cJSON_AddNumberToObject(o, "prefill_seconds", t_prefill);
        cJSON_AddNumberToObject(o, "decode_seconds", t_decode);
        if (prefilled) cJSON_AddNumberToObject(o, "prefill_tok_s", t_prefill > 0 ? (double)g->T / t_prefill : 0.0);
        else cJSON_AddNullToObject(o, "prefill_tok_s"); /* interrupted before the prefill ended */
        cJSON_AddNumberToObject(o, "decode_tok_s", t_decode > 0 && produced > 1 ? (double)(produced - 1) / t_decode : 0.0);
        cli_json_print_obj(o);
        cJSON_Delete(o);
    }
    fflush(stdout);
    if (produced > 1) print_speed("decode", produced - 1, t_decode);
    if (st) return cli_fail(CMD, st);
    return interrupted ? FP4MOE_EXIT_INTERRUPTED : FP4MOE_EXIT_OK;
}

/* ---- --gpus N / --ep-ranks N: the routed experts over N expert-parallel ranks ------------------ */

/* Ranks 1 .. N-1 hold no sequence: each loads its share of the experts and follows rank 0's steps
 * (fp4moe_ep_follow) until it leaves. Two barriers first: every follower ready (or failed), then
 * rank 0's session made (or failed), so that nobody waits for a rank that is not there. */
typedef struct {
    const gen_args *a;
    int rank, ranks, nccl;
    fp4moe_ep_group *g;
    fp4moe_device dev;
    fp4moe_dtype dt;
    fp4moe_cpu_act ca;
    fp4moe_kv_dtype kv;
    int64_t chunk;
    pthread_barrier_t *bar;
    int *failed;                    /* shared: any rank failed to set up */
    int st;
    char err[512];
} gen_follower;

static void *follower_main(void *arg) {
    gen_follower *f = arg;
    fp4moe_model *m = NULL;
    fp4moe_batch *b = NULL;
    int st = f->nccl ? fp4moe_cuda_set_device(f->rank) : FP4MOE_OK;
    if (!st) st = cli_load_share_quiet(f->a->model, !f->a->no_quantize, f->dev, f->ranks, f->rank, &m);
    if (!st) {
        fp4moe_batch_options o;
        fp4moe_batch_options_default(&o);
        o.max_seqs = 1;
        o.max_step_tokens = f->chunk;
        o.act_dtype = f->dt;
        o.cpu_act = f->ca;
        o.kv_dtype = f->kv;
        o.device = f->dev;
        o.ep = f->g;
        o.ep_rank = f->rank;
        st = fp4moe_batch_new(m, &o, &b);
    }
    if (st) {
        snprintf(f->err, sizeof f->err, "rank %d: %s", f->rank, fp4moe_last_error());
        *f->failed = 1;
    }
    pthread_barrier_wait(f->bar); /* 1: the followers */
    pthread_barrier_wait(f->bar); /* 2: rank 0's session */
    if (!*f->failed) {
        st = fp4moe_ep_follow(b, NULL);
        if (st) snprintf(f->err, sizeof f->err, "rank %d: %s", f->rank, fp4moe_last_error());
    }
    f->st = st;
    fp4moe_batch_free(b);
    fp4moe_model_free(m);
    return NULL;
}

/* --json-schema TEXT / --json-schema-file FILE / --json-object: the grammar, the tokenizer's trie, a matcher whose
 * end tokens are the sampler's stop ids */
/* The grammar of --json-schema / --json-schema-file / --json-object (*out; the caller frees it). */
static int schema_grammar(const gen_args *a, fp4moe_grammar **out) {
    char *text = NULL;
    int st = FP4MOE_OK;
    if (a->json_schema_file) st = cli_read_text(a->json_schema_file, (int64_t)16 << 20, &text);
    if (!st && !a->json_object) {
        const char *src = text ? text : a->json_schema;
        cJSON *schema = cJSON_ParseWithOpts(src, NULL, 1); /* (nothing after the schema) */
        if (!schema) {
            st = fp4moe_set_error(FP4MOE_EINVAL, "%s is not one JSON value (near byte %lld)",
                                  a->json_schema_file ? a->json_schema_file : "--json-schema",
                                  cJSON_GetErrorPtr() ? (long long)(cJSON_GetErrorPtr() - src) : 0LL);
        } else {
            st = fp4moe_grammar_from_json_schema(schema, a->json_schema_file ? a->json_schema_file : "--json-schema",
                                                 out);
            cJSON_Delete(schema);
        }
    } else if (!st) {
        st = fp4moe_grammar_from_json_schema(NULL, NULL, out);
    }
    free(text);
    return st;
}

static int setup_grammar(const gen_args *a, gen_state *g, const fp4moe_sampler_params *sp, int64_t V) {
    if (!g->tok) return fp4moe_set_error(FP4MOE_EINVAL, "structured output needs the model's tokenizer.json");
    int st = schema_grammar(a, &g->grammar);
    if (!st) st = fp4moe_grammar_vocab_new(g->tok, &g->gv);
    if (!st) st = fp4moe_grammar_matcher_new(g->grammar, g->gv, sp->stop_ids, sp->n_stop, &g->gm);
    if (!st && !(g->mlog = malloc((size_t)V * sizeof(float)))) st = fp4moe_set_error(FP4MOE_ENOMEM, "out of memory");
    return st;
}

static int generate(const gen_args *a) {
    gen_state g;
    memset(&g, 0, sizeof g);
    fp4moe_dtype dt;
    fp4moe_device dev;
    fp4moe_cpu_act ca;
    fp4moe_kv_dtype kv;
    int rc = cli_parse_compute(CMD, a->device, a->dtype, a->cpu_act, &dev, &dt, &ca);
    if (!rc) rc = cli_parse_kv_dtype(CMD, a->kv_cache, dev, &kv);
    if (!rc) rc = cli_check_gpus(CMD, a->gpus, a->device, dev);   /* before any loading */
    if (rc) return rc;
    const volatile sig_atomic_t *stop = cli_install_sigint();
    char *text = NULL;                      /* -f FILE / -p -: the prompt text */
    gen_args ta = *a;
    if (a->file || (a->prompt && !strcmp(a->prompt, "-"))) {
        const int st = a->file ? cli_read_text(a->file, (int64_t)1 << 30, &text) : cli_read_stream(stdin, &text);
        if (st && *stop) /* Ctrl-C while waiting for the prompt (a pipe without its writer yet): a stop, not a read error */
            return cli_error(CMD, FP4MOE_EXIT_INTERRUPTED, "stopped (Ctrl-C) while reading the prompt");
        if (st) return cli_fail(CMD, st);
        if (a->file) cli_drop_final_newline(text); /* -f only (standard input keeps its text) */
        ta.prompt = text;
        ta.file = NULL;
        a = &ta;
    }
    if ((rc = load_tokenizer(a, &g)) || (rc = encode_prompt(a, &g)) ||
        (rc = cli_load_model_on(CMD, a->model, !a->no_quantize, dev, &g.m))) {
        gen_free(&g);
        free(text);
        return rc;
    }
    free(text);
    if ((rc = cli_ids_in_vocab(a->model, a->prompt_ids ? NULL : g.tok, g.prompt, g.T, fp4moe_model_config(g.m)->vocab,
                               a->prompt_ids ? "--prompt-ids" : "the prompt"))) {
        gen_free(&g);
        return cli_fail(CMD, rc);
    }
    const int64_t ctx = a->ctx > 0 ? a->ctx : fp4moe_model_config(g.m)->max_position;
    cli_warn_ctx(CMD, a->ctx, fp4moe_model_config(g.m)->max_position);
    if (ctx > 0 && g.T == ctx) { /* prompt + generated tokens <= ctx, as the server's limit (vLLM's max_model_len) */
        cli_error(CMD, FP4MOE_EXIT_FAIL, "the prompt has %lld tokens, all of the context limit of %lld tokens (--ctx): "
                  "no room for a generated token", (long long)g.T, (long long)ctx);
        gen_free(&g);
        return FP4MOE_EXIT_FAIL;
    }
    if (ctx > 0 && g.T > ctx) {
        cli_error(CMD, FP4MOE_EXIT_FAIL, "the prompt has %lld tokens, more than the context limit of %lld tokens "
                  "(--ctx; the model's max_position_embeddings is %lld)", (long long)g.T, (long long)ctx,
                  (long long)fp4moe_model_config(g.m)->max_position);
        gen_free(&g);
        return FP4MOE_EXIT_FAIL;
    }
    g.ctx = ctx;
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.act_dtype = dt;
    so.cpu_act = ca;
    so.kv_dtype = kv;
    g.cpu_act = fp4moe_cpu_act_name(ca);
    so.interrupt = stop;
    so.device = dev;
    if (dev == FP4MOE_DEVICE_CUDA) so.max_chunk = cli_cuda_chunk(g.T);
    if (a->chunk > 0) so.max_chunk = a->chunk;
    const int64_t V = fp4moe_model_config(g.m)->vocab;
    /* prefill pieces of whole session chunks, >= 4,096 tokens (the progress of a long prompt); not for EP runs */
    g.piece = a->gpus > 1 || a->ep_ranks > 1 || so.max_chunk <= 0 ? 0 : so.max_chunk * (4096 / so.max_chunk > 1 ? 4096 / so.max_chunk : 1);
    /* expert parallelism: the followers first (each loads its share), then rank 0's session */
    const int nccl = a->gpus > 1, W = (int)(nccl ? a->gpus : a->ep_ranks);
    fp4moe_ep_group *grp = NULL;
    gen_follower *fol = NULL;
    pthread_t *th = NULL;
    pthread_barrier_t bar;
    int failed = 0, nfol = 0, bar_ok = 0, st = FP4MOE_OK;
    if (W >= 1) {
        if (nccl && dev != FP4MOE_DEVICE_CUDA) {
            gen_free(&g);
            return cli_usage_error(CMD, "--gpus needs --device cuda");
        }
        if (nccl && fp4moe_cuda_device_count() < W) {
            fprintf(stderr, "%s: --gpus %d: %d CUDA device(s) visible\n", CMD, W, fp4moe_cuda_device_count());
            gen_free(&g);
            return FP4MOE_EXIT_USAGE;
        }
        st = nccl ? fp4moe_ep_group_new_nccl(W, NULL, &grp) : fp4moe_ep_group_new(W, &grp);
        fol = calloc((size_t)W, sizeof *fol);
        th = calloc((size_t)W, sizeof *th);
        if (!st && (!fol || !th || pthread_barrier_init(&bar, NULL, (unsigned)W)))
            st = fp4moe_set_error(FP4MOE_ENOMEM, "generate: %d expert-parallel ranks", W);
        else if (!st)
            bar_ok = 1;
        for (int r = 1; !st && r < W; r++) {
            fol[r] = (gen_follower){a, r, W, nccl, grp, dev, dt, ca, kv, so.max_chunk, &bar, &failed, 0, {0}};
            if (pthread_create(&th[r], NULL, follower_main, &fol[r])) {
                st = fp4moe_set_error(FP4MOE_ENOMEM, "generate: cannot start rank %d", r);
                break;
            }
            nfol++;
        }
        if (st && nfol) { /* the started ones wait at the barriers of W threads: never released */
            fprintf(stderr, "fp4moe %s: %s\n", CMD, fp4moe_last_error());
            _exit(FP4MOE_EXIT_FAIL);
        }
        if (!st) {
            pthread_barrier_wait(&bar); /* 1: the followers are ready (or failed) */
            so.ep = grp;
            so.ep_rank = 0;
        }
    }
    if (!st && !(W >= 1 && failed)) st = fp4moe_session_new(g.m, &so, &g.s);
    if (W >= 1 && nfol) {
        if (st) failed = 1;
        pthread_barrier_wait(&bar); /* 2: rank 0's session (followers go on only if every rank is set) */
        for (int r = 1; failed && r < W; r++)
            if (fol[r].err[0]) fprintf(stderr, "fp4moe %s: %s\n", CMD, fol[r].err);
        if (failed && !st) st = fp4moe_set_error(FP4MOE_EINVAL, "generate: an expert-parallel rank failed to start");
    }
    fp4moe_sampler_params sp;   /* stop ids: the tokenizer's EOS and every one of generation_config.json */
    cli_sampling_params(&a->smp, a->model, g.tok, V, a->ignore_eos, &sp);
    srv_text_init(&g.stop, (char *const *)a->stop.v, a->stop.n, 0, 0);
    if (!st) st = fp4moe_sampler_init_params(&g.smp, V, &sp);
    if (!st && (a->json_schema || a->json_schema_file || a->json_object)) st = setup_grammar(a, &g, &sp, V);
    if (!st && !(g.logits = malloc((size_t)V * sizeof(float)))) st = FP4MOE_ENOMEM;
    g.json = a->json;
    /* the ids of --json: at most -n, and no more than the context leaves after the prompt (-n may be huge) */
    const int64_t n_ids_cap = ctx > 0 && ctx - g.T < a->n ? ctx - g.T : a->n;
    if (!st && a->json && !(g.ids = malloc((size_t)n_ids_cap * sizeof(int32_t)))) st = FP4MOE_ENOMEM;
    rc = st ? cli_fail(CMD, st) : run_generation(a, &g, stop);
    if (grp) {
        if (g.s) (void)fp4moe_session_ep_leave(g.s); /* the followers return */
        for (int r = 1; r <= nfol; r++) {
            pthread_join(th[r], NULL);
            if (fol[r].st && fol[r].err[0]) {
                cli_error(CMD, FP4MOE_EXIT_FAIL, "%s", fol[r].err);
                if (rc == FP4MOE_EXIT_OK) rc = FP4MOE_EXIT_FAIL;
            }
        }
        if (bar_ok) pthread_barrier_destroy(&bar);
    }
    gen_free(&g);
    fp4moe_ep_group_free(grp);
    free(fol);
    free(th);
    return rc;
}

int cmd_generate(int argc, char **argv) {
    gen_args a = {.n = 128, .dtype = NULL, .device = "auto", .smp = CLI_SAMPLING_INIT};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory (config.json, *.safetensors, tokenizer.json)"},
        {"--prompt", "-p", CLI_STRING, &a.prompt, "TEXT", "prompt text (- reads it from standard input, byte for byte: no newline dropped)"},
        {"--file", "-f", CLI_STRING, &a.file, "FILE", "read the prompt from FILE (one trailing newline dropped, as llama.cpp's -f; - : standard input)"},
        {"--ctx", "-c", CLI_INT, &a.ctx, "N", "context limit in tokens (default: the model's max_position_embeddings)"},
        {"--prompt-ids", NULL, CLI_STRING, &a.prompt_ids, "IDS", "prompt as token ids, e.g. 1,2,3 (no tokenizer needed)"},
        {"--tokens", "-n", CLI_INT, &a.n, "N", "tokens to generate (default 128)"},
        CLI_SAMPLING_OPTS(a.smp),
        {"--device", NULL, CLI_STRING, &a.device, "DEV", "cpu, cuda or auto (default auto: cuda when a GPU is visible)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32 on cpu; cuda: bf16 only)"},
        {"--cpu-act", NULL, CLI_STRING, &a.cpu_act, "MODE", CLI_CPU_ACT_HELP},
        {"--kv-cache-dtype", NULL, CLI_STRING, &a.kv_cache, "T", CLI_KV_HELP},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense (default: NVFP4 on load)"},
        {"--chunk", NULL, CLI_INT, &a.chunk, "N", "prefill chunk in tokens (default and 0: 256 on cpu; on cuda 32768, or the prompt's length rounded up to 256 if shorter)"},
        {"--ignore-eos", NULL, CLI_FLAG, &a.ignore_eos, NULL, "do not stop at the end-of-sequence tokens"},
        {"--stop", NULL, CLI_STRINGS, &a.stop, "TEXT", "stop before this text (repeatable, up to 16)"},
        {"--threads", "-t", CLI_INT, &a.threads, "N", "CPU threads (default: one per core)"},
        {"--gpus", NULL, CLI_INT, &a.gpus, "N",
         "expert parallelism over N CUDA devices through NCCL: each holds 1/N of every MoE layer's "
         "routed experts (libnccl.so.2 on LD_LIBRARY_PATH; default 0: none)"},
        {"--ep-ranks", NULL, CLI_INT, &a.ep_ranks, "N",
         "expert parallelism with N ranks on this one device (in-process loopback)"},
        {"--json", NULL, CLI_FLAG, &a.json, NULL, "print one JSON object (text, ids, finish_reason, seed, timings) at the end"},
        {"--json-schema", NULL, CLI_STRING, &a.json_schema, "SCHEMA",
         "constrain the output to JSON that satisfies this JSON Schema (the subset of include/fp4moe/grammar.h)"},
        {"--json-schema-file", NULL, CLI_STRING, &a.json_schema_file, "FILE", "--json-schema, read from FILE"},
        {"--json-object", NULL, CLI_FLAG, &a.json_object, NULL, "constrain the output to a JSON object"},
    };
    const cli_spec spec = {CMD, "fp4moe generate -m DIR -p TEXT [options]",
                           "Generates text with a nemotron_h model (MLX nvfp4, ModelOpt NVFP4 or dense\n"
                           "bf16/f16/f32 checkpoint). Greedy by default; tokens are streamed to stdout,\n"
                           "load time and prefill/decode speed go to stderr. Ctrl-C stops cleanly.",
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (a.chunk < 0) return cli_usage_error(CMD, "--chunk must be >= 1 (0: the default)");
    if (a.gpus < 0 || a.gpus > 64 || a.ep_ranks < 0 || a.ep_ranks > 64)
        return cli_usage_error(CMD, "--gpus and --ep-ranks must be in 1 .. 64 (0: none, the default)");
    if (a.gpus > 1 && a.ep_ranks > 0) return cli_usage_error(CMD, "give one of --gpus and --ep-ranks");
    if (!a.model) return cli_usage_error(CMD, "-m DIR is required");
    if ((a.prompt != NULL) + (a.prompt_ids != NULL) + (a.file != NULL) != 1)
        return cli_usage_error(CMD, "give exactly one of -p TEXT, -f FILE and --prompt-ids IDS");
    if (a.ctx < 0) return cli_usage_error(CMD, "--ctx must be >= 1 (0: the model's max_position_embeddings)");
    if (a.n < 1) return cli_usage_error(CMD, "-n must be >= 1");
    if ((rc = cli_sampling_check(CMD, &a.smp))) return rc;
    if (!!a.json_schema + !!a.json_schema_file + !!a.json_object > 1)
        return cli_usage_error(CMD, "give one of --json-schema, --json-schema-file and --json-object");
    if ((a.json_schema || a.json_schema_file || a.json_object) && a.ignore_eos)
        return cli_usage_error(CMD, "--ignore-eos cannot end a structured output: drop one of them");
    for (int i = 0; i < a.stop.n; i++)
        if (!a.stop.v[i][0]) return cli_usage_error(CMD, "--stop must not be empty");
    if (a.json_schema) { /* a schema given inline is checked before the model loads: a usage error (exit 2) */
        cJSON *schema = cJSON_ParseWithOpts(a.json_schema, NULL, 1);
        if (!schema)
            return cli_usage_error(CMD, "--json-schema is not one JSON value (near byte %lld)",
                                   cJSON_GetErrorPtr() ? (long long)(cJSON_GetErrorPtr() - a.json_schema) : 0LL);
        fp4moe_grammar *gr = NULL;
        const int gst = fp4moe_grammar_from_json_schema(schema, "--json-schema", &gr);
        cJSON_Delete(schema);
        fp4moe_grammar_free(gr);
        if (gst) return cli_usage_error(CMD, "%s", fp4moe_last_error());
    }
    if (a.json_schema_file) { /* the file and its schema checked before the model loads: a file error (exit 1) */
        fp4moe_grammar *gr = NULL;
        const int gst = schema_grammar(&a, &gr);
        fp4moe_grammar_free(gr);
        if (gst) return cli_fail(CMD, gst);
    }
    if ((rc = cli_set_threads(CMD, a.threads))) return rc;
    if ((rc = cli_require_model_dir(CMD, a.model))) return rc;
    return generate(&a);
}
