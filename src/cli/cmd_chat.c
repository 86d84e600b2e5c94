/* fp4moe chat -m DIR: multi-turn chat in the terminal. Each turn renders the conversation with the
 * model's own chat template (fp4moe/template.h: Jinja with transformers' settings), tokenizes it
 * (the template writes the special tokens), runs it through a session and streams the answer until
 * an end-of-sequence token or -n tokens. Ctrl-C stops the current answer (the conversation keeps what
 * was said); /reset forgets the conversation (the system prompt stays); /exit or end of input quits.
 * The template comes from --chat-template FILE, else DIR/chat_template.jinja, else the
 * "chat_template" of DIR/tokenizer_config.json (a string, or a list of {name, template}: "default"). */
#include <cjson/cJSON.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef FP4MOE_HAVE_LIBEDIT
#include <editline/readline.h>
#endif

#include "cli/cli_util.h"
#include "cli/commands.h"
#include "fp4moe/fp4moe.h"
#include "fp4moe/model.h"
#include "fp4moe/template.h"
#include "fp4moe/tokenizer.h"

#define CMD "chat"

typedef struct {
    const char *model, *chat_template, *system, *system_file, *think, *device, *dtype, *cpu_act, *kv_cache;
    int64_t n, chunk, ctx;
    cli_sampling smp;
    int no_quantize, verbose;
    int64_t threads;
} chat_args;

static void add_message(cJSON *msgs, const char *role, const char *content) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", role);
    cJSON_AddStringToObject(m, "content", content);
    cJSON_AddItemToArray(msgs, m);
}

/* One answer: the rendered conversation through a fresh session, streamed; the text in *answer. ctx_len > 0:
 * the context limit in tokens - a conversation of ctx_len tokens or more is not sent (*too_long = 1, nothing
 * printed but the message), an answer stops at the limit. */
/* One message of the user into out (NUL-terminated, without its end of line). In a terminal the line is read
 * with libedit when the build has it (lines of any length - the terminal's own line mode stops at 4,095 bytes -,
 * cursor keys, history of the session's messages), and a line ending in '\\' continues on the next (a multi-line
 * message, as llama-cli's); the prompt goes to stdout. Piped input: one line, one message. Returns 0, -1 at the end
 * of the input, -2 when Ctrl-C was pressed at the prompt. */
static int read_message(int tty, cli_text *out) {
    const volatile sig_atomic_t *stop = cli_install_sigint();
    for (int first = 1;; first = 0) {
        char *l = NULL;
        size_t n = 0;
#ifdef FP4MOE_HAVE_LIBEDIT
        if (tty) {
            fflush(stdout);
            l = readline(first ? "> " : ". ");
            if (!l) return *stop ? -2 : -1;
            n = strlen(l);
        } else
#endif
        {
            if (tty) {
                fputs(first ? "> " : ". ", stdout);
                fflush(stdout);
            }
            size_t cap = 0;
            const ssize_t k = getline(&l, &cap, stdin);
            if (k < 0) {
                free(l);
                return *stop ? -2 : -1;
            }
            n = (size_t)k;
            while (n && (l[n - 1] == '\n' || l[n - 1] == '\r')) l[--n] = 0;
        }
        const int more = tty && n && l[n - 1] == '\\';
        if (more) l[--n] = 0;
        if ((!first && cli_text_add(out, "\n", 1)) || cli_text_add(out, l, n)) {
            free(l);
            return -1;
        }
        free(l);
        if (!more) break;
    }
    if (!out->s && cli_text_add(out, "", 0)) return -1;
#ifdef FP4MOE_HAVE_LIBEDIT
    if (tty && out->n) add_history(out->s);
#endif
    return 0;
}

/* The tokens the session holds, in order (the previous turns' prompt and the answer's forwarded ids): a new turn
 * whose rendered conversation starts with them computes only what follows (the Mamba state cannot be rewound, so
 * anything else - a template that rewrites earlier turns, e.g. one dropping old reasoning - starts over). */
typedef struct {
    int32_t *ids;
    int64_t n, cap;
} chat_hist;

static int hist_add(chat_hist *h, const int32_t *ids, int64_t n) {
    if (h->n + n > h->cap) {
        int64_t cap = h->cap ? h->cap : 1024;
        while (cap < h->n + n) cap *= 2;
        int32_t *p = realloc(h->ids, (size_t)cap * sizeof *p);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "chat: out of memory");
        h->ids = p;
        h->cap = cap;
    }
    memcpy(h->ids + h->n, ids, (size_t)n * sizeof *ids);
    h->n += n;
    return FP4MOE_OK;
}

static int answer(const chat_args *a, fp4moe_session *s, int64_t V, fp4moe_tokenizer *tok, fp4moe_sampler *smp,
                  const fp4moe_template *tmpl, const char *tmpl_name, cJSON *ctx, int64_t ctx_len, cli_text *answer,
                  int *too_long, chat_hist *h) {
    *too_long = 0;
    char *prompt = NULL;
    int st = fp4moe_template_render(tmpl, ctx, NULL, &prompt, NULL);
    if (st) { /* e.g. the template's raise_exception on this message: said, the message dropped, the chat goes on */
        fprintf(stderr, "%s: %s: %s: message not sent\n", CMD, tmpl_name, fp4moe_last_error());
        *too_long = 1;
        return FP4MOE_OK;
    }
    int32_t *ids = NULL;
    int64_t T = 0;
    st = fp4moe_tokenizer_encode(tok, prompt, (int64_t)strlen(prompt), 0, &ids, &T);
    free(prompt);
    if (!st) st = cli_ids_in_vocab(a->model, tok, ids, T, V, "the rendered conversation");
    if (!st && T == 0)
        st = fp4moe_set_error(FP4MOE_EINVAL, "%s: the rendered conversation encodes to no tokens (the template "
                              "renders nothing for it)", tmpl_name);
    if (!st && ctx_len > 0 && T >= ctx_len) {
        const int alone = cJSON_GetArraySize(cJSON_GetObjectItem(ctx, "messages")) <= 1 + (a->system != NULL);
        fprintf(stderr, "%s: the conversation with this message is %lld tokens, the context %lld (--ctx): message not "
                "sent; %s\n", CMD, (long long)T, (long long)ctx_len,
                alone ? "it is too long even alone (with the --system prompt): a shorter one, or a larger --ctx"
                      : "/reset starts over");
        *too_long = 1;
        free(ids);
        return FP4MOE_OK;
    }
    float *lg = st ? NULL : malloc((size_t)V * sizeof(float));
    if (!st && !lg) st = fp4moe_set_error(FP4MOE_ENOMEM, "chat: out of memory");
    const volatile sig_atomic_t *stop = cli_install_sigint();
    fp4moe_tokenizer_stream ts;
    fp4moe_tokenizer_stream_init(&ts, tok, 1);
    const int64_t keep = h->n > 0 && h->n < T && fp4moe_session_pos(s) == h->n &&
                                 !memcmp(h->ids, ids, (size_t)h->n * sizeof *ids)
                             ? h->n
                             : 0; /* the session's tokens start this conversation: only the rest is computed */
    if (!keep) fp4moe_session_reset(s);
    const double t0 = cli_now();
    h->n = 0;
    fp4moe_sampler_forget(smp);                  /* the repeat penalty sees this conversation's tokens, the
                                                    presence / frequency penalties this answer's */
    for (int64_t i = 0; !st && i < T; i++) fp4moe_sampler_accept(smp, ids[i]);
    if (!st) st = fp4moe_session_forward(s, ids + keep, T - keep, lg, 0);
    int hist_ok = !st && hist_add(h, ids, T) == FP4MOE_OK;
    for (int64_t i = 0; !st && i < a->n && !*stop; i++) {
        const int32_t id = fp4moe_sample(smp, lg);
        if (fp4moe_sampler_is_stop(smp, id)) break;
        fp4moe_sampler_accept_output(smp, id);
        const char *text;
        int64_t len;
        if ((st = fp4moe_tokenizer_stream_push(&ts, id, &text, &len))) break;
        fwrite(text, 1, (size_t)len, stdout);
        fflush(stdout);
        cli_text_add(answer, text, (size_t)len);
        if (i + 1 < a->n && ctx_len > 0 && T + i + 1 >= ctx_len) {
            fprintf(stderr, "\n%s: answer stopped at the context limit of %lld tokens (--ctx)", CMD, (long long)ctx_len);
            break;
        }
        if (i + 1 < a->n) {
            st = fp4moe_session_forward(s, &id, 1, lg, 0);
            hist_ok = hist_ok && !st && hist_add(h, &id, 1) == FP4MOE_OK;
        }
    }
    if (!hist_ok || st || *stop) h->n = 0; /* an error or Ctrl-C may leave the session mid-forward: start over */
    if (a->verbose && !st)
        fprintf(stderr, "%s: prompt %lld tokens (%lld kept from the turns before), answer %lld bytes, %.2f s\n", CMD,
                (long long)T, (long long)keep, (long long)answer->n, cli_now() - t0);
    const char *text;
    int64_t len;
    if (!fp4moe_tokenizer_stream_flush(&ts, &text, &len)) {
        fwrite(text, 1, (size_t)len, stdout);
        cli_text_add(answer, text, (size_t)len);
    }
    fp4moe_tokenizer_stream_free(&ts);
    printf("\n");
    fflush(stdout);
    if (st == FP4MOE_EINTERRUPTED || *stop) {
        fprintf(stderr, "%s: answer stopped (Ctrl-C)\n", CMD);
        st = FP4MOE_OK;
    }
    free(ids);
    free(lg);
    return st;
}

static int chat(const chat_args *a) {
    fp4moe_device dev;
    fp4moe_dtype dt;
    fp4moe_cpu_act ca;
    fp4moe_kv_dtype kv;
    int rc = cli_parse_compute(CMD, a->device, a->dtype, a->cpu_act, &dev, &dt, &ca);
    if (!rc) rc = cli_parse_kv_dtype(CMD, a->kv_cache, dev, &kv);
    if (rc) return rc;
    char *where = NULL;
    char *src = cli_load_chat_template(a->model, a->chat_template, &where);
    if (!src) return cli_fail(CMD, FP4MOE_EINVAL);
    fp4moe_template *tmpl = NULL;
    int st = fp4moe_template_compile(src, strlen(src), &tmpl);
    if (st) fp4moe_error_context(st, "%s", where ? where : "chat template");
    char tmpl_name[512]; /* for the errors of its renders */
    snprintf(tmpl_name, sizeof tmpl_name, "%s", where ? where : "chat template");
    free(src);
    free(where);
    if (st) return cli_fail(CMD, st);
    fp4moe_tokenizer *tok = NULL;
    fp4moe_model *m = NULL;
    fp4moe_session *s = NULL;
    fp4moe_sampler smp;
    memset(&smp, 0, sizeof smp);
    if ((st = fp4moe_tokenizer_load(a->model, &tok))) {
        fp4moe_template_free(tmpl);
        return cli_fail(CMD, st);
    }
    if ((rc = cli_load_model_on(CMD, a->model, !a->no_quantize, dev, &m))) {
        fp4moe_tokenizer_free(tok);
        fp4moe_template_free(tmpl);
        return rc;
    }
    fp4moe_session_options so;
    fp4moe_session_options_default(&so);
    so.act_dtype = dt;
    so.cpu_act = ca;
    so.kv_dtype = kv;
    so.device = dev;
    so.interrupt = cli_install_sigint();
    const int64_t maxpos = fp4moe_model_config(m)->max_position, ctx_len = a->ctx > 0 ? a->ctx : maxpos;
    cli_warn_ctx(CMD, a->ctx, maxpos);
    if (dev == FP4MOE_DEVICE_CUDA) so.max_chunk = CLI_CUDA_CHUNK;
    if (a->chunk > 0) so.max_chunk = a->chunk;
    st = fp4moe_session_new(m, &so, &s);
    fp4moe_sampler_params sp;
    cli_sampling_params(&a->smp, a->model, tok, fp4moe_model_config(m)->vocab, 0, &sp);
    if (!st) st = fp4moe_sampler_init_params(&smp, fp4moe_model_config(m)->vocab, &sp);
    cJSON *ctx = cJSON_CreateObject(), *msgs = cJSON_AddArrayToObject(ctx, "messages");
    cJSON_AddNullToObject(ctx, "tools");
    cJSON_AddNullToObject(ctx, "documents");
    cJSON_AddTrueToObject(ctx, "add_generation_prompt");
    if (a->think) cJSON_AddBoolToObject(ctx, "enable_thinking", !strcmp(a->think, "on"));
    cli_template_special_tokens(a->model, ctx);
    if (a->system) add_message(msgs, "system", a->system);
    const int tty = isatty(0);
    int interrupted = 0;
    chat_hist hist = {0};
    while (!st) {
        cli_text msg = {0};
        const int r = read_message(tty, &msg);
        if (r < 0) {
            free(msg.s);
            if (tty) printf("\n"); /* the shell's prompt on a line of its own */
            interrupted = r == -2;
            break;
        }
        char *line = msg.s;
        size_t len = msg.n;
        if (memchr(line, 0, len)) { /* the message would end there without a word */
            fprintf(stderr, "%s: the line has a NUL byte at offset %lld: not sent\n", CMD,
                    (long long)((const char *)memchr(line, 0, len) - line));
            free(msg.s);
            continue;
        }
        const int64_t bad = fp4moe_utf8_invalid_at(line, (int64_t)len); /* the tokenizer would refuse the whole turn */
        if (bad >= 0) {
            fprintf(stderr, "%s: the line is not valid UTF-8 at byte %lld (0x%02X): not sent\n", CMD, (long long)bad,
                    (unsigned)(unsigned char)line[bad]);
            free(msg.s);
            continue;
        }
        if (line[0] == '/' && line[1] != '/') /* a command: trailing blanks do not count */
            while (len && (line[len - 1] == ' ' || line[len - 1] == '\t')) line[--len] = 0;
        if (!strcmp(line, "/help")) {
            fprintf(stderr, "%s: /reset forgets the conversation (the --system prompt stays), /exit or /quit (or "
                    "Ctrl-D) ends the chat; Ctrl-C stops an answer; in a terminal a line ending in '\\' goes on on "
                    "the next line; start a message with // to send a leading /\n", CMD);
            free(msg.s);
            continue;
        }
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) {
            free(msg.s);
            break;
        }
        if (!strcmp(line, "/reset")) {
            while (cJSON_GetArraySize(msgs) > (a->system ? 1 : 0))
                cJSON_DeleteItemFromArray(msgs, cJSON_GetArraySize(msgs) - 1);
            fprintf(stderr, "%s: conversation reset\n", CMD);
            hist.n = 0;
            free(msg.s);
            continue;
        }
        if (!len) {
            free(msg.s);
            continue;
        }
        if (line[0] == '/' && line[1] != '/' && line[1] != ' ' && line[1]) {   /* "//text" sends "/text" */
            fprintf(stderr, "%s: unknown command %s (commands: /reset, /exit, /help; start a message with // to send a "
                    "leading /)\n", CMD, line);
            free(msg.s);
            continue;
        }
        add_message(msgs, "user", line[0] == '/' && line[1] == '/' ? line + 1 : line);
        cli_text ans = {0};
        int too_long = 0;
        st = answer(a, s, fp4moe_model_config(m)->vocab, tok, &smp, tmpl, tmpl_name, ctx, ctx_len, &ans, &too_long,
                    &hist);
        if (too_long) cJSON_DeleteItemFromArray(msgs, cJSON_GetArraySize(msgs) - 1); /* the message not sent */
        else add_message(msgs, "assistant", ans.s ? ans.s : "");
        free(ans.s);
        free(msg.s);
    }
    free(hist.ids);
    cJSON_Delete(ctx);
    fp4moe_sampler_free(&smp);
    fp4moe_session_free(s);
    fp4moe_model_free(m);
    fp4moe_tokenizer_free(tok);
    fp4moe_template_free(tmpl);
    return st ? cli_fail(CMD, st) : interrupted ? FP4MOE_EXIT_INTERRUPTED : FP4MOE_EXIT_OK;
}

int cmd_chat(int argc, char **argv) {
    chat_args a = {.n = 512, .device = "auto", .smp = CLI_SAMPLING_INIT};
    const cli_opt opts[] = {
        {"--model", "-m", CLI_STRING, &a.model, "DIR", "model directory (config.json, *.safetensors, tokenizer.json)"},
        {"--chat-template", NULL, CLI_STRING, &a.chat_template, "FILE", "Jinja chat template (default: the model's)"},
        {"--system", NULL, CLI_STRING, &a.system, "TEXT", "system prompt"},
        {"--system-file", NULL, CLI_STRING, &a.system_file, "FILE", "the system prompt from a file, e.g. a long document to "
         "ask about (one trailing newline dropped, as generate -f)"},
        {"--verbose", "-v", CLI_FLAG, &a.verbose, NULL, "a line per turn on stderr: prompt tokens, those kept from the "
         "turns before (not computed again), time"},
        {"--think", NULL, CLI_STRING, &a.think, "on|off", "enable_thinking for reasoning templates (default: the template's)"},
        {"--tokens", "-n", CLI_INT, &a.n, "N", "most tokens per answer (default 512)"},
        {"--ctx", "-c", CLI_INT, &a.ctx, "N", "context limit in tokens, the conversation's and its answer's (default: "
         "the model's max_position_embeddings)"},
        CLI_SAMPLING_OPTS(a.smp),
        {"--threads", "-t", CLI_INT, &a.threads, "N", "CPU threads (default: one per core)"},
        {"--device", NULL, CLI_STRING, &a.device, "DEV", "cpu, cuda or auto (default auto)"},
        {"--dtype", NULL, CLI_STRING, &a.dtype, "DT", "matmul activations: f32 or bf16 (default f32 on cpu; cuda: bf16)"},
        {"--cpu-act", NULL, CLI_STRING, &a.cpu_act, "MODE", CLI_CPU_ACT_HELP},
        {"--kv-cache-dtype", NULL, CLI_STRING, &a.kv_cache, "T", CLI_KV_HELP},
        {"--chunk", NULL, CLI_INT, &a.chunk, "N", "prefill chunk in tokens (default and 0: 256 on cpu, 32768 on cuda)"},
        {"--no-quantize", NULL, CLI_FLAG, &a.no_quantize, NULL, "keep dense checkpoints dense"},
    };
    const cli_spec spec = {CMD, "fp4moe chat -m DIR [options]",
                           "Multi-turn chat with the model's chat template. Type a message and Enter; /reset\n"
                           "forgets the conversation, /exit (or end of input) quits, Ctrl-C stops an answer.",
                           opts, (int)(sizeof opts / sizeof opts[0]), NULL, 0, NULL};
    int rc = cli_parse(&spec, argc, argv);
    if (rc == CLI_HELP) return FP4MOE_EXIT_OK;
    if (rc) return FP4MOE_EXIT_USAGE;
    if (!a.model) return cli_usage_error(CMD, "-m DIR is required");
    if (a.n < 1) return cli_usage_error(CMD, "--tokens must be >= 1");
    if (a.ctx < 0) return cli_usage_error(CMD, "--ctx must be >= 1 (0: the model's max_position_embeddings)");
    if (a.chunk < 0) return cli_usage_error(CMD, "--chunk must be >= 1 (0: the default)");
    if (a.think && strcmp(a.think, "on") && strcmp(a.think, "off")) return cli_usage_error(CMD, "--think must be on or off");
    if ((rc = cli_sampling_check(CMD, &a.smp))) return rc;
    if ((rc = cli_set_threads(CMD, a.threads))) return rc;
    if ((rc = cli_require_model_dir(CMD, a.model))) return rc;
    if (a.system && a.system_file) return cli_usage_error(CMD, "give one of --system and --system-file");
    char *doc = NULL;
    if (a.system_file) { /* a document as the system message: each piped line is its own turn, so no file comes in that way */
        const int st = cli_read_utf8_text("system file", a.system_file, (int64_t)1 << 30, &doc);
        if (st) return cli_fail(CMD, st);
        cli_drop_final_newline(doc);
        a.system = doc;
    }
    rc = chat(&a);
    free(doc);
    return rc;
}
