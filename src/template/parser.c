/* Parser: tokens -> AST, following jinja2/parser.py (precedence from loosest to tightest:
 * conditional `a if c else b`, or, and, not, comparisons (chained; in / not in), + -, ~,
 * * / // %, ** (left-associative as in Jinja), unary - +, then postfix . [] () and the filter /
 * test chain | and `is`, which binds tighter than every binary operator). */
#include "template/tmpl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/types.h"

#define MAX_NEST 200

typedef struct {
    tmpl_err *e;
    const token *t;
    size_t n, i;
    int depth;        /* expression / statement nesting */
    int loops;        /* enclosing for loops (break / continue allowed) */
    int macros;
} parser;

static const token *cur(parser *P) { return &P->t[P->i < P->n ? P->i : P->n - 1]; }
static const token *peek(parser *P, size_t k) {
    return &P->t[P->i + k < P->n ? P->i + k : P->n - 1];
}
static void adv(parser *P) { if (P->i < P->n - 1) P->i++; }
static int is_op(const token *t, const char *op) { return t->type == TK_OP && strcmp(t->text, op) == 0; }
static int is_name(const token *t, const char *nm) { return t->type == TK_NAME && strcmp(t->text, nm) == 0; }

static const char *tok_desc(const token *t) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template data";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "end of print statement '}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "end of statement block '%}'";
    default: return t->text ? t->text : "?";
    }
}

static int fail_tok(parser *P, const char *what) {
    const token *t = cur(P);
    return tmpl_fail(P->e, FP4MOE_EFORMAT, t->line, "%s, got '%s'", what, tok_desc(t));
}

static int expect_op(parser *P, const char *op) {
    if (!is_op(cur(P), op)) {
        char m[64];
        snprintf(m, sizeof m, "expected '%s'", op);
        return fail_tok(P, m);
    }
    adv(P);
    return 0;
}

static int expect_type(parser *P, tk_type type, const char *what) {
    if (cur(P)->type != type) return fail_tok(P, what);
    adv(P);
    return 0;
}

static tnode *mk(parser *P, node_kind k, int line) {
    tnode *n = calloc(1, sizeof *n);
    if (!n) { tmpl_fail(P->e, FP4MOE_ENOMEM, line, "out of memory (AST)"); return NULL; }
    n->kind = k;
    n->line = line;
    return n;
}

static int vec_push(parser *P, node_vec *v, tnode *x) {
    if (!x) return -1;
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 4;
        tnode **p = realloc(v->v, cap * sizeof *p);
        if (!p) { tmpl_node_free(x); return tmpl_fail(P->e, FP4MOE_ENOMEM, 0, "out of memory (AST)"); }
        v->v = p;
        v->cap = cap;
    }
    v->v[v->n++] = x;
    return 0;
}

static char *dupstr(parser *P, const char *s) {
    char *d = strdup(s);
    if (!d) tmpl_fail(P->e, FP4MOE_ENOMEM, 0, "out of memory (AST)");
    return d;
}

void tmpl_node_free(tnode *n) {
    if (!n) return;
    free(n->name);
    tv_free_static(n->lit);
    tv_unref(n->scope);
    tmpl_node_free(n->a);
    tmpl_node_free(n->b);
    tmpl_node_free(n->c);
    tmpl_node_free(n->d);
    for (size_t i = 0; i < n->list.n; i++) tmpl_node_free(n->list.v[i]);
    for (size_t i = 0; i < n->list2.n; i++) tmpl_node_free(n->list2.v[i]);
    free(n->list.v);
    free(n->list2.v);
    free(n);
}

/* ---- expressions ----------------------------------------------------------------------------- */
static tnode *p_expr(parser *P);                /* conditional expression */
static tnode *p_or(parser *P);
static tnode *p_unary(parser *P, int with_filter);
static tnode *p_primary(parser *P);
static tnode *p_postfix(parser *P, tnode *n);
static tnode *p_filter_chain(parser *P, tnode *n);

static int enter(parser *P) {
    if (++P->depth > MAX_NEST) {
        P->depth--;
        return tmpl_fail(P->e, FP4MOE_EFORMAT, cur(P)->line, "expression nested too deeply (more than %d levels)", MAX_NEST);
    }
    return 0;
}

/* One more link of a left-nested chain (a + b + c, x|f|g, a.b[c]): counted as a nesting level so
 * that evaluating and freeing the tree stays within MAX_NEST recursion. On failure frees *n,
 * sets it NULL and returns -1; the caller restores P->depth. */
static int chain_step(parser *P, tnode **n) {
    if (P->depth + 1 > MAX_NEST) {
        tmpl_fail(P->e, FP4MOE_EFORMAT, cur(P)->line, "expression nested too deeply (more than %d levels)", MAX_NEST);
        tmpl_node_free(*n);
        *n = NULL;
        return -1;
    }
    P->depth++;
    return 0;
}
static tnode *p_postfix_loop(parser *P, tnode *n);
static tnode *p_filter_chain_loop(parser *P, tnode *n);

/* `a, b, c` (a tuple) or a single expression; condexpr=0 parses `or` level items (for/if heads). */
static tnode *p_tuple(parser *P, int condexpr) {
    int line = cur(P)->line;
    tnode *first = condexpr ? p_expr(P) : p_or(P);
    if (!first || !is_op(cur(P), ",")) return first;
    tnode *t = mk(P, N_TUPLE, line);
    if (!t || vec_push(P, &t->list, first)) { if (!t) tmpl_node_free(first); tmpl_node_free(t); return NULL; }
    while (is_op(cur(P), ",")) {
        adv(P);
        const token *c = cur(P);
        if (c->type == TK_BLOCK_END || c->type == TK_VAR_END || is_op(c, ")") || is_name(c, "in") ||
            is_op(c, "=") || c->type == TK_EOF)
            break;
        if (vec_push(P, &t->list, condexpr ? p_expr(P) : p_or(P))) { tmpl_node_free(t); return NULL; }
    }
    return t;
}

static tnode *p_expr(parser *P) {
    if (enter(P)) return NULL;
    tnode *a = p_or(P);
    while (a && is_name(cur(P), "if")) {
        int line = cur(P)->line;
        adv(P);
        tnode *n = mk(P, N_COND, line);
        if (!n) { tmpl_node_free(a); a = NULL; break; }
        n->b = a;                          /* value when true */
        n->a = p_or(P);                    /* condition */
        if (!n->a) { tmpl_node_free(n); a = NULL; break; }
        if (is_name(cur(P), "else")) {
            adv(P);
            n->c = p_expr(P);
            if (!n->c) { tmpl_node_free(n); a = NULL; break; }
        }
        a = n;
    }
    P->depth--;
    return a;
}

static tnode *binop(parser *P, node_kind k, int op, int line, tnode *a, tnode *b) {
    if (!a || !b) { tmpl_node_free(a); tmpl_node_free(b); return NULL; }
    tnode *n = mk(P, k, line);
    if (!n) { tmpl_node_free(a); tmpl_node_free(b); return NULL; }
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static tnode *p_not(parser *P);
static tnode *p_and(parser *P) {
    tnode *a = p_not(P);
    int d0 = P->depth;
    while (a && is_name(cur(P), "and") && !chain_step(P, &a)) {
        int line = cur(P)->line;
        adv(P);
        a = binop(P, N_AND, 0, line, a, p_not(P));
    }
    P->depth = d0;
    return a;
}

static tnode *p_or(parser *P) {
    tnode *a = p_and(P);
    int d0 = P->depth;
    while (a && is_name(cur(P), "or") && !chain_step(P, &a)) {
        int line = cur(P)->line;
        adv(P);
        a = binop(P, N_OR, 0, line, a, p_and(P));
    }
    P->depth = d0;
    return a;
}

static tnode *p_math1(parser *P);
static tnode *p_compare(parser *P) {
    tnode *a = p_math1(P);
    if (!a) return NULL;
    tnode *cmp = NULL;
    for (;;) {
        const token *t = cur(P);
        int op = -1;
        if (t->type == TK_OP) {
            if (!strcmp(t->text, "==")) op = OP_EQ;
            else if (!strcmp(t->text, "!=")) op = OP_NE;
            else if (!strcmp(t->text, "<")) op = OP_LT;
            else if (!strcmp(t->text, "<=")) op = OP_LE;
            else if (!strcmp(t->text, ">")) op = OP_GT;
            else if (!strcmp(t->text, ">=")) op = OP_GE;
        } else if (is_name(t, "in")) op = OP_IN;
        else if (is_name(t, "not") && is_name(peek(P, 1), "in")) { op = OP_NOTIN; adv(P); }
        if (op < 0) break;
        int line = t->line;
        adv(P);
        if (!cmp) {
            cmp = mk(P, N_CMP, line);
            if (!cmp) { tmpl_node_free(a); return NULL; }
            cmp->a = a;
        }
        tnode *o = mk(P, N_CMPOP, line);
        if (!o) { tmpl_node_free(cmp); return NULL; }
        o->op = op;
        o->a = p_math1(P);
        if (!o->a || vec_push(P, &cmp->list, o)) { if (!o->a) tmpl_node_free(o); tmpl_node_free(cmp); return NULL; }
    }
    return cmp ? cmp : a;
}

static tnode *p_not(parser *P) {
    if (is_name(cur(P), "not")) {
        int line = cur(P)->line;
        adv(P);
        if (enter(P)) return NULL;
        tnode *x = p_not(P);
        P->depth--;
        if (!x) return NULL;
        tnode *n = mk(P, N_NOT, line);
        if (!n) { tmpl_node_free(x); return NULL; }
        n->a = x;
        return n;
    }
    return p_compare(P);
}

static tnode *p_concat(parser *P);
static tnode *p_math1(parser *P) {
    tnode *a = p_concat(P);
    int d0 = P->depth;
    while (a && (is_op(cur(P), "+") || is_op(cur(P), "-")) && !chain_step(P, &a)) {
        int op = cur(P)->text[0] == '+' ? OP_ADD : OP_SUB, line = cur(P)->line;
        adv(P);
        a = binop(P, N_BIN, op, line, a, p_concat(P));
    }
    P->depth = d0;
    return a;
}

static tnode *p_math2(parser *P);
static tnode *p_concat(parser *P) {
    tnode *a = p_math2(P);
    int d0 = P->depth;
    while (a && is_op(cur(P), "~") && !chain_step(P, &a)) {
        int line = cur(P)->line;
        adv(P);
        a = binop(P, N_BIN, OP_CONCAT, line, a, p_math2(P));
    }
    P->depth = d0;
    return a;
}

static tnode *p_pow(parser *P);
static tnode *p_math2(parser *P) {
    tnode *a = p_pow(P);
    int d0 = P->depth;
    for (;;) {
        const token *t = cur(P);
        int op = -1;
        if (is_op(t, "*")) op = OP_MUL;
        else if (is_op(t, "/")) op = OP_DIV;
        else if (is_op(t, "//")) op = OP_FLOORDIV;
        else if (is_op(t, "%")) op = OP_MOD;
        if (!a || op < 0 || chain_step(P, &a)) { P->depth = d0; return a; }
        adv(P);
        a = binop(P, N_BIN, op, t->line, a, p_pow(P));
    }
}

static tnode *p_pow(parser *P) {
    tnode *a = p_unary(P, 1);
    int d0 = P->depth;
    while (a && is_op(cur(P), "**") && !chain_step(P, &a)) {
        int line = cur(P)->line;
        adv(P);
        a = binop(P, N_BIN, OP_POW, line, a, p_unary(P, 1));
    }
    P->depth = d0;
    return a;
}

static tnode *p_unary(parser *P, int with_filter) {
    if (enter(P)) return NULL;
    tnode *n;
    const token *t = cur(P);
    if (is_op(t, "-") || is_op(t, "+")) {
        adv(P);
        tnode *x = p_unary(P, 0);
        n = x ? mk(P, t->text[0] == '-' ? N_NEG : N_POS, t->line) : NULL;
        if (n) n->a = x;
        else tmpl_node_free(x);
    } else {
        n = p_primary(P);
    }
    if (n) n = p_postfix(P, n);
    if (n && with_filter) n = p_filter_chain(P, n);
    P->depth--;
    return n;
}

/* (args): positional and name=value; appends to v (N_KW nodes for keywords). */
static int p_call_args(parser *P, node_vec *v) {
    if (expect_op(P, "(")) return -1;
    int kw_seen = 0;
    while (!is_op(cur(P), ")")) {
        if (v->n && expect_op(P, ",")) return -1;
        if (is_op(cur(P), ")")) break;
        if (is_op(cur(P), "*") || is_op(cur(P), "**"))
            return tmpl_fail(P->e, FP4MOE_EFORMAT, cur(P)->line, "*args / **kwargs in calls are not supported");
        if (cur(P)->type == TK_NAME && is_op(peek(P, 1), "=")) {
            tnode *k = mk(P, N_KW, cur(P)->line);
            if (!k) return -1;
            k->name = dupstr(P, cur(P)->text);
            adv(P);
            adv(P);
            k->a = k->name ? p_expr(P) : NULL;
            if (!k->a) { tmpl_node_free(k); return -1; }
            if (vec_push(P, v, k)) return -1;
            kw_seen = 1;
        } else {
            if (kw_seen) return tmpl_fail(P->e, FP4MOE_EFORMAT, cur(P)->line, "positional argument follows keyword argument");
            if (vec_push(P, v, p_expr(P))) return -1;
        }
    }
    adv(P);
    return 0;
}

static tnode *p_subscript(parser *P, tnode *obj) {
    int line = cur(P)->line;
    adv(P);   /* '[' */
    tnode *parts[3] = {NULL, NULL, NULL};
    int colons = 0;
    for (;;) {
        const token *t = cur(P);
        if (is_op(t, "]")) break;
        if (is_op(t, ":")) {
            if (++colons > 2) { fail_tok(P, "too many ':' in a slice"); goto fail; }
            adv(P);
            continue;
        }
        if (parts[colons]) { fail_tok(P, "expected ']'"); goto fail; }
        parts[colons] = p_expr(P);
        if (!parts[colons]) goto fail;
    }
    adv(P);
    tnode *n;
    if (colons == 0) {
        if (!parts[0]) { tmpl_fail(P->e, FP4MOE_EFORMAT, line, "empty subscript"); goto fail; }
        n = mk(P, N_GETITEM, line);
        if (!n) goto fail;
        n->a = obj;
        n->b = parts[0];
    } else {
        n = mk(P, N_SLICE, line);
        if (!n) goto fail;
        n->a = obj;
        n->b = parts[0];
        n->c = parts[1];
        n->d = parts[2];
    }
    return n;
fail:
    for (int i = 0; i < 3; i++) tmpl_node_free(parts[i]);
    tmpl_node_free(obj);
    return NULL;
}

static tnode *p_postfix(parser *P, tnode *n) {
    int d0 = P->depth;
    tnode *r = p_postfix_loop(P, n);
    P->depth = d0;
    return r;
}

static tnode *p_postfix_loop(parser *P, tnode *n) {
    for (;;) {
        if (chain_step(P, &n)) return n;
        const token *t = cur(P);
        if (is_op(t, ".")) {
            adv(P);
            const token *a = cur(P);
            if (a->type == TK_NAME) {
                tnode *g = mk(P, N_GETATTR, t->line);
                if (!g) { tmpl_node_free(n); return NULL; }
                g->a = n;
                g->name = dupstr(P, a->text);
                if (!g->name) { tmpl_node_free(g); return NULL; }
                adv(P);
                n = g;
            } else if (a->type == TK_INT) {
                tnode *g = mk(P, N_GETITEM, t->line), *k = mk(P, N_CONST, t->line);
                if (!g || !k) { tmpl_node_free(g); tmpl_node_free(k); tmpl_node_free(n); return NULL; }
                k->lit = tv_int(a->ival);
                g->a = n;
                g->b = k;
                adv(P);
                n = g;
            } else {
                fail_tok(P, "expected an attribute name after '.'");
                tmpl_node_free(n);
                return NULL;
            }
        } else if (is_op(t, "[")) {
            n = p_subscript(P, n);
            if (!n) return NULL;
        } else if (is_op(t, "(")) {
            tnode *c = mk(P, N_CALL, t->line);
            if (!c) { tmpl_node_free(n); return NULL; }
            c->a = n;
            if (p_call_args(P, &c->list)) { tmpl_node_free(c); return NULL; }
            n = c;
        } else {
            return n;
        }
    }
}

static char *dotted_name(parser *P) {
    if (cur(P)->type != TK_NAME) { fail_tok(P, "expected a name"); return NULL; }
    char buf[256];
    snprintf(buf, sizeof buf, "%s", cur(P)->text);
    adv(P);
    while (is_op(cur(P), ".") && peek(P, 1)->type == TK_NAME) {
        size_t l = strlen(buf);
        snprintf(buf + l, sizeof buf - l, ".%s", peek(P, 1)->text);
        adv(P);
        adv(P);
    }
    return dupstr(P, buf);
}

static tnode *p_filter(parser *P, tnode *operand) {
    int line = cur(P)->line;
    adv(P);   /* '|' */
    tnode *f = mk(P, N_FILTER, line);
    if (!f) { tmpl_node_free(operand); return NULL; }
    f->a = operand;
    f->name = dotted_name(P);
    if (!f->name) { tmpl_node_free(f); return NULL; }
    if (!tmpl_has_filter(f->name)) {
        tmpl_fail(P->e, FP4MOE_EFORMAT, line, "No filter named '%s'", f->name);
        tmpl_node_free(f);
        return NULL;
    }
    if (is_op(cur(P), "(") && p_call_args(P, &f->list)) { tmpl_node_free(f); return NULL; }
    return f;
}

static tnode *p_filter_chain(parser *P, tnode *n) {
    int d0 = P->depth;
    tnode *r = p_filter_chain_loop(P, n);
    P->depth = d0;
    return r;
}

static tnode *p_filter_chain_loop(parser *P, tnode *n) {
    for (;;) {
        if (chain_step(P, &n)) return n;
        const token *t = cur(P);
        if (is_op(t, "|")) {
            n = p_filter(P, n);
            if (!n) return NULL;
        } else if (is_name(t, "is")) {
            adv(P);
            int neg = 0;
            if (is_name(cur(P), "not")) { neg = 1; adv(P); }
            tnode *x = mk(P, N_TEST, t->line);
            if (!x) { tmpl_node_free(n); return NULL; }
            x->a = n;
            x->name = dotted_name(P);
            if (!x->name) { tmpl_node_free(x); return NULL; }
            if (!tmpl_has_test(x->name)) {
                tmpl_fail(P->e, FP4MOE_EFORMAT, t->line, "No test named '%s'", x->name);
                tmpl_node_free(x);
                return NULL;
            }
            const token *c = cur(P);
            if (is_op(c, "(")) {
                if (p_call_args(P, &x->list)) { tmpl_node_free(x); return NULL; }
            } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
                        is_op(c, "[") || is_op(c, "{")) &&
                       !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
                if (is_name(c, "is")) {
                    tmpl_fail(P->e, FP4MOE_EFORMAT, c->line, "You cannot chain multiple tests with is");
                    tmpl_node_free(x);
                    return NULL;
                }
                tnode *arg = p_primary(P);
                if (arg) arg = p_postfix(P, arg);
                if (vec_push(P, &x->list, arg)) { tmpl_node_free(x); return NULL; }
            }
            if (neg) {
                tnode *nn = mk(P, N_NOT, t->line);
                if (!nn) { tmpl_node_free(x); return NULL; }
                nn->a = x;
                x = nn;
            }
            n = x;
        } else if (is_op(t, "(")) {
            tnode *c = mk(P, N_CALL, t->line);
            if (!c) { tmpl_node_free(n); return NULL; }
            c->a = n;
            if (p_call_args(P, &c->list)) { tmpl_node_free(c); return NULL; }
            n = c;
        } else {
            return n;
        }
    }
}

static tnode *p_primary(parser *P) {
    const token *t = cur(P);
    tnode *n = NULL;
    switch (t->type) {
    case TK_NAME:
        n = mk(P, N_CONST, t->line);
        if (!n) return NULL;
        if (!strcmp(t->text, "true") || !strcmp(t->text, "True")) n->lit = tv_bool(1);
        else if (!strcmp(t->text, "false") || !strcmp(t->text, "False")) n->lit = tv_bool(0);
        else if (!strcmp(t->text, "none") || !strcmp(t->text, "None")) n->lit = tv_none();
        else {
            n->kind = N_NAME;
            n->name = dupstr(P, t->text);
            if (!n->name) { tmpl_node_free(n); return NULL; }
        }
        adv(P);
        return n;
    case TK_STRING: {
        sbuf b = {0};
        int rc = 0;
        while (cur(P)->type == TK_STRING) {   /* adjacent literals concatenate */
            rc |= sb_put(&b, cur(P)->text, cur(P)->len);
            adv(P);
        }
        n = rc ? NULL : mk(P, N_CONST, t->line);
        if (rc) tmpl_fail(P->e, FP4MOE_ENOMEM, t->line, "out of memory");
        if (n && tv_str_new(P->e, b.p ? b.p : "", b.n, &n->lit)) { tmpl_node_free(n); n = NULL; }
        if (n) tv_make_static(&n->lit); /* shared by every render: tv_ref / tv_unref leave it */
        sb_free(&b);
        return n;
    }
    case TK_INT: case TK_FLOAT:
        n = mk(P, N_CONST, t->line);
        if (n) n->lit = t->type == TK_INT ? tv_int(t->ival) : tv_float(t->fval);
        adv(P);
        return n;
    case TK_OP:
        if (is_op(t, "(")) {
            adv(P);
            if (is_op(cur(P), ")")) {
                adv(P);
                return mk(P, N_TUPLE, t->line);
            }
            n = p_tuple(P, 1);
            if (n && expect_op(P, ")")) { tmpl_node_free(n); return NULL; }
            return n;
        }
        if (is_op(t, "[") || is_op(t, "{")) {
            int dict = t->text[0] == '{';
            const char *close = dict ? "}" : "]";
            n = mk(P, dict ? N_DICT : N_LIST, t->line);
            if (!n) return NULL;
            adv(P);
            while (!is_op(cur(P), close)) {
                if (n->list.n && expect_op(P, ",")) { tmpl_node_free(n); return NULL; }
                if (is_op(cur(P), close)) break;
                if (vec_push(P, &n->list, p_expr(P))) { tmpl_node_free(n); return NULL; }
                if (dict && (expect_op(P, ":") || vec_push(P, &n->list2, p_expr(P)))) { tmpl_node_free(n); return NULL; }
            }
            adv(P);
            return n;
        }
        break;
    default: break;
    }
    fail_tok(P, "unexpected token in an expression");
    return NULL;
}

/* ---- statements ------------------------------------------------------------------------------ */
static int p_body(parser *P, const char *const *ends, tnode **out, const char **which);

static int block_end(parser *P) { return expect_type(P, TK_BLOCK_END, "expected end of statement block '%}'"); }

/* name or name, name (for / set targets); ns_attr allows `ns.attr` (set only) */
static tnode *p_target(parser *P, int ns_attr) {
    int line = cur(P)->line;
    int paren = 0;
    if (is_op(cur(P), "(")) { paren = 1; adv(P); }
    tnode *tup = NULL, *first = NULL;
    for (;;) {
        const token *t = cur(P);
        if (t->type != TK_NAME) { fail_tok(P, "expected a variable name to assign to"); goto fail; }
        tnode *x;
        if (ns_attr && is_op(peek(P, 1), ".") && peek(P, 2)->type == TK_NAME) {
            x = mk(P, N_GETATTR, t->line);
            tnode *nm = mk(P, N_NAME, t->line);
            if (!x || !nm) { tmpl_node_free(x); tmpl_node_free(nm); goto fail; }
            x->a = nm;
            nm->name = dupstr(P, t->text);
            x->name = dupstr(P, peek(P, 2)->text);
            if (!nm->name || !x->name) { tmpl_node_free(x); goto fail; }
            adv(P); adv(P); adv(P);
        } else {
            x = mk(P, N_NAME, t->line);
            if (!x) goto fail;
            x->name = dupstr(P, t->text);
            if (!x->name) { tmpl_node_free(x); goto fail; }
            adv(P);
        }
        if (!first && !is_op(cur(P), ",")) { first = x; break; }
        if (!tup) { tup = mk(P, N_TUPLE, line); if (!tup) { tmpl_node_free(x); goto fail; } }
        if (vec_push(P, &tup->list, x)) goto fail;
        first = tup;
        if (!is_op(cur(P), ",")) break;
        adv(P);
        if (cur(P)->type != TK_NAME) break;
    }
    if (paren && expect_op(P, ")")) { tmpl_node_free(first); return NULL; }
    return first;
fail:
    tmpl_node_free(tup);
    return NULL;
}

static tnode *p_for(parser *P, int line) {
    tnode *n = mk(P, N_FOR, line);
    if (!n) return NULL;
    static const char *const ends1[] = {"endfor", "else", NULL}, *const ends2[] = {"endfor", NULL};
    const char *which = NULL;
    if (!(n->a = p_target(P, 0))) goto fail;
    if (!is_name(cur(P), "in")) { fail_tok(P, "expected 'in'"); goto fail; }
    adv(P);
    if (!(n->b = p_tuple(P, 0))) goto fail;
    if (is_name(cur(P), "if")) {
        adv(P);
        if (!(n->c = p_expr(P))) goto fail;
    }
    if (is_name(cur(P), "recursive")) {
        tmpl_fail(P->e, FP4MOE_EFORMAT, line, "recursive for loops are not supported");
        goto fail;
    }
    if (block_end(P)) goto fail;
    P->loops++;
    tnode *body = NULL;
    int rc = p_body(P, ends1, &body, &which);
    P->loops--;
    if (rc) goto fail;
    n->d = body;
    if (!strcmp(which, "else")) {
        adv(P);
        if (block_end(P)) goto fail;
        tnode *eb = NULL;
        if (p_body(P, ends2, &eb, &which)) goto fail;
        if (vec_push(P, &n->list2, eb)) goto fail;
    }
    adv(P);   /* endfor */
    if (block_end(P)) goto fail;
    return n;
fail:
    tmpl_node_free(n);
    return NULL;
}

static tnode *p_if(parser *P, int line) {
    static const char *const ends[] = {"elif", "else", "endif", NULL}, *const ends2[] = {"endif", NULL};
    tnode *n = mk(P, N_IF, line), *top = n;
    const char *which = NULL;
    if (!n) return NULL;
    for (;;) {
        if (!(n->a = p_tuple(P, 0)) || block_end(P)) goto fail;
        tnode *body = NULL;
        if (p_body(P, ends, &body, &which)) goto fail;
        n->b = body;
        int l2 = cur(P)->line;
        adv(P);
        if (!strcmp(which, "elif")) {
            tnode *e = mk(P, N_IF, l2);
            if (!e) goto fail;
            n->c = e;      /* else branch: a nested if */
            n = e;
            continue;
        }
        if (!strcmp(which, "else")) {
            if (block_end(P)) goto fail;
            tnode *eb = NULL;
            if (p_body(P, ends2, &eb, &which)) goto fail;
            n->c = eb;
            adv(P);
        }
        if (block_end(P)) goto fail;
        return top;
    }
fail:
    tmpl_node_free(top);
    return NULL;
}

static tnode *p_set(parser *P, int line) {
    tnode *target = p_target(P, 1);
    if (!target) return NULL;
    if (is_op(cur(P), "=")) {
        adv(P);
        tnode *n = mk(P, N_SET, line);
        if (!n) { tmpl_node_free(target); return NULL; }
        n->a = target;
        if (!(n->b = p_tuple(P, 1)) || block_end(P)) { tmpl_node_free(n); return NULL; }
        return n;
    }
    /* block set: {% set x | filters %}...{% endset %} */
    static const char *const ends[] = {"endset", NULL};
    const char *which;
    tnode *n = mk(P, N_SETBLOCK, line);
    if (!n) { tmpl_node_free(target); return NULL; }
    n->a = target;
    if (target->kind != N_NAME) {
        tmpl_fail(P->e, FP4MOE_EFORMAT, line, "a block set assigns one plain name");
        tmpl_node_free(n);
        return NULL;
    }
    tnode *chain = NULL;     /* filters applied to the captured text: a chain whose operand is NULL */
    while (is_op(cur(P), "|")) {
        chain = p_filter(P, chain);
        if (!chain) { tmpl_node_free(n); return NULL; }
    }
    n->c = chain;
    tnode *body = NULL;
    if (block_end(P) || p_body(P, ends, &body, &which)) { tmpl_node_free(n); return NULL; }
    n->b = body;
    adv(P);
    if (block_end(P)) { tmpl_node_free(n); return NULL; }
    return n;
}

/* Does the tree n read the name nm (not counting the bodies of macros defined inside it)? */
static int refs_name(const tnode *n, const char *nm) {
    if (!n) return 0;
    if (n->kind == N_NAME && n->name && !strcmp(n->name, nm)) return 1;
    if (n->kind == N_MACRO) return 0;
    if (refs_name(n->a, nm) || refs_name(n->b, nm) || refs_name(n->c, nm) || refs_name(n->d, nm)) return 1;
    for (size_t i = 0; i < n->list.n; i++) if (refs_name(n->list.v[i], nm)) return 1;
    for (size_t i = 0; i < n->list2.n; i++) if (refs_name(n->list2.v[i], nm)) return 1;
    return 0;
}

static tnode *p_macro(parser *P, int line) {
    static const char *const ends[] = {"endmacro", NULL};
    const char *which;
    if (cur(P)->type != TK_NAME) { fail_tok(P, "expected a macro name"); return NULL; }
    tnode *n = mk(P, N_MACRO, line);
    if (!n) return NULL;
    if (!(n->name = dupstr(P, cur(P)->text))) goto fail;
    adv(P);
    if (expect_op(P, "(")) goto fail;
    int defaults = 0;
    while (!is_op(cur(P), ")")) {
        if (n->list.n && expect_op(P, ",")) goto fail;
        if (is_op(cur(P), ")")) break;
        if (cur(P)->type != TK_NAME) { fail_tok(P, "expected a parameter name"); goto fail; }
        tnode *p = mk(P, N_PARAM, cur(P)->line);
        if (!p) goto fail;
        p->name = dupstr(P, cur(P)->text);
        if (!p->name) { tmpl_node_free(p); goto fail; }
        adv(P);
        if (is_op(cur(P), "=")) {
            adv(P);
            if (!(p->a = p_expr(P))) { tmpl_node_free(p); goto fail; }
            defaults = 1;
        } else if (defaults) {
            tmpl_fail(P->e, FP4MOE_EFORMAT, p->line, "non-default argument follows default argument");
            tmpl_node_free(p);
            goto fail;
        }
        if (vec_push(P, &n->list, p)) goto fail;
    }
    adv(P);
    if (block_end(P)) goto fail;
    int loops = P->loops;
    P->loops = 0;
    P->macros++;
    tnode *body = NULL;
    int rc = p_body(P, ends, &body, &which);
    P->macros--;
    P->loops = loops;
    if (rc) goto fail;
    n->b = body;
    /* jinja2: a macro whose body reads varargs / kwargs takes extra positional / keyword arguments into them */
    n->op = (refs_name(body, "varargs") ? 1 : 0) | (refs_name(body, "kwargs") ? 2 : 0);
    adv(P);
    if (block_end(P)) goto fail;
    return n;
fail:
    tmpl_node_free(n);
    return NULL;
}

static tnode *p_filterblock(parser *P, int line) {
    static const char *const ends[] = {"endfilter", NULL};
    const char *which;
    tnode *n = mk(P, N_FILTERBLOCK, line);
    if (!n) return NULL;
    tnode *chain = NULL;
    /* first filter name without '|' */
    if (cur(P)->type != TK_NAME) { fail_tok(P, "expected a filter name"); goto fail; }
    {
        tnode *f = mk(P, N_FILTER, line);
        if (!f) goto fail;
        f->name = dotted_name(P);
        if (!f->name) { tmpl_node_free(f); goto fail; }
        if (!tmpl_has_filter(f->name)) {
            tmpl_fail(P->e, FP4MOE_EFORMAT, line, "No filter named '%s'", f->name);
            tmpl_node_free(f);
            goto fail;
        }
        if (is_op(cur(P), "(") && p_call_args(P, &f->list)) { tmpl_node_free(f); goto fail; }
        chain = f;
    }
    while (is_op(cur(P), "|")) {
        chain = p_filter(P, chain);
        if (!chain) goto fail;
    }
    n->c = chain;
    chain = NULL;
    tnode *body = NULL;
    if (block_end(P) || p_body(P, ends, &body, &which)) goto fail;
    n->b = body;
    adv(P);
    if (block_end(P)) goto fail;
    return n;
fail:
    tmpl_node_free(chain);
    tmpl_node_free(n);
    return NULL;
}

static tnode *p_statement(parser *P) {
    const token *t = cur(P);
    int line = t->line;
    if (t->type != TK_NAME) { fail_tok(P, "expected a statement name after '{%'"); return NULL; }
    const char *nm = t->text;
    if (enter(P)) return NULL;
    adv(P);
    tnode *n = NULL;
    if (!strcmp(nm, "for")) n = p_for(P, line);
    else if (!strcmp(nm, "if")) n = p_if(P, line);
    else if (!strcmp(nm, "set")) n = p_set(P, line);
    else if (!strcmp(nm, "macro")) n = p_macro(P, line);
    else if (!strcmp(nm, "filter")) n = p_filterblock(P, line);
    else if (!strcmp(nm, "break") || !strcmp(nm, "continue")) {
        if (!P->loops) tmpl_fail(P->e, FP4MOE_EFORMAT, line, "'%s' outside of a for loop", nm);
        else if ((n = mk(P, nm[0] == 'b' ? N_BREAK : N_CONTINUE, line)) && block_end(P)) {
            tmpl_node_free(n);
            n = NULL;
        }
    } else if (!strcmp(nm, "generation")) {   /* transformers' AssistantTracker: renders its body */
        static const char *const ends[] = {"endgeneration", NULL};
        const char *which;
        tnode *body = NULL;
        if (!block_end(P) && !p_body(P, ends, &body, &which)) {
            adv(P);
            if (block_end(P)) tmpl_node_free(body);
            else n = body;
        }
    } else if (!strcmp(nm, "include") || !strcmp(nm, "import") || !strcmp(nm, "from") ||
               !strcmp(nm, "extends") || !strcmp(nm, "block") || !strcmp(nm, "call") ||
               !strcmp(nm, "with") || !strcmp(nm, "autoescape") || !strcmp(nm, "do")) {
        tmpl_fail(P->e, FP4MOE_EFORMAT, line, "the '%s' tag is not supported by this engine", nm);
    } else {
        tmpl_fail(P->e, FP4MOE_EFORMAT, line, "Encountered unknown tag '%s'", nm);
    }
    P->depth--;
    return n;
}

/* Parses until EOF (ends == NULL) or a block whose name is in ends; then cur() is that name. */
static int p_body(parser *P, const char *const *ends, tnode **out, const char **which) {
    int line = cur(P)->line;
    tnode *body = mk(P, N_BODY, line);
    if (!body) return -1;
    /* for the messages: the tag that opened this body (its '{%' line and name) and the tags that may end it */
    int open = line;
    const char *tag = "?";
    char want[128] = "";
    if (ends) {
        for (size_t k = P->i; k-- > 0;)
            if (P->t[k].type == TK_BLOCK_BEGIN) {
                open = P->t[k].line;
                if (k + 1 < P->n && P->t[k + 1].type == TK_NAME) tag = P->t[k + 1].text;
                break;
            }
        for (int i = 0; ends[i]; i++) {
            size_t l = strlen(want);
            snprintf(want + l, sizeof want - l, "%s'%s'", i ? " or " : "", ends[i]);
        }
    }
    for (;;) {
        const token *t = cur(P);
        if (t->type == TK_EOF) {
            if (ends) {
                tmpl_fail(P->e, FP4MOE_EFORMAT, t->line,
                          "Unexpected end of template: the '%s' block opened on line %d needs %s", tag, open, want);
                tmpl_node_free(body);
                return -1;
            }
            *out = body;
            return 0;
        }
        if (t->type == TK_DATA) {
            tnode *x = mk(P, N_TEXT, t->line);
            const int bad = !x || tv_str_new(P->e, t->text, t->len, &x->lit);
            if (!bad) tv_make_static(&x->lit);
            if (bad || vec_push(P, &body->list, x)) {
                tmpl_node_free(x);
                tmpl_node_free(body);
                return -1;
            }
            adv(P);
            continue;
        }
        if (t->type == TK_VAR_BEGIN) {
            adv(P);
            tnode *x = mk(P, N_OUTPUT, t->line);
            if (!x) { tmpl_node_free(body); return -1; }
            x->a = p_tuple(P, 1);
            if (!x->a || expect_type(P, TK_VAR_END, "expected end of print statement '}}'")) {
                tmpl_node_free(x);
                tmpl_node_free(body);
                return -1;
            }
            if (vec_push(P, &body->list, x)) { tmpl_node_free(body); return -1; }
            continue;
        }
        if (t->type == TK_BLOCK_BEGIN) {
            adv(P);
            const token *nm = cur(P);
            if (nm->type == TK_NAME && ends) {
                for (int i = 0; ends[i]; i++)
                    if (!strcmp(nm->text, ends[i])) {
                        *which = ends[i];
                        *out = body;
                        return 0;
                    }
            }
            if (nm->type == TK_NAME && (!strncmp(nm->text, "end", 3) || !strcmp(nm->text, "else") ||
                                        !strcmp(nm->text, "elif"))) {
                if (ends)
                    tmpl_fail(P->e, FP4MOE_EFORMAT, nm->line, "Encountered unexpected tag '%s' (the '%s' block opened on line %d "
                              "needs %s)", nm->text, tag, open, want);
                else
                    tmpl_fail(P->e, FP4MOE_EFORMAT, nm->line, "Encountered unexpected tag '%s' with no open block", nm->text);
                tmpl_node_free(body);
                return -1;
            }
            if (vec_push(P, &body->list, p_statement(P))) { tmpl_node_free(body); return -1; }
            continue;
        }
        fail_tok(P, "unexpected token");
        tmpl_node_free(body);
        return -1;
    }
}

int tmpl_parse(tmpl_err *e, const token_vec *toks, tnode **out) {
    parser P = {e, toks->t, toks->n, 0, 0, 0, 0};
    const char *which = NULL;
    return p_body(&P, NULL, out, &which);
}
