/* Template values: refcounted strings, lists, dicts; Python str()/repr(), json.dumps as
 * transformers' tojson calls it (ensure_ascii=False), equality and ordering as in Python. */
#include "template/tmpl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fp4moe/types.h"

int tmpl_fail(tmpl_err *e, int status, int line, const char *fmt, ...) {
    if (e->status) return -1;
    e->status = status;
    e->line = line;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return -1;
}

/* ---- sbuf ------------------------------------------------------------------------------------ */
int sb_put(sbuf *b, const char *s, size_t n) {
    if (b->limit && (n > b->limit || b->n > b->limit - n)) return -1;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) {
            if (cap > SIZE_MAX / 2) return -1;
            cap *= 2;
        }
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return 0;
}
int sb_puts(sbuf *b, const char *s) { return sb_put(b, s, strlen(s)); }
int sb_putc(sbuf *b, char c) { return sb_put(b, &c, 1); }
void sb_free(sbuf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* ---- refcounting ----------------------------------------------------------------------------- */
/* A string with refs < 0 belongs to a compiled template (a literal: tv_make_static) and is shared by every
 * render of it, on any thread (the server renders concurrently): never counted, freed with the template. */
tv tv_ref(tv v) {
    switch (v.kind) {
    case TV_STR: if (v.u.s->refs >= 0) v.u.s->refs++; break;
    case TV_LIST: v.u.l->refs++; break;
    case TV_DICT: case TV_NS: v.u.d->refs++; break;
    default: break;
    }
    return v;
}

/* The bytes of the values alive in the render on this thread (strings, the item arrays of lists and dicts):
 * fp4moe_template_render sets the budget for its render (tv_budget_set), NULL outside renders (the template's
 * literals, made at compile time, are not counted). A list doubled in a loop fails here with a message instead
 * of taking the machine's memory (issue: a 2^30-item list reached 18 GB). */
static _Thread_local tv_budget *cur_budget;

void tv_budget_set(tv_budget *b) { cur_budget = b; }

static int charge(tmpl_err *e, size_t n) {
    tv_budget *b = cur_budget;
    if (!b) return 0;
    if (n > b->limit - b->live || b->live > b->limit)
        return tmpl_fail(e, FP4MOE_EOVERFLOW, 0, "render limit exceeded: more than %zu bytes of lists, dicts and "
                         "strings alive at once", b->limit);
    b->live += n;
    return 0;
}
static void uncharge(size_t n) {
    tv_budget *b = cur_budget;
    if (b) b->live = n < b->live ? b->live - n : 0;
}

void tv_make_static(tv *v) {
    if (v->kind == TV_STR) v->u.s->refs = -1;
}

void tv_free_static(tv v) {
    if (v.kind == TV_STR && v.u.s->refs < 0) free(v.u.s);
    else tv_unref(v);
}

void tv_unref(tv v) {
    switch (v.kind) {
    case TV_STR:
        if (v.u.s->refs >= 0 && --v.u.s->refs == 0) {
            uncharge(sizeof(tv_str) + v.u.s->len + 1);
            free(v.u.s);
        }
        break;
    case TV_LIST:
        if (--v.u.l->refs == 0) {
            for (size_t i = 0; i < v.u.l->n; i++) tv_unref(v.u.l->items[i]);
            uncharge(v.u.l->cap * sizeof(tv));
            free(v.u.l->items);
            free(v.u.l);
        }
        break;
    case TV_DICT: case TV_NS:
        if (--v.u.d->refs == 0) {
            for (size_t i = 0; i < v.u.d->n; i++) {
                tv_unref(v.u.d->keys[i]);
                tv_unref(v.u.d->vals[i]);
            }
            uncharge(2 * v.u.d->cap * sizeof(tv));
            free(v.u.d->keys);
            free(v.u.d->vals);
            free(v.u.d);
        }
        break;
    default: break;
    }
}

int tv_str_new(tmpl_err *e, const char *s, size_t n, tv *out) {
    if (n > SIZE_MAX - sizeof(tv_str) - 1) return tmpl_fail(e, FP4MOE_ENOMEM, 0, "string too long");
    if (charge(e, sizeof(tv_str) + n + 1)) return -1;
    tv_str *p = malloc(sizeof *p + n + 1);
    if (!p) {
        uncharge(sizeof(tv_str) + n + 1);
        return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory (string of %zu bytes)", n);
    }
    p->refs = 1;
    p->len = n;
    if (n) memcpy(p->data, s, n);
    p->data[n] = '\0';
    out->kind = TV_STR;
    out->u.s = p;
    return 0;
}

int tv_list_new(tmpl_err *e, tv *out) {
    tv_list *l = calloc(1, sizeof *l);
    if (!l) return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory (list)");
    l->refs = 1;
    l->depth = 1;
    out->kind = TV_LIST;
    out->u.l = l;
    return 0;
}

int tv_dict_new(tmpl_err *e, tv *out) {
    tv_dict *d = calloc(1, sizeof *d);
    if (!d) return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory (dict)");
    d->refs = 1;
    d->depth = 1;
    out->kind = TV_DICT;
    out->u.d = d;
    return 0;
}

int tv_depth(tv v) {
    if (v.kind == TV_LIST) return v.u.l->depth;
    if (v.kind == TV_DICT || v.kind == TV_NS) return v.u.d->depth;
    return 0;
}

int tv_holds(tv v, const tv_dict *d) {
    if ((v.kind == TV_DICT || v.kind == TV_NS) && v.u.d == d) return 1;
    if (v.kind == TV_LIST) {
        for (size_t i = 0; i < v.u.l->n; i++) if (tv_holds(v.u.l->items[i], d)) return 1;
    } else if (v.kind == TV_DICT || v.kind == TV_NS) {
        for (size_t i = 0; i < v.u.d->n; i++) if (tv_holds(v.u.d->vals[i], d)) return 1;
    }
    return 0;
}

static int too_deep(tmpl_err *e, tv v) {
    tv_unref(v);
    return tmpl_fail(e, FP4MOE_EOVERFLOW, 0, "value nested deeper than %d lists / dicts", TV_MAX_DEPTH);
}

int tv_list_push(tmpl_err *e, tv_list *l, tv v) {
    int dv = tv_depth(v);
    if (dv + 1 > TV_MAX_DEPTH) return too_deep(e, v);
    if (dv + 1 > l->depth) l->depth = dv + 1;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        if (cap >= SIZE_MAX / sizeof(tv) || charge(e, (cap - l->cap) * sizeof(tv))) {
            tv_unref(v);
            return e->status ? -1 : tmpl_fail(e, FP4MOE_ENOMEM, 0, "list of %zu items too long", l->n);
        }
        tv *p = realloc(l->items, cap * sizeof(tv));
        if (!p) {
            uncharge((cap - l->cap) * sizeof(tv));
            tv_unref(v);
            return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory (list of %zu items)", l->n);
        }
        l->items = p;
        l->cap = cap;
    }
    l->items[l->n++] = v;
    return 0;
}

/* Dict keys compare as Python's hash equality: 1 == 1.0 == True. */
static long dict_find(const tv_dict *d, tv key) {
    for (size_t i = 0; i < d->n; i++)
        if (tv_eq(d->keys[i], key)) return (long)i;
    return -1;
}

int tv_dict_set(tmpl_err *e, tv_dict *d, tv key, tv val) {
    int dv = tv_depth(val) > tv_depth(key) ? tv_depth(val) : tv_depth(key);
    if (dv + 1 > TV_MAX_DEPTH) { tv_unref(key); return too_deep(e, val); }
    if (dv + 1 > d->depth) d->depth = dv + 1;   /* an upper bound (a replaced value may have been deeper) */
    long i = dict_find(d, key);
    if (i >= 0) {
        tv_unref(key);
        tv_unref(d->vals[i]);
        d->vals[i] = val;
        return 0;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        if (cap >= SIZE_MAX / sizeof(tv) || charge(e, 2 * (cap - d->cap) * sizeof(tv))) {
            tv_unref(key);
            tv_unref(val);
            return e->status ? -1 : tmpl_fail(e, FP4MOE_ENOMEM, 0, "dict too large");
        }
        tv *k = realloc(d->keys, cap * sizeof(tv));
        if (k) d->keys = k;
        tv *v = k ? realloc(d->vals, cap * sizeof(tv)) : NULL;
        if (v) d->vals = v;
        if (!k || !v) {
            uncharge(2 * (cap - d->cap) * sizeof(tv));
            tv_unref(key);
            tv_unref(val);
            return tmpl_fail(e, FP4MOE_ENOMEM, 0, "out of memory (dict)");
        }
        d->cap = cap;
    }
    d->keys[d->n] = key;
    d->vals[d->n] = val;
    d->n++;
    return 0;
}

tv tv_dict_get(const tv_dict *d, tv key, int *found) {
    long i = dict_find(d, key);
    *found = i >= 0;
    return i >= 0 ? d->vals[i] : tv_undef();
}

tv tv_dict_gets(const tv_dict *d, const char *key, int *found) {
    size_t n = strlen(key);
    for (size_t i = 0; i < d->n; i++) {
        tv k = d->keys[i];
        if (k.kind == TV_STR && k.u.s->len == n && memcmp(k.u.s->data, key, n) == 0) {
            *found = 1;
            return d->vals[i];
        }
    }
    *found = 0;
    return tv_undef();
}

/* On failure *out is undefined (nothing to free: callers may tv_unref it either way). */
int tv_from_json(tmpl_err *e, const cJSON *j, tv *out) {
    if (cJSON_IsNull(j) || !j) { *out = tv_none(); return 0; }
    if (cJSON_IsBool(j)) { *out = tv_bool(cJSON_IsTrue(j)); return 0; }
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (isfinite(d) && d == floor(d) && fabs(d) < 9007199254740992.0) *out = tv_int((int64_t)d);
        else *out = tv_float(d);
        return 0;
    }
    if (cJSON_IsString(j)) {
        const char *s = j->valuestring ? j->valuestring : "";
        return tv_str_new(e, s, strlen(s), out);
    }
    if (cJSON_IsArray(j)) {
        if (tv_list_new(e, out)) return -1;
        for (const cJSON *c = j->child; c; c = c->next) {
            tv x;
            if (tv_from_json(e, c, &x) || tv_list_push(e, out->u.l, x)) { tv_drop(out); return -1; }
        }
        return 0;
    }
    if (cJSON_IsObject(j)) {
        if (tv_dict_new(e, out)) return -1;
        for (const cJSON *c = j->child; c; c = c->next) {
            tv k, x;
            const char *ks = c->string ? c->string : "";
            if (tv_str_new(e, ks, strlen(ks), &k)) { tv_drop(out); return -1; }
            if (tv_from_json(e, c, &x)) { tv_unref(k); tv_drop(out); return -1; }
            if (tv_dict_set(e, out->u.d, k, x)) { tv_drop(out); return -1; }
        }
        return 0;
    }
    return tmpl_fail(e, FP4MOE_EINVAL, 0, "context holds a JSON value of unknown type");
}

/* ---- truth, equality, order ------------------------------------------------------------------ */
int tv_is_num(tv v) { return v.kind == TV_BOOL || v.kind == TV_INT || v.kind == TV_FLOAT; }
double tv_num(tv v) {
    return v.kind == TV_FLOAT ? v.u.f : v.kind == TV_INT ? (double)v.u.i : v.kind == TV_BOOL ? v.u.b : 0;
}
static int64_t tv_ival(tv v) { return v.kind == TV_INT ? v.u.i : v.kind == TV_BOOL ? v.u.b : 0; }

int tv_truthy(tv v) {
    switch (v.kind) {
    case TV_UNDEF: case TV_NONE: return 0;
    case TV_BOOL: return v.u.b;
    case TV_INT: return v.u.i != 0;
    case TV_FLOAT: return v.u.f != 0.0;
    case TV_STR: return v.u.s->len != 0;
    case TV_LIST: return v.u.l->n != 0;
    case TV_DICT: return v.u.d->n != 0;
    default: return 1;
    }
}

int tv_eq(tv a, tv b) {
    if (tv_is_num(a) && tv_is_num(b)) {
        if (a.kind != TV_FLOAT && b.kind != TV_FLOAT) return tv_ival(a) == tv_ival(b);
        return tv_num(a) == tv_num(b);
    }
    if (a.kind != b.kind) return 0;
    switch (a.kind) {
    case TV_UNDEF: case TV_NONE: return 1;
    case TV_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->data, b.u.s->data, a.u.s->len) == 0;
    case TV_LIST:
        if (a.u.l->n != b.u.l->n) return 0;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!tv_eq(a.u.l->items[i], b.u.l->items[i])) return 0;
        return 1;
    case TV_DICT:
        if (a.u.d->n != b.u.d->n) return 0;
        for (size_t i = 0; i < a.u.d->n; i++) {
            int found;
            tv x = tv_dict_get(b.u.d, a.u.d->keys[i], &found);
            if (!found || !tv_eq(a.u.d->vals[i], x)) return 0;
        }
        return 1;
    case TV_NS: return a.u.d == b.u.d;
    case TV_MACRO: return a.u.m == b.u.m;
    case TV_FUNC: return a.u.fn == b.u.fn;
    default: return 0;
    }
}

const char *tv_type_name(tv v) {
    switch (v.kind) {
    case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return "str";
    case TV_LIST: return "list";
    case TV_DICT: return "dict";
    case TV_NS: return "Namespace";
    case TV_MACRO: return "Macro";
    case TV_FUNC: return "function";
    }
    return "?";
}

int tv_cmp(tmpl_err *e, int line, tv a, tv b, int *res) {
    if (tv_is_num(a) && tv_is_num(b)) {
        if (a.kind != TV_FLOAT && b.kind != TV_FLOAT) {
            int64_t x = tv_ival(a), y = tv_ival(b);
            *res = x < y ? -1 : x > y;
        } else {
            double x = tv_num(a), y = tv_num(b);
            *res = x < y ? -1 : x > y;
        }
        return 0;
    }
    if (a.kind == TV_STR && b.kind == TV_STR) {   /* UTF-8 byte order == code point order */
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->data, b.u.s->data, n);
        *res = c ? (c < 0 ? -1 : 1) : (a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len);
        return 0;
    }
    if (a.kind == TV_LIST && b.kind == TV_LIST) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (tv_eq(a.u.l->items[i], b.u.l->items[i])) continue;
            return tv_cmp(e, line, a.u.l->items[i], b.u.l->items[i], res);
        }
        *res = a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
        return 0;
    }
    if (a.kind == TV_UNDEF || b.kind == TV_UNDEF)
        return tmpl_fail(e, FP4MOE_EFORMAT, line, "comparison with an undefined value");
    return tmpl_fail(e, FP4MOE_EFORMAT, line, "'<' not supported between instances of '%s' and '%s'",
                     tv_type_name(a), tv_type_name(b));
}

/* ---- UTF-8 ----------------------------------------------------------------------------------- */
size_t u8_next(const char *s, size_t n, size_t i, uint32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    unsigned c = u[i];
    size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (i + k > n) k = 1;
    for (size_t j = 1; j < k; j++)
        if ((u[i + j] & 0xC0) != 0x80) { k = 1; break; }
    if (cp) {
        if (k == 1) *cp = c;
        else if (k == 2) *cp = ((c & 0x1Fu) << 6) | (u[i + 1] & 0x3Fu);
        else if (k == 3) *cp = ((c & 0x0Fu) << 12) | ((u[i + 1] & 0x3Fu) << 6) | (u[i + 2] & 0x3Fu);
        else *cp = ((c & 0x07u) << 18) | ((u[i + 1] & 0x3Fu) << 12) | ((u[i + 2] & 0x3Fu) << 6) | (u[i + 3] & 0x3Fu);
    }
    return i + k;
}

size_t u8_len(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i = u8_next(s, n, i, NULL)) c++;
    return c;
}

size_t u8_offset(const char *s, size_t n, size_t cp) {
    size_t i = 0;
    while (cp-- && i < n) i = u8_next(s, n, i, NULL);
    return i;
}

int py_isspace(uint32_t c) {   /* Python str.isspace() */
    return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* ---- Python str / repr ----------------------------------------------------------------------- */
void fmt_float(sbuf *b, double f) {
    if (isnan(f)) { sb_puts(b, "nan"); return; }
    if (isinf(f)) { sb_puts(b, f < 0 ? "-inf" : "inf"); return; }
    char buf[64];
    int p;
    for (p = 1; p <= 17; p++) {      /* shortest digits that round-trip, like repr() */
        snprintf(buf, sizeof buf, "%.*e", p - 1, f);
        if (strtod(buf, NULL) == f) break;
    }
    /* buf = [-]d[.ddd]e[+-]XX */
    char digits[32];
    size_t nd = 0;
    const char *q = buf;
    int neg = 0;
    if (*q == '-') { neg = 1; q++; }
    for (; *q && *q != 'e'; q++)
        if (*q >= '0' && *q <= '9' && nd < sizeof digits - 1) digits[nd++] = *q;
    int exp10 = atoi(q + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = '\0';
    if (neg) sb_putc(b, '-');
    if (exp10 >= -5 + 1 && exp10 < 16) {
        if (exp10 >= 0) {
            for (int i = 0; i <= exp10; i++) sb_putc(b, (size_t)i < nd ? digits[i] : '0');
            sb_putc(b, '.');
            if ((size_t)exp10 + 1 < nd) sb_put(b, digits + exp10 + 1, nd - (size_t)exp10 - 1);
            else sb_putc(b, '0');
        } else {
            sb_puts(b, "0.");
            for (int i = 0; i < -exp10 - 1; i++) sb_putc(b, '0');
            sb_put(b, digits, nd);
        }
    } else {
        sb_putc(b, digits[0]);
        if (nd > 1) { sb_putc(b, '.'); sb_put(b, digits + 1, nd - 1); }
        char eb[16];
        snprintf(eb, sizeof eb, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
        sb_puts(b, eb);
    }
}

static int oom(tmpl_err *e, int line) {
    return tmpl_fail(e, FP4MOE_EOVERFLOW, line, "output or string larger than the render limit");
}

static int repr_str(sbuf *b, const char *s, size_t n) {
    int has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    int rc = sb_putc(b, q);
    for (size_t i = 0; i < n && !rc; i++) {
        unsigned char c = (unsigned char)s[i];
        char eb[8];
        if (c == '\\') rc = sb_puts(b, "\\\\");
        else if (c == (unsigned char)q) { eb[0] = '\\'; eb[1] = q; rc = sb_put(b, eb, 2); }
        else if (c == '\n') rc = sb_puts(b, "\\n");
        else if (c == '\r') rc = sb_puts(b, "\\r");
        else if (c == '\t') rc = sb_puts(b, "\\t");
        else if (c < 0x20 || c == 0x7f) { snprintf(eb, sizeof eb, "\\x%02x", c); rc = sb_puts(b, eb); }
        else rc = sb_putc(b, (char)c);
    }
    return rc ? rc : sb_putc(b, q);
}

static int str_or_repr(tmpl_err *e, int line, sbuf *b, tv v, int repr) {
    char nb[32];
    int rc = 0;
    switch (v.kind) {
    case TV_UNDEF: rc = repr ? sb_puts(b, "Undefined") : 0; break;
    case TV_NONE: rc = sb_puts(b, "None"); break;
    case TV_BOOL: rc = sb_puts(b, v.u.b ? "True" : "False"); break;
    case TV_INT: snprintf(nb, sizeof nb, "%lld", (long long)v.u.i); rc = sb_puts(b, nb); break;
    case TV_FLOAT: fmt_float(b, v.u.f); break;
    case TV_STR: rc = repr ? repr_str(b, v.u.s->data, v.u.s->len) : sb_put(b, v.u.s->data, v.u.s->len); break;
    case TV_LIST:
        rc = sb_putc(b, v.u.l->is_tuple ? '(' : '[');
        for (size_t i = 0; i < v.u.l->n && !rc; i++) {
            if (i) rc = sb_puts(b, ", ");
            if (!rc && str_or_repr(e, line, b, v.u.l->items[i], 1)) return -1;
        }
        if (!rc && v.u.l->is_tuple && v.u.l->n == 1) rc = sb_putc(b, ',');
        if (!rc) rc = sb_putc(b, v.u.l->is_tuple ? ')' : ']');
        break;
    case TV_DICT: case TV_NS:
        if (v.kind == TV_NS) rc = sb_puts(b, "<Namespace ");
        if (!rc) rc = sb_putc(b, '{');
        for (size_t i = 0; i < v.u.d->n && !rc; i++) {
            if (i) rc = sb_puts(b, ", ");
            if (!rc && str_or_repr(e, line, b, v.u.d->keys[i], 1)) return -1;
            if (!rc) rc = sb_puts(b, ": ");
            if (!rc && str_or_repr(e, line, b, v.u.d->vals[i], 1)) return -1;
        }
        if (!rc) rc = sb_putc(b, '}');
        if (!rc && v.kind == TV_NS) rc = sb_putc(b, '>');
        break;
    case TV_MACRO: rc = sb_puts(b, "<Macro>"); break;
    case TV_FUNC: rc = sb_puts(b, "<function>"); break;
    }
    return rc ? oom(e, line) : 0;
}

int tv_str_append(tmpl_err *e, int line, sbuf *b, tv v) { return str_or_repr(e, line, b, v, 0); }
int tv_repr_append(tmpl_err *e, int line, sbuf *b, tv v) { return str_or_repr(e, line, b, v, 1); }

int tv_to_str(tmpl_err *e, int line, tv v, tv *out) {
    if (v.kind == TV_STR) { *out = tv_ref(v); return 0; }
    sbuf b = {0};
    if (tv_str_append(e, line, &b, v)) { sb_free(&b); return -1; }
    int rc = tv_str_new(e, b.p ? b.p : "", b.n, out);
    sb_free(&b);
    return rc;
}

/* ---- json.dumps ------------------------------------------------------------------------------ */
static int json_str(sbuf *b, const char *s, size_t n) {
    int rc = sb_putc(b, '"');
    for (size_t i = 0; i < n && !rc; i++) {
        unsigned char c = (unsigned char)s[i];
        char eb[8];
        switch (c) {
        case '"': rc = sb_puts(b, "\\\""); break;
        case '\\': rc = sb_puts(b, "\\\\"); break;
        case '\n': rc = sb_puts(b, "\\n"); break;
        case '\r': rc = sb_puts(b, "\\r"); break;
        case '\t': rc = sb_puts(b, "\\t"); break;
        case '\b': rc = sb_puts(b, "\\b"); break;
        case '\f': rc = sb_puts(b, "\\f"); break;
        default:
            if (c < 0x20) { snprintf(eb, sizeof eb, "\\u%04x", c); rc = sb_puts(b, eb); }
            else rc = sb_putc(b, (char)c);
        }
    }
    return rc ? rc : sb_putc(b, '"');
}

static int json_newline(sbuf *b, int indent, const char *indent_str, int level) {
    if (sb_putc(b, '\n')) return -1;
    for (int i = 0; i < level; i++) {
        if (indent_str) { if (sb_puts(b, indent_str)) return -1; }
        else for (int k = 0; k < indent; k++) if (sb_putc(b, ' ')) return -1;
    }
    return 0;
}

static int json_key(tmpl_err *e, int line, sbuf *b, tv k) {
    switch (k.kind) {
    case TV_STR: return json_str(b, k.u.s->data, k.u.s->len);
    case TV_NONE: return sb_puts(b, "\"null\"");
    case TV_BOOL: return sb_puts(b, k.u.b ? "\"true\"" : "\"false\"");
    case TV_INT: case TV_FLOAT: {
        sbuf t = {0};
        if (tv_str_append(e, line, &t, k)) { sb_free(&t); return -1; }
        int rc = sb_putc(b, '"') || sb_put(b, t.p, t.n) || sb_putc(b, '"');
        sb_free(&t);
        return rc ? -1 : 0;
    }
    default:
        return tmpl_fail(e, FP4MOE_EFORMAT, line, "tojson: keys must be str, int, float, bool or None, not %s",
                         tv_type_name(k));
    }
}

int tv_json_append(tmpl_err *e, int line, sbuf *b, tv v, int indent, const char *indent_str,
                   int sort_keys, int depth) {
    int pretty = indent >= 0 || indent_str;
    if (depth > 200) return tmpl_fail(e, FP4MOE_EOVERFLOW, line, "tojson: value nested too deeply");
    int rc = 0;
    switch (v.kind) {
    case TV_NONE: rc = sb_puts(b, "null"); break;
    case TV_BOOL: rc = sb_puts(b, v.u.b ? "true" : "false"); break;
    case TV_INT: return tv_str_append(e, line, b, v);
    case TV_FLOAT:
        if (isnan(v.u.f)) rc = sb_puts(b, "NaN");
        else if (isinf(v.u.f)) rc = sb_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else fmt_float(b, v.u.f);
        break;
    case TV_STR: rc = json_str(b, v.u.s->data, v.u.s->len); break;
    case TV_LIST:
        if (v.u.l->n == 0) { rc = sb_puts(b, "[]"); break; }
        rc = sb_putc(b, '[');
        for (size_t i = 0; i < v.u.l->n && !rc; i++) {
            if (i) rc = sb_puts(b, pretty ? "," : ", ");
            if (!rc && pretty) rc = json_newline(b, indent, indent_str, depth + 1);
            if (!rc && tv_json_append(e, line, b, v.u.l->items[i], indent, indent_str, sort_keys, depth + 1))
                return -1;
        }
        if (!rc && pretty) rc = json_newline(b, indent, indent_str, depth);
        if (!rc) rc = sb_putc(b, ']');
        break;
    case TV_DICT: {
        const tv_dict *d = v.u.d;
        if (d->n == 0) { rc = sb_puts(b, "{}"); break; }
        size_t *ord = malloc(d->n * sizeof *ord);
        if (!ord) return tmpl_fail(e, FP4MOE_ENOMEM, line, "out of memory");
        for (size_t i = 0; i < d->n; i++) ord[i] = i;
        if (sort_keys) {   /* insertion sort, stable; keys must be mutually orderable */
            for (size_t i = 1; i < d->n; i++)
                for (size_t j = i; j > 0; j--) {
                    int c;
                    if (tv_cmp(e, line, d->keys[ord[j - 1]], d->keys[ord[j]], &c)) { free(ord); return -1; }
                    if (c <= 0) break;
                    size_t t = ord[j]; ord[j] = ord[j - 1]; ord[j - 1] = t;
                }
        }
        rc = sb_putc(b, '{');
        for (size_t k = 0; k < d->n && !rc; k++) {
            size_t i = ord[k];
            if (k) rc = sb_puts(b, pretty ? "," : ", ");
            if (!rc && pretty) rc = json_newline(b, indent, indent_str, depth + 1);
            if (!rc && (json_key(e, line, b, d->keys[i]) || sb_puts(b, ": ") ||
                        tv_json_append(e, line, b, d->vals[i], indent, indent_str, sort_keys, depth + 1))) {
                free(ord);
                return e->status ? -1 : oom(e, line);
            }
        }
        free(ord);
        if (!rc && pretty) rc = json_newline(b, indent, indent_str, depth);
        if (!rc) rc = sb_putc(b, '}');
        break;
    }
    default:
        return tmpl_fail(e, FP4MOE_EFORMAT, line, "tojson: Object of type %s is not JSON serializable",
                         tv_type_name(v));
    }
    return rc ? oom(e, line) : 0;
}
