/* vLLM's tokenizer endpoints (srv.h): POST /tokenize, POST /detokenize, GET /tokenizer_info. What
 * lm-evaluation-harness's remote tokenizer calls (lm_eval.utils.RemoteTokenizer: /tokenizer_info for the
 * special tokens and the chat template, /tokenize with add_special_tokens false, /detokenize). Pure: no model,
 * no I/O. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

static cJSON *parse_object(const char *body, size_t len, srv_error *e) {
    cJSON *o = cJSON_ParseWithLength(body, len);
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        srv_fail(e, 400, NULL, "the request body must be a JSON object");
        return NULL;
    }
    return o;
}

static char *print_delete(cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* The body as a JSON object whose "model" (if any) is the served one; NULL after an error */
static cJSON *parse_body(const srv_parse_ctx *c, const char *body, size_t len, srv_error *e) {
    const long long nul = srv_json_nul_at(body, len);
    if (nul >= 0) {
        srv_fail(e, 400, NULL, "the request body has a NUL character (U+0000) in a string (at byte %lld of %zu); "
                 "fp4moe does not accept it in any text", nul, len);
        return NULL;
    }
    cJSON *o = parse_object(body, len, e);
    if (!o) return NULL;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(o, "model");
    if (model && !cJSON_IsNull(model) && !(cJSON_IsString(model) && !strcmp(model->valuestring, c->model_name))) {
        srv_fail(e, cJSON_IsString(model) ? 404 : 400, "model", "The model '%.200s' does not exist (this server serves "
                 "'%.200s')", cJSON_IsString(model) ? model->valuestring : "?", c->model_name);
        if (cJSON_IsString(model)) e->code = "model_not_found";
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

/* The messages of o (with its tools, chat_template_kwargs, add_generation_prompt, continue_final_message,
 * chat_template) as a chat request parses them: *r holds the ids and the rendered text (free with
 * srv_request_free) */
static int parse_messages(const srv_parse_ctx *c, const cJSON *o, const cJSON *msgs, srv_request *r, srv_error *e) {
    cJSON *req = cJSON_CreateObject();
    cJSON_AddItemToObject(req, "messages", cJSON_Duplicate(msgs, 1));
    const cJSON *kv;
    static const char *const pass[] = {"tools", "chat_template_kwargs", "add_generation_prompt",
                                       "continue_final_message", "chat_template"};
    for (int i = 0; i < 5; i++)
        if ((kv = cJSON_GetObjectItemCaseSensitive(o, pass[i]))) cJSON_AddItemToObject(req, pass[i], cJSON_Duplicate(kv, 1));
    cJSON_AddNumberToObject(req, "max_tokens", 1);
    char *s = cJSON_PrintUnformatted(req);
    cJSON_Delete(req);
    int rc = 0;
    if (!s) rc = srv_fail(e, 500, NULL, "out of memory");
    else if (srv_parse_request(c, SRV_CHAT, s, strlen(s), r, e)) rc = -1;
    free(s);
    return rc;
}

int srv_apply_template(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *e) {
    *out = NULL;
    cJSON *o = parse_body(c, body, len, e);
    if (!o) return -1;
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages");
    srv_request r;
    int rc = 0;
    if (!cJSON_IsArray(msgs)) rc = srv_fail(e, 400, "messages", "'messages' (a list) is required");
    else if (parse_messages(c, o, msgs, &r, e)) rc = -1;
    cJSON_Delete(o);
    if (rc) return -1;
    cJSON *res = cJSON_CreateObject();
    cJSON *p = srv_json_string(r.chat_text ? r.chat_text : "", r.chat_text ? r.chat_text_len : 0);
    srv_request_free(&r);
    if (!res || !p) {
        cJSON_Delete(res);
        cJSON_Delete(p);
        return srv_fail(e, 500, NULL, "out of memory");
    }
    cJSON_AddItemToObject(res, "prompt", p);
    if (!(*out = print_delete(res))) return srv_fail(e, 500, NULL, "out of memory");
    return 0;
}

int srv_tokenize(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *e) {
    *out = NULL;
    cJSON *o = parse_body(c, body, len, e);
    if (!o) return -1;
    const int strs = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "return_token_strs"));
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(o, "prompt");
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(o, "messages");
    const cJSON *add = cJSON_GetObjectItemCaseSensitive(o, "add_special_tokens");
    int32_t *ids = NULL;
    int64_t n = 0;
    int rc = 0;
    if (add && !cJSON_IsBool(add) && !cJSON_IsNull(add))
        rc = srv_fail(e, 400, "add_special_tokens", "'add_special_tokens' must be true or false");
    else if (cJSON_IsString(prompt) == cJSON_IsArray(msgs))
        rc = srv_fail(e, 400, "prompt", "give 'prompt' (a string) or 'messages' (a list), one of them");
    else if (cJSON_IsString(prompt)) {
        const int special = !cJSON_IsFalse(add); /* vLLM's default for a prompt: true */
        if (fp4moe_tokenizer_encode(c->tok, prompt->valuestring, (int64_t)strlen(prompt->valuestring), special, &ids, &n))
            rc = srv_fail(e, 400, "prompt", "cannot tokenize the prompt: %s", fp4moe_last_error());
    } else if (cJSON_IsTrue(add)) {
        rc = srv_fail(e, 400, "add_special_tokens", "'add_special_tokens' true with 'messages' is not supported (the "
                      "chat template writes the special tokens)");
    } else { /* the messages as a chat request renders them */
        srv_request r;
        if (parse_messages(c, o, msgs, &r, e)) rc = -1;
        else {
            ids = r.ids;
            n = r.n_ids;
            r.ids = NULL;
            srv_request_free(&r);
        }
    }
    cJSON_Delete(o);
    if (rc) {
        free(ids);
        return -1;
    }
    cJSON *res = cJSON_CreateObject(), *t = cJSON_AddArrayToObject(res, "tokens");
    cJSON_AddNumberToObject(res, "count", (double)n);
    cJSON_AddNumberToObject(res, "max_model_len", (double)c->context);
    for (int64_t i = 0; i < n; i++) cJSON_AddItemToArray(t, cJSON_CreateNumber(ids[i]));
    if (strs) { /* the vocab strings, as HF convert_ids_to_tokens */
        cJSON *ts = cJSON_AddArrayToObject(res, "token_strs");
        for (int64_t i = 0; i < n; i++) {
            const char *tk = fp4moe_tokenizer_id_to_token(c->tok, ids[i]);
            cJSON_AddItemToArray(ts, cJSON_CreateString(tk ? tk : ""));
        }
    } else {
        cJSON_AddNullToObject(res, "token_strs");
    }
    free(ids);
    if (!(*out = print_delete(res))) return srv_fail(e, 500, NULL, "out of memory");
    return 0;
}

int srv_detokenize(const srv_parse_ctx *c, const char *body, size_t len, char **out, srv_error *e) {
    *out = NULL;
    cJSON *o = parse_object(body, len, e);
    if (!o) return -1;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "tokens"), *it;
    if (!cJSON_IsArray(t)) {
        cJSON_Delete(o);
        return srv_fail(e, 400, "tokens", "'tokens' (a list of token ids) is required");
    }
    const int n = cJSON_GetArraySize(t);
    int32_t *ids = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (!ids) {
        cJSON_Delete(o);
        return srv_fail(e, 500, NULL, "out of memory");
    }
    const int64_t V = fp4moe_tokenizer_vocab_size(c->tok);
    int k = 0, rc = 0;
    cJSON_ArrayForEach(it, t) {
        const double d = cJSON_IsNumber(it) ? it->valuedouble : -1.0;
        if (!(d == floor(d)) || d < 0 || d >= (double)V || !fp4moe_tokenizer_id_to_token(c->tok, (int32_t)d)) {
            rc = srv_fail(e, 400, "tokens", "tokens[%d] is not a token id of the tokenizer ([0, %lld))", k, (long long)V);
            break;
        }
        ids[k++] = (int32_t)d;
    }
    cJSON_Delete(o);
    char *text = NULL;
    int64_t tl = 0;
    if (!rc && fp4moe_tokenizer_decode(c->tok, ids, k, 0, &text, &tl))
        rc = srv_fail(e, 400, "tokens", "cannot decode the tokens: %s", fp4moe_last_error());
    free(ids);
    if (rc) {
        free(text);
        return -1;
    }
    cJSON *res = cJSON_CreateObject();
    cJSON_AddItemToObject(res, "prompt", srv_json_string(text, (size_t)tl)); /* (a NUL token: \u0000) */
    free(text);
    if (!(*out = print_delete(res))) return srv_fail(e, 500, NULL, "out of memory");
    return 0;
}

char *srv_tokenizer_info(const srv_parse_ctx *c) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tokenizer_class", "PreTrainedTokenizerFast"); /* a tokenizer.json tokenizer */
    /* tokenizer_config.json's strings, else the tokens of the tokenizer's BOS / EOS ids */
    const char *sp[2] = {c->bos_token, c->eos_token};
    const int32_t id[2] = {fp4moe_tokenizer_bos_id(c->tok), fp4moe_tokenizer_eos_id(c->tok)};
    for (int i = 0; i < 2; i++)
        if (!(sp[i] && sp[i][0]) && id[i] >= 0) sp[i] = fp4moe_tokenizer_id_to_token(c->tok, id[i]);
    const char *key[2] = {"bos_token", "eos_token"};
    for (int i = 0; i < 2; i++) {
        if (sp[i] && sp[i][0]) cJSON_AddStringToObject(o, key[i], sp[i]);
        else cJSON_AddNullToObject(o, key[i]);
    }
    if (c->pad_token && c->pad_token[0]) cJSON_AddStringToObject(o, "pad_token", c->pad_token);
    else cJSON_AddNullToObject(o, "pad_token");
    cJSON_AddNumberToObject(o, "model_max_length", (double)c->context);
    if (c->chat_template) cJSON_AddStringToObject(o, "chat_template", c->chat_template);
    else cJSON_AddNullToObject(o, "chat_template");
    return print_delete(o);
}
