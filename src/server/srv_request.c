/* Request JSON -> srv_request (see srv.h). Field rules follow OpenAI's API reference for
 * /v1/chat/completions and /v1/completions, with vLLM's extensions top_k, min_p, ignore_eos,
 * repetition_penalty, stop_token_ids, chat_template_kwargs and the structured outputs (guided_json,
 * guided_choice, structured_outputs). What fp4moe cannot do (a chat echo, guided_regex, ...) is a 400 naming the field, never
 * silently ignored. */
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

int srv_fail(srv_error *e, int http, const char *param, const char *fmt, ...) {
    memset(e, 0, sizeof *e);
    e->http = http;
    e->type = http == 401 ? "authentication_error"
              : http == 404 ? "not_found_error"
              : http == 429 ? "rate_limit_error"
              : http >= 500 ? "server_error"
                            : "invalid_request_error";
    if (param) snprintf(e->param, sizeof e->param, "%s", param);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

char *srv_error_json(const srv_error *e) {
    cJSON *o = cJSON_CreateObject(), *er = cJSON_AddObjectToObject(o, "error");
    /* the message may quote request bytes (a model name, a '%.200s' cut inside a character): valid UTF-8 only */
    srv_buf m = {0};
    const int ok = srv_utf8_lossy(&m, e->message, strlen(e->message)) >= 0;
    cJSON_AddStringToObject(er, "message", !ok ? "(the error message could not be shown: out of memory)" : m.p ? m.p : "");
    srv_buf_free(&m);
    cJSON_AddStringToObject(er, "type", e->type ? e->type : "invalid_request_error");
    if (e->param[0]) cJSON_AddStringToObject(er, "param", e->param);
    else cJSON_AddNullToObject(er, "param");
    if (e->code) cJSON_AddStringToObject(er, "code", e->code);
    else cJSON_AddNullToObject(er, "code");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

void srv_request_free(srv_request *r) {
    if (!r) return;
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->ids);
    free(r->bias_ids);
    free(r->bias);
    for (int i = 0; r->more_ids && i < r->n_prompts - 1; i++) free(r->more_ids[i]);
    free(r->more_ids);
    free(r->more_n);
    free(r->tools_json);
    free(r->chat_text);
    free(r->tool_forced);
    if (r->grammar && __atomic_sub_fetch(&r->grammar->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        fp4moe_grammar_free(r->grammar->g);
        free(r->grammar);
    }
    memset(r, 0, sizeof *r);
}

void srv_request_pick(srv_request *r, int p, int64_t context) {
    if (p > 0 && p < r->n_prompts) {
        free(r->ids);
        r->ids = r->more_ids[p - 1];
        r->n_ids = r->more_n[p - 1];
        r->more_ids[p - 1] = NULL;
    }
    for (int i = 0; r->more_ids && i < r->n_prompts - 1; i++) free(r->more_ids[i]);
    free(r->more_ids);
    free(r->more_n);
    r->more_ids = NULL;
    r->more_n = NULL;
    r->n_prompts = 1;
    if (!r->has_max) r->max_tokens = srv_default_max_tokens(r, context);
    r->sp.repeat_last_n = r->n_ids + r->max_tokens;
}

int srv_request_copy(const srv_request *a, srv_request *b) {
    *b = *a;
    b->ids = NULL;
    b->bias_ids = NULL;
    b->bias = NULL;
    b->n_stop = 0;
    int ok = (b->ids = malloc((size_t)(a->n_ids > 0 ? a->n_ids : 1) * sizeof(int32_t))) != NULL;
    if (ok) memcpy(b->ids, a->ids, (size_t)a->n_ids * sizeof(int32_t));
    for (int i = 0; ok && i < a->n_stop; i++) ok = (b->stop[b->n_stop++] = strdup(a->stop[i])) != NULL;
    if (ok && a->sp.n_bias > 0) {
        b->bias_ids = malloc((size_t)a->sp.n_bias * sizeof(int32_t));
        b->bias = malloc((size_t)a->sp.n_bias * sizeof(float));
        ok = b->bias_ids && b->bias;
        if (ok) {
            memcpy(b->bias_ids, a->sp.bias_ids, (size_t)a->sp.n_bias * sizeof(int32_t));
            memcpy(b->bias, a->sp.bias, (size_t)a->sp.n_bias * sizeof(float));
        }
    }
    b->sp.bias_ids = b->bias_ids;
    b->sp.bias = b->bias;
    if (b->grammar) __atomic_add_fetch(&b->grammar->refs, 1, __ATOMIC_ACQ_REL);
    b->tools_json = NULL;
    b->tool_forced = NULL;
    if (ok && a->tools_json) ok = (b->tools_json = strdup(a->tools_json)) != NULL;
    if (ok && a->tool_forced) ok = (b->tool_forced = strdup(a->tool_forced)) != NULL;
    b->more_ids = NULL;
    b->more_n = NULL;
    const int extra = a->n_prompts > 1 ? a->n_prompts - 1 : 0;
    b->n_prompts = 1;
    if (ok && extra) {
        b->more_ids = calloc((size_t)extra, sizeof *b->more_ids);
        b->more_n = malloc((size_t)extra * sizeof *b->more_n);
        ok = b->more_ids && b->more_n;
        if (ok) b->n_prompts = 1 + extra;
        for (int i = 0; ok && i < extra; i++) {
            b->more_n[i] = a->more_n[i];
            if ((ok = (b->more_ids[i] = malloc((size_t)(a->more_n[i] > 0 ? a->more_n[i] : 1) * sizeof(int32_t))) != NULL))
                memcpy(b->more_ids[i], a->more_ids[i], (size_t)a->more_n[i] * sizeof(int32_t));
        }
    }
    if (!ok) {
        srv_request_free(b); /* (a failed strdup left a NULL: free(NULL) is nothing) */
        return -1;
    }
    return 0;
}

/* ---- typed field access ----------------------------------------------------------------------- */

static const cJSON *field(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static int get_number(const cJSON *o, const char *name, double lo, double hi, double *out, srv_error *e) {
    const cJSON *v = field(o, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return srv_fail(e, 400, name, "'%s' must be a number", name);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return srv_fail(e, 400, name, "'%s' is %g; it must be in [%g, %g]", name, v->valuedouble, lo, hi);
    *out = v->valuedouble;
    return 1;
}

static int get_int(const cJSON *o, const char *name, int64_t lo, int64_t hi, int64_t *out, srv_error *e) {
    const cJSON *v = field(o, name);
    if (!v) return 0;
    const double d = cJSON_IsNumber(v) ? v->valuedouble + 0.0 : NAN; /* + 0.0: -0 is 0 */
    if (!(d == floor(d))) return srv_fail(e, 400, name, "'%s' must be an integer", name);
    if (!(d >= -9.2e18 && d <= 9.2e18)) {
        /* 2^63 - 1 arrives as 2^63 (cJSON keeps numbers as doubles; so do 2^63 - 512 .. 2^63 + 1024): the
         * documented top of an int64 range, not an error whose message names a number past it */
        if (d == 0x1p63 && hi == INT64_MAX) {
            *out = hi;
            return 1;
        }
        return srv_fail(e, 400, name, "'%s' is %.6g; it must be in [%lld, %lld]", name, d, (long long)lo,
                        (long long)hi); /* (%.6g: 1e300 is not written out in 301 digits) */
    }
    if (d < (double)lo || d > (double)hi)
        return srv_fail(e, 400, name, "'%s' is %.0f; it must be in [%lld, %lld]", name, d, (long long)lo,
                        (long long)hi);
    *out = (int64_t)d;
    return 1;
}

static int get_bool(const cJSON *o, const char *name, int *out, srv_error *e) {
    const cJSON *v = field(o, name);
    if (!v) return 0;
    if (!cJSON_IsBool(v)) return srv_fail(e, 400, name, "'%s' must be true or false", name);
    *out = cJSON_IsTrue(v);
    return 1;
}

/* A field fp4moe does not implement: accepted only with its neutral value. */
static int refuse_unless_neutral(const cJSON *o, srv_error *e) {
    const cJSON *v;
    const cJSON *n = field(o, "n");
    if ((v = field(o, "best_of")) && !(cJSON_IsNumber(v) && (v->valuedouble == 1.0 ||
                                                             (cJSON_IsNumber(n) && v->valuedouble == n->valuedouble))))
        return srv_fail(e, 400, "best_of", "'best_of' must equal 'n' (fp4moe does not rank extra samples)");
    if ((v = field(o, "suffix")))
        return srv_fail(e, 400, "suffix", "'suffix' is not supported by fp4moe");
    if ((v = field(o, "tool_choice")) && !(cJSON_IsString(v) && (!strcmp(v->valuestring, "auto") ||
                                                                !strcmp(v->valuestring, "none") ||
                                                                !strcmp(v->valuestring, "required"))) && !cJSON_IsObject(v))
        return srv_fail(e, 400, "tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": "
                        "\"function\", \"function\": {\"name\": ...}}");
    if ((v = field(o, "function_call")) && !(cJSON_IsString(v) && (!strcmp(v->valuestring, "auto") ||
                                                                  !strcmp(v->valuestring, "none"))) &&
        !(cJSON_IsObject(v) && cJSON_IsString(cJSON_GetObjectItemCaseSensitive(v, "name"))))
        return srv_fail(e, 400, "function_call", "'function_call' must be \"auto\", \"none\" or {\"name\": ...} (the "
                        "deprecated form of tool_choice)");
    if ((v = field(o, "functions")) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
        return srv_fail(e, 400, "functions", "'functions' (the deprecated form) is not supported by fp4moe: give "
                        "'tools'");
    /* vLLM's extra sampling / structured-output fields (clients send them to any OpenAI-compatible server) */
    if ((v = field(o, "min_tokens")) && !(cJSON_IsNumber(v) && v->valuedouble == 0.0))
        return srv_fail(e, 400, "min_tokens", "'min_tokens' is not supported by fp4moe (only 0)");
    if ((v = field(o, "use_beam_search")) && !cJSON_IsFalse(v))
        return srv_fail(e, 400, "use_beam_search", "'use_beam_search' is not supported by fp4moe");
    static const char *const empty_list[] = {"bad_words", "allowed_token_ids"};
    for (int i = 0; i < 2; i++)
        if ((v = field(o, empty_list[i])) && !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
            return srv_fail(e, 400, empty_list[i], "'%s' is not supported by fp4moe", empty_list[i]);
    if ((v = field(o, "include_stop_str_in_output")) && !cJSON_IsFalse(v))
        return srv_fail(e, 400, "include_stop_str_in_output", "'include_stop_str_in_output' is not supported by fp4moe "
                        "(only false)");
    /* vLLM's backend name is a hint fp4moe has one answer to; its options (after ':') change the output: refused */
    if ((v = field(o, "guided_decoding_backend")) && !(cJSON_IsString(v) && !strchr(v->valuestring, ':')))
        return srv_fail(e, 400, "guided_decoding_backend", "'guided_decoding_backend' options are not supported by "
                        "fp4moe (a backend name alone is accepted and ignored)");
    static const char *const never[] = {"prompt_logprobs", "guided_regex", "guided_grammar", "guided_whitespace_pattern"};
    for (int i = 0; i < 4; i++)
        if ((v = field(o, never[i])))
            return srv_fail(e, 400, never[i], "'%s' is not supported by fp4moe", never[i]);
    return 0;
}

/* A schema given as an object, or as JSON text (vLLM's guided_json / structured_outputs.json take both) ->
 * r->grammar; `where` names the field. */
static int set_grammar(srv_request *r, const cJSON *schema, int any_object, const char *where, const char *param,
                       srv_error *e) {
    cJSON *parsed = NULL;
    if (!any_object && cJSON_IsString(schema)) {
        if (!(parsed = cJSON_ParseWithOpts(schema->valuestring, NULL, 1)))
            return srv_fail(e, 400, param, "'%s' is a string but not JSON text of a schema (or has more after it)", where);
        schema = parsed;
    }
    if (!any_object && !cJSON_IsObject(schema) && !cJSON_IsBool(schema)) {
        cJSON_Delete(parsed);
        return srv_fail(e, 400, param, "'%s' must be a JSON Schema (an object)", where);
    }
    srv_grammar *sg = calloc(1, sizeof *sg);
    if (!sg) {
        cJSON_Delete(parsed);
        return srv_fail(e, 500, NULL, "out of memory");
    }
    const int st = fp4moe_grammar_from_json_schema(any_object ? NULL : schema, where, &sg->g);
    cJSON_Delete(parsed);
    if (st) {
        free(sg);
        return srv_fail(e, st == FP4MOE_ENOMEM ? 500 : 400, param, "%s", fp4moe_last_error());
    }
    sg->refs = 1;
    sg->json = 1;
    r->grammar = sg;
    return 0;
}

static int set_choices(srv_request *r, const cJSON *list, const char *where, const char *param, srv_error *e) {
    const int n = cJSON_GetArraySize(list);
    if (!cJSON_IsArray(list) || n < 1 || n > 65536)
        return srv_fail(e, 400, param, "'%s' must be a list of 1..65536 strings", where);
    const char **ch = malloc((size_t)n * sizeof *ch);
    if (!ch) return srv_fail(e, 500, NULL, "out of memory");
    int i = 0;
    for (const cJSON *c = list->child; c; c = c->next, i++) {
        if (!cJSON_IsString(c) || !c->valuestring[0]) {
            free(ch);
            return srv_fail(e, 400, param, "'%s' must list non-empty strings (item %d is not one)", where, i);
        }
        ch[i] = c->valuestring;
    }
    srv_grammar *sg = calloc(1, sizeof *sg);
    const int st = sg ? fp4moe_grammar_from_choices(ch, NULL, n, &sg->g) : FP4MOE_ENOMEM;
    free(ch);
    if (st) {
        free(sg);
        return srv_fail(e, st == FP4MOE_ENOMEM ? 500 : 400, param, "'%s': %s", where, fp4moe_last_error());
    }
    sg->refs = 1;
    r->grammar = sg;
    return 0;
}

/* Structured output: OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema":
 * {"name", "schema", "strict", "description"}}) and vLLM's guided_json (a schema or its JSON text), guided_choice
 * (strings) and structured_outputs ({"json" | "choice" | "json_object"}); at most one of them. */
static int parse_structured(const cJSON *o, srv_request *r, srv_error *e) {
    const cJSON *rf = field(o, "response_format"), *gj = field(o, "guided_json"), *gc = field(o, "guided_choice"),
                *so = field(o, "structured_outputs");
    if (rf) {
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(rf, "type");
        if (!cJSON_IsObject(rf) || !cJSON_IsString(t))
            return srv_fail(e, 400, "response_format", "'response_format' must be an object with a 'type'");
        if (!strcmp(t->valuestring, "text")) rf = NULL;
        else if (strcmp(t->valuestring, "json_object") && strcmp(t->valuestring, "json_schema"))
            return srv_fail(e, 400, "response_format", "'response_format.type' must be \"text\", \"json_object\" or "
                            "\"json_schema\" (fp4moe does not support \"%.64s\")", t->valuestring);
    }
    if (!!rf + !!gj + !!gc + !!so > 1)
        return srv_fail(e, 400, rf ? "response_format" : "guided_json", "give one of 'response_format' (json_object / "
                        "json_schema), 'guided_json', 'guided_choice' and 'structured_outputs'");
    if (rf) {
        const char *t = cJSON_GetObjectItemCaseSensitive(rf, "type")->valuestring;
        if (!strcmp(t, "json_object")) return set_grammar(r, NULL, 1, "response_format", "response_format", e);
        const cJSON *js = cJSON_GetObjectItemCaseSensitive(rf, "json_schema");
        if (!cJSON_IsObject(js))
            return srv_fail(e, 400, "response_format", "'response_format.json_schema' must be an object with a 'schema'");
        const cJSON *sc = cJSON_GetObjectItemCaseSensitive(js, "schema");
        if (!sc) return srv_fail(e, 400, "response_format", "'response_format.json_schema.schema' is required");
        return set_grammar(r, sc, 0, "response_format.json_schema.schema", "response_format", e);
    }
    if (gj) return set_grammar(r, gj, 0, "guided_json", "guided_json", e);
    if (gc) return set_choices(r, gc, "guided_choice", "guided_choice", e);
    if (so) {
        if (!cJSON_IsObject(so)) return srv_fail(e, 400, "structured_outputs", "'structured_outputs' must be an object");
        const cJSON *pick = NULL;
        for (const cJSON *k = so->child; k; k = k->next) {
            const int known = !strcmp(k->string, "json") || !strcmp(k->string, "choice") ||
                              !strcmp(k->string, "json_object");
            if (!known && !cJSON_IsNull(k) && !cJSON_IsFalse(k))
                return srv_fail(e, 400, "structured_outputs", "'structured_outputs.%.64s' is not supported by fp4moe "
                                "(json, choice and json_object are)", k->string);
            if (!known || cJSON_IsNull(k) || cJSON_IsFalse(k)) continue;
            if (pick) return srv_fail(e, 400, "structured_outputs", "'structured_outputs' must give one of json, "
                                      "choice and json_object");
            pick = k;
        }
        if (!pick) return srv_fail(e, 400, "structured_outputs", "'structured_outputs' gives none of json, choice "
                                   "and json_object");
        if (!strcmp(pick->string, "json")) return set_grammar(r, pick, 0, "structured_outputs.json", "structured_outputs", e);
        if (!strcmp(pick->string, "choice"))
            return set_choices(r, pick, "structured_outputs.choice", "structured_outputs", e);
        if (!cJSON_IsTrue(pick)) return srv_fail(e, 400, "structured_outputs", "'structured_outputs.json_object' must be "
                                                 "true");
        return set_grammar(r, NULL, 1, "structured_outputs.json_object", "structured_outputs", e);
    }
    return 0;
}

/* logprobs / top_logprobs: chat takes {"logprobs": bool, "top_logprobs": 0..20} (top_logprobs > 0 needs logprobs
 * true, as vLLM), a completion {"logprobs": 0..20} (the alternatives of each token; null: none) */
static int parse_logprobs(const cJSON *o, srv_request *r, srv_error *e) {
    int64_t k = 0;
    int st;
    if (r->kind == SRV_CHAT) {
        if (get_bool(o, "logprobs", &r->logprobs, e) < 0) return -1;
        if ((st = get_int(o, "top_logprobs", 0, SRV_MAX_TOP_LOGPROBS, &k, e)) < 0) return -1;
        if (st && k > 0 && !r->logprobs)
            return srv_fail(e, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true");
    } else {
        const cJSON *v = field(o, "logprobs");
        if (v && cJSON_IsBool(v)) return srv_fail(e, 400, "logprobs", "'logprobs' of a completion is the number of "
                                                  "alternatives to return (0 to %d), not true / false",
                                                  SRV_MAX_TOP_LOGPROBS);
        if ((st = get_int(o, "logprobs", 0, SRV_MAX_TOP_LOGPROBS, &k, e)) < 0) return -1;
        r->logprobs = st;
        if (field(o, "top_logprobs"))
            return srv_fail(e, 400, "top_logprobs", "'top_logprobs' is a chat field: a completion gives the number as "
                            "'logprobs'");
    }
    r->top_logprobs = (int)k;
    return get_bool(o, "return_tokens_as_token_ids", &r->tokens_as_ids, e) < 0 ? -1 : 0;
}

/* presence_penalty, frequency_penalty (OpenAI, over the output's tokens), repetition_penalty (vLLM: over the
 * prompt's and the output's tokens; the window is set by check_length), logit_bias {"token id": -100..100} */
static int parse_penalties(const srv_parse_ctx *c, const cJSON *o, srv_request *r, srv_error *e) {
    double d;
    int st;
    if ((st = get_number(o, "presence_penalty", -2.0, 2.0, &d, e)) < 0) return -1;
    if (st) r->sp.presence_penalty = (float)d;
    if ((st = get_number(o, "frequency_penalty", -2.0, 2.0, &d, e)) < 0) return -1;
    if (st) r->sp.frequency_penalty = (float)d;
    /* (from 1e-6: a smaller one divides a logit past the float range) */
    if ((st = get_number(o, "repetition_penalty", 1e-6, 100.0, &d, e)) < 0) return -1;
    if (st) r->sp.repeat_penalty = (float)d;
    const cJSON *v;
    if (!(v = field(o, "logit_bias"))) return 0;
    if (!cJSON_IsObject(v))
        return srv_fail(e, 400, "logit_bias", "'logit_bias' must be an object mapping token ids to numbers");
    const int n = cJSON_GetArraySize(v);
    if (n > SRV_MAX_LOGIT_BIAS)
        return srv_fail(e, 400, "logit_bias", "'logit_bias' holds %d entries; at most %d", n, SRV_MAX_LOGIT_BIAS);
    if (n == 0) return 0;
    r->bias_ids = malloc((size_t)n * sizeof(int32_t));
    r->bias = malloc((size_t)n * sizeof(float));
    if (!r->bias_ids || !r->bias) return srv_fail(e, 500, NULL, "out of memory");
    int k = 0;
    const cJSON *it;
    int32_t *slot = malloc((size_t)c->vocab * sizeof(int32_t)); /* id -> its entry: one id under two spellings ("7",
                                                                    "007"): the last one counts, as vLLM's int(key) */
    if (!slot) return srv_fail(e, 500, NULL, "out of memory");
    for (int64_t i = 0; i < c->vocab; i++) slot[i] = -1;
    cJSON_ArrayForEach(it, v) {
        const char *key = it->string ? it->string : "";
        size_t nd = 0;
        while (key[nd] >= '0' && key[nd] <= '9') nd++;
        const long long id = nd && !key[nd] && nd <= 10 ? strtoll(key, NULL, 10) : -1;
        if (id < 0 || id >= c->vocab) {
            free(slot);
            return srv_fail(e, 400, "logit_bias", "'logit_bias' key '%.40s' is not a token id in [0, %lld)", key,
                            (long long)c->vocab);
        }
        if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble) || it->valuedouble < -100.0 || it->valuedouble > 100.0) {
            free(slot);
            return srv_fail(e, 400, "logit_bias", "'logit_bias' of token %lld must be a number in [-100, 100]", id);
        }
        if (slot[id] < 0) {
            slot[id] = k;
            r->bias_ids[k++] = (int32_t)id;
        }
        r->bias[slot[id]] = (float)it->valuedouble;
    }
    free(slot);
    r->sp.bias_ids = r->bias_ids;
    r->sp.bias = r->bias;
    r->sp.n_bias = k;
    return 0;
}

static int parse_stop(const srv_parse_ctx *c, const cJSON *o, srv_request *r, srv_error *e) {
    const cJSON *v = field(o, "stop");
    if (v) {
        const cJSON *one = cJSON_IsString(v) ? v : NULL, *it;
        if (!one && !cJSON_IsArray(v)) return srv_fail(e, 400, "stop", "'stop' must be a string or a list of strings");
        if (!one && cJSON_GetArraySize(v) > SRV_MAX_STOP)
            return srv_fail(e, 400, "stop", "'stop' holds %d strings; at most %d", cJSON_GetArraySize(v), SRV_MAX_STOP);
        for (it = one ? one : v->child; it; it = one ? NULL : it->next) {
            if (!cJSON_IsString(it)) return srv_fail(e, 400, "stop", "'stop' must be a string or a list of strings");
            const size_t l = strlen(it->valuestring);
            if (l == 0 || l > SRV_MAX_STOP_LEN)
                return srv_fail(e, 400, "stop", "each stop string must have 1 to %d bytes", SRV_MAX_STOP_LEN);
            if (!(r->stop[r->n_stop++] = strdup(it->valuestring))) return srv_fail(e, 500, NULL, "out of memory");
        }
    }
    if ((v = field(o, "stop_token_ids"))) {
        if (!cJSON_IsArray(v)) return srv_fail(e, 400, "stop_token_ids", "'stop_token_ids' must be a list of token ids");
        const cJSON *it;
        cJSON_ArrayForEach(it, v) {
            if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < 0 ||
                it->valuedouble > 2147483647.0)
                return srv_fail(e, 400, "stop_token_ids", "'stop_token_ids' must be a list of token ids");
            if (it->valuedouble >= (double)c->vocab) /* before the request is queued: a stream's status is still 400 */
                return srv_fail(e, 400, "stop_token_ids", "'stop_token_ids' entry %.0f is not a token id in [0, %lld)",
                                it->valuedouble, (long long)c->vocab);
            if (r->sp.n_stop >= FP4MOE_MAX_STOP_IDS)
                return srv_fail(e, 400, "stop_token_ids", "at most %d stop token ids (the model's EOS ids included)",
                                FP4MOE_MAX_STOP_IDS);
            r->sp.stop_ids[r->sp.n_stop++] = (int32_t)it->valuedouble;
        }
    }
    return 0;
}

/* ---- sampling and limits (common to both endpoints) ------------------------------------------ */

static int parse_common(const srv_parse_ctx *c, const cJSON *o, srv_request *r, int *has_max, srv_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (v && !cJSON_IsNull(v)) {
        if (!cJSON_IsString(v)) return srv_fail(e, 400, "model", "'model' must be a string");
        if (strcmp(v->valuestring, c->model_name)) {
            srv_fail(e, 404, "model", "The model '%.200s' does not exist (this server serves '%.200s')",
                     v->valuestring, c->model_name);
            e->code = "model_not_found";
            return -1;
        }
    }
    if (refuse_unless_neutral(o, e)) return -1;
    if (parse_structured(o, r, e)) return -1;
    r->sp = c->defaults;
    double d;
    int64_t i;
    int b = 0, st;
    if ((st = get_number(o, "temperature", 0.0, 100.0, &d, e)) < 0) return -1;
    if (st) r->sp.temperature = (float)d;
    const cJSON *tp = field(o, "top_p"); /* (0, 1]: the same message for 0 and for 2 */
    if (tp && cJSON_IsNumber(tp) && !(tp->valuedouble > 0.0 && tp->valuedouble <= 1.0))
        return srv_fail(e, 400, "top_p", "'top_p' is %g; it must be in (0, 1]", tp->valuedouble);
    if ((st = get_number(o, "top_p", 0.0, 1.0, &d, e)) < 0) return -1;
    if (st) {
        r->sp.top_p = (float)d;
    }
    if ((st = get_int(o, "top_k", -1, 1 << 30, &i, e)) < 0) return -1;
    if (st) r->sp.top_k = i <= 0 ? 0 : i;
    if ((st = get_number(o, "min_p", 0.0, 1.0, &d, e)) < 0) return -1;
    if (st) r->sp.min_p = (float)d;
    if ((st = get_int(o, "seed", INT64_MIN + 1, INT64_MAX, &i, e)) < 0) return -1;
    if (st) {
        r->sp.seed = (uint64_t)i;
        if (!r->sp.seed) r->sp.seed = 0x9E3779B97F4A7C15ull;   /* 0 means "default" to the sampler */
    }
    r->has_seed = st;
    if ((st = get_bool(o, "stream", &b, e)) < 0) return -1;
    if (st) r->stream = b;
    if ((v = field(o, "stream_options")) && !cJSON_IsNull(v)) {
        if (!cJSON_IsObject(v)) return srv_fail(e, 400, "stream_options", "'stream_options' must be an object");
        if (!r->stream) /* vLLM's and OpenAI's answer */
            return srv_fail(e, 400, "stream_options", "Stream options can only be defined when `stream=True`.");
        if (get_bool(v, "include_usage", &r->include_usage, e) < 0 ||
            get_bool(v, "continuous_usage_stats", &r->continuous_usage, e) < 0)
            return -1;
        r->continuous_usage = r->continuous_usage && r->include_usage; /* (vLLM: continuous only with include_usage) */
    }
    if ((st = get_bool(o, "ignore_eos", &b, e)) < 0) return -1;
    if (st) r->ignore_eos = b;
    if (r->ignore_eos) r->sp.n_stop = 0;
    if (parse_stop(c, o, r, e) || parse_logprobs(o, r, e) || parse_penalties(c, o, r, e)) return -1;
    if ((st = get_int(o, "n", 1, SRV_MAX_N, &i, e)) < 0) return -1;
    r->n = st ? (int)i : 1;
    if ((st = get_bool(o, "echo", &b, e)) < 0) return -1;
    if (st && b && r->kind == SRV_CHAT)
        return srv_fail(e, 400, "echo", "'echo' is supported on /v1/completions only");
    r->echo = st && b;
    /* vLLM's truncate_prompt_tokens: k >= 1 keeps the last k tokens of each prompt (left truncation), -1 the last
     * context-length ones */
    if ((st = get_int(o, "truncate_prompt_tokens", -1, INT64_MAX, &i, e)) < 0) return -1;
    if (st && i == 0)
        return srv_fail(e, 400, "truncate_prompt_tokens", "'truncate_prompt_tokens' must be -1 or at least 1");
    if (st && i > c->context) /* (vLLM: "greater than max_model_len") */
        return srv_fail(e, 400, "truncate_prompt_tokens", "'truncate_prompt_tokens' %lld is more than the context, "
                        "%lld tokens", (long long)i, (long long)c->context);
    r->truncate = st ? (i < 0 ? c->context : i) : 0;
    const char *mt = field(o, "max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
    if ((st = get_int(o, mt, r->echo ? 0 : 1, INT64_MAX, &r->max_tokens, e)) < 0) return -1;
    *has_max = st ? (strcmp(mt, "max_tokens") ? 2 : 1) : 0; /* 2: given as max_completion_tokens */
    r->has_max = *has_max;
    return 0;
}

/* the last k of n ids moved to the front (left truncation); returns k when n > k, else n */
static int64_t keep_last(int32_t *ids, int64_t n, int64_t k) {
    if (k <= 0 || n <= k) return n;
    memmove(ids, ids + (n - k), (size_t)k * sizeof *ids);
    return k;
}

static int check_length(const srv_parse_ctx *c, srv_request *r, int has_max, srv_error *e) {
    const char *param = r->kind == SRV_CHAT ? "messages" : "prompt";
    int64_t longest = 0;
    if (r->truncate) { /* every prompt of a list; a chat's history (a prefix of the prompt) no longer is one */
        const int64_t n0 = r->n_ids;
        r->n_ids = keep_last(r->ids, r->n_ids, r->truncate);
        if (r->n_ids != n0) r->history = 0;
        for (int p = 1; p < r->n_prompts; p++) r->more_n[p - 1] = keep_last(r->more_ids[p - 1], r->more_n[p - 1], r->truncate);
    }
    for (int p = 0; p < (r->n_prompts > 1 ? r->n_prompts : 1); p++) { /* every prompt of a list */
        const int64_t n = p ? r->more_n[p - 1] : r->n_ids;
        char which[32] = "";
        if (r->n_prompts > 1) snprintf(which, sizeof which, " (prompt %d)", p);
        if (n == 0) return srv_fail(e, 400, param, "the prompt encodes to no tokens%s", which);
        if (n >= c->context)
            return srv_fail(e, 400, param, "This model's maximum context length is %lld tokens. However, your prompt%s "
                            "has %lld tokens (at least one must remain for the output).", (long long)c->context, which,
                            (long long)n);
        if (n > longest) longest = n;
    }
    if (!has_max) {
        r->max_tokens = srv_default_max_tokens(r, c->context); /* (each prompt of a list: its own, srv_request_pick) */
    } else if (r->max_tokens > c->context - longest) {
        return srv_fail(e, 400, has_max == 2 ? "max_completion_tokens" : "max_tokens",
                        "This model's maximum context length is %lld tokens. However, you requested %lld tokens "
                        "(%lld in the prompt, %lld for the completion).", (long long)c->context,
                        (long long)(r->max_tokens > INT64_MAX - longest ? INT64_MAX : longest + r->max_tokens),
                        (long long)longest, (long long)r->max_tokens);
    }
    r->sp.repeat_last_n = r->n_ids + r->max_tokens; /* vLLM's repetition_penalty: every prompt and output token */
    return 0;
}

/* max_tokens when a request gives none (or null): chat, the rest of the context (vLLM); completions, 16 (the
 * OpenAI legacy Completions API's and vLLM's default), within the context */
int64_t srv_default_max_tokens(const srv_request *r, int64_t context) {
    const int64_t left = context - r->n_ids;
    return r->kind == SRV_CHAT || left < 16 ? left : 16;
}

/* ---- /v1/completions -------------------------------------------------------------------------- */

/* which: "" or " of prompt P" (a list of prompts) */
static int ids_from_array(const srv_parse_ctx *c, const cJSON *a, int32_t **ids, int64_t *n_ids, const char *which,
                          srv_error *e) {
    const int n = cJSON_GetArraySize(a);
    *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!*ids) return srv_fail(e, 500, NULL, "out of memory");
    const cJSON *it;
    cJSON_ArrayForEach(it, a) {
        const double d = cJSON_IsNumber(it) ? it->valuedouble : -1.0;
        if (!(d == floor(d)) || d < 0 || d >= (double)c->vocab) {
            char *t = cJSON_PrintUnformatted(it);
            srv_fail(e, 400, "prompt", "prompt token %.40s (at index %lld%s) is not a token id in [0, %lld)", t ? t : "?",
                     (long long)*n_ids, which, (long long)c->vocab);
            free(t);
            return -1;
        }
        (*ids)[(*n_ids)++] = (int32_t)d;
    }
    return 0;
}

static int encode(const srv_parse_ctx *c, const char *text, size_t len, int add_special, int32_t **ids, int64_t *n,
                  const char *param, srv_error *e) {
    if (fp4moe_tokenizer_encode(c->tok, text, (int64_t)len, add_special, ids, n))
        return srv_fail(e, 400, param, "cannot tokenize the %s: %s", param, fp4moe_last_error());
    return 0;
}

/* One prompt: a string (encoded with the special tokens, as vLLM) or a list of token ids. */
static int one_prompt(const srv_parse_ctx *c, const cJSON *p, const char *which, int32_t **ids, int64_t *n,
                      srv_error *e) {
    if (cJSON_IsString(p)) return encode(c, p->valuestring, strlen(p->valuestring), 1, ids, n, "prompt", e);
    if (cJSON_IsArray(p) && (cJSON_GetArraySize(p) == 0 || cJSON_IsNumber(p->child)))
        return ids_from_array(c, p, ids, n, which, e);
    return srv_fail(e, 400, "prompt", "'prompt'%s must be a string or a list of token ids", which);
}

static int parse_completion(const srv_parse_ctx *c, const cJSON *o, srv_request *r, srv_error *e) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    if (!p || cJSON_IsNull(p)) return srv_fail(e, 400, "prompt", "'prompt' is required");
    const int list = cJSON_IsArray(p) && cJSON_GetArraySize(p) > 0 && (cJSON_IsString(p->child) || cJSON_IsArray(p->child));
    if (!list) return one_prompt(c, p, "", &r->ids, &r->n_ids, e);
    /* a list of prompts (strings or lists of ids, as OpenAI's and vLLM's): choice p x n + k is choice k of prompt p */
    const int np = cJSON_GetArraySize(p);
    if (np > SRV_MAX_N)
        return srv_fail(e, 400, "prompt", "'prompt' holds %d prompts; at most %d in one request", np, SRV_MAX_N);
    if (np > 1) {
        r->more_ids = calloc((size_t)(np - 1), sizeof *r->more_ids);
        r->more_n = calloc((size_t)(np - 1), sizeof *r->more_n);
        if (!r->more_ids || !r->more_n) return srv_fail(e, 500, NULL, "out of memory");
        r->n_prompts = np;
    }
    int k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, p) {
        char which[32] = "";
        if (np > 1) snprintf(which, sizeof which, " of prompt %d", k);
        if (one_prompt(c, it, which, k ? &r->more_ids[k - 1] : &r->ids, k ? &r->more_n[k - 1] : &r->n_ids, e))
            return -1;
        k++;
    }
    return 0;
}

/* ---- /v1/chat/completions --------------------------------------------------------------------- */

/* A message as the template sees it: "content": null as "" (vLLM's parse_chat_messages: an assistant message of
 * only tool calls has content "", so `content is not none` holds and `content + ...` renders), other keys with
 * null values dropped, text parts joined, tool-call arguments given as JSON text parsed into objects (as vLLM
 * does before rendering). */
static cJSON *clean_message(const cJSON *m, int index, srv_error *e) {
    if (!cJSON_IsObject(m)) {
        srv_fail(e, 400, "messages", "messages[%d] must be an object", index);
        return NULL;
    }
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
    if (!cJSON_IsString(role) || !role->valuestring[0]) {
        srv_fail(e, 400, "messages", "messages[%d].role must be a non-empty string", index);
        return NULL;
    }
    cJSON *out = cJSON_CreateObject();
    const cJSON *kv;
    cJSON_ArrayForEach(kv, m) {
        if (!kv->string) continue;
        if (cJSON_IsNull(kv)) {
            if (!strcmp(kv->string, "content")) cJSON_AddStringToObject(out, "content", "");
            continue;
        }
        if (!strcmp(kv->string, "content") && cJSON_IsArray(kv)) {
            srv_buf text = {0};
            const cJSON *part;
            cJSON_ArrayForEach(part, kv) {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
                const cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "text");
                const int bad = !cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(t);
                if (bad || srv_buf_add(&text, t->valuestring, strlen(t->valuestring))) {
                    srv_buf_free(&text);
                    cJSON_Delete(out);
                    if (bad) srv_fail(e, 400, "messages", "messages[%d].content: only parts of type \"text\" are "
                                      "supported", index);
                    else srv_fail(e, 500, NULL, "out of memory");
                    return NULL;
                }
            }
            cJSON_AddStringToObject(out, "content", text.p ? text.p : "");
            srv_buf_free(&text);
            continue;
        }
        if (!strcmp(kv->string, "content") && !cJSON_IsString(kv)) {
            cJSON_Delete(out);
            srv_fail(e, 400, "messages", "messages[%d].content must be a string, a list of text parts or null", index);
            return NULL;
        }
        cJSON *copy = cJSON_Duplicate(kv, 1);
        if (!strcmp(kv->string, "tool_calls") && !cJSON_IsNull(copy)) { /* OpenAI's shape, arguments as an object */
            int k = 0;
            const char *bad = !cJSON_IsArray(copy) ? "must be a list" : NULL;
            cJSON *call;
            cJSON_ArrayForEach(call, copy) {
                cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
                cJSON *nm = cJSON_GetObjectItemCaseSensitive(fn, "name");
                cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
                if (bad) break;
                if (!cJSON_IsObject(call) || !cJSON_IsObject(fn) || !cJSON_IsString(nm) || !nm->valuestring[0])
                    bad = "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}";
                else if (cJSON_IsString(args)) {
                    cJSON *parsed = cJSON_Parse(args->valuestring);
                    if (cJSON_IsObject(parsed)) cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed);
                    else {
                        cJSON_Delete(parsed);
                        bad = ".function.arguments must be JSON text of an object";
                    }
                } else if (args && !cJSON_IsObject(args) && !cJSON_IsNull(args)) {
                    bad = ".function.arguments must be JSON text of an object";
                }
                if (!bad) k++;
            }
            if (bad) {
                cJSON_Delete(copy);
                cJSON_Delete(out);
                if (bad[0] == '.')
                    srv_fail(e, 400, "messages", "messages[%d].tool_calls[%d]%s", index, k, bad);
                else srv_fail(e, 400, "messages", "messages[%d].tool_calls%s%s %s", index, cJSON_IsArray(kv) ? "[" : "",
                              cJSON_IsArray(kv) ? "]" : "", bad);
                return NULL;
            }
        }
        cJSON_AddItemToObject(out, kv->string, copy);
    }
    return out;
}

static int render(const srv_parse_ctx *c, cJSON *ctx, int gen_prompt, char **text, size_t *len, srv_error *e) {
    cJSON_ReplaceItemInObjectCaseSensitive(ctx, "add_generation_prompt", cJSON_CreateBool(gen_prompt));
    const int st = fp4moe_template_render(c->tmpl, ctx, NULL, text, len);
    if (st) return srv_fail(e, 400, "messages", "the chat template failed: %s", fp4moe_last_error());
    return 0;
}

/* tools + tool_choice: "none" (the calls stay text), "auto" (default: the calls of the answer become tool_calls when
 * the server knows the model's format), or {"type": "function", "function": {"name": N}}: the output is N's arguments,
 * constrained to its parameters schema (vLLM's named tool choice), returned as one call to N. */
static int parse_tool_choice2(const srv_parse_ctx *c, const cJSON *tc, const cJSON *tools, int n, srv_request *r,
                              srv_error *e);

/* a tool's parameters for a grammar: {} (any JSON) stands for an object, as the arguments always are */
static const cJSON *tool_params(const cJSON *params, cJSON **made) {
    *made = NULL;
    int empty = cJSON_IsObject(params);
    for (const cJSON *k = params ? params->child : NULL; empty && k; k = k->next)
        empty = !strcmp(k->string, "title") || !strcmp(k->string, "description") || !strcmp(k->string, "$schema");
    if (!params || empty) return *made = cJSON_Parse("{\"type\": \"object\"}");
    return params;
}

static int parse_tool_choice(const srv_parse_ctx *c, const cJSON *o, const cJSON *tools, srv_request *r,
                             srv_error *e) {
    const cJSON *tc = field(o, "tool_choice");
    const int n = tools ? cJSON_GetArraySize(tools) : 0;
    int ti = 0;
    for (const cJSON *t = n ? tools->child : NULL; t; t = t->next, ti++) { /* OpenAI's shape of a tool */
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(t, "type"), *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(f, "name"), *pa = cJSON_GetObjectItemCaseSensitive(f, "parameters");
        if (!cJSON_IsObject(t) || !cJSON_IsString(ty) || strcmp(ty->valuestring, "function"))
            return srv_fail(e, 400, "tools", "'tools[%d].type' must be \"function\"", ti);
        if (!cJSON_IsObject(f) || !cJSON_IsString(nm) || !nm->valuestring[0])
            return srv_fail(e, 400, "tools", "'tools[%d].function.name' must be a non-empty string", ti);
        if (pa && !cJSON_IsObject(pa) && !cJSON_IsNull(pa))
            return srv_fail(e, 400, "tools", "'tools[%d].function.parameters' must be a JSON Schema object", ti);
    }
    /* the legacy form: function_call "none" / "auto" / {"name": N} stands for tool_choice when that is absent */
    cJSON *legacy = NULL;
    const cJSON *fc = field(o, "function_call");
    if (!tc && fc) {
        if (cJSON_IsObject(fc)) {
            legacy = cJSON_CreateObject();
            cJSON_AddStringToObject(legacy, "type", "function");
            cJSON_AddItemToObject(cJSON_AddObjectToObject(legacy, "function"), "name",
                                  cJSON_Duplicate(cJSON_GetObjectItemCaseSensitive(fc, "name"), 1));
        } else {
            legacy = cJSON_Duplicate(fc, 1);
        }
        tc = legacy;
    }
    const cJSON *ptc = field(o, "parallel_tool_calls");
    if (ptc && !cJSON_IsBool(ptc)) {
        cJSON_Delete(legacy);
        return srv_fail(e, 400, "parallel_tool_calls", "'parallel_tool_calls' must be true or false");
    }
    r->tool_single = cJSON_IsFalse(ptc); /* (before the "required" grammar: one call at most) */
    const int st = parse_tool_choice2(c, tc, tools, n, r, e);
    cJSON_Delete(legacy);
    return st;
}

static int parse_tool_choice2(const srv_parse_ctx *c, const cJSON *tc, const cJSON *tools, int n, srv_request *r,
                              srv_error *e) {
    if (cJSON_IsObject(tc)) {
        const cJSON *ty = cJSON_GetObjectItemCaseSensitive(tc, "type");
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tc, "function"), "name");
        if (!cJSON_IsString(ty) || strcmp(ty->valuestring, "function") || !cJSON_IsString(nm))
            return srv_fail(e, 400, "tool_choice", "'tool_choice' must be {\"type\": \"function\", \"function\": "
                            "{\"name\": ...}}");
        const cJSON *params = NULL;
        int found = 0, idx = 0;
        for (const cJSON *t = n ? tools->child : NULL; t; t = t->next, idx++) {
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(f, "name");
            if (cJSON_IsString(fn) && !strcmp(fn->valuestring, nm->valuestring)) {
                found = idx + 1;
                params = cJSON_GetObjectItemCaseSensitive(f, "parameters");
                break;
            }
        }
        if (!found)
            return srv_fail(e, 400, "tool_choice", "'tool_choice' names the function '%.200s', which 'tools' does not "
                            "have", nm->valuestring);
        if (r->grammar)
            return srv_fail(e, 400, "tool_choice", "a named 'tool_choice' constrains the output itself: give no "
                            "response_format / guided_* / structured_outputs with it");
        if (!(r->tool_forced = strdup(nm->valuestring))) return srv_fail(e, 500, NULL, "out of memory");
        cJSON *obj;
        const cJSON *sch = tool_params(params, &obj);
        char where[64];
        snprintf(where, sizeof where, "tools[%d].function.parameters", found - 1);
        const int st = set_grammar(r, sch, 0, where, "tools", e);
        cJSON_Delete(obj);
        return st;
    }
    if (cJSON_IsString(tc) && !strcmp(tc->valuestring, "required")) { /* [{"name", "parameters"}, ...] */
        if (!n) return srv_fail(e, 400, "tool_choice", "'tool_choice' \"required\" needs 'tools'");
        if (r->grammar)
            return srv_fail(e, 400, "tool_choice", "'tool_choice' \"required\" constrains the output itself: give no "
                            "response_format / guided_* / structured_outputs with it");
        const char **names = calloc((size_t)n, sizeof *names);
        const cJSON **params = calloc((size_t)n, sizeof *params);
        srv_grammar *sg = calloc(1, sizeof *sg);
        if (!names || !params || !sg) {
            free(names);
            free(params);
            free(sg);
            return srv_fail(e, 500, NULL, "out of memory");
        }
        int i = 0, bad = -1;
        cJSON *mades = cJSON_CreateArray();
        for (const cJSON *t = tools->child; t; t = t->next, i++) {
            const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
            names[i] = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(f, "name"));
            cJSON *made;
            params[i] = tool_params(cJSON_GetObjectItemCaseSensitive(f, "parameters"), &made);
            if (made) { /* (kept until the grammar is made: a list of them, freed below) */
                cJSON_AddItemToArray(mades, made);
                params[i] = cJSON_GetArrayItem(mades, cJSON_GetArraySize(mades) - 1);
            }
            if (!names[i] && bad < 0) bad = i;
        }
        int st = bad >= 0 ? srv_fail(e, 400, "tools", "'tools[%d].function.name' must be a string", bad) : 0;
        if (!st) {
            const int gs = fp4moe_grammar_from_tools_limit(names, params, n, r->tool_single ? 1 : 0, &sg->g);
            if (gs) st = srv_fail(e, gs == FP4MOE_ENOMEM ? 500 : 400, "tools", "%s", fp4moe_last_error());
        }
        free(names);
        free(params);
        cJSON_Delete(mades);
        if (st) {
            free(sg);
            return st;
        }
        sg->refs = 1;
        sg->json = 1;
        r->grammar = sg;
        r->tool_required = 1;
        return 0;
    }
    if (n && c->tools != SRV_TOOLS_NONE && !(cJSON_IsString(tc) && !strcmp(tc->valuestring, "none"))) {
        r->tools_fmt = c->tools;
        if (!(r->tools_json = cJSON_PrintUnformatted(tools))) return srv_fail(e, 500, NULL, "out of memory");
    }
    return 0;
}

/* continue_final_message, as transformers 5's render_jinja_template (utils/chat_template_utils.py) does it: the final
 * message's content gets CONT_TAG appended before the render (tag_final_message), and the rendered chat is cut at the
 * tag's last occurrence (cut_at_tag) - where the template kept the space after it, exactly there, else with the
 * white space before it stripped (the template trimmed the message). An empty content works too (the cut falls
 * where its text would be). */
#define CONT_TAG "CONTINUE_FINAL_MESSAGE_TAG "

/* m's content (a string: clean_message joined text parts) + CONT_TAG; *orig: the content before (malloc'd) */
static int tag_final_message(cJSON *m, char **orig, srv_error *e) {
    *orig = NULL;
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (!cJSON_IsString(ct))
        return srv_fail(e, 400, "continue_final_message", "continue_final_message is set but the final message has no "
                        "\"content\" to continue");
    const size_t n = strlen(ct->valuestring);
    char *t = malloc(n + sizeof CONT_TAG);
    *orig = strdup(ct->valuestring);
    cJSON *ns = NULL;
    if (t && *orig) {
        memcpy(t, ct->valuestring, n);
        memcpy(t + n, CONT_TAG, sizeof CONT_TAG);
        ns = cJSON_CreateString(t);
    }
    free(t);
    if (!ns || !cJSON_ReplaceItemInObjectCaseSensitive(m, "content", ns)) {
        cJSON_Delete(ns);
        free(*orig);
        *orig = NULL;
        return srv_fail(e, 500, NULL, "out of memory");
    }
    return 0;
}

/* The rendered chat `text` (*len bytes) cut at the tag; orig: the final message's content without it. 0, or -1
 * (e: 400) when the template dropped the message or the tag. */
static int cut_at_tag(const char *orig, char *text, size_t *len, srv_error *e) {
    static const char tag[] = "CONTINUE_FINAL_MESSAGE_TAG"; /* CONT_TAG stripped */
    const size_t tn = sizeof tag - 1;
    const char *lead = orig; /* orig stripped: [lead, lead + sn) */
    while (*lead && isspace((unsigned char)*lead)) lead++;
    size_t sn = strlen(lead);
    while (sn > 0 && isspace((unsigned char)lead[sn - 1])) sn--;
    const char *at = NULL; /* the tag's last occurrence (memmem is linear; its hits do not overlap) */
    for (const char *p = text; (p = memmem(p, *len - (size_t)(p - text), tag, tn)); p += tn) at = p;
    if (!at || (sn && !memmem(text, *len, lead, sn)))
        return srv_fail(e, 400, "continue_final_message", "continue_final_message is set but the final message does "
                        "not appear in the chat after applying the chat template");
    size_t keep = (size_t)(at - text);
    if (!((size_t)(at - text) + sizeof CONT_TAG - 1 <= *len && !memcmp(at, CONT_TAG, sizeof CONT_TAG - 1)))
        while (keep > 0 && isspace((unsigned char)text[keep - 1])) keep--; /* Python's str.rstrip */
    *len = keep;
    text[keep] = 0;
    return 0;
}

static int parse_chat(const srv_parse_ctx *c, const cJSON *o, srv_request *r, srv_error *e) {
    if (!c->tmpl)
        return srv_fail(e, 400, "messages", "model '%s' has no chat template: start the server with --chat-template "
                        "FILE, or use /v1/completions", c->model_name);
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages");
    if (!cJSON_IsArray(msgs)) return srv_fail(e, 400, "messages", "'messages' is required and must be a list");
    if (cJSON_GetArraySize(msgs) == 0) return srv_fail(e, 400, "messages", "'messages' must not be empty");
    /* vLLM's prompt-shaping fields: add_generation_prompt (default true), continue_final_message (the last message
     * left open for the model to continue: transformers' apply_chat_template cuts the rendered chat after its
     * content); a template in the request is refused, as vLLM refuses one unless started with
     * --trust-request-chat-template */
    int gen = 1, cont = 0, st;
    if ((st = get_bool(o, "add_generation_prompt", &gen, e)) < 0 || get_bool(o, "continue_final_message", &cont, e) < 0)
        return -1;
    if (!st) gen = !cont;
    if (gen && cont)
        return srv_fail(e, 400, "continue_final_message", "Cannot set both `continue_final_message` and "
                        "`add_generation_prompt` to True.");
    const cJSON *tv = field(o, "chat_template");
    if (tv && !cJSON_IsNull(tv))
        return srv_fail(e, 400, "chat_template", "a chat template in the request is not accepted by fp4moe: start the "
                        "server with --chat-template FILE");
    cJSON *ctx = cJSON_CreateObject(), *list = cJSON_AddArrayToObject(ctx, "messages");
    int idx = 0, rc = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, msgs) {
        cJSON *cm = clean_message(m, idx++, e);
        if (!cm) {
            cJSON_Delete(ctx);
            return -1;
        }
        cJSON_AddItemToArray(list, cm);
    }
    const cJSON *tools = field(o, "tools");
    if (tools && !cJSON_IsArray(tools)) {
        cJSON_Delete(ctx);
        return srv_fail(e, 400, "tools", "'tools' must be a list");
    }
    cJSON_AddItemToObject(ctx, "tools", tools && cJSON_GetArraySize(tools) ? cJSON_Duplicate(tools, 1) : cJSON_CreateNull());
    if (parse_tool_choice(c, o, tools, r, e)) {
        cJSON_Delete(ctx);
        return -1;
    }
    cJSON_AddNullToObject(ctx, "documents");
    cJSON_AddTrueToObject(ctx, "add_generation_prompt");
    cJSON_AddStringToObject(ctx, "bos_token", c->bos_token ? c->bos_token : "");
    cJSON_AddStringToObject(ctx, "eos_token", c->eos_token ? c->eos_token : "");
    cJSON_AddStringToObject(ctx, "pad_token", c->pad_token ? c->pad_token : ""); /* as `fp4moe chat` (cli_template_special_tokens) */
    const cJSON *kw = field(o, "chat_template_kwargs");
    if (kw) {
        if (!cJSON_IsObject(kw)) {
            cJSON_Delete(ctx);
            return srv_fail(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
        }
        const cJSON *kv;
        cJSON_ArrayForEach(kv, kw) {
            if (!strcmp(kv->string, "messages") || !strcmp(kv->string, "add_generation_prompt")) continue;
            cJSON_DeleteItemFromObjectCaseSensitive(ctx, kv->string);
            cJSON_AddItemToObject(ctx, kv->string, cJSON_Duplicate(kv, 1));
        }
    }
    char *text = NULL, *hist = NULL;
    size_t len = 0, hlen = 0;
    cJSON *fin = cont ? cJSON_GetArrayItem(list, idx - 1) : NULL;
    char *orig = NULL;
    if ((fin && tag_final_message(fin, &orig, e)) || render(c, ctx, gen, &text, &len, e) ||
        (fin && cut_at_tag(orig, text, &len, e)) || encode(c, text, len, 0, &r->ids, &r->n_ids, "messages", e)) {
        rc = -1;
    } else {
        if (fin) { /* the history below without the tag */
            cJSON *os = cJSON_CreateString(orig);
            if (!os || !cJSON_ReplaceItemInObjectCaseSensitive(fin, "content", os)) cJSON_Delete(os);
        }
        /* does the output start inside <think>? (the last <think> of the prompt is not closed) */
        const char *open = NULL, *close = NULL;
        for (const char *p = text; (p = strstr(p, "<think>")); p++) open = p;
        for (const char *p = text; (p = strstr(p, "</think>")); p++) close = p;
        r->reasoning_start = open && (!close || close < open);
        /* the history (no generation prompt): a prefix-cache point when its tokens start the prompt */
        int32_t *hids = NULL;
        int64_t nh = 0;
        srv_error ignored;
        if (!render(c, ctx, 0, &hist, &hlen, &ignored) && !encode(c, hist, hlen, 0, &hids, &nh, "messages", &ignored) &&
            nh < r->n_ids && !memcmp(hids, r->ids, (size_t)nh * sizeof(int32_t)))
            r->history = nh;
        free(hids);
        r->chat_text = text; /* kept for /apply-template */
        r->chat_text_len = len;
        text = NULL;
    }
    free(orig);
    free(text);
    free(hist);
    cJSON_Delete(ctx);
    return rc;
}

/* The byte offset of a NUL character in a valid JSON text (a raw 0 byte, or the string escape \u0000), or
 * -1: cJSON keeps strings NUL-terminated, so everything after one would be lost without a word. In a valid
 * JSON text a backslash occurs only in a string, as an escape of the next character. */
size_t srv_json_span(const char *p, size_t n, size_t *deepest) {
    size_t depth = 0, most = 0, end = 0;
    for (size_t i = 0, in = 0; i < n && !end; i++) {
        const char ch = p[i];
        if (in) {
            if (ch == '\\') i++;
            else if (ch == '"') in = 0;
        } else if (ch == '"') {
            in = 1;
        } else if (ch == '[' || ch == '{') {
            if (++depth > most) most = depth;
        } else if ((ch == ']' || ch == '}') && depth && --depth == 0) {
            end = i + 1;
        }
    }
    if (deepest) *deepest = most;
    return end;
}

long long srv_json_nul_at(const char *body, size_t len) {
    for (size_t i = 0; i < len; i++) {
        if (body[i] == 0) return (long long)i;
        if (body[i] != '\\') continue;
        if (i + 5 < len && body[i + 1] == 'u' && !memcmp(body + i + 2, "0000", 4)) return (long long)i;
        i++; /* the escaped character */
    }
    return -1;
}

cJSON *srv_json_string(const char *s, size_t n) {
    if (!memchr(s, 0, n)) return cJSON_CreateString(s);
    cJSON *t = cJSON_CreateString("");   /* the NUL-free pieces escaped by cJSON, each NUL as \u0000 */
    srv_buf b = {0};
    int ok = t && !srv_buf_add(&b, "\"", 1);
    for (size_t i = 0; ok && i < n;) {
        const char *z = memchr(s + i, 0, n - i);
        const size_t k = z ? (size_t)(z - (s + i)) : n - i;
        char *piece = malloc(k + 1);
        if ((ok = piece != NULL)) {
            memcpy(piece, s + i, k);
            piece[k] = 0;
            cJSON_SetValuestring(t, piece);
            free(piece);
            char *lit = cJSON_PrintUnformatted(t); /* "..." */
            ok = lit && !srv_buf_add(&b, lit + 1, strlen(lit) - 2) && (!z || !srv_buf_add(&b, "\\u0000", 6));
            free(lit);
        }
        i += k + (z ? 1 : 0);
    }
    ok = ok && !srv_buf_add(&b, "\"", 1);
    cJSON_Delete(t);
    cJSON *r = ok ? cJSON_CreateRaw(b.p) : NULL;
    srv_buf_free(&b);
    return r;
}

/* Keys an object holds twice, at any depth: the last value wins, as in Python's json (vLLM, the OpenAI SDKs'
 * servers; cJSON alone would find the first). Sorted by (key, position): n log n, whatever a body holds. Depth is
 * bounded by the parser's nesting limit. 0, or -1 out of memory. */
typedef struct {
    const char *key;
    size_t pos;
    cJSON *item;
} key_at;
static int cmp_key_at(const void *a, const void *b) {
    const key_at *x = a, *y = b;
    const int c = strcmp(x->key, y->key);
    return c ? c : (x->pos > y->pos) - (x->pos < y->pos);
}

static int last_key_wins(cJSON *o) {
    if (cJSON_IsObject(o) && o->child && o->child->next) {
        size_t n = 0;
        for (const cJSON *a = o->child; a; a = a->next) n++;
        key_at *k = malloc(n * sizeof *k);
        if (!k) return -1;
        size_t m = 0;
        for (cJSON *a = o->child; a; a = a->next, m++) k[m] = (key_at){a->string ? a->string : "", m, a};
        qsort(k, m, sizeof *k, cmp_key_at);
        for (size_t i = 0; i + 1 < m; i++) /* an entry with the same key after it: dropped */
            if (!strcmp(k[i].key, k[i + 1].key)) cJSON_Delete(cJSON_DetachItemViaPointer(o, k[i].item));
        free(k);
    }
    for (cJSON *a = o ? o->child : NULL; a; a = a->next)
        if ((cJSON_IsObject(a) || cJSON_IsArray(a)) && last_key_wins(a)) return -1;
    return 0;
}

/* Why a body cJSON refused is not JSON it takes, for the message: nesting deeper than its limit, or a \u escape of
 * a lone UTF-16 surrogate at the error position (valid JSON text, but no Unicode text: Python keeps it as a lone
 * surrogate that no tokenizer encodes) */
static const char *json_refusal(const char *body, size_t len, size_t at) {
    size_t most = 0;
    srv_json_span(body, len, &most);
    if (most > CJSON_NESTING_LIMIT) return "it nests arrays / objects deeper than 1000 levels";
    if (at + 6 <= len && body[at] == '\\' && body[at + 1] == 'u') {
        unsigned v = 0;
        int ok = 1;
        for (int i = 2; i < 6 && ok; i++) {
            const char h = body[at + i];
            v = v * 16 + (unsigned)(h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                    : h >= 'A' && h <= 'F' ? h - 'A' + 10 : (ok = 0));
        }
        if (ok && v >= 0xD800 && v <= 0xDFFF) return "a \\u escape of a lone UTF-16 surrogate (no Unicode character)";
    }
    return NULL;
}

int srv_parse_request(const srv_parse_ctx *c, srv_kind kind, const char *body, size_t len, srv_request *r,
                      srv_error *e) {
    memset(r, 0, sizeof *r);
    memset(e, 0, sizeof *e);
    r->kind = kind;
    r->n_prompts = 1;
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!o) {
        const size_t at = end && end >= body ? (size_t)(end - body) : 0;
        const char *why = json_refusal(body, len, at);
        if (why) return srv_fail(e, 400, NULL, "the request body is not JSON fp4moe takes: %s (at byte %zu of %zu)", why, at, len);
        return srv_fail(e, 400, NULL, "the request body is not valid JSON (at byte %zu of %zu)", at, len);
    }
    while (end && (size_t)(end - body) < len && (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t')) end++;
    if (end && (size_t)(end - body) < len) {
        const size_t at = (size_t)(end - body);
        cJSON_Delete(o);
        return srv_fail(e, 400, NULL, "the request body has data after its JSON value (at byte %zu of %zu)", at, len);
    }
    int rc = 0, has_max = 0;
    const long long nul = srv_json_nul_at(body, len);
    if (nul >= 0)
        rc = srv_fail(e, 400, NULL, "the request body has a NUL character (U+0000) in a string (at byte %lld of %zu); "
                      "fp4moe does not accept it in any text", nul, len);
    else if (!cJSON_IsObject(o)) rc = srv_fail(e, 400, NULL, "the request body must be a JSON object");
    else if (last_key_wins(o)) rc = srv_fail(e, 500, NULL, "out of memory");
    else if (parse_common(c, o, r, &has_max, e)) rc = -1;
    else if (kind == SRV_CHAT ? parse_chat(c, o, r, e) : parse_completion(c, o, r, e)) rc = -1;
    else if (check_length(c, r, has_max, e)) rc = -1;
    r->reasoning = kind == SRV_CHAT && c->reasoning;
    cJSON_Delete(o);
    if (rc) srv_request_free(r);
    return rc;
}
