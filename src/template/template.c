/* Public API of the chat-template engine (include/fp4moe/template.h). */
#include "fp4moe/template.h"

#include <stdlib.h>
#include <string.h>

#include "fp4moe/types.h"
#include "template/tmpl.h"

struct fp4moe_template {
    tnode *body;
};

static int report(const tmpl_err *e) {
    if (e->line > 0) return fp4moe_set_error(e->status, "template line %d: %s", e->line, e->msg);
    return fp4moe_set_error(e->status, "template: %s", e->msg);
}

int fp4moe_template_compile(const char *src, size_t len, fp4moe_template **out) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_template_compile: out is NULL");
    *out = NULL;
    if (!src && len) return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_template_compile: src is NULL");
    tmpl_err e = {0};
    token_vec toks = {0};
    if (tmpl_lex(&e, src ? src : "", len, &toks)) return report(&e);
    tnode *body = NULL;
    int rc = tmpl_parse(&e, &toks, &body);
    tmpl_tokens_free(&toks);
    if (rc) return report(&e);
    if (tmpl_analyze_scopes(&e, body)) {
        tmpl_node_free(body);
        return report(&e);
    }
    fp4moe_template *t = calloc(1, sizeof *t);
    if (!t) {
        tmpl_node_free(body);
        return fp4moe_set_error(FP4MOE_ENOMEM, "template: out of memory");
    }
    t->body = body;
    *out = t;
    return FP4MOE_OK;
}

int fp4moe_template_render(const fp4moe_template *tmpl, const cJSON *context,
                           const fp4moe_template_limits *limits, char **out, size_t *out_len) {
    if (!out) return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_template_render: out is NULL");
    *out = NULL;
    if (out_len) *out_len = 0;
    if (!tmpl) return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_template_render: template is NULL");
    if (context && !cJSON_IsObject(context))
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_template_render: the context must be a JSON object");
    rctx r;
    memset(&r, 0, sizeof r);
    r.max_output = limits && limits->max_output_bytes ? limits->max_output_bytes : (size_t)64 << 20;
    r.max_depth = limits && limits->max_macro_depth > 0 ? limits->max_macro_depth : 64;
    r.max_steps = limits && limits->max_steps ? limits->max_steps : 50000000ull;
    tv_budget budget = {0, limits && limits->max_value_bytes ? limits->max_value_bytes : (size_t)256 << 20};
    tv_budget_set(&budget);
    frame globals = {tv_undef(), NULL, NULL}, root = {tv_undef(), &globals, NULL};
    int rc = 0;
    if (context) rc = tv_from_json(&r.err, context, &globals.vars);
    else rc = tv_dict_new(&r.err, &globals.vars);
    if (!rc) rc = tv_dict_new(&r.err, &root.vars);
    sbuf b = {0};
    b.limit = r.max_output;
    if (!rc) {
        r.root = &root;
        root.undef_first = tmpl->body->scope.kind == TV_DICT ? tmpl->body->scope.u.d : NULL;
        rc = tmpl_eval_body(&r, tmpl->body, &root, &b) < 0 ? -1 : 0;
    }
    tv_unref(root.vars);
    tv_unref(globals.vars);
    tv_budget_set(NULL);
    if (rc) {
        sb_free(&b);
        if (!r.err.status) tmpl_fail(&r.err, FP4MOE_ENOMEM, 0, "out of memory");
        return report(&r.err);
    }
    if (!b.p && sb_put(&b, "", 0)) return fp4moe_set_error(FP4MOE_ENOMEM, "template: out of memory");
    *out = b.p;
    if (out_len) *out_len = b.n;
    return FP4MOE_OK;
}

void fp4moe_template_free(fp4moe_template *tmpl) {
    if (!tmpl) return;
    tmpl_node_free(tmpl->body);
    free(tmpl);
}
