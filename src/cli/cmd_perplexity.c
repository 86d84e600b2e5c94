/* fp4moe perplexity -m DIR --file TEXT: perplexity of a nemotron_h model over a text file, in
 * windows of --ctx tokens, like llama.cpp's perplexity tool.
 *
 * Scoring rule (llama.cpp's, examples/perplexity): the text is tokenized as one string (no BOS, no
 * EOS) and cut into consecutive, non-overlapping windows of ctx tokens; the tail that does not fill
 * a window is dropped. Each window is run on its own from an empty state (KV cache, conv and SSM
 * states cleared). In a window of tokens t[0..ctx), the logits at positions j = ctx/2 .. ctx-2
 * predict t[j+1]; only those ctx - 1 - ctx/2 predictions are scored, so every scored token has at
 * least ctx/2 tokens of context:
 *   NLL = mean over scored predictions of -log softmax(logits_j)[t[j+1]]     (natural log, fp64)
 *   PPL = exp(NLL),  +/- PPL * stderr(NLL)  (stderr = sample std / sqrt(count), as llama.cpp prints)
 * For comparison with losses reported by training scripts, the same run also gives "all": every
 * prediction j = 0 .. ctx-2 of each window (ppl_all in --json and on stderr).
 *
 * Logits are computed max_chunk tokens at a time (session option --chunk), so memory stays at
 * chunk x V floats also for large vocabularies. */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/gather_qmm.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"
#include "fp4moe/tokenizer.h"

#define CMD "perplexity"
#define MAX_TEXT_BYTES ((int64_t)1 << 30)

typedef struct {
    const char *model, *file, *dtype, *cpu_act, *kv_cache;
    int64_t ctx, max_tokens, chunk;
    int json, no_quantize;
    const char *device;
    int64_t threads;
} ppl_args;

/* Running sums of the negative log-likelihoods (natural log) of scored predictions. */
typedef struct {
    double sum, sum_sq;
    int64_t count;
} nll_sum;

static void nll_add(nll_sum *a, double nll) {
    a->sum += nll;
    a->sum_sq += nll * nll;
    a->count++;
}

static double nll_mean(const nll_sum *a) { return a->count ? a->sum / (double)a->count : NAN; }

/* Standard error of the mean NLL (0 with fewer than 2 predictions). */
static double nll_stderr(const nll_sum *a) {
    if (a->count < 2) return 0.0;
    const double m = nll_mean(a), var = a->sum_sq / (double)a->count - m * m;
    return var > 0 ? sqrt(var / (double)(a->count - 1)) : 0.0;
}

/* -log softmax(logits)[target] over V logits, in fp64: logsumexp(logits) - logits[target]. */
static double token_nll(const float *logits, int64_t V, int32_t target) {
    float mx = logits[0];
    for (int64_t v = 1; v < V; v++) mx = logits[v] > mx ? logits[v] : mx;
    double s = 0.0;
    for (int64_t v = 0; v < V; v++) s += exp((double)logits[v] - (double)mx);
    return (double)mx + log(s) - (double)logits[target];
}

typedef struct {
    fp4moe_model *m;
    fp4moe_tokenizer *tok;
    fp4moe_session *s;
    int32_t *ids;          /* the whole text's tokens */
    int64_t n_ids;
    float *logits;         /* chunk x V */
} ppl_state;

static void ppl_free(ppl_state *p) {
    fp4moe_session_free(p->s);
    fp4moe_tokenizer_free(p->tok);
    fp4moe_model_free(p->m);
    free(p->ids);
    free(p->logits);
}

/* Reads and tokenizes the text file (no special tokens added). */
static int tokenize_file(const ppl_args *a, ppl_state *p) {
    char *text = NULL;
    int st = cli_read_text(a->file, MAX_TEXT_BYTES, &text);
    if (st) return cli_fail(CMD, st);
    const double t0 = cli_now();
    st = fp4moe_tokenizer_load(a->model, &p->tok);
    if (st) {
        free(text);
        return cli_fail(CMD, st);
    }
    st = fp4moe_tokenizer_encode(p->tok, text, (int64_t)strlen(text), 0, &p->ids, &p->n_ids);
    free(text);
    if (st) return cli_fail(CMD, fp4moe_error_context(st, "%s", a->file));
    if (!a->json)
        fprintf(stderr, "%s: %s: %lld tokens (tokenized in %.2f s)\n", CMD, a->file,
                (long long)p->n_ids, cli_now() - t0);
    return FP4MOE_EXIT_OK;
}

/* The progress line: tokens scored of all windows (a window of 32k tokens takes a minute on a CPU: the line moves
 * with its chunks, not only between windows) */
static void ppl_progress(cli_progress *bar, int64_t tokens, int64_t win, int64_t windows, const nll_sum *half) {
    char item[96], gauge[24];
    const int w = 20, fill = (int)((double)tokens / (double)bar->total * w);
    for (int i = 0; i < w; i++) gauge[i] = i < fill ? '#' : '.';
    gauge[w] = '\0';
    if (half->count) snprintf(item, sizeof item, "[%s] window %lld/%lld  ppl %.4f", gauge, (long long)win, (long long)windows,
                          exp(nll_mean(half)));
    else snprintf(item, sizeof item, "[%s] window %lld/%lld", gauge, (long long)win, (long long)windows);
    cli_progress_update(bar, tokens, item);
}

/* Runs window `win` (0-based) of ctx tokens from an empty state, chunk tokens at a time, and adds its
 * predictions to `half` (positions ctx/2 .. ctx-2) and `all` (positions 0 .. ctx-2). */
static int score_window(ppl_state *p, const int32_t *w, int64_t ctx, int64_t chunk, int64_t V,
                        nll_sum *half, nll_sum *all, cli_progress *bar, int64_t win, int64_t windows) {
    fp4moe_session_reset(p->s);
    const int64_t first = ctx / 2;
    for (int64_t j0 = 0; j0 < ctx; j0 += chunk) {
        const int64_t n = ctx - j0 < chunk ? ctx - j0 : chunk;
        int st = fp4moe_session_forward(p->s, w + j0, n, p->logits, 1);
        if (st) return st;
        for (int64_t i = 0; i < n; i++) {
            const int64_t j = j0 + i;
            if (j + 1 >= ctx) break;
            const double nll = token_nll(p->logits + i * V, V, w[j + 1]);
            nll_add(all, nll);
            if (j >= first) nll_add(half, nll);
        }
        ppl_progress(bar, win * ctx + j0 + n, win + 1, windows, half);
    }
    return FP4MOE_OK;
}

static void report(const ppl_args *a, const ppl_state *p, int64_t windows, int64_t done,
                   const nll_sum *half, const nll_sum *all, double seconds, int interrupted) {
    const double nll = nll_mean(half), ppl = exp(nll), err = ppl * nll_stderr(half);
    const double nll_a = nll_mean(all), ppl_a = exp(nll_a);
    const double tps = seconds > 0 ? (double)(done * a->ctx) / seconds : 0.0;
    if (a->json) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "model", a->model);
        cJSON_AddStringToObject(o, "format", fp4moe_quant_mode_name(fp4moe_model_format(p->m)));
        cJSON_AddBoolToObject(o, "quantized_on_load",
                              fp4moe_model_format(p->m) == FP4MOE_QUANT_NONE && !a->no_quantize);
        cJSON_AddStringToObject(o, "file", a->file);
        cJSON_AddStringToObject(o, "dtype", a->dtype);
        cJSON_AddStringToObject(o, "cpu_act", a->cpu_act);
        cJSON_AddStringToObject(o, "kv_cache_dtype", a->kv_cache ? a->kv_cache : "auto");
        cJSON_AddNumberToObject(o, "threads", omp_get_max_threads());
        cJSON_AddNumberToObject(o, "ctx", (double)a->ctx);
        cJSON_AddStringToObject(o, "device", a->device);
        cJSON_AddNumberToObject(o, "text_tokens", (double)p->n_ids);
        if (a->max_tokens > 0) cJSON_AddNumberToObject(o, "max_tokens", (double)a->max_tokens);
        else cJSON_AddNullToObject(o, "max_tokens"); /* not given: all the text */
        cJSON_AddNumberToObject(o, "tokens_used", (double)(windows * a->ctx)); /* the windows' tokens (the tail that
                                                                                   fills none is dropped) */
        cJSON_AddNumberToObject(o, "windows", (double)windows);
        cJSON_AddNumberToObject(o, "windows_done", (double)done);
        cJSON_AddBoolToObject(o, "interrupted", interrupted);
        cJSON_AddStringToObject(o, "rule", "llama.cpp: non-overlapping windows of ctx tokens, no BOS; "
                                "positions ctx/2..ctx-2 of each window predict the next token");
        cJSON_AddNumberToObject(o, "tokens_scored", (double)half->count);
        cJSON_AddNumberToObject(o, "nll", nll);
        cJSON_AddNumberToObject(o, "ppl", ppl);
        cJSON_AddNumberToObject(o, "ppl_stderr", err);
        cJSON_AddNumberToObject(o, "tokens_scored_all", (double)all->count);
        cJSON_AddNumberToObject(o, "nll_all", nll_a);
        cJSON_AddNumberToObject(o, "ppl_all", ppl_a);
        cJSON_AddNumberToObject(o, "seconds", seconds);
        cJSON_AddNumberToObject(o, "tok_per_s", tps);
        cli_json_print_obj(o);
        cJSON_Delete(o);
        return;
    }
    fprintf(stderr, "%s: %lld of %lld windows of %lld tokens in %.1f s, %.1f tok/s%s\n", CMD,
            (long long)done, (long long)windows, (long long)a->ctx, seconds, tps,
            interrupted ? " (interrupted)" : "");
    fprintf(stderr, "%s: all predictions (positions 0..ctx-2): %lld tokens, ppl %.4f\n", CMD,
            (long long)all->count, ppl_a);
    printf("ppl %.4f +/- %.4f over %lld tokens scored (positions %lld..%lld of each window, "
           "llama.cpp rule)\n", ppl, err, (long long)half->count, (long long)(a->ctx / 2),
           (long long)(a->ctx - 2));
}

static int perplexity(const ppl_args *a) {
    ppl_state p;
    memset(&p, 0, sizeof p);
    fp4moe_dtype dt;
    fp4moe_device dev;
    fp4moe_cpu_act ca;
    fp4moe_kv_dtype kv;
    int rc = cli_parse_compute(CMD, a->device, a->dtype, a->cpu_act, &dev, &dt, &ca);
    if (!rc) rc = cli_parse_kv_dtype(CMD, a->kv_cache, dev, &kv);
    if (rc) return rc;
    ppl_args resolved = *a;                  /* the dtype in force, for the report */
    resolved.dtype = fp4moe_dtype_name(dt);
    resolved.cpu_act = fp4moe_cpu_act_name(ca);
    resolved.device = dev == FP4MOE_DEVICE_CUDA ? "cuda" : "cpu";
    a = &resolved;
    if ((rc = tokenize_file(a, &p))) {
        ppl_free(&p);
        return rc;
    }
    const int64_t used = a->max_tokens > 0 && a->max_tokens < p.n_ids ? a->max_tokens : p.n_ids;
    const int64_t windows = used / a->ctx;
    if (windows < 1) {
        ppl_free(&p);
        if (used < p.n_ids)
            return cli_usage_error(CMD, "%s: --max-tokens %lld (of its %lld tokens) is fewer than --ctx %lld", a->file,
                                   (long long)used, (long long)p.n_ids, (long long)a->ctx);
        /* the text is too short for one window: a failure of the input (exit 1), as llama.cpp's perplexity says it */
        return cli_error(CMD, FP4MOE_EXIT_FAIL, "%s has %lld tokens, fewer than --ctx %lld (one window): give a longer "
                         "text or a smaller --ctx", a->file, (long long)p.n_ids, (long long)a->ctx);
    }
    if ((rc = cli_load_model_on(CMD, a->model, !a->no_quantize, dev, &p.m))) {
        ppl_free(&p);
        return rc;
    }
    if ((rc = cli_ids_in_vocab(a->model, p.tok, p.ids, p.n_ids, fp4moe_model_config(p.m)->vocab, a->file))) {
        ppl_free(&p);
        return cli_fail(CMD, rc);
    }
    cli_warn_ctx(CMD, a->ctx, fp4moe_model_config(p.m)->max_position);
    const volatile sig_atomic_t *stop = cli_install_sigint();
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.act_dtype = dt;
    so.cpu_act = ca;
    so.kv_dtype = kv;
    so.interrupt = stop;
    so.device = dev;
    /* every row's logits come back (chunk x vocab fp32): CUDA chunks of 2048, not generate's 8192 */
    if (dev == FP4MOE_DEVICE_CUDA) so.max_chunk = a->ctx < 2048 ? a->ctx : 2048;
    if (a->chunk > 0) so.max_chunk = a->chunk;
    const int64_t chunk = so.max_chunk < a->ctx ? so.max_chunk : a->ctx;
    const int64_t V = fp4moe_model_config(p.m)->vocab;
    int st = fp4moe_session_new(p.m, &so, &p.s);
    if (!st && !(p.logits = malloc((size_t)chunk * (size_t)V * sizeof(float)))) st = FP4MOE_ENOMEM;
    if (st) {
        rc = cli_fail(CMD, st);
        ppl_free(&p);
        return rc;
    }

    nll_sum half = {0}, all = {0};
    cli_progress bar;
    cli_progress_start(&bar, CMD, windows * a->ctx);
    const double t0 = cli_now();
    int64_t done = 0;
    for (; done < windows && !*stop; done++)
        if ((st = score_window(&p, p.ids + done * a->ctx, a->ctx, chunk, V, &half, &all, &bar, done, windows))) break;
    const double seconds = cli_now() - t0;
    if (bar.shown && bar.tty) fprintf(stderr, "\r\033[K");
    const int interrupted = st == FP4MOE_EINTERRUPTED || *stop;
    if (st && !interrupted) {
        rc = cli_fail(CMD, st);
    } else if (done == 0) {
        rc = cli_error(CMD, FP4MOE_EXIT_INTERRUPTED, "stopped (Ctrl-C) before the first window finished");
    } else if (!isfinite(nll_mean(&all))) {
        rc = cli_error(CMD, FP4MOE_EXIT_FAIL, "%s", CLI_BAD_LOGITS);
    } else {
        report(a, &p, windows, done, &half, &all, seconds, interrupted);
        rc = interrupted ? FP4MOE_EXIT_INTERRUPTED : FP4MOE_EXIT_OK;
    }
    ppl_free(&p);
    return rc;
}

int cmd_perplexity(int argc, char **argv) {
    ppl_args a = {.ctx = 512, .device = "cpu"};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory (config.json, *.safetensors, tokenizer.json)"},
        {"--file", "-f", CLI_STRING, &a.file, "TEXT", "UTF-8 text file to score"},
        {"--ctx", "-c", CLI_INT, &a.ctx, "N", "window length in tokens, >= 4 (default 512)"},
        {"--max-tokens", NULL, CLI_INT, &a.max_tokens, "N", "use only the first N tokens of the text (default: all)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32 on cpu; cuda: bf16)"},
        {"--cpu-act", NULL, CLI_STRING, &a.cpu_act, "MODE", CLI_CPU_ACT_HELP},
        {"--kv-cache-dtype", NULL, CLI_STRING, &a.kv_cache, "T", CLI_KV_HELP},
        {"--device", NULL, CLI_STRING, &a.device, "DEV", "cpu, cuda or auto (default cpu; the fp32 reference is cpu with --cpu-act float)"},
        {"--threads", "-t", CLI_INT, &a.threads, "N", "CPU threads (default: one per core)"},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense (default: NVFP4 on load)"},
        {"--chunk", NULL, CLI_INT, &a.chunk, "N", "tokens per forward call (default and 0: 256)"},
        {"--json", NULL, CLI_FLAG, &a.json, NULL, "print one JSON object on stdout"},
    };
    const cli_spec spec = {
        CMD, "fp4moe perplexity -m DIR --file TEXT [options]",
        "Perplexity of the model over a text file, like llama.cpp's perplexity tool. The text is\n"
        "tokenized as one string (no BOS) and cut into non-overlapping windows of --ctx tokens (the\n"
        "tail that does not fill a window is dropped); each window runs from an empty state. Scored:\n"
        "the predictions of positions ctx/2 .. ctx-2 of each window (each sees >= ctx/2 tokens).\n"
        "Prints ppl = exp(mean NLL) +/- its standard error; stderr also gives the ppl of every\n"
        "prediction (positions 0 .. ctx-2). Progress on stderr: a bar on a terminal, otherwise a\n"
        "line every 10 s. --file - reads standard input.",
        opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!a.model) return cli_usage_error(CMD, "-m DIR is required");
    if (!a.file) return cli_usage_error(CMD, "--file TEXT is required");
    if (a.ctx < 4) return cli_usage_error(CMD, "--ctx must be >= 4");
    if (a.max_tokens < 0) return cli_usage_error(CMD, "--max-tokens must be >= 0");
    if (a.chunk < 0) return cli_usage_error(CMD, "--chunk must be >= 1 (0: the default)");
    if ((rc = cli_set_threads(CMD, a.threads))) return rc;
    if ((rc = cli_require_model_dir(CMD, a.model))) return rc;
    return perplexity(&a);
}
