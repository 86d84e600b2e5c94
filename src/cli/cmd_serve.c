/* fp4moe serve -m DIR: an OpenAI-compatible HTTP server (POST /v1/chat/completions,
 * POST /v1/completions, GET /v1/models, GET /health, GET /metrics) with continuous batching and
 * prefix reuse over the batch API (src/server/). --synthetic CONFIG --tokenizer DIR serves random
 * weights of a config's exact shape, for load tests without the checkpoint. SIGINT / SIGTERM stop
 * it: running requests end with a 503 error, then the process exits (0 for SIGTERM, 130 for
 * Ctrl-C, by the shell convention). --gpus N / --ep-ranks N: expert parallelism (docs/EP.md): N
 * ranks, each with 1/N of every MoE layer's routed experts and its own requests (NCCL over N GPUs,
 * or an in-process loopback on one device). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"
#include "fp4moe/template.h"
#include "fp4moe/tokenizer.h"
#include "server/srv.h"

#define CMD "serve"

typedef struct {
    const char *model, *synthetic, *tokenizer, *chat_template, *host, *api_key, *name, *device, *dtype, *reasoning, *tool_parser, *cpu_act,
        *kv_cache, *api_key_file, *allowed_origins;
    char *api_key_buf; /* --api-key-file's key (freed by cmd_serve) */
    int64_t port, ctx, max_seqs, max_step_tokens, max_queue, max_body, prefix_cache_mb, prefix_min_tokens,
        http_threads, seed, kv_tokens, gpus, ep_ranks;
    int no_quantize, quiet, no_warmup;
    int64_t threads;
} serve_args;

static volatile int g_stop;
static volatile int g_signal;
static void on_signal(int sig) {
    g_signal = sig;
    g_stop = 1;
}

/* The served model id of a directory or config path: its last component, without ".json"; a file named config.json
 * stands for its directory ("--synthetic DIR/config.json" is DIR's model). */
static const char *base_name(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    static char buf[256];
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    if (n - s == 11 && !strncmp(path + s, "config.json", 11) && s > 1) { /* DIR/config.json: DIR */
        n = s - 1;
        while (n > 1 && path[n - 1] == '/') n--;
        s = n;
        while (s > 0 && path[s - 1] != '/') s--;
    } else if (n - s > 5 && !strncmp(path + n - 5, ".json", 5)) {
        n -= 5;
    }
    snprintf(buf, sizeof buf, "%.*s", (int)(n - s), path + s);
    return buf;
}

/* The ranks' models (loopback ranks of a --synthetic model share models[0]). */
static void free_models(fp4moe_model **models, int W) {
    for (int r = 0; r < W; r++)
        if (models[r] && (r == 0 || models[r] != models[0])) fp4moe_model_free(models[r]);
}

static int serve(const serve_args *a) {
    fp4moe_device dev;
    fp4moe_dtype dt;
    fp4moe_cpu_act ca;
    fp4moe_kv_dtype kv;
    int rc = cli_parse_compute(CMD, a->device, a->dtype, a->cpu_act, &dev, &dt, &ca);
    if (!rc) rc = cli_parse_kv_dtype(CMD, a->kv_cache, dev, &kv);
    if (rc) return rc;
    const char *tok_dir = a->tokenizer ? a->tokenizer : a->model;
    fp4moe_tokenizer *tok = NULL;
    int st = fp4moe_tokenizer_load(tok_dir, &tok);
    if (st) return cli_fail(CMD, st);
    /* the chat template: optional (completions work without one; chat requests then get a 400) */
    fp4moe_template *tmpl = NULL;
    char *where = NULL;
    char *src = cli_load_chat_template(tok_dir, a->chat_template, &where);
    if (!src && a->chat_template) {
        fp4moe_tokenizer_free(tok);
        return cli_fail(CMD, FP4MOE_EIO);
    }
    if (src && (st = fp4moe_template_compile(src, strlen(src), &tmpl))) {
        fp4moe_error_context(st, "%s", where ? where : "chat template");
        free(src);
        free(where);
        fp4moe_tokenizer_free(tok);
        return cli_fail(CMD, st);
    }
    free(where);
    if (!src) fprintf(stderr, "%s: %s has no chat template: /v1/chat/completions will answer 400 (give one with "
                      "--chat-template FILE)\n", CMD, tok_dir);
    /* the model: one, or (expert parallelism) one per rank: rank r's share of the routed experts of a
       checkpoint; --synthetic: the whole model per GPU (NCCL) or one shared by the loopback ranks */
    const int nccl = a->gpus > 1, W = nccl ? (int)a->gpus : a->ep_ranks > 1 ? (int)a->ep_ranks : 1;
    const int grc = nccl ? cli_check_gpus(CMD, W, a->device, dev) : FP4MOE_EXIT_OK;
    if (grc) {
        fp4moe_template_free(tmpl);
        free(src);
        fp4moe_tokenizer_free(tok);
        return grc;
    }
    fp4moe_model *m = NULL, *models[64] = {NULL};
    if (W > 1) {
        fp4moe_config c0;
        if (!fp4moe_config_load(a->synthetic ? a->synthetic : a->model, &c0)) {
            if (c0.n_experts < W)
                fprintf(stderr, "%s: warning: %d ranks for %lld routed experts: %lld rank(s) hold no expert (their "
                        "requests still run; their MoE layers only send rows away)\n", CMD, W,
                        (long long)c0.n_experts, (long long)(W - c0.n_experts));
            fp4moe_config_free(&c0);
        }
    }
    fp4moe_ep_group *grp = NULL;
    if (W == 1) {
        rc = a->synthetic ? cli_load_synthetic(CMD, a->synthetic, (uint64_t)a->seed, dev, &m)
                          : cli_load_model_on(CMD, a->model, !a->no_quantize, dev, &m);
        models[0] = m;
    } else {
        for (int r = 0; !st && r < W; r++) {
            const double t0 = cli_now();
            if (nccl) st = fp4moe_cuda_set_device(r);
            if (!st && a->synthetic && (nccl || r == 0)) st = cli_synthetic_quiet(a->synthetic, (uint64_t)a->seed, dev, &models[r]);
            else if (!st && a->synthetic) models[r] = models[0];
            else if (!st) st = cli_load_share_quiet(a->model, !a->no_quantize, dev, W, r, &models[r]);
            if (!st) {
                int64_t lo, hi;
                fp4moe_ep_range(fp4moe_model_config(models[r])->n_experts, W, r, &lo, &hi);
                fprintf(stderr, "%s: rank %d%s: routed experts [%lld, %lld) in %.1f s\n", CMD, r,
                        nccl ? " (GPU)" : "", (long long)lo, (long long)hi, cli_now() - t0);
            }
        }
        if (nccl) (void)fp4moe_cuda_set_device(0);
        if (!st) st = nccl ? fp4moe_ep_group_new_nccl(W, NULL, &grp) : fp4moe_ep_group_new(W, &grp);
        m = models[0];
        rc = st ? cli_fail(CMD, st) : 0;
    }
    if (rc) {
        free_models(models, W);
        fp4moe_ep_group_free(grp);
        fp4moe_template_free(tmpl);
        free(src);
        fp4moe_tokenizer_free(tok);
        return rc;
    }
    const fp4moe_config *cfg = fp4moe_model_config(m);
    int64_t ctx = cfg->max_position > 0 ? cfg->max_position : 4096;
    if (a->ctx > 0) {
        if (cfg->max_position > 0 && a->ctx > 8 * cfg->max_position) { /* a typo's extra zeros: page tables of that */
            fprintf(stderr, "fp4moe %s: error: --ctx %lld is more than 8x the model's max_position_embeddings %lld (the "
                    "KV page tables of every sequence are sized for it before the server listens)\n", CMD,
                    (long long)a->ctx, (long long)cfg->max_position);
            free_models(models, W);
            fp4moe_ep_group_free(grp);
            fp4moe_template_free(tmpl);
            free(src);
            fp4moe_tokenizer_free(tok);
            return FP4MOE_EXIT_USAGE;
        }
        if (cfg->max_position > 0 && a->ctx > cfg->max_position)
            fprintf(stderr, "%s: warning: --ctx %lld is above the model's max_position_embeddings %lld\n", CMD,
                    (long long)a->ctx, (long long)cfg->max_position);
        ctx = a->ctx;
    }
    if (a->kv_tokens > 0 && a->kv_tokens < ctx)
        fprintf(stderr, "%s: warning: --kv-cache-tokens %lld holds less than one context (%lld tokens): a prompt "
                "larger than the pool is refused (400), and an answer that outgrows it ends there (finish_reason "
                "\"length\") even alone\n", CMD, (long long)a->kv_tokens,
                (long long)ctx);
    if (fp4moe_tokenizer_vocab_size(tok) > cfg->vocab)
        fprintf(stderr, "%s: warning: the tokenizer has %lld ids, the model %lld: prompts with larger ids are refused\n",
                CMD, (long long)fp4moe_tokenizer_vocab_size(tok), (long long)cfg->vocab);
    cJSON *special = cJSON_CreateObject();
    cli_template_special_tokens(tok_dir, special);
    srv_parse_ctx pc = {0};
    pc.model_name = a->name ? a->name : base_name(a->synthetic ? a->synthetic : a->model);
    pc.tok = tok;
    pc.tmpl = tmpl;
    pc.chat_template = src;
    pc.bos_token = cJSON_GetStringValue(cJSON_GetObjectItem(special, "bos_token"));
    pc.eos_token = cJSON_GetStringValue(cJSON_GetObjectItem(special, "eos_token"));
    pc.pad_token = cJSON_GetStringValue(cJSON_GetObjectItem(special, "pad_token"));
    pc.vocab = cfg->vocab;
    pc.context = ctx;
    pc.reasoning = !a->reasoning || !strcmp(a->reasoning, "on");
    /* tool calls: the format the template asks for, unless --tool-call-parser says */
    pc.tools = !a->tool_parser || !strcmp(a->tool_parser, "auto") ? srv_tool_format_of_template(src)
               : !strcmp(a->tool_parser, "qwen3_coder")          ? SRV_TOOLS_XML
               : !strcmp(a->tool_parser, "nemotron_json")        ? SRV_TOOLS_JSON
                                                                 : SRV_TOOLS_NONE;
    fp4moe_sampler_params_default(&pc.defaults);
    pc.defaults.temperature = 1.0f;   /* OpenAI's default, unless generation_config.json says otherwise */
    cli_generation_defaults(tok_dir, tok, cfg->vocab, &pc.defaults);
    srv_engine_options eo = {
        .max_seqs = a->max_seqs > 0 ? a->max_seqs : (dev == FP4MOE_DEVICE_CUDA ? 64 : 16),
        .max_step_tokens = a->max_step_tokens > 0 ? a->max_step_tokens : (dev == FP4MOE_DEVICE_CUDA ? 2048 : 256),
        .max_queue = a->max_queue,
        .context = ctx,
        .prefix_cache_bytes = (a->prefix_cache_mb >= 0 ? a->prefix_cache_mb : dev == FP4MOE_DEVICE_CUDA ? 8192 : 1024) << 20,
        .prefix_min_tokens = a->prefix_min_tokens,
        .kv_tokens = a->kv_tokens,
        .warmup = dev == FP4MOE_DEVICE_CUDA && a->kv_tokens > 0 && !a->no_warmup && W == 1,
        .log = !a->quiet,
        .device = dev,
        .act_dtype = dt,
        .cpu_act = ca,
        .kv_dtype = kv,
        .ep_ranks = W,
        .ep = grp,
        .ep_models = (const fp4moe_model *const *)models,
        .ep_gpus = nccl,
    };
    if (eo.max_step_tokens < eo.max_seqs) eo.max_step_tokens = eo.max_seqs;
    srv_engine *e = NULL;
    const double tw = cli_now();
    if (eo.warmup) fprintf(stderr, "%s: warming up CUDA graphs for 1..%lld decode rows ...\n", CMD, (long long)eo.max_seqs);
    if ((st = srv_engine_new(m, tok, pc.model_name, &eo, &e))) {
        if (st == FP4MOE_ENOMEM) /* what asked for the memory, and how to ask for less */
            fprintf(stderr, "%s: note: the engine's buffers for --max-seqs %lld, --max-step-tokens %lld%s did not fit: "
                    "lower them (or --kv-cache-tokens / --prefix-cache-mb)\n", CMD, (long long)eo.max_seqs,
                    (long long)eo.max_step_tokens, a->kv_tokens > 0 ? " and --kv-cache-tokens" : "");
        cJSON_Delete(special);
        free_models(models, W);
        fp4moe_ep_group_free(grp);
        fp4moe_template_free(tmpl);
        free(src);
        fp4moe_tokenizer_free(tok);
        return cli_fail(CMD, st);
    }
    if (eo.warmup) fprintf(stderr, "%s: warm-up done in %.1f s\n", CMD, cli_now() - tw);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    char eps[160] = "";
    if (W > 1)
        snprintf(eps, sizeof eps, ", expert parallel over %d ranks (%s; sequences and step tokens per rank, "
                 "the prefix cache split over them)", W,
                 nccl ? "NCCL, one GPU each" : "in-process loopback");
    fprintf(stderr, "%s: model '%s' on %s (%s activations%s%s, KV cache %s), context %lld, %lld sequences x %lld tokens "
            "per step, prefix cache %lld MiB%s%s\n",
            CMD, pc.model_name, fp4moe_device_name(dev), fp4moe_dtype_name(dt), dev == FP4MOE_DEVICE_CPU ? ", " : "",
            dev == FP4MOE_DEVICE_CPU ? fp4moe_cpu_act_name(ca) : "", fp4moe_kv_dtype_name(kv), (long long)ctx,
            (long long)eo.max_seqs, (long long)eo.max_step_tokens, (long long)(eo.prefix_cache_bytes >> 20), eps,
            a->api_key ? ", API key required" : "");
    if (a->max_step_tokens > 0 && eo.max_step_tokens != a->max_step_tokens)
        fprintf(stderr, "%s: note: --max-step-tokens %lld raised to %lld (every running sequence decodes one token a "
                "step)\n", CMD, (long long)a->max_step_tokens, (long long)eo.max_step_tokens);
    srv_http_options ho = {.host = a->host, .port = (int)a->port, .api_key = a->api_key, .max_body = a->max_body,
                           .allowed_origins = a->allowed_origins ? a->allowed_origins : "*", .log_errors = !a->quiet,
                           .http_threads = (int)a->http_threads, .stop = &g_stop};
    st = srv_http_run(&ho, e, &pc);
    if (st) fprintf(stderr, "fp4moe %s: error: %s\n", CMD, fp4moe_last_error()); /* (no "serve:" inside: said once) */
    else fprintf(stderr, "%s: stopped (%s)\n", CMD, g_signal == SIGTERM ? "SIGTERM" : "Ctrl-C");
    srv_engine_free(e);
    cJSON_Delete(special);
    free_models(models, W);
    fp4moe_ep_group_free(grp);
    fp4moe_template_free(tmpl);
    free(src);
    fp4moe_tokenizer_free(tok);
    if (st) return FP4MOE_EXIT_FAIL;
    return g_signal == SIGINT ? 130 : FP4MOE_EXIT_OK;
}

int cmd_serve(int argc, char **argv) {
    serve_args a = {.host = "127.0.0.1", .port = 8080, .device = "auto", .max_queue = 256, .max_body = 8 << 20,
                    .prefix_cache_mb = INT64_MIN /* not given */, .prefix_min_tokens = 32, .http_threads = 4};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory (config.json, *.safetensors, tokenizer.json)"},
        {"--synthetic", NULL, CLI_STRING, &a.synthetic, "CONFIG", "random weights of a config's shape (with --tokenizer)"},
        {"--tokenizer", NULL, CLI_STRING, &a.tokenizer, "DIR", "tokenizer directory (default: the model's)"},
        {"--chat-template", NULL, CLI_STRING, &a.chat_template, "FILE", "Jinja chat template (default: the model's)"},
        {"--host", NULL, CLI_STRING, &a.host, "ADDR", "address to listen on (default 127.0.0.1)"},
        {"--port", NULL, CLI_INT, &a.port, "N", "TCP port; 0 = any free port, printed (default 8080)"},
        {"--api-key", NULL, CLI_STRING, &a.api_key, "KEY", "require 'Authorization: Bearer KEY' on /v1/* (also: "
         "--api-key-file, or the environment's FP4MOE_API_KEY, which the process list does not show)"},
        {"--api-key-file", NULL, CLI_STRING, &a.api_key_file, "FILE", "the API key: the first line of FILE"},
        {"--allowed-origins", NULL, CLI_STRING, &a.allowed_origins, "LIST",
         "CORS: origins whose browser pages may call the API, comma-separated, '*' for any, 'none' for no CORS "
         "headers (default '*', as vLLM)"},
        {"--served-model-name", NULL, CLI_STRING, &a.name, "NAME", "model id of the API (default: the directory name)"},
        {"--ctx", "-c", CLI_INT, &a.ctx, "N", "tokens per request, prompt + output (default and 0: max_position_embeddings; "
         "at most 8x it)"},
        {"--max-seqs", NULL, CLI_INT, &a.max_seqs, "N", "requests computed at once, per expert-parallel rank (default and 0: 16 cpu, 64 cuda)"},
        {"--max-step-tokens", NULL, CLI_INT, &a.max_step_tokens, "N", "tokens per batch step, per expert-parallel rank, at least --max-seqs (default and 0: 256 cpu, 2048 cuda)"},
        {"--max-queue", NULL, CLI_INT, &a.max_queue, "N", "requests waiting beyond --max-seqs before 429 (default 256)"},
        {"--max-body", NULL, CLI_INT, &a.max_body, "BYTES", "largest request body (default 8388608)"},
        {"--prefix-cache-mb", NULL, CLI_INT, &a.prefix_cache_mb, "MB", "memory for kept conversation states (GPU memory on cuda), split evenly over expert-parallel ranks; 0 = off (default 1024 cpu, 8192 cuda)"},
        {"--kv-cache-tokens", NULL, CLI_INT, &a.kv_tokens, "N", "KV cache pool over all requests, fixed (CUDA: graphs "
         "warmed up at start); 0 = grown on demand (default)"},
        {"--no-warmup", NULL, CLI_FLAG, &a.no_warmup, NULL, "skip the CUDA graph warm-up"},
        {"--quiet", "-q", CLI_FLAG, &a.quiet, NULL, "no line per finished request on stderr"},
        {"--prefix-min-tokens", NULL, CLI_INT, &a.prefix_min_tokens, "N", "shortest prefix worth keeping (default 32)"},
        {"--reasoning", NULL, CLI_STRING, &a.reasoning, "on|off", "return <think> text as reasoning_content (default on)"},
        {"--tool-call-parser", NULL, CLI_STRING, &a.tool_parser, "P",
         "tool calls in chat answers -> tool_calls: auto (the chat template's format), qwen3_coder (<tool_call><function=...>, "
         "Nemotron-3), nemotron_json (<TOOLCALL>[...], Nemotron-Nano-9B-v2) or none (default auto)"},
        {"--http-threads", NULL, CLI_INT, &a.http_threads, "N", "HTTP worker threads (default 4)"},
        {"--threads", "-t", CLI_INT, &a.threads, "N", "CPU threads (default: one per core)"},
        {"--device", NULL, CLI_STRING, &a.device, "DEV", "cpu, cuda or auto (default auto)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32 on cpu; cuda: bf16)"},
        {"--cpu-act", NULL, CLI_STRING, &a.cpu_act, "MODE", CLI_CPU_ACT_HELP},
        {"--kv-cache-dtype", NULL, CLI_STRING, &a.kv_cache, "T", CLI_KV_HELP},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense"},
        {"--seed", NULL, CLI_INT, &a.seed, "S", "seed of --synthetic weights (default 0)"},
        {"--gpus", NULL, CLI_INT, &a.gpus, "N",
         "expert parallelism over N CUDA devices through NCCL (libnccl.so.2 on LD_LIBRARY_PATH): each GPU "
         "holds 1/N of every MoE layer's routed experts and runs its own requests (--max-seqs each). Default: 1 GPU, no expert parallelism"},
        {"--ep-ranks", NULL, CLI_INT, &a.ep_ranks, "N",
         "expert parallelism with N ranks on this one device (in-process loopback): the --gpus path without N GPUs"},
    };
    const cli_spec spec = {CMD, "fp4moe serve -m DIR [options] | fp4moe serve --synthetic CONFIG --tokenizer DIR",
                           "OpenAI-compatible HTTP server with continuous batching: POST /v1/chat/completions,\n"
                           "POST /v1/completions (stream or not), GET /v1/models, GET /health, GET /metrics.\n"
                           "Prints 'listening on http://HOST:PORT' when ready; SIGINT/SIGTERM stop it.",
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!a.model == !a.synthetic) return cli_usage_error(CMD, "give one of -m DIR or --synthetic CONFIG");
    if (a.synthetic && !a.tokenizer) return cli_usage_error(CMD, "--synthetic needs --tokenizer DIR");
    if (a.port < 0 || a.port > 65535) return cli_usage_error(CMD, "--port must be in [0, 65535]");
    { /* each bad value named (one combined message named them all) */
        const struct { const char *name; int64_t v, lo, hi; } lim[] = {
            {"--ctx", a.ctx, 0, INT64_C(1) << 40},          {"--kv-cache-tokens", a.kv_tokens, 0, INT64_C(1) << 40},
            {"--max-seqs", a.max_seqs, 0, 1 << 20},          {"--max-step-tokens", a.max_step_tokens, 0, INT64_C(1) << 30},
            {"--max-queue", a.max_queue, 0, INT64_C(1) << 30}, {"--prefix-cache-mb", a.prefix_cache_mb == INT64_MIN ? 0 : a.prefix_cache_mb, 0, INT64_C(1) << 30},
            {"--prefix-min-tokens", a.prefix_min_tokens, 1, INT64_C(1) << 30}, {"--http-threads", a.http_threads, 1, 64},
            {"--max-body", a.max_body, 1024, INT64_C(1) << 40},
        };
        if (a.ctx < 0) /* (its real top comes with the model: 8x max_position_embeddings) */
            return cli_usage_error(CMD, "--ctx must be >= 0 (0: the model's max_position_embeddings; at most 8x it) "
                                   "(got %lld)", (long long)a.ctx);
        for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
            if (lim[i].v < lim[i].lo || lim[i].v > lim[i].hi)
                return cli_usage_error(CMD, "%s must be in [%lld, %lld] (got %lld)", lim[i].name, (long long)lim[i].lo,
                                       (long long)lim[i].hi, (long long)lim[i].v);
    }
    if (a.reasoning && strcmp(a.reasoning, "on") && strcmp(a.reasoning, "off"))
        return cli_usage_error(CMD, "--reasoning must be on or off");
    if (a.tool_parser && strcmp(a.tool_parser, "auto") && strcmp(a.tool_parser, "qwen3_coder") &&
        strcmp(a.tool_parser, "nemotron_json") && strcmp(a.tool_parser, "none"))
        return cli_usage_error(CMD, "--tool-call-parser must be auto, qwen3_coder, nemotron_json or none (got '%s')",
                               a.tool_parser);
    if (a.api_key && !a.api_key[0]) return cli_usage_error(CMD, "--api-key must not be empty");
    if (a.api_key && a.api_key_file) return cli_usage_error(CMD, "give one of --api-key and --api-key-file");
    if (a.api_key_file) { /* the first line, without its end of line */
        if (cli_read_text(a.api_key_file, 1 << 16, &a.api_key_buf))
            return cli_error(CMD, FP4MOE_EXIT_FAIL, "--api-key-file: %s", fp4moe_last_error());
        a.api_key_buf[strcspn(a.api_key_buf, "\r\n")] = 0;
        a.api_key = a.api_key_buf;
        if (!a.api_key[0]) {
            free(a.api_key_buf);
            return cli_usage_error(CMD, "--api-key-file %s: the first line (the key) is empty", a.api_key_file);
        }
    } else if (!a.api_key && fp4moe_env_value("FP4MOE_API_KEY")[0]) {
        a.api_key = fp4moe_env_value("FP4MOE_API_KEY");
    }
    if (a.allowed_origins && !strcmp(a.allowed_origins, "none")) a.allowed_origins = "";
    if (a.gpus < 0 || a.gpus > 64 || a.ep_ranks < 0 || a.ep_ranks > 64)
        return cli_usage_error(CMD, "--gpus and --ep-ranks must be in 1 .. 64");
    if (a.gpus > 1 && a.ep_ranks > 1) return cli_usage_error(CMD, "give one of --gpus and --ep-ranks");
    if ((rc = cli_set_threads(CMD, a.threads)) || (rc = cli_require_model_dir(CMD, a.model))) {
        free(a.api_key_buf);
        return rc;
    }
    if (srv_http_probe(a.host, (int)a.port)) { /* a busy port fails now, not after the model's load */
        free(a.api_key_buf);
        return cli_error(CMD, FP4MOE_EXIT_FAIL, "%s", fp4moe_last_error());
    }
    rc = serve(&a);
    free(a.api_key_buf);
    return rc;
}
