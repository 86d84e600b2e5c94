/* libFuzzer harness: fp4moe serve's request parsing (srv_parse_request: JSON, every field rule,
 * chat rendering with the real Nemotron-3 template, tokenization with the default model's
 * tokenizer), the structured-output grammars it compiles (64 masked steps each), its error bodies, and vLLM's
 * tokenizer endpoints (srv_tokenize / srv_detokenize).
 * The first input byte picks the endpoint (bit 1 set: bit 2 set /tokenize, else /detokenize;
 * otherwise bit 0: 0 chat, 1 completions); the rest is the request body. Run by
 * fuzz/run_request.sh from the repository root. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

static srv_parse_ctx g_ctx;
static fp4moe_grammar_vocab *g_gv;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    static fp4moe_tokenizer *tok;
    static fp4moe_template *tmpl;
    if (fp4moe_tokenizer_load("models/nemotron-h-tiny-moe", &tok)) abort();
    if (fp4moe_grammar_vocab_new(tok, &g_gv)) abort();
    FILE *f = fopen("tests/golden/templates/nemotron-3-nano-30b-a3b.jinja", "rb");
    static char src[1 << 16];
    const size_t n = f ? fread(src, 1, sizeof src, f) : 0;
    if (f) fclose(f);
    if (!n || fp4moe_template_compile(src, n, &tmpl)) abort();
    g_ctx = (srv_parse_ctx){.model_name = "tiny", .tok = tok, .tmpl = tmpl, .bos_token = "<s>", .eos_token = "</s>",
                            .vocab = 8192, .context = 4096, .reasoning = 1};
    fp4moe_sampler_params_default(&g_ctx.defaults);
    g_ctx.defaults.stop_ids[g_ctx.defaults.n_stop++] = 2;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    srv_request r;
    srv_error e;
    const srv_kind k = (data[0] & 1) ? SRV_COMPLETION : SRV_CHAT;
    if (data[0] & 2) { /* the tokenizer endpoints: a 200 body or a 4xx */
        char *out = NULL;
        const int rc = data[0] & 4 ? srv_tokenize(&g_ctx, (const char *)data + 1, size - 1, &out, &e)
                                   : srv_detokenize(&g_ctx, (const char *)data + 1, size - 1, &out, &e);
        if (rc == 0 ? !out : (out || e.http < 400 || e.http > 599 || !e.message[0])) abort();
        free(out);
        return 0;
    }
    if (srv_parse_request(&g_ctx, k, (const char *)data + 1, size - 1, &r, &e) == 0) {
        if (r.n_ids < 1 || r.max_tokens < (r.echo ? 0 : 1) || r.n_ids + r.max_tokens > g_ctx.context ||
            r.history >= r.n_ids || (r.echo && r.kind != SRV_COMPLETION) || r.top_logprobs < 0 ||
            r.top_logprobs > SRV_MAX_TOP_LOGPROBS)
            abort();
        for (int64_t i = 0; i < r.n_ids; i++)
            if (r.ids[i] < 0 || r.ids[i] >= g_ctx.vocab) abort();
        for (int p = 1; p < r.n_prompts; p++) { /* a list of prompts: each non-empty, in the vocabulary and context */
            if (r.more_n[p - 1] < 1 || r.more_n[p - 1] >= g_ctx.context ||
                (r.has_max && r.more_n[p - 1] + r.max_tokens > g_ctx.context))
                abort();
            for (int64_t i = 0; i < r.more_n[p - 1]; i++)
                if (r.more_ids[p - 1][i] < 0 || r.more_ids[p - 1][i] >= g_ctx.vocab) abort();
        }
        fp4moe_sampler s; /* whatever the parser accepts, the sampler takes */
        if (fp4moe_sampler_init_params(&s, g_ctx.vocab, &r.sp)) abort();
        fp4moe_sampler_free(&s);
        if (r.grammar) { /* a structured-output grammar: 64 steps of the mask, each taking an allowed token picked by
                            the input's bytes; the mask never empties before the value is complete */
            static float lg[8192];
            fp4moe_grammar_matcher *m = NULL;
            if (fp4moe_grammar_matcher_new(r.grammar->g, g_gv, r.sp.stop_ids, r.sp.n_stop, &m)) abort();
            for (int step = 0; step < 64 && !fp4moe_grammar_is_ended(m); step++) {
                for (int i = 0; i < 8192; i++) lg[i] = 0.0f;
                const int64_t left = fp4moe_grammar_mask_logits(m, lg, 8192);
                if (left == 0) {
                    if (!fp4moe_grammar_is_complete(m)) abort();
                    break;
                }
                int64_t k = (int64_t)(data[(step * 7) % size] * 131 + step) % left;
                int32_t id = 0;
                for (; id < 8192; id++)
                    if (lg[id] == 0.0f && k-- == 0) break;
                if (id == 8192 || fp4moe_grammar_accept_token(m, id)) abort();
            }
            fp4moe_grammar_matcher_free(m);
        }
        srv_request_free(&r);
    } else {
        if (e.http < 400 || e.http > 599 || !e.message[0]) abort();
        free(srv_error_json(&e));
    }
    return 0;
}
