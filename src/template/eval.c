/* Evaluator: runs the AST over values with Jinja2's semantics as transformers uses them.
 * Scopes: the globals (render context) -> the template's root frame -> one frame per for-loop
 * iteration (so `set` inside a loop does not leak out, as in Jinja) and one per macro call (whose
 * parent is the root frame). `if` opens no scope. Namespaces are shared mutable dicts. */
#include "template/tmpl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/types.h"

enum { EX_OK = 0, EX_BREAK = 1, EX_CONTINUE = 2 };

static int eval(rctx *r, frame *f, const tnode *n, tv *out);

int tmpl_step(rctx *r, int line) {
    if (++r->steps > r->max_steps)
        return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line,
                         "render limit exceeded: more than %llu steps (loop iterations, macro / filter calls and "
                         "range() items together)", (unsigned long long)r->max_steps);
    return 0;
}

static int too_big(rctx *r, int line) {
    return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "output or string larger than the render limit (%zu bytes)",
                     r->max_output);
}

/* A short description of an expression for error messages: name, a.b, a[0], a['k']. */
static void desc(const tnode *n, char *buf, size_t cap) {
    char inner[200];
    switch (n->kind) {
    case N_NAME: snprintf(buf, cap, "%s", n->name); return;
    case N_GETATTR: desc(n->a, inner, sizeof inner); snprintf(buf, cap, "%s.%s", inner, n->name); return;
    case N_GETITEM:
        desc(n->a, inner, sizeof inner);
        if (n->b->kind == N_CONST && n->b->lit.kind == TV_INT) snprintf(buf, cap, "%s[%lld]", inner, (long long)n->b->lit.u.i);
        else if (n->b->kind == N_CONST && n->b->lit.kind == TV_STR) snprintf(buf, cap, "%s['%s']", inner, n->b->lit.u.s->data);
        else snprintf(buf, cap, "%s[...]", inner);
        return;
    case N_CALL: desc(n->a, inner, sizeof inner); snprintf(buf, cap, "%s(...)", inner); return;
    default: snprintf(buf, cap, "value"); return;
    }
}

static int undefined_error(rctx *r, const tnode *n) {
    char d[240];
    desc(n, d, sizeof d);
    return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "'%s' is undefined", d);
}

/* ---- variables ------------------------------------------------------------------------------- */
static tv lookup(const frame *f, const char *name, int *found) {
    const frame *start = f;
    for (; f; f = f->parent) {
        tv v = tv_dict_gets(f->vars.u.d, name, found);
        if (*found) return v;
        if (f != start && f->undef_first) {   /* stored later in that scope: undefined until then */
            (void)tv_dict_gets(f->undef_first, name, found);
            if (*found) return tv_undef();
        }
    }
    int fn = tmpl_global_fn(name);
    if (fn && fn != FN_LOOP_CYCLE) {
        *found = 1;
        tv v;
        v.kind = TV_FUNC;
        v.u.fn = fn;
        return v;
    }
    *found = 0;
    return tv_undef();
}

static int set_var(rctx *r, frame *f, const char *name, tv val) {   /* takes val */
    tv k;
    if (tv_str_new(&r->err, name, strlen(name), &k)) { tv_unref(val); return -1; }
    return tv_dict_set(&r->err, f->vars.u.d, k, val);
}

static void frame_scope(frame *fr, const tnode *body) {
    fr->undef_first = body && body->scope.kind == TV_DICT ? body->scope.u.d : NULL;
}

static int frame_init(rctx *r, frame *fr, frame *parent) {
    fr->parent = parent;
    fr->undef_first = NULL;
    return tv_dict_new(&r->err, &fr->vars);
}

int tmpl_iter_list(rctx *r, int line, tv v, tv *out) {
    switch (v.kind) {
    case TV_LIST: *out = tv_ref(v); return 0;
    case TV_UNDEF: return tv_list_new(&r->err, out);
    case TV_DICT:
        if (tv_list_new(&r->err, out)) return -1;
        for (size_t i = 0; i < v.u.d->n; i++)
            if (tv_list_push(&r->err, out->u.l, tv_ref(v.u.d->keys[i]))) { tv_drop(out); return -1; }
        return 0;
    case TV_STR: {
        if (tv_list_new(&r->err, out)) return -1;
        const char *s = v.u.s->data;
        size_t n = v.u.s->len;
        for (size_t i = 0; i < n;) {
            size_t j = u8_next(s, n, i, NULL);
            tv c;
            if (tv_str_new(&r->err, s + i, j - i, &c) || tv_list_push(&r->err, out->u.l, c)) { tv_drop(out); return -1; }
            i = j;
        }
        return 0;
    }
    default:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "'%s' object is not iterable", tv_type_name(v));
    }
}

/* ---- attribute / item access ----------------------------------------------------------------- */
int tmpl_getattr(rctx *r, int line, tv obj, const char *name, tv *out) {
    int found = 0;
    switch (obj.kind) {
    case TV_UNDEF:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "'%s' of an undefined value", name);
    case TV_DICT: case TV_NS: {
        tv v = tv_dict_gets(obj.u.d, name, &found);
        *out = found ? tv_ref(v) : tv_undef();
        return 0;
    }
    default:
        *out = tv_undef();
        return 0;
    }
}

static int norm_index(int64_t i, size_t n, size_t *out) {
    if (i < 0) i += (int64_t)n;
    if (i < 0 || (uint64_t)i >= n) return -1;
    *out = (size_t)i;
    return 0;
}

int tmpl_getitem(rctx *r, int line, tv obj, tv key, tv *out) {
    size_t idx;
    int found;
    switch (obj.kind) {
    case TV_UNDEF:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "subscript of an undefined value");
    case TV_LIST:
        if ((key.kind == TV_INT || key.kind == TV_BOOL) &&
            !norm_index(key.kind == TV_INT ? key.u.i : key.u.b, obj.u.l->n, &idx))
            *out = tv_ref(obj.u.l->items[idx]);
        else
            *out = tv_undef();
        return 0;
    case TV_STR:
        if (key.kind == TV_INT || key.kind == TV_BOOL) {
            size_t n = u8_len(obj.u.s->data, obj.u.s->len);
            if (!norm_index(key.kind == TV_INT ? key.u.i : key.u.b, n, &idx)) {
                size_t a = u8_offset(obj.u.s->data, obj.u.s->len, idx);
                size_t b = u8_next(obj.u.s->data, obj.u.s->len, a, NULL);
                return tv_str_new(&r->err, obj.u.s->data + a, b - a, out);
            }
        }
        *out = tv_undef();
        return 0;
    case TV_DICT: case TV_NS: {
        tv v = tv_dict_get(obj.u.d, key, &found);
        *out = found ? tv_ref(v) : tv_undef();
        return 0;
    }
    default:
        *out = tv_undef();
        return 0;
    }
}

/* Python slice indices for length n */
static void slice_idx(int has, int64_t v, int64_t step, int64_t n, int is_start, int64_t *out) {
    if (!has) {
        *out = step > 0 ? (is_start ? 0 : n) : (is_start ? n - 1 : -1);
        return;
    }
    if (v < 0) {
        v += n;
        if (v < 0) v = step > 0 ? 0 : -1;
    } else if (v >= n) {
        v = step > 0 ? n : n - 1;
    }
    *out = v;
}

static int get_slice_part(rctx *r, frame *f, const tnode *n, int *has, int64_t *v) {
    *has = 0;
    *v = 0;
    if (!n) return 0;
    tv x;
    if (eval(r, f, n, &x)) return -1;
    if (x.kind == TV_NONE) return 0;
    if (x.kind != TV_INT && x.kind != TV_BOOL) {
        tv_unref(x);
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "slice indices must be integers or None");
    }
    *has = 1;
    *v = x.kind == TV_INT ? x.u.i : x.u.b;
    return 0;
}

static int do_slice(rctx *r, frame *f, const tnode *n, tv obj, tv *out) {
    int hs, he, hp;
    int64_t s, e, step;
    if (get_slice_part(r, f, n->b, &hs, &s) || get_slice_part(r, f, n->c, &he, &e) ||
        get_slice_part(r, f, n->d, &hp, &step))
        return -1;
    if (!hp) step = 1;
    if (step == 0) return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "slice step cannot be zero");
    if (step == INT64_MIN) step = -INT64_MAX;
    if (obj.kind == TV_UNDEF) return undefined_error(r, n->a);
    if (obj.kind != TV_LIST && obj.kind != TV_STR)   /* Jinja compiles slices to a raw Python subscript */
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "'%s' object is not subscriptable (slice)", tv_type_name(obj));
    int64_t len = obj.kind == TV_LIST ? (int64_t)obj.u.l->n : (int64_t)u8_len(obj.u.s->data, obj.u.s->len);
    int64_t a, b;
    slice_idx(hs, s, step, len, 1, &a);
    slice_idx(he, e, step, len, 0, &b);
    if (obj.kind == TV_LIST) {
        if (tv_list_new(&r->err, out)) return -1;
        for (int64_t i = a; step > 0 ? i < b : i > b; i += step) {
            if (tv_list_push(&r->err, out->u.l, tv_ref(obj.u.l->items[i]))) { tv_drop(out); return -1; }
            if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
        }
        return 0;
    }
    const char *str = obj.u.s->data;
    size_t sl = obj.u.s->len;
    if (step == 1) {
        if (b < a) b = a;
        size_t x = u8_offset(str, sl, (size_t)a), y = u8_offset(str, sl, (size_t)b);
        return tv_str_new(&r->err, str + x, y - x, out);
    }
    sbuf sb = {0};
    for (int64_t i = a; step > 0 ? i < b : i > b; i += step) {
        size_t x = u8_offset(str, sl, (size_t)i), y = u8_next(str, sl, x, NULL);
        if (sb_put(&sb, str + x, y - x)) { sb_free(&sb); return too_big(r, n->line); }
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
    }
    int rc = tv_str_new(&r->err, sb.p ? sb.p : "", sb.n, out);
    sb_free(&sb);
    return rc;
}

/* ---- operators ------------------------------------------------------------------------------- */
static int64_t ival(tv v) { return v.kind == TV_INT ? v.u.i : v.u.b; }
static int is_intlike(tv v) { return v.kind == TV_INT || v.kind == TV_BOOL; }

static const char *op_sym(int op) {
    static const char *const s[] = {"+", "-", "*", "/", "//", "%", "**", "~", "==", "!=", "<", "<=", ">", ">=", "in", "not in"};
    return op >= 0 && op < (int)(sizeof s / sizeof s[0]) ? s[op] : "?";
}

static int type_err(rctx *r, int line, int op, tv a, tv b) {
    return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "unsupported operand type(s) for %s: '%s' and '%s'", op_sym(op),
                     tv_type_name(a), tv_type_name(b));
}

static int repeat(rctx *r, int line, tv seq, int64_t times, tv *out) {
    if (times < 0) times = 0;
    /* an empty sequence stays empty: no loop over `times` (found by fuzz/run_template.sh: '' * 3777777777 ran for
       seconds without growing the output that the limit watches) */
    if ((seq.kind == TV_STR ? seq.u.s->len : seq.u.l->n) == 0) times = 0;
    if (seq.kind == TV_STR) {
        size_t len = seq.u.s->len;
        if (len && (uint64_t)times > r->max_output / len) return too_big(r, line);
        sbuf b = {0};
        for (int64_t i = 0; i < times; i++)
            if (sb_put(&b, seq.u.s->data, len)) { sb_free(&b); return too_big(r, line); }
        int rc = tv_str_new(&r->err, b.p ? b.p : "", b.n, out);
        sb_free(&b);
        return rc;
    }
    size_t n = seq.u.l->n;
    if (n && (uint64_t)times > (r->max_output / 8) / n) return too_big(r, line);
    if (tv_list_new(&r->err, out)) return -1;
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < n; k++)
            if (tv_list_push(&r->err, out->u.l, tv_ref(seq.u.l->items[k]))) { tv_drop(out); return -1; }
    return 0;
}

static int binop(rctx *r, int line, int op, tv a, tv b, tv *out) {
    if (op == OP_CONCAT) {
        sbuf s = {0};
        s.limit = r->max_output;
        if (tv_str_append(&r->err, line, &s, a) || tv_str_append(&r->err, line, &s, b)) { sb_free(&s); return -1; }
        int rc = tv_str_new(&r->err, s.p ? s.p : "", s.n, out);
        sb_free(&s);
        return rc;
    }
    if (a.kind == TV_UNDEF || b.kind == TV_UNDEF)
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "undefined value used with '%s'", op_sym(op));
    int nums = tv_is_num(a) && tv_is_num(b), ints = is_intlike(a) && is_intlike(b);
    if (nums) {
        double x = tv_num(a), y = tv_num(b);
        int64_t i = ival(a), j = ival(b), k;
        switch (op) {
        case OP_ADD:
            if (!ints) { *out = tv_float(x + y); return 0; }
            if (__builtin_add_overflow(i, j, &k)) goto ovf;
            *out = tv_int(k);
            return 0;
        case OP_SUB:
            if (!ints) { *out = tv_float(x - y); return 0; }
            if (__builtin_sub_overflow(i, j, &k)) goto ovf;
            *out = tv_int(k);
            return 0;
        case OP_MUL:
            if (!ints) { *out = tv_float(x * y); return 0; }
            if (__builtin_mul_overflow(i, j, &k)) goto ovf;
            *out = tv_int(k);
            return 0;
        case OP_DIV:
            if (y == 0) goto zero;
            *out = tv_float(x / y);
            return 0;
        case OP_FLOORDIV:
            if (ints) {
                if (j == 0) goto zero;
                if (i == INT64_MIN && j == -1) goto ovf;
                int64_t q = i / j;
                if ((i % j != 0) && ((i < 0) != (j < 0))) q--;
                *out = tv_int(q);
            } else {
                if (y == 0) goto zero;
                *out = tv_float(floor(x / y));
            }
            return 0;
        case OP_MOD:
            if (ints) {
                if (j == 0) goto zero;
                if (j == -1) { *out = tv_int(0); return 0; }
                int64_t m = i % j;
                if (m != 0 && ((m < 0) != (j < 0))) m += j;
                *out = tv_int(m);
            } else {
                if (y == 0) goto zero;
                double m = fmod(x, y);
                if (m != 0 && ((m < 0) != (y < 0))) m += y;
                *out = tv_float(m);
            }
            return 0;
        case OP_POW:
            if (ints && j >= 0) {
                int64_t res = 1, base = i;
                for (int64_t e = j; e > 0; e >>= 1) {
                    if (e & 1) { if (__builtin_mul_overflow(res, base, &res)) goto ovf; }
                    if (e > 1 && __builtin_mul_overflow(base, base, &base)) {
                        if (base != 0 && base != 1 && base != -1) goto ovf;
                    }
                }
                *out = tv_int(res);
            } else {
                if (x == 0 && y < 0) goto zero;
                *out = tv_float(pow(x, y));
            }
            return 0;
        default: break;
        }
    }
    if (op == OP_ADD && a.kind == TV_STR && b.kind == TV_STR) {
        if (a.u.s->len + b.u.s->len > r->max_output) return too_big(r, line);
        sbuf s = {0};
        if (sb_put(&s, a.u.s->data, a.u.s->len) || sb_put(&s, b.u.s->data, b.u.s->len)) {
            sb_free(&s);
            return tmpl_fail(&r->err, FP4MOE_ENOMEM, line, "out of memory");
        }
        int rc = tv_str_new(&r->err, s.p ? s.p : "", s.n, out);
        sb_free(&s);
        return rc;
    }
    if (op == OP_ADD && a.kind == TV_LIST && b.kind == TV_LIST) {
        if (tv_list_new(&r->err, out)) return -1;
        for (int k = 0; k < 2; k++) {
            tv_list *l = k ? b.u.l : a.u.l;
            for (size_t i = 0; i < l->n; i++)
                if (tv_list_push(&r->err, out->u.l, tv_ref(l->items[i]))) { tv_drop(out); return -1; }
        }
        return 0;
    }
    if (op == OP_MUL && (a.kind == TV_STR || a.kind == TV_LIST) && is_intlike(b)) return repeat(r, line, a, ival(b), out);
    if (op == OP_MUL && (b.kind == TV_STR || b.kind == TV_LIST) && is_intlike(a)) return repeat(r, line, b, ival(a), out);
    if (op == OP_MOD && a.kind == TV_STR)
        return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, line, "printf-style string formatting ('%%') is not supported");
    return type_err(r, line, op, a, b);
ovf:
    return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "integer overflow in '%s' (values beyond 64 bits are not supported)", op_sym(op));
zero:
    return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "division by zero");
}

static int contains(rctx *r, int line, tv needle, tv hay, int *res) {
    switch (hay.kind) {
    case TV_STR:
        if (needle.kind != TV_STR)
            return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "'in <string>' requires string as left operand, not %s",
                             tv_type_name(needle));
        *res = needle.u.s->len == 0 ||
               memmem(hay.u.s->data, hay.u.s->len, needle.u.s->data, needle.u.s->len) != NULL;
        return 0;
    case TV_LIST:
        *res = 0;
        for (size_t i = 0; i < hay.u.l->n && !*res; i++) *res = tv_eq(needle, hay.u.l->items[i]);
        return 0;
    case TV_DICT: case TV_NS: {
        int found;
        if (needle.kind == TV_LIST || needle.kind == TV_DICT)
            return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "unhashable type: '%s'", tv_type_name(needle));
        (void)tv_dict_get(hay.u.d, needle, &found);
        *res = found;
        return 0;
    }
    case TV_UNDEF:
        *res = 0;
        return 0;
    default:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "argument of type '%s' is not iterable", tv_type_name(hay));
    }
}

static int compare(rctx *r, int line, int op, tv a, tv b, int *res) {
    int c;
    switch (op) {
    case OP_EQ: *res = tv_eq(a, b); return 0;
    case OP_NE: *res = !tv_eq(a, b); return 0;
    case OP_IN: return contains(r, line, a, b, res);
    case OP_NOTIN: if (contains(r, line, a, b, res)) return -1; *res = !*res; return 0;
    default:
        if (tv_cmp(&r->err, line, a, b, &c)) return -1;
        *res = op == OP_LT ? c < 0 : op == OP_LE ? c <= 0 : op == OP_GT ? c > 0 : c >= 0;
        return 0;
    }
}

/* ---- calls ----------------------------------------------------------------------------------- */
static void free_args(argv_t *a) {
    for (size_t i = 0; i < a->n; i++) tv_unref(a->v[i]);
    free(a->v);
    free(a->names);
    a->v = NULL;
    a->names = NULL;
    a->n = 0;
}

static int eval_args(rctx *r, frame *f, const node_vec *args, argv_t *a) {
    a->n = 0;
    a->v = NULL;
    a->names = NULL;
    if (!args->n) return 0;
    a->v = calloc(args->n, sizeof *a->v);
    a->names = calloc(args->n, sizeof *a->names);
    if (!a->v || !a->names) {
        free(a->v);
        free(a->names);
        a->v = NULL;
        a->names = NULL;
        return tmpl_fail(&r->err, FP4MOE_ENOMEM, 0, "out of memory");
    }
    for (size_t i = 0; i < args->n; i++) {
        const tnode *x = args->v[i];
        if (x->kind == N_KW) {
            a->names[i] = x->name;
            x = x->a;
        }
        if (eval(r, f, x, &a->v[a->n])) { free_args(a); return -1; }
        a->n++;
    }
    return 0;
}

static int call_macro(rctx *r, int line, const tnode *m, const argv_t *a, tv *out) {
    if (r->depth >= r->max_depth)
        return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "macro '%s': calls nested deeper than %d", m->name, r->max_depth);
    if (tmpl_step(r, line)) return -1;
    frame fr;
    if (frame_init(r, &fr, r->root)) return -1;
    frame_scope(&fr, m->b);
    size_t npos = 0;
    for (size_t i = 0; i < a->n; i++) if (!a->names[i]) npos++;
    const int va = m->op & 1, kw = m->op & 2; /* the body reads varargs / kwargs (p_macro) */
    if (npos > m->list.n && !va) {
        tv_unref(fr.vars);
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "macro '%s' takes not more than %zu argument(s)", m->name, m->list.n);
    }
    for (size_t i = 0; i < a->n; i++) /* a keyword for a parameter given by position */
        for (size_t p = 0; a->names[i] && p < npos && p < m->list.n; p++)
            if (!strcmp(a->names[i], m->list.v[p]->name)) {
                tv_unref(fr.vars);
                return tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "macro '%s' got multiple values for argument '%s'", m->name,
                                 a->names[i]);
            }
    int rc = 0;
    if (va) { /* the positional arguments past the parameters, a tuple */
        tv l;
        rc = tv_list_new(&r->err, &l);
        if (!rc) {
            l.u.l->is_tuple = 1;
            for (size_t p = m->list.n; p < npos && !rc; p++) rc = tv_list_push(&r->err, l.u.l, tv_ref(a->v[p]));
            if (rc) tv_unref(l);
            else rc = set_var(r, &fr, "varargs", l);
        }
    }
    if (kw && !rc) { /* the keyword arguments that name no parameter, a dict */
        tv d = tv_undef();
        rc = tv_dict_new(&r->err, &d);
        for (size_t i = 0; i < a->n && !rc; i++) {
            if (!a->names[i]) continue;
            int par = 0;
            for (size_t p = 0; p < m->list.n; p++) par |= !strcmp(a->names[i], m->list.v[p]->name);
            tv k;
            if (!par && !(rc = tv_str_new(&r->err, a->names[i], strlen(a->names[i]), &k)))
                rc = tv_dict_set(&r->err, d.u.d, k, tv_ref(a->v[i]));
        }
        if (!rc) rc = set_var(r, &fr, "kwargs", d);
        else if (d.kind == TV_DICT) tv_unref(d);
    }
    for (size_t p = 0; p < m->list.n && !rc; p++) {
        const tnode *par = m->list.v[p];
        tv val = tv_undef();
        int have = 0;
        if (p < npos) { val = tv_ref(a->v[p]); have = 1; }
        for (size_t i = 0; i < a->n && !have; i++)
            if (a->names[i] && !strcmp(a->names[i], par->name)) { val = tv_ref(a->v[i]); have = 1; }
        if (!have && par->a && eval(r, &fr, par->a, &val)) { rc = -1; break; }
        rc = set_var(r, &fr, par->name, val);
    }
    for (size_t i = 0; i < a->n && !rc && !kw; i++) {
        if (!a->names[i]) continue;
        int ok = 0;
        for (size_t p = 0; p < m->list.n; p++) ok |= !strcmp(a->names[i], m->list.v[p]->name);
        if (!ok) rc = tmpl_fail(&r->err, FP4MOE_EFORMAT, line, "macro '%s' takes no keyword argument '%s'", m->name, a->names[i]);
    }
    sbuf b = {0};
    b.limit = r->max_output;
    if (!rc) {
        r->depth++;
        int x = tmpl_eval_body(r, m->b, &fr, &b);
        r->depth--;
        if (x < 0) rc = -1;
    }
    if (!rc) rc = tv_str_new(&r->err, b.p ? b.p : "", b.n, out);
    sb_free(&b);
    tv_unref(fr.vars);
    return rc;
}

static int call_value(rctx *r, const tnode *n, tv callee, const argv_t *a, tv *out) {
    if (callee.kind == TV_MACRO) return call_macro(r, n->line, callee.u.m, a, out);
    if (callee.kind == TV_FUNC) return tmpl_call_fn(r, n->line, callee.u.fn, a, out);
    if (callee.kind == TV_UNDEF) return undefined_error(r, n->a);
    return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "'%s' object is not callable", tv_type_name(callee));
}

static int eval_call(rctx *r, frame *f, const tnode *n, tv *out) {
    argv_t a;
    tv callee;
    if (n->a->kind == N_GETATTR) {
        tv obj;
        if (eval(r, f, n->a->a, &obj)) return -1;
        if (obj.kind == TV_UNDEF) { tv_unref(obj); return undefined_error(r, n->a->a); }
        if (eval_args(r, f, &n->list, &a)) { tv_unref(obj); return -1; }
        int handled = 0;
        int rc = tmpl_method(r, n->line, obj, n->a->name, &a, out, &handled);
        if (!handled && !rc) {
            rc = tmpl_getattr(r, n->line, obj, n->a->name, &callee);
            if (!rc) {
                if (callee.kind == TV_UNDEF) {
                    char d[240];
                    desc(n->a, d, sizeof d);
                    rc = tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "'%s' object has no method '%s' (in %s)",
                                   tv_type_name(obj), n->a->name, d);
                } else {
                    rc = call_value(r, n, callee, &a, out);
                }
                tv_unref(callee);
            }
        }
        tv_unref(obj);
        free_args(&a);
        return rc;
    }
    if (eval(r, f, n->a, &callee)) return -1;
    if (eval_args(r, f, &n->list, &a)) { tv_unref(callee); return -1; }
    int rc = call_value(r, n, callee, &a, out);
    tv_unref(callee);
    free_args(&a);
    return rc;
}

/* ---- expressions ----------------------------------------------------------------------------- */
static int eval_filter(rctx *r, frame *f, const tnode *n, tv operand, tv *out) {   /* borrows operand */
    argv_t a;
    if (eval_args(r, f, &n->list, &a)) return -1;
    int rc = tmpl_step(r, n->line);
    if (!rc) rc = tmpl_filter(r, n->line, n->name, operand, &a, out);
    free_args(&a);
    return rc;
}

/* Applies a filter chain whose innermost operand is NULL (block set / filter block) to `text`. */
static int apply_chain(rctx *r, frame *f, const tnode *chain, tv text, tv *out) {
    if (!chain) { *out = tv_ref(text); return 0; }
    tv in;
    if (chain->a) { if (apply_chain(r, f, chain->a, text, &in)) return -1; }
    else in = tv_ref(text);
    int rc = eval_filter(r, f, chain, in, out);
    tv_unref(in);
    return rc;
}

static int eval(rctx *r, frame *f, const tnode *n, tv *out) {
    int found, rc = 0;
    tv a, b;
    switch (n->kind) {
    case N_CONST: *out = tv_ref(n->lit); return 0;
    case N_NAME: *out = tv_ref(lookup(f, n->name, &found)); return 0;
    case N_LIST: case N_TUPLE:
        if (tv_list_new(&r->err, out)) return -1;
        out->u.l->is_tuple = n->kind == N_TUPLE;
        for (size_t i = 0; i < n->list.n; i++)
            if (eval(r, f, n->list.v[i], &a) || tv_list_push(&r->err, out->u.l, a)) { tv_drop(out); return -1; }
        return 0;
    case N_DICT:
        if (tv_dict_new(&r->err, out)) return -1;
        for (size_t i = 0; i < n->list.n; i++) {
            if (eval(r, f, n->list.v[i], &a)) { tv_drop(out); return -1; }
            if (eval(r, f, n->list2.v[i], &b)) { tv_unref(a); tv_drop(out); return -1; }
            if (tv_dict_set(&r->err, out->u.d, a, b)) { tv_drop(out); return -1; }
        }
        return 0;
    case N_GETATTR:
        if (eval(r, f, n->a, &a)) return -1;
        if (a.kind == TV_UNDEF) rc = undefined_error(r, n->a);
        else rc = tmpl_getattr(r, n->line, a, n->name, out);
        tv_unref(a);
        return rc;
    case N_GETITEM:
        if (eval(r, f, n->a, &a)) return -1;
        if (a.kind == TV_UNDEF) { tv_unref(a); return undefined_error(r, n->a); }
        if (eval(r, f, n->b, &b)) { tv_unref(a); return -1; }
        rc = tmpl_getitem(r, n->line, a, b, out);
        tv_unref(a);
        tv_unref(b);
        return rc;
    case N_SLICE:
        if (eval(r, f, n->a, &a)) return -1;
        rc = do_slice(r, f, n, a, out);
        tv_unref(a);
        return rc;
    case N_CALL: return eval_call(r, f, n, out);
    case N_FILTER:
        if (!n->a) return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "filter without operand");
        if (eval(r, f, n->a, &a)) return -1;
        rc = eval_filter(r, f, n, a, out);
        tv_unref(a);
        return rc;
    case N_TEST: {
        argv_t args;
        int res = 0;
        if (eval(r, f, n->a, &a)) return -1;
        if (eval_args(r, f, &n->list, &args)) { tv_unref(a); return -1; }
        rc = tmpl_test(r, n->line, n->name, a, &args, &res);
        free_args(&args);
        tv_unref(a);
        if (!rc) *out = tv_bool(res);
        return rc;
    }
    case N_NOT:
        if (eval(r, f, n->a, &a)) return -1;
        *out = tv_bool(!tv_truthy(a));
        tv_unref(a);
        return 0;
    case N_NEG: case N_POS:
        if (eval(r, f, n->a, &a)) return -1;
        if (a.kind == TV_INT || a.kind == TV_BOOL) {
            int64_t v = ival(a);
            if (n->kind == N_NEG && v == INT64_MIN) return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, n->line, "integer overflow");
            *out = tv_int(n->kind == N_NEG ? -v : v);
        } else if (a.kind == TV_FLOAT) {
            *out = tv_float(n->kind == N_NEG ? -a.u.f : a.u.f);
        } else {
            rc = tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "bad operand type for unary %c: '%s'",
                           n->kind == N_NEG ? '-' : '+', tv_type_name(a));
        }
        tv_unref(a);
        return rc;
    case N_AND: case N_OR:
        if (eval(r, f, n->a, &a)) return -1;
        if ((n->kind == N_AND) != tv_truthy(a)) { *out = a; return 0; }
        tv_unref(a);
        return eval(r, f, n->b, out);
    case N_BIN:
        if (eval(r, f, n->a, &a)) return -1;
        if (eval(r, f, n->b, &b)) { tv_unref(a); return -1; }
        rc = binop(r, n->line, n->op, a, b, out);
        tv_unref(a);
        tv_unref(b);
        return rc;
    case N_CMP: {
        if (eval(r, f, n->a, &a)) return -1;
        int res = 1;
        for (size_t i = 0; i < n->list.n && res; i++) {
            const tnode *o = n->list.v[i];
            if (eval(r, f, o->a, &b)) { tv_unref(a); return -1; }
            if (compare(r, o->line, o->op, a, b, &res)) { tv_unref(a); tv_unref(b); return -1; }
            tv_unref(a);
            a = b;
        }
        tv_unref(a);
        *out = tv_bool(res);
        return 0;
    }
    case N_COND:
        if (eval(r, f, n->a, &a)) return -1;
        rc = tv_truthy(a);
        tv_unref(a);
        if (rc) return eval(r, f, n->b, out);
        if (n->c) return eval(r, f, n->c, out);
        *out = tv_undef();
        return 0;
    default:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "internal error: node %d is not an expression", (int)n->kind);
    }
}

/* ---- statements ------------------------------------------------------------------------------ */
static int assign(rctx *r, frame *f, const tnode *target, tv val) {   /* takes val */
    if (target->kind == N_NAME) return set_var(r, f, target->name, val);
    if (target->kind == N_GETATTR) {
        int found;
        tv ns = lookup(f, target->a->name, &found);
        if (ns.kind != TV_NS) {
            tv_unref(val);
            return tmpl_fail(&r->err, FP4MOE_EFORMAT, target->line, "cannot assign attribute on non-namespace object '%s'",
                             target->a->name);
        }
        if (tv_holds(val, ns.u.d)) {
            tv_unref(val);
            return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, target->line, "a namespace cannot hold itself (ns.%s)", target->name);
        }
        tv k;
        if (tv_str_new(&r->err, target->name, strlen(target->name), &k)) { tv_unref(val); return -1; }
        if (tv_dict_set(&r->err, ns.u.d, k, val)) {
            if (!r->err.line) r->err.line = target->line;
            return -1;
        }
        return 0;
    }
    /* tuple unpacking */
    tv items;
    if (val.kind == TV_LIST) items = tv_ref(val);
    else if (tmpl_iter_list(r, target->line, val, &items)) { tv_unref(val); return -1; }
    tv_unref(val);
    size_t want = target->list.n, have = items.u.l->n;
    if (want != have) {
        tv_unref(items);
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, target->line, "%s values to unpack (expected %zu, got %zu)",
                         have > want ? "too many" : "not enough", want, have);
    }
    for (size_t i = 0; i < want; i++)
        if (assign(r, f, target->list.v[i], tv_ref(items.u.l->items[i]))) { tv_unref(items); return -1; }
    tv_unref(items);
    return 0;
}

static int loop_set(rctx *r, tv_dict *d, const char *k, tv v) {
    tv key;
    if (tv_str_new(&r->err, k, strlen(k), &key)) { tv_unref(v); return -1; }
    return tv_dict_set(&r->err, d, key, v);
}

static int exec_for(rctx *r, frame *f, const tnode *n, sbuf *out) {
    tv seq, items;
    if (eval(r, f, n->b, &seq)) return -1;
    int rc = tmpl_iter_list(r, n->line, seq, &items);
    tv_unref(seq);
    if (rc) return -1;
    if (n->c) {   /* for ... if cond: filter first, loop.* count the kept items */
        tv kept;
        if (tv_list_new(&r->err, &kept)) { tv_unref(items); return -1; }
        for (size_t i = 0; i < items.u.l->n && !rc; i++) {
            frame fr;
            tv c;
            if (tmpl_step(r, n->line) || frame_init(r, &fr, f)) { rc = -1; break; }
            if (assign(r, &fr, n->a, tv_ref(items.u.l->items[i])) || eval(r, &fr, n->c, &c)) rc = -1;
            else {
                if (tv_truthy(c)) rc = tv_list_push(&r->err, kept.u.l, tv_ref(items.u.l->items[i]));
                tv_unref(c);
            }
            tv_unref(fr.vars);
        }
        tv_unref(items);
        if (rc) { tv_unref(kept); return -1; }
        items = kept;
    }
    size_t len = items.u.l->n;
    for (size_t i = 0; i < len && !rc; i++) {
        frame fr;
        tv loop;
        if (tmpl_step(r, n->line) || frame_init(r, &fr, f)) { rc = -1; break; }
        frame_scope(&fr, n->d);
        if (tv_dict_new(&r->err, &loop)) { tv_unref(fr.vars); rc = -1; break; }
        tv_dict *d = loop.u.d;
        d->is_loop = 1;
        rc = loop_set(r, d, "index0", tv_int((int64_t)i)) || loop_set(r, d, "index", tv_int((int64_t)i + 1)) ||
             loop_set(r, d, "revindex", tv_int((int64_t)(len - i))) ||
             loop_set(r, d, "revindex0", tv_int((int64_t)(len - i - 1))) || loop_set(r, d, "first", tv_bool(i == 0)) ||
             loop_set(r, d, "last", tv_bool(i + 1 == len)) || loop_set(r, d, "length", tv_int((int64_t)len)) ||
             loop_set(r, d, "depth", tv_int(1)) || loop_set(r, d, "depth0", tv_int(0)) ||
             (i > 0 && loop_set(r, d, "previtem", tv_ref(items.u.l->items[i - 1]))) ||
             (i + 1 < len && loop_set(r, d, "nextitem", tv_ref(items.u.l->items[i + 1])));
        if (!rc) rc = set_var(r, &fr, "loop", loop);
        else tv_unref(loop);
        if (!rc) rc = assign(r, &fr, n->a, tv_ref(items.u.l->items[i]));
        int x = rc ? -1 : tmpl_eval_body(r, n->d, &fr, out);
        tv_unref(fr.vars);
        if (x < 0) rc = -1;
        else if (x == EX_BREAK) break;
    }
    tv_unref(items);
    if (!rc && len == 0 && n->list2.n) {   /* the else body: a scope of its own, like the loop body */
        frame fr;
        if (frame_init(r, &fr, f)) return -1;
        frame_scope(&fr, n->list2.v[0]);
        int x = tmpl_eval_body(r, n->list2.v[0], &fr, out);
        tv_unref(fr.vars);
        return x < 0 ? -1 : x;
    }
    return rc ? -1 : 0;
}

static int exec_stmt(rctx *r, frame *f, const tnode *n, sbuf *out) {
    tv v;
    switch (n->kind) {
    case N_TEXT:
        if (sb_put(out, n->lit.u.s->data, n->lit.u.s->len)) return too_big(r, n->line);
        return 0;
    case N_OUTPUT:
        if (eval(r, f, n->a, &v)) return -1;
        {
            int rc = tv_str_append(&r->err, n->line, out, v);
            tv_unref(v);
            return rc;
        }
    case N_IF: {
        if (eval(r, f, n->a, &v)) return -1;
        int t = tv_truthy(v);
        tv_unref(v);
        const tnode *br = t ? n->b : n->c;
        if (!br) return 0;
        if (br->kind == N_IF) return exec_stmt(r, f, br, out);
        return tmpl_eval_body(r, br, f, out);
    }
    case N_FOR: return exec_for(r, f, n, out);
    case N_SET:
        if (eval(r, f, n->b, &v)) return -1;
        return assign(r, f, n->a, v) ? -1 : 0;
    case N_SETBLOCK: case N_FILTERBLOCK: {
        sbuf b = {0};
        b.limit = r->max_output;
        frame fr;                      /* the body is a scope of its own (its sets do not leak) */
        if (frame_init(r, &fr, f)) return -1;
        frame_scope(&fr, n->b);
        int x = tmpl_eval_body(r, n->b, &fr, &b);
        tv_unref(fr.vars);
        if (x < 0) { sb_free(&b); return -1; }
        tv text, res;
        int rc = tv_str_new(&r->err, b.p ? b.p : "", b.n, &text);
        sb_free(&b);
        if (rc) return -1;
        rc = apply_chain(r, f, n->c, text, &res);
        tv_unref(text);
        if (rc) return -1;
        if (n->kind == N_SETBLOCK) return assign(r, f, n->a, res) ? -1 : x;
        rc = tv_str_append(&r->err, n->line, out, res);
        tv_unref(res);
        return rc ? -1 : x;
    }
    case N_MACRO:
        v.kind = TV_MACRO;
        v.u.m = n;
        return set_var(r, f, n->name, v);
    case N_BREAK: return EX_BREAK;
    case N_CONTINUE: return EX_CONTINUE;
    case N_BODY: return tmpl_eval_body(r, n, f, out);
    default:
        return tmpl_fail(&r->err, FP4MOE_EFORMAT, n->line, "internal error: node %d is not a statement", (int)n->kind);
    }
}

/* Returns <0 on error, EX_BREAK / EX_CONTINUE when a loop control left the body, else 0. */
int tmpl_eval_body(rctx *r, const tnode *body, frame *f, sbuf *out) {
    for (size_t i = 0; i < body->list.n; i++) {
        int x = exec_stmt(r, f, body->list.v[i], out);
        if (x != 0) {
            if (x < 0 && !r->err.status) too_big(r, body->list.v[i]->line);
            return x;
        }
    }
    return 0;
}

/* ---- scope analysis (jinja2/idtracking.py) ---------------------------------------------------- */
typedef struct chain { const tv_dict *refs; const struct chain *up; } chain;

static int chain_has(const chain *c, const char *name) {
    int found = 0;
    for (; c && !found; c = c->up) (void)tv_dict_gets(c->refs, name, &found);
    return found;
}

/* d: name -> true (starts undefined) / false (resolved or aliased); the first reference decides */
static int note(tmpl_err *e, tv_dict *d, const chain *up, const char *name, int undefined_first) {
    int found;
    (void)tv_dict_gets(d, name, &found);
    if (found) return 0;
    tv k;
    if (tv_str_new(e, name, strlen(name), &k)) return -1;
    return tv_dict_set(e, d, k, tv_bool(undefined_first && !chain_has(up, name)));
}

static int note_loads(tmpl_err *e, tv_dict *d, const chain *up, const tnode *n) {
    if (!n) return 0;
    if (n->kind == N_NAME && note(e, d, up, n->name, 0)) return -1;
    if (note_loads(e, d, up, n->a) || note_loads(e, d, up, n->b) || note_loads(e, d, up, n->c) ||
        note_loads(e, d, up, n->d))
        return -1;
    for (size_t i = 0; i < n->list.n; i++) if (note_loads(e, d, up, n->list.v[i])) return -1;
    for (size_t i = 0; i < n->list2.n; i++) if (note_loads(e, d, up, n->list2.v[i])) return -1;
    return 0;
}

static int note_store(tmpl_err *e, tv_dict *d, const chain *up, const tnode *t, int in_branch) {
    if (t->kind == N_NAME) return note(e, d, up, t->name, !in_branch);
    if (t->kind == N_GETATTR) return note(e, d, up, t->a->name, 0);     /* ns.attr: a load of ns */
    for (size_t i = 0; i < t->list.n; i++)
        if (note_store(e, d, up, t->list.v[i], in_branch)) return -1;
    return 0;
}

/* One scope's statements in order; if branches belong to the scope (in_branch: stores resolve). */
static int walk_scope(tmpl_err *e, tv_dict *d, const chain *up, const tnode *body, int in_branch) {
    if (!body) return 0;
    for (size_t i = 0; i < body->list.n; i++) {
        const tnode *s = body->list.v[i];
        int rc = 0;
        switch (s->kind) {
        case N_OUTPUT: rc = note_loads(e, d, up, s->a); break;
        case N_SET: rc = note_loads(e, d, up, s->b) || note_store(e, d, up, s->a, in_branch); break;
        case N_SETBLOCK: rc = note_store(e, d, up, s->a, in_branch); break;
        case N_MACRO: rc = note(e, d, up, s->name, !in_branch); break;
        case N_FOR: rc = note_loads(e, d, up, s->b); break;
        case N_FILTERBLOCK: rc = note_loads(e, d, up, s->c); break;
        case N_BODY: rc = walk_scope(e, d, up, s, in_branch); break;
        case N_IF:
            for (const tnode *b = s; b && !rc; b = b->c && b->c->kind == N_IF ? b->c : NULL) {
                rc = note_loads(e, d, up, b->a) || walk_scope(e, d, up, b->b, 1);
                if (!rc && b->c && b->c->kind != N_IF) rc = walk_scope(e, d, up, b->c, 1);
            }
            break;
        default: break;
        }
        if (rc) return -1;
    }
    return 0;
}

static int analyze(tmpl_err *e, tnode *body, const chain *up, const tnode *owner);

/* The scopes nested directly in this scope's statements (inside its if branches too). */
static int analyze_nested(tmpl_err *e, tnode *body, const chain *here) {
    if (!body) return 0;
    for (size_t i = 0; i < body->list.n; i++) {
        tnode *s = body->list.v[i];
        int rc = 0;
        switch (s->kind) {
        case N_FOR:
            rc = analyze(e, s->d, here, s);
            if (!rc && s->list2.n) rc = analyze(e, s->list2.v[0], here, NULL);
            break;
        case N_MACRO: rc = analyze(e, s->b, here, s); break;
        case N_SETBLOCK: case N_FILTERBLOCK: rc = analyze(e, s->b, here, NULL); break;
        case N_BODY: rc = analyze_nested(e, s, here); break;
        case N_IF:
            for (tnode *b = s; b && !rc; b = b->c && b->c->kind == N_IF ? b->c : NULL) {
                rc = analyze_nested(e, b->b, here);
                if (!rc && b->c && b->c->kind != N_IF) rc = analyze_nested(e, b->c, here);
            }
            break;
        default: break;
        }
        if (rc) return -1;
    }
    return 0;
}

static int analyze(tmpl_err *e, tnode *body, const chain *up, const tnode *owner) {
    tv refs;
    if (!body || tv_dict_new(e, &refs)) return body ? -1 : 0;
    int rc = 0;
    if (owner && owner->kind == N_FOR) {           /* loop variables are parameters */
        rc = note(e, refs.u.d, up, "loop", 0) || note_store(e, refs.u.d, up, owner->a, 1) ||
             note_loads(e, refs.u.d, up, owner->c);
    } else if (owner && owner->kind == N_MACRO) {
        for (size_t i = 0; i < owner->list.n && !rc; i++) rc = note(e, refs.u.d, up, owner->list.v[i]->name, 0);
        for (size_t i = 0; i < owner->list.n && !rc; i++) rc = note_loads(e, refs.u.d, up, owner->list.v[i]->a);
    }
    if (!rc) rc = walk_scope(e, refs.u.d, up, body, 0);
    chain here = {refs.u.d, up};
    if (!rc) rc = analyze_nested(e, body, &here);
    tv undef;
    if (!rc) rc = tv_dict_new(e, &undef);
    for (size_t i = 0; i < refs.u.d->n && !rc; i++)
        if (refs.u.d->vals[i].u.b) rc = tv_dict_set(e, undef.u.d, tv_ref(refs.u.d->keys[i]), tv_bool(1));
    tv_unref(refs);
    if (rc) return -1;
    tv_unref(body->scope);
    body->scope = undef;
    return 0;
}

int tmpl_analyze_scopes(tmpl_err *e, tnode *body) { return analyze(e, body, NULL, NULL); }
