/* The pure parts of fp4moe serve: srv_text (stop strings + reasoning split, against a direct
 * reference on random splits) and srv_parse_request (every field rule, with the default model's
 * tokenizer and the real Nemotron-3 chat template). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "server/srv.h"

/* ---- srv_text ---------------------------------------------------------------------------------- */

typedef struct {
    char r[4096], c[4096];
    size_t nr, nc;
    int stopped;
} collected;

static void take(collected *o, const srv_delta *d) {
    memcpy(o->r + o->nr, d->reasoning, d->n_reasoning);
    o->nr += d->n_reasoning;
    memcpy(o->c + o->nc, d->content, d->n_content);
    o->nc += d->n_content;
    o->r[o->nr] = o->c[o->nc] = 0;
}

static void feed_all(srv_text *t, const char *s, const size_t *cuts, int ncut, collected *o) {
    memset(o, 0, sizeof *o);
    size_t at = 0;
    srv_delta d;
    for (int i = 0; i <= ncut && !o->stopped; i++) {
        const size_t end = i < ncut ? cuts[i] : strlen(s);
        const int st = srv_text_feed(t, s + at, end - at, &d);
        assert_true(st >= 0);
        take(o, &d);
        o->stopped = st == 1;
        at = end;
    }
    assert_int_equal(srv_text_finish(t, &d), 0);
    take(o, &d);
}

static void test_stop_across_chunks(void **state) {
    (void)state;
    char *stop[] = {"o w", "END"};
    srv_text t;
    srv_text_init(&t, stop, 2, 0, 0);
    srv_delta d;
    assert_int_equal(srv_text_feed(&t, "Hel", 3, &d), 0);
    assert_int_equal(d.n_content, 3);
    assert_int_equal(srv_text_feed(&t, "lo", 2, &d), 0);
    assert_int_equal(d.n_content, 1);            /* "o" held: it may start "o w" */
    assert_memory_equal(d.content, "l", 1);
    assert_int_equal(srv_text_feed(&t, " world", 6, &d), 1);
    assert_int_equal(d.n_content, 0);
    srv_text_free(&t);
    /* a partial stop string that does not complete is released */
    srv_text_init(&t, stop, 2, 0, 0);
    assert_int_equal(srv_text_feed(&t, "abcE", 4, &d), 0);
    assert_int_equal(d.n_content, 3);
    assert_int_equal(srv_text_feed(&t, "Nx", 2, &d), 0);
    assert_int_equal(d.n_content, 3);
    assert_memory_equal(d.content, "ENx", 3);
    srv_text_free(&t);
}

static void test_reasoning_split(void **state) {
    (void)state;
    collected o;
    srv_text t;
    const size_t cuts[] = {5, 11};
    srv_text_init(&t, NULL, 0, 1, 1);
    feed_all(&t, "I think</think>Answer", cuts, 2, &o);   /* "</th" | "ink>" across feeds */
    assert_string_equal(o.r, "I think");
    assert_string_equal(o.c, "Answer");
    srv_text_free(&t);
    srv_text_init(&t, NULL, 0, 1, 0);
    const size_t cuts2[] = {3, 6};
    feed_all(&t, "  <think>abc</think>def", cuts2, 2, &o);   /* the output opens <think> itself */
    assert_string_equal(o.r, "abc");
    assert_string_equal(o.c, "def");
    srv_text_free(&t);
    srv_text_init(&t, NULL, 0, 1, 0);
    feed_all(&t, "Hello <think>x</think>", NULL, 0, &o);   /* not at the start: content */
    assert_string_equal(o.c, "Hello <think>x</think>");
    assert_int_equal(o.nr, 0);
    srv_text_free(&t);
    srv_text_init(&t, NULL, 0, 1, 1);
    feed_all(&t, "abc</thi", NULL, 0, &o);                 /* cut off: the held bytes come out */
    assert_string_equal(o.r, "abc</thi");
    srv_text_free(&t);
    srv_text_init(&t, NULL, 0, 0, 1);                       /* split off: all content */
    feed_all(&t, "a</think>b", NULL, 0, &o);
    assert_string_equal(o.c, "a</think>b");
    srv_text_free(&t);
}

static void test_utf8_never_split(void **state) {
    (void)state;
    char *stop[] = {"\xC3\xA9!"};                           /* "é!" */
    srv_text t;
    srv_text_init(&t, stop, 1, 0, 0);
    srv_delta d;
    assert_int_equal(srv_text_feed(&t, "a\xC3\xA9", 3, &d), 0);
    assert_int_equal(d.n_content, 1);                       /* "é" held whole */
    assert_int_equal(srv_text_feed(&t, "?", 1, &d), 0);
    assert_int_equal(d.n_content, 3);
    assert_memory_equal(d.content, "\xC3\xA9?", 3);
    srv_text_free(&t);
}

/* The reference: cut at the earliest stop string, then split at the first </think>. */
static void reference(const char *s, char *const *stop, int ns, int rstart, collected *o) {
    memset(o, 0, sizeof *o);
    size_t n = strlen(s);
    for (int i = 0; i < ns; i++) {
        const char *m = strstr(s, stop[i]);
        if (m && (size_t)(m - s) < n) n = (size_t)(m - s);
    }
    char buf[4096];
    memcpy(buf, s, n);
    buf[n] = 0;
    const char *close = rstart ? strstr(buf, "</think>") : NULL;
    if (rstart && !close) {
        memcpy(o->r, buf, n + 1);
        o->nr = n;
    } else if (rstart) {
        o->nr = (size_t)(close - buf);
        memcpy(o->r, buf, o->nr);
        strcpy(o->c, close + 8);
        o->nc = strlen(o->c);
    } else {
        memcpy(o->c, buf, n + 1);
        o->nc = n;
    }
}

static void test_random_splits(void **state) {
    (void)state;
    const char *texts[] = {"alpha beta </think> gamma STOP delta", "x</think>y</think>z", "no tags here, ST",
                           "</think>STOPSTOP", "ab\xE2\x82\xAC" "cd</thi" "nk>e\xF0\x9F\x98\x80STOP"};
    char *stop[] = {"STOP", "\xE2\x82\xAC" "c"};
    uint64_t rng = 12345;
    for (int ti = 0; ti < 5; ti++)
        for (int ns = 0; ns <= 2; ns++)
            for (int rs = 0; rs <= 1; rs++)
                for (int trial = 0; trial < 200; trial++) {
                    const char *s = texts[ti];
                    size_t cuts[64];
                    int nc = 0;
                    for (size_t at = 0;;) {
                        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                        at += 1 + (rng >> 33) % 5;
                        if (at >= strlen(s)) break;
                        cuts[nc++] = at;
                    }
                    srv_text t;
                    srv_text_init(&t, stop, ns, 1, rs);
                    collected got, want;
                    feed_all(&t, s, cuts, nc, &got);
                    reference(s, stop, ns, rs, &want);
                    srv_text_free(&t);
                    if (strcmp(got.r, want.r) || strcmp(got.c, want.c))
                        fail_msg("text %d stops %d rstart %d trial %d: got [%s|%s] want [%s|%s]", ti, ns, rs, trial,
                                 got.r, got.c, want.r, want.c);
                }
}

/* ---- srv_parse_request ------------------------------------------------------------------------- */

static fp4moe_tokenizer *g_tok;
static fp4moe_template *g_tmpl;
static srv_parse_ctx g_ctx;

static int setup(void **state) {
    (void)state;
    if (fp4moe_tokenizer_load("models/nemotron-h-tiny-moe", &g_tok)) return -1;
    FILE *f = fopen("tests/golden/templates/nemotron-3-nano-30b-a3b.jinja", "rb");
    if (!f) return -1;
    static char src[1 << 16];
    const size_t n = fread(src, 1, sizeof src, f);
    fclose(f);
    if (fp4moe_template_compile(src, n, &g_tmpl)) return -1;
    src[n < sizeof src ? n : sizeof src - 1] = 0;
    g_ctx = (srv_parse_ctx){.model_name = "tiny", .tok = g_tok, .tmpl = g_tmpl, .chat_template = src, .bos_token = "<s>",
                            .eos_token = "</s>", .vocab = 8192, .context = 512, .reasoning = 1};
    fp4moe_sampler_params_default(&g_ctx.defaults);
    g_ctx.defaults.temperature = 0.7f;
    g_ctx.defaults.stop_ids[g_ctx.defaults.n_stop++] = 2;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    fp4moe_template_free(g_tmpl);
    fp4moe_tokenizer_free(g_tok);
    return 0;
}

static int parse(srv_kind k, const char *body, srv_request *r, srv_error *e) {
    return srv_parse_request(&g_ctx, k, body, strlen(body), r, e);
}

static void test_request_errors(void **state) {
    (void)state;
    static const struct {
        srv_kind k;
        const char *body;
        int http;
        const char *param;
    } cases[] = {
        {SRV_COMPLETION, "", 400, ""},
        {SRV_COMPLETION, "{\"prompt\": \"x\"", 400, ""},
        {SRV_COMPLETION, "{\"prompt\": \"x\"} {}", 400, ""},
        {SRV_COMPLETION, "\"x\"", 400, ""},
        {SRV_COMPLETION, "{}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": null}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": {\"a\": 1}}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [\"a\", 5]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [[1], [2, 8192]]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [\"a\", \"\"]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [[1, 2], {}]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [1, 8192]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [1, -1]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": [1.5]}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": []}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": \"\"}", 400, "prompt"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"model\": 3}", 400, "model"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"model\": \"other\"}", 404, "model"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"temperature\": -0.1}", 400, "temperature"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"temperature\": \"1\"}", 400, "temperature"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 0}", 400, "top_p"},
        /* a key twice: the last value, as Python's json (vLLM) reads it - here out of range */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 5, \"max_tokens\": 0}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"top_p\": 1.5}", 400, "top_p"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"top_k\": 2.5}", 400, "top_k"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"min_p\": 2}", 400, "min_p"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"seed\": 1e30}", 400, "seed"},
        /* 2^63 - 1 (arrives as the double 2^63): the top of the range, here past the context */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 9223372036854775807}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 1e19}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 0}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 512}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_completion_tokens\": \"5\"}", 400, "max_completion_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_completion_tokens\": 512}", 400, "max_completion_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stream\": 1}", 400, "stream"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stream_options\": 1}", 400, "stream_options"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", 400, "stream_options"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"continuous_usage_stats\": 1}}", 400,
         "continuous_usage_stats"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop\": 5}", 400, "stop"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"\"]}", 400, "stop"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"a\",\"a\",\"a\",\"a\",\"a\",\"a\",\"a\",\"a\",\"a\",\"a\","
                         "\"a\",\"a\",\"a\",\"a\",\"a\",\"a\",\"a\"]}", 400, "stop"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop_token_ids\": [\"a\"]}", 400, "stop_token_ids"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop_token_ids\": [8192]}", 400, "stop_token_ids"}, /* past the vocabulary */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"truncate_prompt_tokens\": 513}", 400, "truncate_prompt_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"model\": \"\xff\xfe\"}", 404, "model"}, /* its message: valid UTF-8 */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"n\": 0}", 400, "n"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"n\": 65}", 400, "n"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"n\": 1.5}", 400, "n"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"n\": 2, \"best_of\": 3}", 400, "best_of"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"best_of\": 2}", 400, "best_of"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": true}", 400, "logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 21}", 400, "logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": -1}", 400, "logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 1.5}", 400, "logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 2, \"top_logprobs\": 2}", 400, "top_logprobs"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"logprobs\": 1}", 400, "logprobs"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"top_logprobs\": 2}", 400,
         "top_logprobs"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"logprobs\": true, "
                   "\"top_logprobs\": 21}", 400, "top_logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 1, \"return_tokens_as_token_ids\": 1}", 400,
         "return_tokens_as_token_ids"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"echo\": 1}", 400, "echo"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"echo\": true}", 400, "echo"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 0, \"echo\": false}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": -1, \"echo\": true}", 400, "max_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"suffix\": \"y\"}", 400, "suffix"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"presence_penalty\": 2.5}", 400, "presence_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"presence_penalty\": \"1\"}", 400, "presence_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"frequency_penalty\": -2.01}", 400, "frequency_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": 0}", 400, "repetition_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": -1}", 400, "repetition_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": 101}", 400, "repetition_penalty"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": 1e-39}", 400, "repetition_penalty"}, /* inf logits */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"repetition_penalty\": 1e-46}", 400, "repetition_penalty"}, /* 0 as a float */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": []}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"a\": 1}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"-1\": 1}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"8192\": 1}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"12345678901\": 1}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\" 5\": 1}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 101}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": \"1\"}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": null}}", 400, "logit_bias"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"response_format\": {\"type\": \"structural_tag\"}}", 400, "response_format"},
        {SRV_COMPLETION, "{\"prompt\": \"\\ud800\"}", 400, ""},          /* cJSON: a lone surrogate */
        {SRV_COMPLETION, "{\"prompt\": \"a\xff\"}", 400, "prompt"},        /* invalid UTF-8: the tokenizer */
        {SRV_COMPLETION, "{\"prompt\": \"x\\u0000 and more\"}", 400, ""}, /* NUL: cJSON's string would end there */
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"min_tokens\": 3}", 400, "min_tokens"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"use_beam_search\": true}", 400, "use_beam_search"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"bad_words\": [\"a\"]}", 400, "bad_words"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"allowed_token_ids\": [1]}", 400, "allowed_token_ids"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"prompt_logprobs\": 1}", 400, "prompt_logprobs"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"guided_choice\": \"a\"}", 400, "guided_choice"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"guided_json\": {\"minimum\": 1}}", 400, "guided_json"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"structured_outputs\": {\"regex\": \"a\"}}", 400,
         "structured_outputs"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"function_call\": {\"name\": \"f\"}}",
         400, "tool_choice"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"functions\": [{\"name\": \"f\"}]}",
         400, "functions"},
        {SRV_COMPLETION, "{\"prompt\": \"x\", \"stop\": [\"\\u0000\"]}", 400, ""},
        {SRV_CHAT, "{}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": []}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": {}}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [5]}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [{\"content\": \"x\"}]}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"\", \"content\": \"x\"}]}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"a\\u0000b\"}]}", 400, ""},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}", 400, "messages"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}", 400, "tools"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tool_choice\": \"required\"}", 400,
         "tool_choice"},
        {SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"chat_template_kwargs\": 1}", 400,
         "chat_template_kwargs"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        srv_request r;
        srv_error e;
        const int rc = parse(cases[i].k, cases[i].body, &r, &e);
        if (rc != -1 || e.http != cases[i].http || strcmp(e.param, cases[i].param) || !e.message[0])
            fail_msg("case %zu %s: rc %d http %d param '%s' message '%s'", i, cases[i].body, rc, e.http, e.param,
                     e.message);
        char *j = srv_error_json(&e);
        assert_non_null(strstr(j, "\"error\":{\"message\":"));
        srv_buf u = {0}; /* the body is valid UTF-8: lossy decoding leaves it as it is */
        assert_true(srv_utf8_lossy(&u, j, strlen(j)) >= 0);
        if (u.n != strlen(j) || memcmp(u.p, j, u.n)) fail_msg("case %zu: the error body is not valid UTF-8: %s", i, j);
        srv_buf_free(&u);
        free(j);
    }
    {   /* a valid stop id at the vocabulary's top is accepted */
        srv_request r;
        srv_error e;
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"a\", \"stop_token_ids\": [8191]}", &r, &e), 0);
        srv_request_free(&r);
    }
    /* an escaped backslash before "u0000" is text, not a NUL; the neutral values of refused fields are accepted;
     * an integer out of range says so (not "must be an integer"), -0 is 0 */
    {
        srv_request r;
        srv_error e;
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"a\", \"logit_bias\": {}, \"min_tokens\": 0, "
                                               "\"use_beam_search\": false, \"bad_words\": [], \"prompt_logprobs\": null}",
                               &r, &e), 0);
        srv_request_free(&r);
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"a\", \"seed\": 18446744073709551615}", &r, &e), -1);
        assert_non_null(strstr(e.message, "it must be in ["));
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"a\", \"max_tokens\": -0}", &r, &e), -1);
        assert_null(strstr(e.message, "-0"));
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"a\\\\u0000\"}", &r, &e), 0);
        srv_request_free(&r);
        /* a key twice: the last value wins (Python's json, vLLM), at any depth */
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"max_tokens\": 5, \"max_tokens\": 9}", &r, &e), 0);
        assert_int_equal(r.max_tokens, 9);
        srv_request_free(&r);
        assert_int_equal(parse(SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\", "
                                         "\"content\": \"Goodbye\"}]}", &r, &e), 0);
        char *text = NULL;
        int64_t tn = 0;
        assert_int_equal(fp4moe_tokenizer_decode(g_tok, r.ids, r.n_ids, 0, &text, &tn), 0);
        assert_non_null(strstr(text, "Goodbye"));
        assert_null(strstr(text, "Hello"));
        free(text);
        srv_request_free(&r);
        /* bodies cJSON refuses although they are JSON text: the reason named */
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"cut \\ud83d\"}", &r, &e), -1);
        assert_non_null(strstr(e.message, "lone UTF-16 surrogate"));
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"pair \\ud83d\\ude00\", \"max_tokens\": 2}", &r, &e), 0);
        srv_request_free(&r);
        char deep[2100];
        for (int i = 0; i < 1050; i++) deep[i] = '[';
        for (int i = 0; i < 1050; i++) deep[1050 + i] = ']';
        assert_int_equal(srv_parse_request(&g_ctx, SRV_COMPLETION, deep, 2100, &r, &e), -1);
        assert_non_null(strstr(e.message, "deeper than 1000 levels"));
        assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\"", &r, &e), -1);
        assert_non_null(strstr(e.message, "not valid JSON"));
    }
    /* a long prompt: the message gives both numbers */
    char body[8192];
    strcpy(body, "{\"prompt\": \"");
    for (int i = 0; i < 600; i++) strcat(body, "a b ");
    strcat(body, "\"}");
    srv_request r;
    srv_error e;
    assert_int_equal(parse(SRV_COMPLETION, body, &r, &e), -1);
    assert_non_null(strstr(e.message, "maximum context length is 512"));
    /* the template refuses (raise_exception): its message in a 400 */
    fp4moe_template *t = NULL;
    const char *src = "{% if messages[0].role != 'user' %}{{ raise_exception('roles must start with user') }}{% endif %}x";
    assert_int_equal(fp4moe_template_compile(src, strlen(src), &t), 0);
    g_ctx.tmpl = t;
    assert_int_equal(parse(SRV_CHAT, "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", &r, &e), -1);
    assert_int_equal(e.http, 400);
    assert_non_null(strstr(e.message, "roles must start with user"));
    fp4moe_template_free(t);
    /* no template: a clear chat error */
    g_ctx.tmpl = NULL;
    assert_int_equal(parse(SRV_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", &r, &e), -1);
    assert_non_null(strstr(e.message, "no chat template"));
    g_ctx.tmpl = g_tmpl;
}

static void test_request_fields(void **state) {
    (void)state;
    srv_request r;
    srv_error e;
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"Once upon a time\"}", &r, &e), 0);
    assert_true(r.n_ids > 0);
    assert_int_equal(r.max_tokens, 16);                         /* default: 16 (OpenAI's / vLLM's completions) */
    assert_float_equal(r.sp.temperature, 0.7f, 0);             /* the server's default */
    assert_int_equal(r.sp.n_stop, 1);
    assert_int_equal(r.stream, 0);
    assert_int_equal(r.history, 0);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": [[5, 6, 7]], \"max_tokens\": 3, \"temperature\": 0, "
                           "\"top_k\": -1, \"seed\": 0, \"stop\": \"xy\", \"stream\": true, \"stream_options\": "
                           "{\"include_usage\": true}, \"ignore_eos\": true, \"stop_token_ids\": [9], "
                           "\"n\": 1, \"logprobs\": null, \"user\": \"u\"}", &r, &e), 0);
    assert_int_equal(r.n_ids, 3);
    assert_int_equal(r.ids[2], 7);
    assert_int_equal(r.max_tokens, 3);
    assert_int_equal(r.sp.top_k, 0);
    assert_true(r.has_seed && r.sp.seed != 0);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "xy");
    assert_true(r.stream && r.include_usage && r.ignore_eos);
    assert_int_equal(r.sp.n_stop, 1);                          /* ignore_eos drops EOS; 9 is added */
    assert_int_equal(r.sp.stop_ids[0], 9);
    srv_request_free(&r);
    /* chat: thinking by default (the prompt opens <think>), history = the conversation before the
       generation prompt, a prefix of the prompt */
    const char *chat = "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
                       "\"content\": [{\"type\": \"text\", \"text\": \"Hi \"}, {\"type\": \"text\", \"text\": "
                       "\"there\"}]}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"type\": "
                       "\"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}}]}, "
                       "{\"role\": \"tool\", \"content\": \"42\"}]%s}";
    char body[2048];
    snprintf(body, sizeof body, chat, "");
    assert_int_equal(parse(SRV_CHAT, body, &r, &e), 0);
    assert_true(r.reasoning && r.reasoning_start);
    assert_true(r.history > 0 && r.history < r.n_ids);
    char *text = NULL;
    int64_t n = 0;
    assert_int_equal(fp4moe_tokenizer_decode(g_tok, r.ids, r.n_ids, 0, &text, &n), 0);
    assert_non_null(strstr(text, "Hi there"));                 /* text parts joined */
    assert_non_null(strstr(text, "<parameter=a>"));            /* arguments parsed into an object */
    assert_true(n > 8 && !strcmp(text + n - 8, "<think>\n"));
    free(text);
    srv_request_free(&r);
    snprintf(body, sizeof body, chat, ", \"chat_template_kwargs\": {\"enable_thinking\": false}");
    assert_int_equal(parse(SRV_CHAT, body, &r, &e), 0);
    assert_int_equal(r.reasoning_start, 0);
    assert_int_equal(r.logprobs, 0);
    srv_request_free(&r);
    /* logprobs, penalties, logit_bias */
    snprintf(body, sizeof body, chat, ", \"logprobs\": true, \"top_logprobs\": 20, \"presence_penalty\": -2, "
             "\"frequency_penalty\": 0.5, \"repetition_penalty\": 1.25, \"return_tokens_as_token_ids\": true, "
             "\"max_tokens\": 7");
    assert_int_equal(parse(SRV_CHAT, body, &r, &e), 0);
    assert_true(r.logprobs && r.tokens_as_ids);
    assert_int_equal(r.top_logprobs, 20);
    assert_float_equal(r.sp.presence_penalty, -2.0f, 0);
    assert_float_equal(r.sp.frequency_penalty, 0.5f, 0);
    assert_float_equal(r.sp.repeat_penalty, 1.25f, 0);
    assert_int_equal(r.sp.repeat_last_n, r.n_ids + 7);         /* vLLM: every prompt and output token */
    assert_int_equal(r.sp.n_bias, 0);
    srv_request_free(&r);
    snprintf(body, sizeof body, chat, ", \"logprobs\": false, \"top_logprobs\": 0");
    assert_int_equal(parse(SRV_CHAT, body, &r, &e), 0);
    assert_int_equal(r.logprobs, 0);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": 0, \"logit_bias\": {\"5\": -100, "
                           "\"0\": 100, \"8191\": 0.5, \"007\": 1}}", &r, &e), 0);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 0);
    assert_int_equal(r.sp.n_bias, 4);
    assert_true(r.sp.bias_ids == r.bias_ids && r.sp.bias == r.bias);
    assert_int_equal(r.bias_ids[0], 5);
    assert_float_equal(r.bias[0], -100.0f, 0);
    assert_int_equal(r.bias_ids[2], 8191);
    assert_int_equal(r.bias_ids[3], 7);
    srv_request_free(&r);
    /* one id under two spellings: the last one counts (vLLM's int(key)), one entry */
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"logit_bias\": {\"14\": 100, \"3\": 1, \"014\": -100}}",
                           &r, &e), 0);
    assert_int_equal(r.sp.n_bias, 2);
    assert_int_equal(r.bias_ids[0], 14);
    assert_float_equal(r.bias[0], -100.0f, 0);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"echo\": true, \"max_tokens\": 0, \"logprobs\": 1}",
                           &r, &e), 0);                        /* lm-evaluation-harness's loglikelihood request */
    assert_true(r.echo && r.logprobs);
    assert_int_equal(r.max_tokens, 0);
    assert_int_equal(r.n, 1);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"n\": 64, \"best_of\": 64, \"stop\": [\"a\", \"bc\"], "
                           "\"logit_bias\": {\"5\": 1}}", &r, &e), 0);
    assert_int_equal(r.n, 64);
    assert_int_equal(r.n_prompts, 1);
    srv_request c;                                              /* a choice's deep copy */
    assert_int_equal(srv_request_copy(&r, &c), 0);
    assert_true(c.ids != r.ids && c.stop[1] != r.stop[1] && c.bias != r.bias && c.sp.bias == c.bias);
    assert_string_equal(c.stop[1], "bc");
    assert_int_equal(c.n_ids, r.n_ids);
    assert_int_equal(c.ids[0], r.ids[0]);
    assert_int_equal(c.sp.n_bias, 1);
    srv_request_free(&r);
    srv_request_free(&c);
    /* a list of prompts: prompt 0 in ids, the others in more_ids; each choice picks its own (its default max_tokens) */
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": [[5, 6, 7], [8], [9, 10]]}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 3);
    assert_int_equal(r.n_ids, 3);
    assert_int_equal(r.more_n[0], 1);
    assert_int_equal(r.more_ids[1][1], 10);
    assert_int_equal(srv_request_copy(&r, &c), 0);
    srv_request_pick(&c, 2, 512);
    assert_true(c.n_prompts == 1 && c.n_ids == 2 && c.ids[0] == 9 && !c.more_ids);
    assert_int_equal(c.max_tokens, 16);                         /* no max_tokens: 16 within the context */
    srv_request_free(&c);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": [\"Once upon\", \"a time\"], \"max_tokens\": 4}", &r, &e), 0);
    assert_int_equal(r.n_prompts, 2);
    assert_int_equal(srv_request_copy(&r, &c), 0);
    srv_request_pick(&c, 1, 512);
    assert_int_equal(c.max_tokens, 4);
    assert_int_equal(c.n_ids, r.more_n[0]);
    srv_request_free(&c);
    srv_request_free(&r);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"logprobs\": null, \"logit_bias\": {}, "
                           "\"presence_penalty\": 0, \"repetition_penalty\": 1}", &r, &e), 0);
    assert_int_equal(r.logprobs, 0);
    assert_int_equal(r.sp.n_bias, 0);
    srv_request_free(&r);
}

/* srv_json_string: NUL bytes as \u0000 around cJSON's own escapes; no NUL: a plain string */
static void test_json_string(void **state) {
    (void)state;
    static const struct {
        const char *s;
        size_t n;
        const char *json;
    } cases[] = {
        {"abc", 3, "\"abc\""},
        {"a\0b", 3, "\"a\\u0000b\""},
        {"\0", 1, "\"\\u0000\""},
        {"x\"\0\n\0", 5, "\"x\\\"\\u0000\\n\\u0000\""},
        {"\xC3\xA9\0", 3, "\"\xC3\xA9\\u0000\""},
        {"", 0, "\"\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *a = cJSON_CreateArray();
        cJSON_AddItemToArray(a, srv_json_string(cases[i].s, cases[i].n));
        char *p = cJSON_PrintUnformatted(a);
        char want[64];
        snprintf(want, sizeof want, "[%s]", cases[i].json);
        if (strcmp(p, want)) fail_msg("case %zu: %s, want %s", i, p, want);
        cJSON *back = cJSON_Parse(p); /* valid JSON */
        assert_non_null(back);
        cJSON_Delete(back);
        free(p);
        cJSON_Delete(a);
    }
}

/* srv_utf8_lossy against Python's bytes.decode("utf-8", "replace") on fixed cases (maximal subparts) */
static void test_utf8_lossy(void **state) {
    (void)state;
    static const struct {
        const char *in;
        size_t n;
        const char *out;
        int64_t chars;
    } cases[] = {
        {"abc", 3, "abc", 3},
        {"\xC3\xA9", 2, "\xC3\xA9", 1},                         /* e acute */
        {"\xC3", 1, "\xEF\xBF\xBD", 1},                           /* a lone lead byte */
        {"\xE2\x82", 2, "\xEF\xBF\xBD", 1},                       /* a truncated 3-byte: one U+FFFD */
        {"\xE2\x82\xACx", 4, "\xE2\x82\xACx", 2},               /* the euro sign */
        {"\xE2\x82x", 3, "\xEF\xBF\xBDx", 2},
        {"\x80\x80", 2, "\xEF\xBF\xBD\xEF\xBF\xBD", 2},         /* continuation bytes: one each */
        {"\xC0\xAF", 2, "\xEF\xBF\xBD\xEF\xBF\xBD", 2},         /* an overlong lead: invalid alone */
        {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 3}, /* a surrogate: ED A0 is not a prefix */
        {"\xF0\x9F\x98\x80", 4, "\xF0\x9F\x98\x80", 1},          /* an emoji */
        {"\xF0\x9F\x98", 3, "\xEF\xBF\xBD", 1},
        {"\xF4\x90\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 4}, /* > U+10FFFF */
        {"\xFF" "a", 2, "\xEF\xBF\xBD" "a", 2},
        {"a\0b", 3, "a\0b", 3},
        {"", 0, "", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        srv_buf b = {0};
        const int64_t c = srv_utf8_lossy(&b, cases[i].in, cases[i].n);
        const size_t want = cases[i].n == 3 && !cases[i].in[1] ? 3 : strlen(cases[i].out);
        if (c != cases[i].chars || b.n != want || (want && memcmp(b.p, cases[i].out, want)))
            fail_msg("case %zu: %lld chars, %zu bytes", i, (long long)c, b.n);
        srv_buf_free(&b);
    }
}

/* vLLM's /tokenize, /detokenize, /tokenizer_info (lm-evaluation-harness's remote tokenizer): round trips against the
 * tokenizer itself, the chat form equal to a chat request's ids, and the errors */
static void test_tokenize_endpoints(void **state) {
    (void)state;
    const char *text = "Once upon a time, \xC3\xA9t\xC3\xA9 </s> end";
    int32_t *ids = NULL;
    int64_t n = 0;
    assert_int_equal(fp4moe_tokenizer_encode(g_tok, text, (int64_t)strlen(text), 0, &ids, &n), 0);
    char body[512], *out = NULL;
    srv_error e;
    snprintf(body, sizeof body, "{\"prompt\": \"%s\", \"add_special_tokens\": false}", text);
    assert_int_equal(srv_tokenize(&g_ctx, body, strlen(body), &out, &e), 0);
    cJSON *o = cJSON_Parse(out), *t = cJSON_GetObjectItem(o, "tokens");
    assert_int_equal(cJSON_GetArraySize(t), n);
    assert_int_equal((int64_t)cJSON_GetObjectItem(o, "count")->valuedouble, n);
    assert_int_equal((int64_t)cJSON_GetObjectItem(o, "max_model_len")->valuedouble, 512);
    for (int64_t i = 0; i < n; i++) assert_int_equal((int32_t)cJSON_GetArrayItem(t, (int)i)->valuedouble, ids[i]);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(o, "token_strs")));
    /* back: /detokenize keeps special tokens (</s> is in the text) */
    srv_buf b = {0};
    char *ts = cJSON_PrintUnformatted(t);
    srv_buf_printf(&b, "{\"tokens\": %s}", ts);
    free(ts);
    free(out);
    assert_int_equal(srv_detokenize(&g_ctx, b.p, b.n, &out, &e), 0);
    cJSON *d = cJSON_Parse(out);
    assert_string_equal(cJSON_GetObjectItem(d, "prompt")->valuestring, text);
    cJSON_Delete(d);
    cJSON_Delete(o);
    srv_buf_free(&b);
    free(out);
    free(ids);
    /* messages: the ids of the same chat request */
    const char *msgs = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi there\"}]}";
    srv_request r;
    assert_int_equal(parse(SRV_CHAT, msgs, &r, &e), 0);
    assert_int_equal(srv_tokenize(&g_ctx, msgs, strlen(msgs), &out, &e), 0);
    o = cJSON_Parse(out);
    t = cJSON_GetObjectItem(o, "tokens");
    assert_int_equal(cJSON_GetArraySize(t), r.n_ids);
    for (int64_t i = 0; i < r.n_ids; i++) assert_int_equal((int32_t)cJSON_GetArrayItem(t, (int)i)->valuedouble, r.ids[i]);
    cJSON_Delete(o);
    free(out);
    srv_request_free(&r);
    /* info: the special tokens and the template */
    out = srv_tokenizer_info(&g_ctx);
    o = cJSON_Parse(out);
    assert_string_equal(cJSON_GetObjectItem(o, "eos_token")->valuestring, "</s>");
    assert_string_equal(cJSON_GetObjectItem(o, "bos_token")->valuestring, "<s>");
    assert_string_equal(cJSON_GetObjectItem(o, "chat_template")->valuestring, g_ctx.chat_template);
    cJSON_Delete(o);
    free(out);
    /* errors: each a 400 naming its field */
    /* return_token_strs: the vocab strings; a NUL token decodes to \u0000 (not the end of the text) */
    const char *ts_body = "{\"prompt\": \"Hello world\", \"return_token_strs\": true, \"model\": \"tiny\"}";
    assert_int_equal(srv_tokenize(&g_ctx, ts_body, strlen(ts_body), &out, &e), 0);
    assert_non_null(strstr(out, "\"token_strs\":[\"H\",\"ell\",\"o\",\"\xC4\xA0world\"]"));
    free(out);
    const char *nul_ids = "{\"tokens\": [67, 191, 68]}";
    assert_int_equal(srv_detokenize(&g_ctx, nul_ids, strlen(nul_ids), &out, &e), 0);
    assert_string_equal(out, "{\"prompt\":\"a\\u0000b\"}");
    free(out);
    static const struct {
        int tok;
        const char *body, *param;
        int http;
    } bad[] = {
        {1, "{\"prompt\": \"a\\u0000b\"}", "", 400},
        {1, "{\"prompt\": \"hi\", \"model\": \"other\"}", "model", 404},
        {1, "{\"prompt\": \"hi\", \"model\": 5}", "model", 400},
        {1, "{}", "prompt", 400},
        {1, "[1]", "", 400},
        {1, "{\"prompt\": 5}", "prompt", 400},
        {1, "{\"prompt\": \"a\", \"messages\": []}", "prompt", 400},
        {1, "{\"prompt\": \"a\", \"add_special_tokens\": 1}", "add_special_tokens", 400},
        {1, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"add_special_tokens\": true}",
         "add_special_tokens", 400},
        {1, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"add_generation_prompt\": 0}",
         "add_generation_prompt", 400},
        {1, "{\"messages\": [{\"content\": \"x\"}]}", "messages", 400},
        {0, "{}", "tokens", 400},
        {0, "{\"tokens\": [1, 8192]}", "tokens", 400},
        {0, "{\"tokens\": [1, -1]}", "tokens", 400},
        {0, "{\"tokens\": [1.5]}", "tokens", 400},
        {0, "{\"tokens\": \"1\"}", "tokens", 400},
        {0, "not json", "", 400},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        out = (char *)1;
        const int rc = bad[i].tok ? srv_tokenize(&g_ctx, bad[i].body, strlen(bad[i].body), &out, &e)
                                  : srv_detokenize(&g_ctx, bad[i].body, strlen(bad[i].body), &out, &e);
        if (rc != -1 || e.http != (bad[i].http ? bad[i].http : 400) || strcmp(e.param, bad[i].param) || out)
            fail_msg("case %zu %s: rc %d http %d param '%s'", i, bad[i].body, rc, e.http, e.param);
    }
}

/* vLLM's prompt-shaping fields and the max_tokens defaults: add_generation_prompt false renders the chat without the
 * assistant turn's opening (a prefix of the usual prompt), continue_final_message leaves the last message open (the
 * prompt ends with its text), both true / a template in the request are 400s; truncate_prompt_tokens keeps the last k
 * tokens of each prompt; completions default to 16 tokens within the context, chats to the rest of the context. */
static void test_prompt_shaping(void **state) {
    (void)state;
    srv_request a, b, t;
    srv_error e;
    const char *user = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}]";
    char body[512];
    snprintf(body, sizeof body, "%s}", user);
    assert_int_equal(parse(SRV_CHAT, body, &a, &e), 0);
    assert_int_equal(a.max_tokens, 512 - a.n_ids); /* chat: the rest of the context */
    snprintf(body, sizeof body, "%s, \"add_generation_prompt\": false}", user);
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), 0);
    assert_true(b.n_ids < a.n_ids && !memcmp(a.ids, b.ids, (size_t)b.n_ids * sizeof *b.ids));
    srv_request_free(&b);
    const char *turns = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}, {\"role\": \"assistant\", "
                        "\"content\": \"The answer is\"}]";
    snprintf(body, sizeof body, "%s, \"continue_final_message\": true, \"add_generation_prompt\": false}", turns);
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), 0);
    char *text = NULL;
    int64_t tl = 0;
    assert_int_equal(fp4moe_tokenizer_decode(g_tok, b.ids, b.n_ids, 0, &text, &tl), FP4MOE_OK);
    if (tl < 13 || memcmp(text + tl - 13, "The answer is", 13)) fail_msg("continued prompt ends: [%s]", text);
    free(text);
    srv_request_free(&b);
    snprintf(body, sizeof body, "%s, \"continue_final_message\": true}", turns); /* add_generation_prompt unset */
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), 0);
    srv_request_free(&b);
    /* the text also earlier in the chat: the cut comes after its last occurrence (the final message) */
    const char *twice = "{\"messages\": [{\"role\": \"user\", \"content\": \"The answer is\"}, {\"role\": \"assistant\", "
                        "\"content\": \"The answer is\"}], \"continue_final_message\": true}";
    assert_int_equal(parse(SRV_CHAT, twice, &b, &e), 0);
    assert_int_equal(fp4moe_tokenizer_decode(g_tok, b.ids, b.n_ids, 0, &text, &tl), FP4MOE_OK);
    const char *first = strstr(text, "The answer is");
    if (!first || !strstr(first + 1, "The answer is") || memcmp(text + tl - 13, "The answer is", 13))
        fail_msg("cut after the last occurrence: [%s]", text);
    free(text);
    srv_request_free(&b);
    static const struct {
        const char *tail, *param;
    } bad[] = {
        {", \"continue_final_message\": true, \"add_generation_prompt\": true}", "continue_final_message"},
        {", \"continue_final_message\": \"yes\"}", "continue_final_message"},
        {", \"chat_template\": \"{{ messages }}\"}", "chat_template"},
        {", \"truncate_prompt_tokens\": 0}", "truncate_prompt_tokens"},
        {", \"truncate_prompt_tokens\": -2}", "truncate_prompt_tokens"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(body, sizeof body, "%s%s", turns, bad[i].tail);
        if (parse(SRV_CHAT, body, &b, &e) != -1 || e.http != 400 || strcmp(e.param, bad[i].param))
            fail_msg("case %zu: %s -> http %d param '%s'", i, body, e.http, e.param);
    }
    /* a final message of white space only: transformers 5 renders it (the cut at its tag; tests/server/test_server.py
     * compares such texts with transformers'); the tag never reaches the prompt; a final message without content is
     * a 400 */
    snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"   \"}], \"continue_final_message\": "
             "true, \"add_generation_prompt\": false}");
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), 0);
    assert_int_equal(fp4moe_tokenizer_decode(g_tok, b.ids, b.n_ids, 0, &text, &tl), FP4MOE_OK);
    /* this template keeps the message's text as it is: the cut right after the three spaces */
    if (strstr(text, "CONTINUE") || tl < 8 || memcmp(text + tl - 8, "user\n   ", 8))
        fail_msg("white-space message continued: [%s]", text);
    free(text);
    srv_request_free(&b);
    snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
             "\"content\": null, \"tool_calls\": []}], \"continue_final_message\": true, \"add_generation_prompt\": false}");
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), 0); /* content null is "" (vLLM): continued at its start */
    srv_request_free(&b);
    snprintf(body, sizeof body, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", "
             "\"tool_calls\": []}], \"continue_final_message\": true, \"add_generation_prompt\": false}");
    assert_int_equal(parse(SRV_CHAT, body, &b, &e), -1);
    assert_string_equal(e.param, "continue_final_message");
    assert_non_null(strstr(e.message, "no \"content\" to continue"));
    /* truncate_prompt_tokens: the last k ids of each prompt; -1: at most the context */
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": [[5, 6, 7, 8, 9], [10, 11]], \"truncate_prompt_tokens\": 3}", &t,
                           &e), 0);
    assert_true(t.n_ids == 3 && t.ids[0] == 7 && t.ids[2] == 9 && t.more_n[0] == 2 && t.more_ids[0][0] == 10);
    srv_request_free(&t);
    snprintf(body, sizeof body, "%s, \"truncate_prompt_tokens\": 4}", user);
    assert_int_equal(parse(SRV_CHAT, body, &t, &e), 0);
    assert_true(t.n_ids == 4 && !memcmp(t.ids, a.ids + a.n_ids - 4, 4 * sizeof *t.ids));
    srv_request_free(&t);
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": [5, 6, 7], \"truncate_prompt_tokens\": -1}", &t, &e), 0);
    assert_int_equal(t.n_ids, 3);
    srv_request_free(&t);
    srv_request_free(&a);
    /* completions: 16 tokens by default, fewer where the context ends first (505 of 512 taken: 7) */
    char *big = malloc(8 * 505 + 32);
    assert_non_null(big);
    int o = sprintf(big, "{\"prompt\": [");
    for (int i = 0; i < 505; i++) o += sprintf(big + o, "%s5", i ? ", " : "");
    sprintf(big + o, "]}");
    assert_int_equal(parse(SRV_COMPLETION, big, &t, &e), 0);
    assert_int_equal(t.max_tokens, 7);
    srv_request_free(&t);
    free(big);
}

/* Structured output fields: which set a grammar, that copies share it (refs; ASan: no double free), the 400s */
static void test_structured_fields(void **state) {
    (void)state;
    srv_request r, c1, c2;
    srv_error e;
    assert_int_equal(parse(SRV_COMPLETION, "{\"prompt\": \"x\", \"response_format\": {\"type\": \"text\"}}", &r, &e), 0);
    assert_null(r.grammar);
    srv_request_free(&r);
    static const char *const ok[] = {
        "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_object\"}}",
        "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"n\", "
        "\"strict\": true, \"schema\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}}}}}",
        "{\"prompt\": \"x\", \"guided_json\": \"{\\\"type\\\": \\\"string\\\"}\"}",
        "{\"prompt\": \"x\", \"guided_choice\": [\"a\", \"b\"], \"guided_decoding_backend\": null}",
        "{\"prompt\": \"x\", \"structured_outputs\": {\"choice\": [\"a\"], \"regex\": null}}",
        "{\"prompt\": \"x\", \"structured_outputs\": {\"json_object\": true}}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
        if (parse(SRV_COMPLETION, ok[i], &r, &e)) fail_msg("case %zu: %s", i, e.message);
        assert_non_null(r.grammar);
        assert_int_equal(r.grammar->json, i < 3 || i == 5);
        assert_int_equal(srv_request_copy(&r, &c1), 0);
        assert_int_equal(srv_request_copy(&c1, &c2), 0);
        assert_ptr_equal(c2.grammar, r.grammar);
        assert_int_equal(r.grammar->refs, 3);
        srv_request_free(&r);
        srv_request_free(&c2);
        assert_int_equal(c1.grammar->refs, 1);
        srv_request_free(&c1);
    }
    static const struct {
        const char *body, *param, *msg;
    } bad[] = {
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"regex\"}}", "response_format", "\"regex\""},
        {"{\"prompt\": \"x\", \"response_format\": \"json_object\"}", "response_format", "with a 'type'"},
        {"{\"prompt\": \"x\", \"guided_json\": 5}", "guided_json", "must be a JSON Schema"},
        {"{\"prompt\": \"x\", \"guided_json\": {\"type\": \"array\", \"uniqueItems\": true}}", "guided_json",
         "guided_json: 'uniqueItems' is not supported"},
        {"{\"prompt\": \"x\", \"guided_choice\": [\"a\", 1]}", "guided_choice", "item 1"},
        {"{\"prompt\": \"x\", \"structured_outputs\": {\"json\": {}, \"choice\": [\"a\"]}}", "structured_outputs",
         "one of"},
        {"{\"prompt\": \"x\", \"structured_outputs\": {}}", "structured_outputs", "gives none"},
        {"{\"prompt\": \"x\", \"guided_grammar\": \"root ::= x\"}", "guided_grammar", "not supported"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (parse(SRV_COMPLETION, bad[i].body, &r, &e) != -1 || e.http != 400 || strcmp(e.param, bad[i].param) ||
            !strstr(e.message, bad[i].msg))
            fail_msg("case %zu %s: http %d param '%s' message '%s'", i, bad[i].body, e.http, e.param, e.message);
    }
}

/* Tool calls: an assistant message with tool_calls rendered by the real chat template (NVIDIA's format: the
 * Nemotron-3 XML one, the Nano-9B-v2 JSON one) comes back through srv_tool_split (random splits of the text) and
 * srv_tool_calls_parse as the same names and arguments, the content before the calls as content; text without a
 * call stays content; a marker with no parsable call goes back to the content. */
static void render_assistant(const char *tmpl_path, const char *calls_json, char **out) {
    FILE *f = fopen(tmpl_path, "rb");
    assert_non_null(f);
    static char src[1 << 16];
    const size_t n = fread(src, 1, sizeof src, f);
    fclose(f);
    fp4moe_template *t = NULL;
    assert_int_equal(fp4moe_template_compile(src, n, &t), FP4MOE_OK);
    char ctxs[4096];
    snprintf(ctxs, sizeof ctxs, "{\"messages\": [{\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": "
             "\"assistant\", \"content\": \"Let me check.\", \"tool_calls\": %s}], \"add_generation_prompt\": false, "
             "\"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}", calls_json);
    cJSON *ctx = cJSON_Parse(ctxs);
    assert_non_null(ctx);
    size_t len;
    assert_int_equal(fp4moe_template_render(t, ctx, NULL, out, &len), FP4MOE_OK);
    cJSON_Delete(ctx);
    fp4moe_template_free(t);
}

static void split_parse(srv_tool_format fmt, const char *text, uint64_t *rng, const cJSON *tools, srv_buf *content,
                        cJSON **calls) {
    srv_tool_split t;
    srv_tool_split_init(&t, fmt);
    content->n = 0;
    for (size_t at = 0, n = strlen(text); at < n;) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t k = 1 + (*rng >> 33) % 7;
        if (at + k > n) k = n - at;
        assert_int_equal(srv_tool_split_feed(&t, text + at, k, content), 0);
        at += k;
    }
    assert_int_equal(srv_tool_split_flush(&t, content), 0);
    uint64_t ids = 1;
    *calls = t.in_calls ? srv_tool_calls_parse(fmt, t.calls.p, t.calls.n, tools, 0, &ids) : NULL;
    if (t.in_calls && !*calls) srv_buf_add(content, t.calls.p, t.calls.n);
    srv_tool_split_free(&t);
}

static void test_tool_calls(void **state) {
    (void)state;
    const char *calls_json = "[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                             "\"arguments\": {\"city\": \"Paris, FR\\nrive gauche\", \"days\": 3, \"ratio\": 2.5, "
                             "\"metric\": true, \"units\": {\"t\": \"C\"}, \"tags\": [\"a\", 1], \"note\": null}}}, "
                             "{\"id\": \"c2\", \"type\": \"function\", \"function\": {\"name\": \"now\", \"arguments\": {}}}]";
    const char *tools_json = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
                             "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": "
                             "{\"type\": \"integer\"}, \"ratio\": {\"type\": \"number\"}, \"metric\": {\"type\": "
                             "\"boolean\"}, \"units\": {\"type\": \"object\"}, \"tags\": {\"type\": \"array\"}, "
                             "\"note\": {\"type\": \"string\"}}}}}, {\"type\": \"function\", \"function\": {\"name\": "
                             "\"now\", \"parameters\": {\"type\": \"object\", \"properties\": {}}}}]";
    cJSON *want = cJSON_Parse(calls_json), *tools = cJSON_Parse(tools_json);
    assert_non_null(want);
    assert_non_null(tools);
    const struct {
        const char *tmpl, *start, *end;
        srv_tool_format fmt;
    } fm[] = {{"tests/golden/templates/nemotron-3-nano-30b-a3b.jinja", "</think>", "<|im_end|>", SRV_TOOLS_XML},
              {"tests/golden/templates/nemotron-nano-9b-v2.jinja", "<SPECIAL_11>Assistant\n", "<SPECIAL_12>",
               SRV_TOOLS_JSON}};
    uint64_t rng = 99;
    for (int k = 0; k < 2; k++) {
        char *text = NULL;
        render_assistant(fm[k].tmpl, calls_json, &text);
        FILE *f = fopen(fm[k].tmpl, "rb");
        static char src[1 << 16];
        const size_t n = fread(src, 1, sizeof src - 1, f);
        fclose(f);
        src[n] = 0;
        assert_int_equal(srv_tool_format_of_template(src), fm[k].fmt);
        /* the assistant's answer as the model writes it: after the generation prompt, up to the end-of-turn */
        const char *a = NULL; /* (the last one: Nano-9B-v2 writes a last turn's calls in an assistant block of their own) */
        for (const char *p = text; (p = strstr(p, fm[k].start)); p++) a = p;
        if (!a) fail_msg("template %s: no '%s' in [%s]", fm[k].tmpl, fm[k].start, text);
        a += strlen(fm[k].start);
        const char *b = strstr(a, fm[k].end);
        assert_non_null(b);
        char *answer = strndup(a, (size_t)(b - a));
        for (int trial = 0; trial < 50; trial++) {
            srv_buf content = {0};
            cJSON *calls = NULL;
            split_parse(fm[k].fmt, answer, &rng, tools, &content, &calls);
            if (!calls) fail_msg("template %d: no calls in [%s]", k, answer);
            assert_int_equal(cJSON_GetArraySize(calls), 2);
            if (k == 0) assert_true(content.n >= 13 && !memcmp(content.p, "Let me check.", 13));
            int i = 0;
            for (const cJSON *c = calls->child, *w = want->child; c && w; c = c->next, w = w->next, i++) {
                const cJSON *cf = cJSON_GetObjectItem(c, "function"), *wf = cJSON_GetObjectItem(w, "function");
                assert_string_equal(cJSON_GetObjectItem(cf, "name")->valuestring, cJSON_GetObjectItem(wf, "name")->valuestring);
                cJSON *args = cJSON_Parse(cJSON_GetObjectItem(cf, "arguments")->valuestring);
                cJSON *wa = cJSON_Duplicate(cJSON_GetObjectItem(wf, "arguments"), 1);
                /* the XML template writes null as Python's str(None); vLLM's parser keeps that text, as here */
                if (k == 0 && cJSON_GetObjectItem(wa, "note")) cJSON_ReplaceItemInObject(wa, "note", cJSON_CreateString("None"));
                const int same = cJSON_Compare(args, wa, 1);
                cJSON_Delete(wa);
                if (!same)
                    fail_msg("template %d call %d: arguments %s", k, i, cJSON_GetObjectItem(cf, "arguments")->valuestring);
                cJSON_Delete(args);
                assert_int_equal(strncmp(cJSON_GetObjectItem(c, "id")->valuestring, "call_", 5), 0);
                assert_string_equal(cJSON_GetObjectItem(c, "type")->valuestring, "function");
            }
            cJSON_Delete(calls);
            srv_buf_free(&content);
        }
        free(answer);
        free(text);
    }
    /* no call: the text unchanged (a partial marker at the end included); a marker without a call: content */
    const char *plain[] = {"just text, no call <tool_", "a < b <function", "<TOOLCALL>not json", "<tool_call>\n</tool_call>"};
    for (int i = 0; i < 4; i++) {
        srv_buf content = {0};
        cJSON *calls = NULL;
        split_parse(i == 2 ? SRV_TOOLS_JSON : SRV_TOOLS_XML, plain[i], &rng, NULL, &content, &calls);
        assert_null(calls);
        assert_true(content.n == strlen(plain[i]) && !memcmp(content.p, plain[i], content.n));
        srv_buf_free(&content);
    }
    /* without the tools' schema every value is a string; "null" is null whatever the type */
    uint64_t ids = 5;
    const char *x = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=z>\nNULL\n</parameter>\n"
                    "</function>\n</tool_call>";
    cJSON *c = srv_tool_calls_parse(SRV_TOOLS_XML, x, strlen(x), NULL, 0, &ids);
    assert_non_null(c);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(c->child, "function"), "arguments")->valuestring,
                        "{\"n\":\"42\",\"z\":null}");
    cJSON_Delete(c);
    /* vLLM's reading of malformed XML: a value ends at </tool_call> too; <function= inside a value is text; integers
       keep their digits (no double), "03" is 3, a hex "number" stays a string */
    static const struct {
        const char *text, *args;
        int n;
    } xml[] = {
        {"<tool_call>\n<function=f>\n<parameter=tz>\nUTC\n</tool_call>", "{\"tz\":\"UTC\"}", 1},
        {"<tool_call>\n<function=f>\n<parameter=a>\nuse <function=g> here\n</parameter>\n</function>\n</tool_call>",
         "{\"a\":\"use <function=g> here\"}", 1},
        {"<tool_call>\n<function=get_weather>\n<parameter=days>\n9007199254740993\n</parameter>\n<parameter=ratio>\n0x10\n"
         "</parameter>\n</function>\n</tool_call>", "{\"days\":9007199254740993,\"ratio\":\"0x10\"}", 1},
        {"<tool_call>\n<function=get_weather>\n<parameter=days>\n03\n</parameter>\n<parameter=ratio>\n-12345678901234567890\n"
         "</parameter>\n</function>\n</tool_call><tool_call>\n<function=now>\n</function>\n</tool_call>",
         "{\"days\":3,\"ratio\":-12345678901234567890}", 2},
    };
    /* (tools: still the parsed list of above) */
    for (int i = 0; i < 4; i++) {
        c = srv_tool_calls_parse(SRV_TOOLS_XML, xml[i].text, strlen(xml[i].text), tools, 0, &ids);
        assert_non_null(c);
        assert_int_equal(cJSON_GetArraySize(c), xml[i].n);
        const char *a = cJSON_GetObjectItem(cJSON_GetObjectItem(c->child, "function"), "arguments")->valuestring;
        if (strcmp(a, xml[i].args)) fail_msg("xml case %d: arguments %s, want %s", i, a, xml[i].args);
        cJSON_Delete(c);
    }
    /* JSON format: every <TOOLCALL> block; arguments that are not an object: no call (the text stays content) */
    const char *j2 = "<TOOLCALL>[{\"name\": \"a\", \"arguments\": {}}]</TOOLCALL>\n<TOOLCALL>[{\"name\": \"b\", "
                     "\"arguments\": \"{\\\"x\\\": 1}\"}]</TOOLCALL>";
    c = srv_tool_calls_parse(SRV_TOOLS_JSON, j2, strlen(j2), NULL, 0, &ids);
    assert_non_null(c);
    assert_int_equal(cJSON_GetArraySize(c), 2);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetArrayItem(c, 1), "function"), "arguments")->valuestring,
                        "{\"x\":1}");
    cJSON_Delete(c);
    const char *j3 = "<TOOLCALL>[{\"name\": \"a\", \"arguments\": \"hello\"}]</TOOLCALL>";
    assert_null(srv_tool_calls_parse(SRV_TOOLS_JSON, j3, strlen(j3), NULL, 0, &ids));
    /* cut by max_tokens: only the calls the answer closed (a call cut in a value would read as a whole one) */
    const char *cut1 = "<tool_call>\n<function=get_time>\n<parameter=tz>\nC";
    assert_non_null(c = srv_tool_calls_parse(SRV_TOOLS_XML, cut1, strlen(cut1), NULL, 0, &ids)); /* (not cut: kept) */
    cJSON_Delete(c);
    assert_null(srv_tool_calls_parse(SRV_TOOLS_XML, cut1, strlen(cut1), NULL, 1, &ids));
    const char *cut2 = "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n"
                       "<tool_call>\n<function=b>\n<parameter=y>\n2";
    assert_non_null(c = srv_tool_calls_parse(SRV_TOOLS_XML, cut2, strlen(cut2), NULL, 1, &ids));
    assert_int_equal(cJSON_GetArraySize(c), 1);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(c->child, "function"), "name")), "a");
    cJSON_Delete(c);
    /* tool_choice "required" cut short: the complete leading calls; none complete: NULL */
    const char *req = "[ {\"name\": \"get_time\", \"parameters\": {\"tz\": \"CET\"}\n}\n, {\"name\": \"get_"
                      "time\", \"paramet";
    assert_non_null(c = srv_tool_calls_required(req, strlen(req), &ids));
    assert_int_equal(cJSON_GetArraySize(c), 1);
    assert_string_equal(cJSON_GetStringValue(cJSON_GetObjectItem(cJSON_GetObjectItem(c->child, "function"), "arguments")),
                        "{\"tz\":\"CET\"}");
    cJSON_Delete(c);
    const char *req2 = "[{\"name\": \"a\", \"parameters\": {\"s\": \"}{\\\"\"}}, {\"name\": \"b\", \"parameters\": {}}]";
    assert_non_null(c = srv_tool_calls_required(req2, strlen(req2), &ids));
    assert_int_equal(cJSON_GetArraySize(c), 2);
    cJSON_Delete(c);
    assert_non_null(c = srv_tool_calls_required(req2, strlen(req2) - 5, &ids)); /* the second cut: the first */
    assert_int_equal(cJSON_GetArraySize(c), 1);
    cJSON_Delete(c);
    assert_null(srv_tool_calls_required("[{\"name\": \"a\", \"param", 20, &ids));
    assert_null(srv_tool_calls_required("{\"name\": \"a\"}", 13, &ids));
    cJSON_Delete(want);
    cJSON_Delete(tools);
}

/* Every input kept by fuzz/run_request.sh: parses to a request or a 4xx, never a crash. */
#include <dirent.h>
static void test_regressions(void **state) {
    (void)state;
    DIR *d = opendir("tests/server/regressions");
    assert_non_null(d);
    int n = 0;
    for (struct dirent *de; (de = readdir(d));) {
        if (de->d_name[0] == '.') continue;
        char path[512];
        snprintf(path, sizeof path, "tests/server/regressions/%s", de->d_name);
        FILE *f = fopen(path, "rb");
        assert_non_null(f);
        static char buf[1 << 16];
        const size_t len = fread(buf, 1, sizeof buf, f);
        fclose(f);
        if (!len) continue;
        srv_request r;
        srv_error e;
        const srv_kind k = (buf[0] & 1) ? SRV_COMPLETION : SRV_CHAT;
        if (srv_parse_request(&g_ctx, k, buf + 1, len - 1, &r, &e) == 0) srv_request_free(&r);
        else assert_true(e.http >= 400 && e.http < 600 && e.message[0]);
        n++;
    }
    closedir(d);
    assert_true(n >= 4);
}

int main(void) {
    const struct CMUnitTest text_tests[] = {
        cmocka_unit_test(test_stop_across_chunks),
        cmocka_unit_test(test_reasoning_split),
        cmocka_unit_test(test_utf8_never_split),
        cmocka_unit_test(test_random_splits),
        cmocka_unit_test(test_utf8_lossy),
        cmocka_unit_test(test_json_string),
    };
    const struct CMUnitTest request_tests[] = {
        cmocka_unit_test(test_request_errors),
        cmocka_unit_test(test_request_fields),
        cmocka_unit_test(test_structured_fields),
        cmocka_unit_test(test_prompt_shaping),
        cmocka_unit_test(test_tool_calls),
        cmocka_unit_test(test_regressions),
        cmocka_unit_test(test_tokenize_endpoints),
    };
    const int a = cmocka_run_group_tests_name("srv_text", text_tests, NULL, NULL);
    return a | cmocka_run_group_tests_name("srv_request", request_tests, setup, teardown);
}
