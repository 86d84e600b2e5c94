/* Builtins: Jinja2's filters and tests (jinja2/filters.py, jinja2/tests.py) with transformers'
 * overrides (tojson = json.dumps(x, ensure_ascii=False, indent, separators, sort_keys);
 * raise_exception; strftime_now; namespace), and the Python str / dict methods templates call. */
#include "template/tmpl.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fp4moe/types.h"

#define FAIL(line, ...) tmpl_fail(&r->err, FP4MOE_EFORMAT, line, __VA_ARGS__)

/* ---- argument access ------------------------------------------------------------------------- */
/* The pos-th positional argument, or the keyword `name`; NULL when absent. */
static const tv *arg(const argv_t *a, size_t pos, const char *name) {
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->names[i]) {
            if (name && !strcmp(a->names[i], name)) return &a->v[i];
        } else if (k++ == pos) {
            return &a->v[i];
        }
    }
    return NULL;
}
static size_t npos(const argv_t *a) {
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) k += a->names[i] == NULL;
    return k;
}
static int arg_bool(const argv_t *a, size_t pos, const char *name, int def) {
    const tv *v = arg(a, pos, name);
    return v ? tv_truthy(*v) : def;
}
static int check_args(rctx *r, int line, const char *what, const argv_t *a, size_t max_pos, const char *const *kws) {
    if (npos(a) > max_pos) return FAIL(line, "%s takes at most %zu positional argument(s), got %zu", what, max_pos, npos(a));
    for (size_t i = 0; i < a->n; i++) {
        if (!a->names[i]) continue;
        int ok = 0;
        for (int k = 0; kws && kws[k]; k++) ok |= !strcmp(kws[k], a->names[i]);
        if (!ok) return FAIL(line, "%s got an unexpected keyword argument '%s'", what, a->names[i]);
    }
    return 0;
}

static int new_str(rctx *r, const char *s, size_t n, tv *out) { return tv_str_new(&r->err, s, n, out); }
static int sbuf_to_str(rctx *r, int line, sbuf *b, tv *out) {
    int rc = tv_str_new(&r->err, b->p ? b->p : "", b->n, out);
    sb_free(b);
    return rc;
}
static int too_big(rctx *r, int line) {
    return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "output or string larger than the render limit (%zu bytes)",
                     r->max_output);
}

/* ---- string helpers -------------------------------------------------------------------------- */
/* Does code point cp occur in chars (a UTF-8 string)? chars == NULL: Python whitespace. */
static int in_set(uint32_t cp, const tv_str *chars) {
    if (!chars) return py_isspace(cp);
    for (size_t i = 0; i < chars->len;) {
        uint32_t c;
        i = u8_next(chars->data, chars->len, i, &c);
        if (c == cp) return 1;
    }
    return 0;
}

static int strip(rctx *r, tv s, const tv *chars, int left, int right, tv *out) {
    const tv_str *cs = NULL;
    if (chars && chars->kind == TV_STR) cs = chars->u.s;
    else if (chars && chars->kind != TV_NONE) return FAIL(0, "strip arg must be None or str");
    const char *p = s.u.s->data;
    size_t n = s.u.s->len, a = 0, b = n;
    if (left)
        while (a < b) {
            uint32_t cp;
            size_t j = u8_next(p, n, a, &cp);
            if (!in_set(cp, cs)) break;
            a = j;
        }
    if (right)
        while (b > a) {
            size_t i = b - 1;
            while (i > a && ((unsigned char)p[i] & 0xC0) == 0x80 && b - i < 4) i--;
            uint32_t cp;
            u8_next(p, n, i, &cp);
            if (!in_set(cp, cs)) break;
            b = i;
        }
    return new_str(r, p + a, b - a, out);
}

/* Simple case mappings of Python's str methods for ASCII, Latin-1, Latin Extended-A, Greek, Cyrillic
 * and fullwidth Latin; other characters have no case here. */
static uint32_t cp_upper(uint32_t c) {
    if (c >= 'a' && c <= 'z') return c - 32;
    if (c < 0x80) return c;
    if (c == 0xB5) return 0x39C;
    if (c >= 0xE0 && c <= 0xFE && c != 0xF7) return c - 0x20;
    if (c == 0xFF) return 0x178;
    if (((c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) && (c & 1)) return c - 1;
    if (((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) && !(c & 1)) return c - 1;
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if ((c >= 0x3B1 && c <= 0x3C1) || (c >= 0x3C3 && c <= 0x3CB)) return c - 0x20;
    if (c == 0x3C2) return 0x3A3;
    if (c == 0x3AC) return 0x386;
    if (c >= 0x3AD && c <= 0x3AF) return c - 0x25;
    if (c == 0x3CC) return 0x38C;
    if (c == 0x3CD || c == 0x3CE) return c - 0x3F;
    if (c >= 0x430 && c <= 0x44F) return c - 0x20;
    if (c >= 0x450 && c <= 0x45F) return c - 0x50;
    if (((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF)) && (c & 1)) return c - 1;
    if (c >= 0xFF41 && c <= 0xFF5A) return c - 0x20;
    return c;
}

static uint32_t cp_lower(uint32_t c) {
    if (c >= 'A' && c <= 'Z') return c + 32;
    if (c < 0x80) return c;
    if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
    if (c == 0x178) return 0xFF;
    if (((c >= 0x100 && c <= 0x12F) || (c >= 0x132 && c <= 0x137) || (c >= 0x14A && c <= 0x177)) && !(c & 1)) return c + 1;
    if (((c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E)) && (c & 1)) return c + 1;
    if ((c >= 0x391 && c <= 0x3A1) || (c >= 0x3A3 && c <= 0x3AB)) return c + 0x20;
    if (c == 0x386) return 0x3AC;
    if (c >= 0x388 && c <= 0x38A) return c + 0x25;
    if (c == 0x38C) return 0x3CC;
    if (c == 0x38E || c == 0x38F) return c + 0x3F;
    if (c >= 0x410 && c <= 0x42F) return c + 0x20;
    if (c >= 0x400 && c <= 0x40F) return c + 0x50;
    if (((c >= 0x460 && c <= 0x481) || (c >= 0x48A && c <= 0x4BF)) && !(c & 1)) return c + 1;
    if (c >= 0xFF21 && c <= 0xFF3A) return c + 0x20;
    return c;
}

static int cp_cased(uint32_t c) {
    return c == 0xDF || c == 0x130 || c == 0x138 || c == 0x149 || cp_upper(c) != c || cp_lower(c) != c;
}

/* Case_Ignorable characters that matter for the final sigma (a subset of Unicode's) */
static int cp_case_ignorable(uint32_t c) {
    return c == '\'' || c == '.' || c == ':' || c == '^' || c == '`' || c == 0xA8 || c == 0xAD || c == 0xAF ||
           c == 0xB4 || c == 0xB7 || c == 0xB8 || (c >= 0x2B0 && c <= 0x36F) || c == 0x2019;
}

static int put_cp(sbuf *b, uint32_t c) {
    char u[4];
    size_t n;
    if (c < 0x80) { u[0] = (char)c; n = 1; }
    else if (c < 0x800) { u[0] = (char)(0xC0 | (c >> 6)); u[1] = (char)(0x80 | (c & 0x3F)); n = 2; }
    else if (c < 0x10000) {
        u[0] = (char)(0xE0 | (c >> 12)); u[1] = (char)(0x80 | ((c >> 6) & 0x3F)); u[2] = (char)(0x80 | (c & 0x3F)); n = 3;
    } else {
        u[0] = (char)(0xF0 | (c >> 18)); u[1] = (char)(0x80 | ((c >> 12) & 0x3F));
        u[2] = (char)(0x80 | ((c >> 6) & 0x3F)); u[3] = (char)(0x80 | (c & 0x3F)); n = 4;
    }
    return sb_put(b, u, n);
}

/* c upper-cased (title: 1 for the title case of a word start) or lower-cased, with Python's
 * multi-character results for U+00DF (SS / Ss), U+0149 and U+0130 (i + combining dot); a capital sigma at
 * the end of a word lowers to the final form, as str.lower() does. */
static int put_case(sbuf *b, uint32_t c, int up, int title, int final_sigma) {
    if (up) {
        if (c == 0xDF) return sb_puts(b, title ? "Ss" : "SS");
        if (c == 0x149) return sb_puts(b, "\xca\xbcN");   /* U+02BC + N */
        return put_cp(b, cp_upper(c));
    }
    if (c == 0x130) return sb_puts(b, "i\xcc\x87");
    if (c == 0x3A3 && final_sigma) return put_cp(b, 0x3C2);
    return put_cp(b, cp_lower(c));
}

/* 0 lower, 1 upper, 2 capitalize, 3 str.title(), 4 the title filter (words start after - space ( { [ <) */
static int case_map(rctx *r, tv s, int mode, tv *out) {
    sbuf b = {0};
    b.limit = r->max_output;
    const char *p = s.u.s->data;
    size_t n = s.u.s->len;
    int prev_cased = 0, last_cased = 0, last_cased_tail = 0, rc = 0;
    for (size_t i = 0; i < n && !rc;) {
        uint32_t c;
        size_t j = u8_next(p, n, i, &c);
        int up;
        if (mode == 0) up = 0;
        else if (mode == 1) up = 1;
        else if (mode == 2) up = i == 0;
        else up = !prev_cased;
        int final_sigma = 0;
        /* Final_Sigma: a cased letter before (for the title filter: within the lower-cased rest of
         * the word, item[1:].lower()), none after */
        if (c == 0x3A3 && !up && (mode == 4 ? last_cased_tail : last_cased)) {
            uint32_t nx = 0;
            size_t k = j;
            while (k < n && (k = u8_next(p, n, k, &nx), cp_case_ignorable(nx))) nx = 0;
            final_sigma = !cp_cased(nx);
        }
        /* the title filter upper-cases word starts (item[0].upper()); the methods title-case them */
        if (up || cp_cased(c)) rc = put_case(&b, c, up, mode == 2 || mode == 3, final_sigma);
        else rc = sb_put(&b, p + i, j - i);
        if (!cp_case_ignorable(c)) {
            last_cased = cp_cased(c);
            last_cased_tail = last_cased && !up;   /* not the (upper-cased) first letter of a word */
        }
        if (up) last_cased_tail = 0;
        if (mode == 4) prev_cased = !(py_isspace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<');
        else prev_cased = cp_cased(c);
        i = j;
    }
    if (rc) { sb_free(&b); return too_big(r, 0); }
    return sbuf_to_str(r, 0, &b, out);
}

static int replace(rctx *r, int line, tv s, tv old, tv nw, int64_t count, tv *out) {
    if (old.kind != TV_STR || nw.kind != TV_STR) return FAIL(line, "replace() arguments must be strings");
    const char *p = s.u.s->data, *o = old.u.s->data, *w = nw.u.s->data;
    size_t n = s.u.s->len, on = old.u.s->len, wn = nw.u.s->len;
    sbuf b = {0};
    b.limit = r->max_output;
    int64_t done = 0;
    size_t i = 0;
    if (on == 0) {   /* Python: insert between every character */
        while (1) {
            if ((count < 0 || done < count)) { if (sb_put(&b, w, wn)) goto big; done++; }
            if (i >= n) break;
            size_t j = u8_next(p, n, i, NULL);
            if (sb_put(&b, p + i, j - i)) goto big;
            i = j;
        }
        return sbuf_to_str(r, line, &b, out);
    }
    while (i < n) {
        const char *hit = (count < 0 || done < count) ? memmem(p + i, n - i, o, on) : NULL;
        if (!hit) { if (sb_put(&b, p + i, n - i)) goto big; break; }
        size_t h = (size_t)(hit - p);
        if (sb_put(&b, p + i, h - i) || sb_put(&b, w, wn)) goto big;
        i = h + on;
        done++;
    }
    return sbuf_to_str(r, line, &b, out);
big:
    sb_free(&b);
    return too_big(r, line);
}

static int split(rctx *r, int line, tv s, const tv *sep, int64_t maxsplit, tv *out) {
    const char *p = s.u.s->data;
    size_t n = s.u.s->len;
    if (tv_list_new(&r->err, out)) return -1;
    tv piece;
    int64_t done = 0;
    if (!sep || sep->kind == TV_NONE) {   /* runs of whitespace; no empty strings */
        size_t i = 0;
        for (;;) {
            uint32_t cp;
            while (i < n) { size_t j = u8_next(p, n, i, &cp); if (!py_isspace(cp)) break; i = j; }
            if (i >= n) break;
            size_t a = i;
            if (maxsplit >= 0 && done >= maxsplit) {
                size_t b = n;   /* rest, right-stripped */
                while (b > a) {
                    size_t k = b - 1;
                    while (k > a && ((unsigned char)p[k] & 0xC0) == 0x80) k--;
                    u8_next(p, n, k, &cp);
                    if (!py_isspace(cp)) break;
                    b = k;
                }
                if (new_str(r, p + a, b - a, &piece) || tv_list_push(&r->err, out->u.l, piece)) goto fail;
                break;
            }
            while (i < n) { size_t j = u8_next(p, n, i, &cp); if (py_isspace(cp)) break; i = j; }
            if (new_str(r, p + a, i - a, &piece) || tv_list_push(&r->err, out->u.l, piece)) goto fail;
            done++;
        }
        return 0;
    }
    if (sep->kind != TV_STR) { tv_drop(out); return FAIL(line, "split() separator must be str or None"); }
    const char *q = sep->u.s->data;
    size_t qn = sep->u.s->len;
    if (qn == 0) { tv_drop(out); return FAIL(line, "ValueError: empty separator"); }
    size_t i = 0;
    for (;;) {
        const char *hit = (maxsplit < 0 || done < maxsplit) ? memmem(p + i, n - i, q, qn) : NULL;
        size_t e = hit ? (size_t)(hit - p) : n;
        if (new_str(r, p + i, e - i, &piece) || tv_list_push(&r->err, out->u.l, piece)) goto fail;
        if (!hit) break;
        i = e + qn;
        done++;
    }
    return 0;
fail:
    tv_drop(out);
    return -1;
}

/* ---- global functions ------------------------------------------------------------------------ */
int tmpl_global_fn(const char *name) {
    if (!strcmp(name, "namespace")) return FN_NAMESPACE;
    if (!strcmp(name, "raise_exception")) return FN_RAISE;
    if (!strcmp(name, "range")) return FN_RANGE;
    if (!strcmp(name, "dict")) return FN_DICT;
    if (!strcmp(name, "strftime_now")) return FN_STRFTIME;
    return 0;
}

static int kwargs_into(rctx *r, int line, const argv_t *a, tv_dict *d, int allow_one_pos) {
    size_t np = npos(a);
    if (np > (size_t)allow_one_pos) return FAIL(line, "expected at most %d positional argument(s)", allow_one_pos);
    const tv *first = np ? arg(a, 0, NULL) : NULL;
    if (first) {
        if (first->kind != TV_DICT && first->kind != TV_NS) return FAIL(line, "expected a mapping argument");
        for (size_t i = 0; i < first->u.d->n; i++)
            if (tv_dict_set(&r->err, d, tv_ref(first->u.d->keys[i]), tv_ref(first->u.d->vals[i]))) return -1;
    }
    for (size_t i = 0; i < a->n; i++) {
        if (!a->names[i]) continue;
        tv k;
        if (new_str(r, a->names[i], strlen(a->names[i]), &k)) return -1;
        if (tv_dict_set(&r->err, d, k, tv_ref(a->v[i]))) return -1;
    }
    return 0;
}

int tmpl_call_fn(rctx *r, int line, int fn, const argv_t *a, tv *out) {
    switch (fn) {
    case FN_NAMESPACE: case FN_DICT:
        if (tv_dict_new(&r->err, out)) return -1;
        if (fn == FN_NAMESPACE) out->kind = TV_NS;
        if (kwargs_into(r, line, a, out->u.d, 1)) { tv_drop(out); return -1; }
        if (fn == FN_NAMESPACE)
            for (size_t i = 0; i < out->u.d->n; i++) {
                tv k = out->u.d->keys[i];
                if (k.kind == TV_STR && k.u.s->len && k.u.s->data[0] == '_') {
                    tv_drop(out);
                    return FAIL(line, "Chat templates cannot store underscore-prefixed attributes on a namespace");
                }
            }
        return 0;
    case FN_RAISE: {
        const tv *m = arg(a, 0, "message");
        sbuf b = {0};
        if (m && tv_str_append(&r->err, line, &b, *m)) { sb_free(&b); return -1; }
        tmpl_fail(&r->err, FP4MOE_EINVAL, line, "%s", b.p ? b.p : "");
        sb_free(&b);
        return -1;
    }
    case FN_RANGE: {
        size_t np = npos(a);
        if (np < 1 || np > 3 || np != a->n) return FAIL(line, "range expected 1 to 3 integer arguments");
        int64_t v[3];
        for (size_t i = 0; i < np; i++) {
            if (a->v[i].kind != TV_INT && a->v[i].kind != TV_BOOL) return FAIL(line, "range() arguments must be integers");
            v[i] = a->v[i].kind == TV_INT ? a->v[i].u.i : a->v[i].u.b;
        }
        int64_t start = np == 1 ? 0 : v[0], stop = np == 1 ? v[0] : v[1], step = np == 3 ? v[2] : 1;
        if (step == 0) return FAIL(line, "range() arg 3 must not be zero");
        if (tv_list_new(&r->err, out)) return -1;
        for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
            if (tmpl_step(r, line) || tv_list_push(&r->err, out->u.l, tv_int(i))) { tv_drop(out); return -1; }
            if (__builtin_add_overflow(i, step, &i)) break;
        }
        return 0;
    }
    case FN_STRFTIME: {
        const tv *f = arg(a, 0, NULL);
        if (!f || f->kind != TV_STR) return FAIL(line, "strftime_now expects a format string");
        time_t now = time(NULL);
        struct tm tm;
        char buf[512];
        if (!localtime_r(&now, &tm)) return FAIL(line, "strftime_now: no local time");
        size_t n = strftime(buf, sizeof buf, f->u.s->data, &tm);
        return new_str(r, buf, n, out);
    }
    default:
        return FAIL(line, "unknown function");
    }
}

/* ---- methods --------------------------------------------------------------------------------- */
static int64_t arg_int(const tv *v, int64_t def) {
    if (!v || v->kind == TV_NONE) return def;
    return v->kind == TV_INT ? v->u.i : v->kind == TV_BOOL ? v->u.b : def;
}

static int starts_ends(rctx *r, int line, tv s, const tv *x, int ends, int *res) {
    if (!x) return FAIL(line, "%s() takes at least 1 argument", ends ? "endswith" : "startswith");
    if (x->kind == TV_LIST) {
        *res = 0;
        for (size_t i = 0; i < x->u.l->n && !*res; i++)
            if (starts_ends(r, line, s, &x->u.l->items[i], ends, res)) return -1;
        return 0;
    }
    if (x->kind != TV_STR) return FAIL(line, "%s() argument must be str or a tuple of str", ends ? "endswith" : "startswith");
    size_t n = s.u.s->len, k = x->u.s->len;
    *res = k <= n && memcmp(s.u.s->data + (ends ? n - k : 0), x->u.s->data, k) == 0;
    return 0;
}

static int str_method(rctx *r, int line, tv s, const char *m, const argv_t *a, tv *out, int *handled) {
    *handled = 1;
    const tv *a0 = arg(a, 0, NULL), *a1 = arg(a, 1, NULL);
    if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip"))
        return strip(r, s, a0, m[0] != 'r', m[0] != 'l', out);
    if (!strcmp(m, "split") || !strcmp(m, "rsplit")) {
        const tv *sep = arg(a, 0, "sep");
        int64_t maxs = arg_int(arg(a, 1, "maxsplit"), -1);
        if (m[0] == 'r' && maxs >= 0) return FAIL(line, "rsplit with maxsplit is not supported");
        return split(r, line, s, sep, maxs, out);
    }
    if (!strcmp(m, "replace")) {
        if (!a0 || !a1) return FAIL(line, "replace() takes at least 2 arguments");
        return replace(r, line, s, *a0, *a1, arg_int(arg(a, 2, "count"), -1), out);
    }
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
        int res;
        if (starts_ends(r, line, s, a0, m[0] == 'e', &res)) return -1;
        *out = tv_bool(res);
        return 0;
    }
    if (!strcmp(m, "upper")) return case_map(r, s, 1, out);
    if (!strcmp(m, "lower")) return case_map(r, s, 0, out);
    if (!strcmp(m, "capitalize")) return case_map(r, s, 2, out);
    if (!strcmp(m, "title")) return case_map(r, s, 3, out);
    if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "count")) {
        if (!a0 || a0->kind != TV_STR) return FAIL(line, "%s() argument must be str", m);
        const char *p = s.u.s->data;
        size_t n = s.u.s->len, k = a0->u.s->len;
        if (!strcmp(m, "count")) {
            int64_t c = 0;
            if (k == 0) c = (int64_t)u8_len(p, n) + 1;
            else for (const char *h = p; (h = memmem(h, (size_t)(p + n - h), a0->u.s->data, k)); h += k) c++;
            *out = tv_int(c);
            return 0;
        }
        long pos = -1;
        if (m[0] == 'r') {
            for (size_t i = n >= k ? n - k + 1 : 0; i-- > 0;)
                if (!memcmp(p + i, a0->u.s->data, k)) { pos = (long)i; break; }
        } else {
            const char *h = k ? memmem(p, n, a0->u.s->data, k) : p;
            if (h) pos = (long)(h - p);
        }
        if (pos < 0 && m[0] == 'i') return FAIL(line, "ValueError: substring not found");
        *out = tv_int(pos < 0 ? -1 : (int64_t)u8_len(p, (size_t)pos));
        return 0;
    }
    if (!strcmp(m, "join")) {
        tv items;
        if (!a0) return FAIL(line, "join() takes exactly one argument");
        if (tmpl_iter_list(r, line, *a0, &items)) return -1;
        sbuf b = {0};
        b.limit = r->max_output;
        for (size_t i = 0; i < items.u.l->n; i++) {
            tv x = items.u.l->items[i];
            if (x.kind != TV_STR) { tv_unref(items); sb_free(&b); return FAIL(line, "sequence item %zu: expected str instance, %s found", i, tv_type_name(x)); }
            if ((i && sb_put(&b, s.u.s->data, s.u.s->len)) || sb_put(&b, x.u.s->data, x.u.s->len)) { tv_unref(items); sb_free(&b); return too_big(r, line); }
        }
        tv_unref(items);
        return sbuf_to_str(r, line, &b, out);
    }
    if (!strcmp(m, "isdigit") || !strcmp(m, "isalpha") || !strcmp(m, "isspace") || !strcmp(m, "isalnum") ||
        !strcmp(m, "isupper") || !strcmp(m, "islower")) {
        const char *p = s.u.s->data;
        size_t n = s.u.s->len;
        int ok = n > 0, cased = 0;
        for (size_t i = 0; i < n && ok; i++) {
            unsigned char c = (unsigned char)p[i];
            if (!strcmp(m, "isdigit")) ok = isdigit(c);
            else if (!strcmp(m, "isalpha")) ok = isalpha(c) || c >= 0x80;
            else if (!strcmp(m, "isalnum")) ok = isalnum(c) || c >= 0x80;
            else if (!strcmp(m, "isspace")) ok = isspace(c);
            else if (!strcmp(m, "isupper")) { if (islower(c)) ok = 0; cased |= isupper(c) != 0; }
            else { if (isupper(c)) ok = 0; cased |= islower(c) != 0; }
        }
        if (!strcmp(m, "isupper") || !strcmp(m, "islower")) ok = ok && cased;
        *out = tv_bool(ok);
        return 0;
    }
    *handled = 0;
    return 0;
}

int tmpl_method(rctx *r, int line, tv obj, const char *m, const argv_t *a, tv *out, int *handled) {
    *handled = 0;
    if (obj.kind == TV_STR) return str_method(r, line, obj, m, a, out, handled);
    if (obj.kind == TV_DICT || obj.kind == TV_NS) {
        tv_dict *d = obj.u.d;
        if (d->is_loop && !strcmp(m, "cycle")) {
            *handled = 1;
            if (!a->n) return FAIL(line, "no items for cycling given");
            int found;
            tv i0 = tv_dict_gets(d, "index0", &found);
            *out = tv_ref(a->v[(size_t)i0.u.i % a->n]);
            return 0;
        }
        if (obj.kind == TV_NS) return 0;
        if (!strcmp(m, "items") || !strcmp(m, "keys") || !strcmp(m, "values")) {
            *handled = 1;
            if (tv_list_new(&r->err, out)) return -1;
            for (size_t i = 0; i < d->n; i++) {
                tv x;
                if (m[0] == 'k') x = tv_ref(d->keys[i]);
                else if (m[0] == 'v') x = tv_ref(d->vals[i]);
                else {
                    if (tv_list_new(&r->err, &x)) { tv_drop(out); return -1; }
                    x.u.l->is_tuple = 1;
                    if (tv_list_push(&r->err, x.u.l, tv_ref(d->keys[i])) || tv_list_push(&r->err, x.u.l, tv_ref(d->vals[i]))) {
                        tv_unref(x);
                        tv_drop(out);
                        return -1;
                    }
                }
                if (tv_list_push(&r->err, out->u.l, x)) { tv_drop(out); return -1; }
            }
            return 0;
        }
        if (!strcmp(m, "get")) {
            *handled = 1;
            const tv *k = arg(a, 0, NULL), *def = arg(a, 1, NULL);
            if (!k) return FAIL(line, "get expected at least 1 argument");
            int found;
            tv v = tv_dict_get(d, *k, &found);
            *out = found ? tv_ref(v) : def ? tv_ref(*def) : tv_none();
            return 0;
        }
        if (!strcmp(m, "pop") || !strcmp(m, "update") || !strcmp(m, "clear") || !strcmp(m, "setdefault") ||
            !strcmp(m, "popitem")) {
            *handled = 1;
            return FAIL(line, "access to attribute '%s' of 'dict' object is unsafe (the sandbox forbids changing values)", m);
        }
    }
    if (obj.kind == TV_LIST && (!strcmp(m, "append") || !strcmp(m, "pop") || !strcmp(m, "extend") ||
                                !strcmp(m, "insert") || !strcmp(m, "remove") || !strcmp(m, "clear") ||
                                !strcmp(m, "sort") || !strcmp(m, "reverse"))) {
        *handled = 1;
        return FAIL(line, "access to attribute '%s' of 'list' object is unsafe (the sandbox forbids changing values)", m);
    }
    return 0;
}

/* ---- tests ----------------------------------------------------------------------------------- */
static const char *const TESTS[] = {
    "defined", "undefined", "none", "mapping", "sequence", "string", "number", "integer", "float",
    "iterable", "boolean", "true", "false", "in", "equalto", "eq", "==", "ne", "!=", "sameas",
    "divisibleby", "odd", "even", "callable", "lower", "upper", "gt", "ge", "lt", "le",
    "greaterthan", "lessthan", ">", ">=", "<", "<=", "escaped", "filter", "test", NULL};

int tmpl_has_test(const char *name) {
    for (int i = 0; TESTS[i]; i++) if (!strcmp(TESTS[i], name)) return 1;
    return 0;
}

int tmpl_test(rctx *r, int line, const char *t, tv v, const argv_t *a, int *out) {
    const tv *x = arg(a, 0, NULL);
    static const char *const one_arg[] = {"in", "equalto", "eq", "==", "ne", "!=", "sameas", "divisibleby", "gt", "ge",
                                          "lt", "le", "greaterthan", "lessthan", ">", ">=", "<", "<=", NULL};
    size_t want = 0;
    for (int i = 0; one_arg[i]; i++) if (!strcmp(one_arg[i], t)) want = 1;
    if (a->n > want) return FAIL(line, "test '%s' takes %zu argument(s), got %zu", t, want, a->n);
    if (!strcmp(t, "defined")) { *out = v.kind != TV_UNDEF; return 0; }
    if (!strcmp(t, "undefined")) { *out = v.kind == TV_UNDEF; return 0; }
    if (!strcmp(t, "none")) { *out = v.kind == TV_NONE; return 0; }
    if (!strcmp(t, "mapping")) { *out = v.kind == TV_DICT; return 0; }
    if (!strcmp(t, "sequence")) { *out = v.kind == TV_STR || v.kind == TV_LIST || v.kind == TV_DICT || v.kind == TV_UNDEF; return 0; }
    if (!strcmp(t, "string")) { *out = v.kind == TV_STR; return 0; }
    if (!strcmp(t, "number")) { *out = tv_is_num(v); return 0; }
    if (!strcmp(t, "integer")) { *out = v.kind == TV_INT; return 0; }
    if (!strcmp(t, "float")) { *out = v.kind == TV_FLOAT; return 0; }
    if (!strcmp(t, "iterable")) {
        *out = v.kind == TV_STR || v.kind == TV_LIST || v.kind == TV_DICT || v.kind == TV_UNDEF;
        return 0;
    }
    if (!strcmp(t, "boolean")) { *out = v.kind == TV_BOOL; return 0; }
    if (!strcmp(t, "true")) { *out = v.kind == TV_BOOL && v.u.b; return 0; }
    if (!strcmp(t, "false")) { *out = v.kind == TV_BOOL && !v.u.b; return 0; }
    if (!strcmp(t, "callable")) { *out = v.kind == TV_MACRO || v.kind == TV_FUNC; return 0; }
    if (!strcmp(t, "escaped")) { *out = 0; return 0; }
    if (!strcmp(t, "filter") || !strcmp(t, "test")) {   /* `'upper' is filter`: is there one so named */
        *out = v.kind == TV_STR && (t[0] == 'f' ? tmpl_has_filter(v.u.s->data) : tmpl_has_test(v.u.s->data));
        return 0;
    }
    if (!strcmp(t, "lower") || !strcmp(t, "upper")) {
        if (v.kind != TV_STR) return FAIL(line, "test '%s' expects a string", t);
        int ok = 1, cased = 0;
        for (size_t i = 0; i < v.u.s->len; i++) {
            unsigned char c = (unsigned char)v.u.s->data[i];
            if (t[0] == 'l' ? isupper(c) : islower(c)) ok = 0;
            cased |= t[0] == 'l' ? islower(c) != 0 : isupper(c) != 0;
        }
        *out = ok && cased;
        return 0;
    }
    if (!strcmp(t, "odd") || !strcmp(t, "even")) {   /* value % 2 == 1 / == 0, Python's float % too */
        if (!tv_is_num(v)) return FAIL(line, "test '%s' expects a number, got %s", t, tv_type_name(v));
        if (v.kind == TV_FLOAT) {
            double m = fmod(v.u.f, 2.0);
            if (m < 0) m += 2.0;
            *out = t[0] == 'o' ? m == 1.0 : m == 0.0;
            return 0;
        }
        int64_t i = v.kind == TV_INT ? v.u.i : v.u.b;
        *out = (i % 2 != 0) == (t[0] == 'o');
        return 0;
    }
    if (!x) return FAIL(line, "test '%s' needs an argument", t);
    if (!strcmp(t, "in")) {
        if (x->kind == TV_STR) {
            if (v.kind != TV_STR) return FAIL(line, "'in <string>' requires string as left operand");
            *out = memmem(x->u.s->data, x->u.s->len, v.u.s->data, v.u.s->len) != NULL || v.u.s->len == 0;
            return 0;
        }
        if (x->kind == TV_LIST) {
            *out = 0;
            for (size_t i = 0; i < x->u.l->n && !*out; i++) *out = tv_eq(v, x->u.l->items[i]);
            return 0;
        }
        if (x->kind == TV_DICT || x->kind == TV_NS) { (void)tv_dict_get(x->u.d, v, out); return 0; }
        return FAIL(line, "argument of type '%s' is not iterable", tv_type_name(*x));
    }
    if (!strcmp(t, "equalto") || !strcmp(t, "eq") || !strcmp(t, "==")) { *out = tv_eq(v, *x); return 0; }
    if (!strcmp(t, "ne") || !strcmp(t, "!=")) { *out = !tv_eq(v, *x); return 0; }
    if (!strcmp(t, "sameas")) {
        *out = v.kind == x->kind && ((v.kind <= TV_BOOL && tv_eq(v, *x)) ||
                                     (v.kind >= TV_STR && v.kind <= TV_NS && v.u.l == x->u.l));
        return 0;
    }
    if (!strcmp(t, "divisibleby")) {
        if (!tv_is_num(v) || !tv_is_num(*x)) return FAIL(line, "test 'divisibleby' expects numbers");
        if (v.kind == TV_FLOAT || x->kind == TV_FLOAT) {
            double y = tv_num(*x);
            if (y == 0) return FAIL(line, "float modulo by zero");
            double m = fmod(tv_num(v), y);
            if (m != 0 && ((m < 0) != (y < 0))) m += y;
            *out = m == 0.0;
            return 0;
        }
        int64_t i = v.kind == TV_INT ? v.u.i : v.u.b, j = x->kind == TV_INT ? x->u.i : x->u.b;
        if (j == 0) return FAIL(line, "integer division or modulo by zero");
        *out = j == -1 || i % j == 0;
        return 0;
    }
    int c;
    if (tv_cmp(&r->err, line, v, *x, &c)) return -1;
    if (!strcmp(t, "gt") || !strcmp(t, ">") || !strcmp(t, "greaterthan")) *out = c > 0;
    else if (!strcmp(t, "ge") || !strcmp(t, ">=")) *out = c >= 0;
    else if (!strcmp(t, "lt") || !strcmp(t, "<") || !strcmp(t, "lessthan")) *out = c < 0;
    else *out = c <= 0;
    return 0;
}

/* ---- filters --------------------------------------------------------------------------------- */
typedef int (*filter_fn)(rctx *r, int line, tv v, const argv_t *a, tv *out);

/* attribute lookup for map/selectattr/sort/...: "a.b.0" paths as in jinja2's make_attrgetter */
static int attr_path(rctx *r, int line, tv v, const tv *attr, tv *out) {
    if (attr->kind == TV_INT) return tmpl_getitem(r, line, v, *attr, out);
    if (attr->kind != TV_STR) return FAIL(line, "attribute must be a string or an integer");
    tv cur = tv_ref(v);
    const char *p = attr->u.s->data;
    while (1) {
        const char *dot = strchr(p, '.');
        size_t len = dot ? (size_t)(dot - p) : strlen(p);
        char part[256];
        if (len >= sizeof part) len = sizeof part - 1;
        memcpy(part, p, len);
        part[len] = '\0';
        tv next, key;
        int is_num = len > 0;
        for (size_t i = 0; i < len; i++) is_num &= isdigit((unsigned char)part[i]) != 0;
        if (cur.kind == TV_UNDEF) { *out = cur; return 0; }
        int rc;
        if (is_num && len < 18) key = tv_int(strtoll(part, NULL, 10)), rc = 0;
        else rc = new_str(r, part, len, &key);
        if (rc) { tv_unref(cur); return -1; }
        rc = (cur.kind == TV_DICT || cur.kind == TV_NS || cur.kind == TV_LIST || cur.kind == TV_STR)
                 ? tmpl_getitem(r, line, cur, key, &next)
                 : (next = tv_undef(), 0);
        tv_unref(key);
        tv_unref(cur);
        if (rc) return -1;
        cur = next;
        if (!dot) break;
        p = dot + 1;
    }
    *out = cur;
    return 0;
}

static int f_tojson(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    static const char *const kws[] = {"indent", "ensure_ascii", "separators", "sort_keys", NULL};
    if (check_args(r, line, "tojson", a, 4, kws)) return -1;
    const tv *ind = arg(a, 0, "indent"), *ea = arg(a, 1, "ensure_ascii"), *sep = arg(a, 2, "separators");
    if (ea && tv_truthy(*ea)) return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, line, "tojson(ensure_ascii=True) is not supported");
    if (sep && sep->kind != TV_NONE) return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, line, "tojson(separators=...) is not supported");
    int indent = -1;
    const char *indent_str = NULL;
    if (ind && ind->kind == TV_INT) indent = ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : (int)ind->u.i;
    else if (ind && ind->kind == TV_STR) indent_str = ind->u.s->data;
    else if (ind && ind->kind != TV_NONE) return FAIL(line, "tojson: indent must be an integer, a string or None");
    sbuf b = {0};
    b.limit = r->max_output;
    if (tv_json_append(&r->err, line, &b, v, indent, indent_str, arg_bool(a, 3, "sort_keys", 0), 0)) {
        sb_free(&b);
        return -1;
    }
    return sbuf_to_str(r, line, &b, out);
}

/* Markup(value): a string (no autoescape here, so only the conversion shows) */
static int f_safe(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind == TV_UNDEF) return new_str(r, "", 0, out);
    return tv_to_str(&r->err, line, v, out);
}

static int f_string(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind == TV_UNDEF) return new_str(r, "", 0, out);
    return tv_to_str(&r->err, line, v, out);
}

static int f_trim(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int rc = strip(r, s, arg(a, 0, "chars"), 1, 1, out);
    tv_unref(s);
    return rc;
}

static int f_length(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    switch (v.kind) {
    case TV_UNDEF: *out = tv_int(0); return 0;
    case TV_STR: *out = tv_int((int64_t)u8_len(v.u.s->data, v.u.s->len)); return 0;
    case TV_LIST: *out = tv_int((int64_t)v.u.l->n); return 0;
    case TV_DICT: *out = tv_int((int64_t)v.u.d->n); return 0;
    default: return FAIL(line, "object of type '%s' has no len()", tv_type_name(v));
    }
}

static int f_default(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *d = arg(a, 0, "default_value");
    int boolean = arg_bool(a, 1, "boolean", 0);
    if (v.kind != TV_UNDEF && !(boolean && !tv_truthy(v))) { *out = tv_ref(v); return 0; }
    if (d) { *out = tv_ref(*d); return 0; }
    return new_str(r, "", 0, out);
}

static int f_items(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind == TV_UNDEF) return tv_list_new(&r->err, out);
    if (v.kind != TV_DICT) return FAIL(line, "Can only get item pairs from a mapping, not %s", tv_type_name(v));
    int handled;
    argv_t none = {NULL, NULL, 0};
    return tmpl_method(r, line, v, "items", &none, out, &handled);
}

static int f_dictsort(rctx *r, int line, tv v, const argv_t *a, tv *out);
static int f_upper(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int rc = case_map(r, s, 1, out);
    tv_unref(s);
    return rc;
}
static int f_lower(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int rc = case_map(r, s, 0, out);
    tv_unref(s);
    return rc;
}
static int f_capitalize(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int rc = case_map(r, s, 2, out);
    tv_unref(s);
    return rc;
}
static int f_title(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int rc = case_map(r, s, 4, out);
    tv_unref(s);
    return rc;
}

static int f_replace(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *o = arg(a, 0, "old"), *n = arg(a, 1, "new");
    if (!o || !n) return FAIL(line, "replace needs old and new");
    tv s, os, ns;
    if (f_string(r, line, v, a, &s)) return -1;
    if (tv_to_str(&r->err, line, *o, &os)) { tv_unref(s); return -1; }
    if (tv_to_str(&r->err, line, *n, &ns)) { tv_unref(s); tv_unref(os); return -1; }
    int rc = replace(r, line, s, os, ns, arg_int(arg(a, 2, "count"), -1), out);
    tv_unref(s);
    tv_unref(os);
    tv_unref(ns);
    return rc;
}

static int f_list(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv l;
    if (tmpl_iter_list(r, line, v, &l)) return -1;
    if (v.kind != TV_LIST) { *out = l; return 0; }
    /* a copy */
    if (tv_list_new(&r->err, out)) { tv_unref(l); return -1; }
    for (size_t i = 0; i < l.u.l->n; i++)
        if (tv_list_push(&r->err, out->u.l, tv_ref(l.u.l->items[i]))) { tv_unref(l); tv_drop(out); return -1; }
    tv_unref(l);
    return 0;
}

static int f_first_last(rctx *r, int line, tv v, const argv_t *a, tv *out, int last) {
    tv l;
    if (tmpl_iter_list(r, line, v, &l)) return -1;
    *out = l.u.l->n ? tv_ref(l.u.l->items[last ? l.u.l->n - 1 : 0]) : tv_undef();
    tv_unref(l);
    return 0;
}
static int f_first(rctx *r, int line, tv v, const argv_t *a, tv *out) { return f_first_last(r, line, v, a, out, 0); }
static int f_last(rctx *r, int line, tv v, const argv_t *a, tv *out) { return f_first_last(r, line, v, a, out, 1); }

/* Python int(str) / float(str) with surrounding whitespace and underscores rejected -> default */
static int f_int(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *d = arg(a, 0, "default");
    int64_t base = arg_int(arg(a, 1, "base"), 10);
    tv def = d ? *d : tv_int(0);
    if (v.kind == TV_INT || v.kind == TV_BOOL) { *out = tv_int(v.kind == TV_INT ? v.u.i : v.u.b); return 0; }
    /* Python's int() of a number past 64 bits is a bigint here an overflow error (the header's known difference),
     * not the default; NaN gives the default (ValueError, as jinja2's do_int) */
    if (v.kind == TV_FLOAT) {
        if (isnan(v.u.f)) { *out = tv_ref(def); return 0; }
        if (!(fabs(v.u.f) < 9.2e18))
            return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "int(%g): integer overflow (integers are 64-bit here)", v.u.f);
        *out = tv_int((int64_t)v.u.f);
        return 0;
    }
    if (v.kind == TV_STR) {
        char *end;
        const char *s = v.u.s->data;
        while (isspace((unsigned char)*s)) s++;
        if (*s && base >= 2 && base <= 36) {
            errno = 0;
            long long x = strtoll(s, &end, (int)base);
            const int range = errno == ERANGE;
            while (isspace((unsigned char)*end)) end++;
            if (*end == '\0' && end != s) {
                if (range)
                    return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "int('%.40s'): integer overflow (integers are 64-bit "
                                     "here)", v.u.s->data);
                *out = tv_int(x);
                return 0;
            }
            double f = strtod(s, &end);
            while (isspace((unsigned char)*end)) end++;
            if (*end == '\0' && end != s && !isnan(f)) {
                if (!(fabs(f) < 9.2e18))
                    return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "int('%.40s'): integer overflow (integers are 64-bit "
                                     "here)", v.u.s->data);
                *out = tv_int((int64_t)f);
                return 0;
            }
        }
    }
    *out = tv_ref(def);
    return 0;
}

static int f_float(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *d = arg(a, 0, "default");
    tv def = d ? *d : tv_float(0.0);
    if (tv_is_num(v)) { *out = tv_float(tv_num(v)); return 0; }
    if (v.kind == TV_STR) {
        char *end;
        const char *s = v.u.s->data;
        double f = strtod(s, &end);
        while (isspace((unsigned char)*end)) end++;
        if (*end == '\0' && end != s) { *out = tv_float(f); return 0; }
    }
    *out = tv_ref(def);
    return 0;
}

static int f_abs(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind == TV_INT || v.kind == TV_BOOL) {
        int64_t i = v.kind == TV_INT ? v.u.i : v.u.b;
        if (i == INT64_MIN) return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "integer overflow");
        *out = tv_int(i < 0 ? -i : i);
        return 0;
    }
    if (v.kind == TV_FLOAT) { *out = tv_float(fabs(v.u.f)); return 0; }
    return FAIL(line, "bad operand type for abs(): '%s'", tv_type_name(v));
}

static int f_round(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    int64_t prec = arg_int(arg(a, 0, "precision"), 0);
    const tv *m = arg(a, 1, "method");
    const char *method = m && m->kind == TV_STR ? m->u.s->data : "common";
    if (!tv_is_num(v)) return FAIL(line, "round expects a number, got %s", tv_type_name(v));
    if (strcmp(method, "common") && strcmp(method, "ceil") && strcmp(method, "floor"))
        return FAIL(line, "method must be common, ceil or floor");
    if (prec < -300 || prec > 300) return FAIL(line, "round: precision out of range");
    if (strcmp(method, "common") == 0 && v.kind != TV_FLOAT) {   /* round(int, n) stays int */
        int64_t i = v.kind == TV_INT ? v.u.i : v.u.b;
        if (prec >= 0) { *out = tv_int(i); return 0; }
        double p = pow(10.0, (double)-prec), x = (double)i / p, fl = floor(x), diff = x - fl;
        double rr = diff > 0.5 ? fl + 1 : diff < 0.5 ? fl : (fmod(fl, 2.0) == 0 ? fl : fl + 1);
        *out = tv_int((int64_t)(rr * p));
        return 0;
    }
    double x = tv_num(v), res;
    if (!strcmp(method, "common")) {
        if (prec >= 0 && prec <= 30 && isfinite(x)) {   /* correctly rounded, half-even, as round() */
            char buf[400];
            snprintf(buf, sizeof buf, "%.*f", (int)prec, x);
            res = strtod(buf, NULL);
        } else {
            double p = pow(10.0, (double)prec);
            res = nearbyint(x * p) / p;
        }
    } else {
        double p = pow(10.0, (double)prec);
        res = (method[0] == 'c' ? ceil(x * p) : floor(x * p)) / p;
    }
    *out = tv_float(res);
    return 0;
}

/* filter / test by name applied to one value (map, select, reject, ...); extra args from a[from..] */
static int sub_args(const argv_t *a, size_t from, argv_t *sub) {
    size_t k = 0, i;
    for (i = 0; i < a->n; i++) {
        if (a->names[i]) continue;
        if (k++ == from) break;
    }
    sub->v = a->v + i;
    sub->names = a->names + i;
    sub->n = i <= a->n ? a->n - i : 0;
    return 0;
}

static int sel(rctx *r, int line, tv v, const argv_t *a, tv *out, int attr_mode, int keep) {
    tv items;
    if (!tv_truthy(v)) return tv_list_new(&r->err, out);    /* jinja2: `if seq: for item in seq` */
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    const tv *attr = NULL;
    size_t tpos = 0;
    if (attr_mode) {
        attr = arg(a, 0, NULL);
        if (!attr) { tv_unref(items); return FAIL(line, "selectattr / rejectattr need an attribute name"); }
        tpos = 1;
    }
    const tv *tname = arg(a, tpos, NULL);
    if (tname && tname->kind != TV_STR) { tv_unref(items); return FAIL(line, "test name must be a string"); }
    if (tname && !tmpl_has_test(tname->u.s->data)) { tv_unref(items); return FAIL(line, "No test named '%s'", tname->u.s->data); }
    argv_t targs = {NULL, NULL, 0};
    if (tname) sub_args(a, tpos + 1, &targs);
    if (tv_list_new(&r->err, out)) { tv_unref(items); return -1; }
    for (size_t i = 0; i < items.u.l->n; i++) {
        tv x = items.u.l->items[i], val;
        if (attr_mode) { if (attr_path(r, line, x, attr, &val)) goto fail; }
        else val = tv_ref(x);
        int res;
        if (tname) {
            if (tmpl_test(r, line, tname->u.s->data, val, &targs, &res)) { tv_unref(val); goto fail; }
        } else res = tv_truthy(val);
        tv_unref(val);
        if (res == keep && tv_list_push(&r->err, out->u.l, tv_ref(x))) goto fail;
    }
    tv_unref(items);
    return 0;
fail:
    tv_unref(items);
    tv_drop(out);
    return -1;
}
static int f_select(rctx *r, int line, tv v, const argv_t *a, tv *out) { return sel(r, line, v, a, out, 0, 1); }
static int f_reject(rctx *r, int line, tv v, const argv_t *a, tv *out) { return sel(r, line, v, a, out, 0, 0); }
static int f_selectattr(rctx *r, int line, tv v, const argv_t *a, tv *out) { return sel(r, line, v, a, out, 1, 1); }
static int f_rejectattr(rctx *r, int line, tv v, const argv_t *a, tv *out) { return sel(r, line, v, a, out, 1, 0); }

static int f_map(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv items;
    if (!tv_truthy(v)) return tv_list_new(&r->err, out);    /* jinja2: `if value: for item in value` */
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    const tv *attr = arg(a, 999, "attribute"), *def = arg(a, 999, "default");
    const tv *fname = attr ? NULL : arg(a, 0, NULL);
    if (!attr && (!fname || fname->kind != TV_STR)) { tv_unref(items); return FAIL(line, "map needs a filter name or attribute="); }
    if (fname && !tmpl_has_filter(fname->u.s->data)) { tv_unref(items); return FAIL(line, "No filter named '%s'", fname->u.s->data); }
    argv_t fargs = {NULL, NULL, 0};
    if (fname) sub_args(a, 1, &fargs);
    if (tv_list_new(&r->err, out)) { tv_unref(items); return -1; }
    for (size_t i = 0; i < items.u.l->n; i++) {
        tv x = items.u.l->items[i], val;
        int rc = attr ? attr_path(r, line, x, attr, &val) : tmpl_filter(r, line, fname->u.s->data, x, &fargs, &val);
        if (rc) goto fail;
        if (attr && def && val.kind == TV_UNDEF) val = tv_ref(*def);
        if (tv_list_push(&r->err, out->u.l, val)) goto fail;
    }
    tv_unref(items);
    return 0;
fail:
    tv_unref(items);
    tv_drop(out);
    return -1;
}

static int f_join(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *d = arg(a, 0, "d"), *attr = arg(a, 1, "attribute");
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    sbuf b = {0};
    b.limit = r->max_output;
    for (size_t i = 0; i < items.u.l->n; i++) {
        tv x = items.u.l->items[i], val;
        if (attr) { if (attr_path(r, line, x, attr, &val)) { tv_unref(items); sb_free(&b); return -1; } }
        else val = tv_ref(x);
        int rc = (i && d) ? tv_str_append(&r->err, line, &b, *d) : 0;
        if (!rc) rc = tv_str_append(&r->err, line, &b, val);
        tv_unref(val);
        if (rc) { tv_unref(items); sb_free(&b); return -1; }
    }
    tv_unref(items);
    return sbuf_to_str(r, line, &b, out);
}

/* sort key: the value (or attribute), lower-cased when a string and case-insensitive */
static int sort_key(rctx *r, int line, tv x, const tv *attr, int cs, tv *key) {
    tv k;
    if (attr) { if (attr_path(r, line, x, attr, &k)) return -1; }
    else k = tv_ref(x);
    if (!cs && k.kind == TV_STR) {
        tv l;
        int rc = case_map(r, k, 0, &l);
        tv_unref(k);
        if (rc) return -1;
        k = l;
    }
    *key = k;
    return 0;
}

/* stable merge sort of items by keys; reverse keeps stability like Python's sorted(reverse=True) */
static int msort(rctx *r, int line, tv *items, tv *keys, size_t n, int reverse, tv *ti, tv *tk) {
    if (n < 2) return 0;
    size_t h = n / 2;
    if (msort(r, line, items, keys, h, reverse, ti, tk) || msort(r, line, items + h, keys + h, n - h, reverse, ti, tk))
        return -1;
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n) {
        int c;
        if (tv_cmp(&r->err, line, keys[j], keys[i], &c)) return -1;
        int take_right = reverse ? c > 0 : c < 0;
        if (take_right) { ti[k] = items[j]; tk[k++] = keys[j++]; }
        else { ti[k] = items[i]; tk[k++] = keys[i++]; }
    }
    while (i < h) { ti[k] = items[i]; tk[k++] = keys[i++]; }
    while (j < n) { ti[k] = items[j]; tk[k++] = keys[j++]; }
    memcpy(items, ti, n * sizeof *items);
    memcpy(keys, tk, n * sizeof *keys);
    return 0;
}

static int sort_list(rctx *r, int line, tv items, const tv *attr, int cs, int reverse, tv *out) {
    size_t n = items.u.l->n;
    tv *keys = calloc(n ? n : 1, sizeof *keys), *its = calloc(n ? n : 1, sizeof *its);
    tv *t1 = calloc(n ? n : 1, sizeof *t1), *t2 = calloc(n ? n : 1, sizeof *t2);
    int rc = 0;
    size_t made = 0;
    if (!keys || !its || !t1 || !t2) rc = tmpl_fail(&r->err, FP4MOE_ENOMEM, line, "out of memory");
    for (size_t i = 0; i < n && !rc; i++, made++) {
        its[i] = items.u.l->items[i];
        rc = sort_key(r, line, its[i], attr, cs, &keys[i]);
        if (rc) break;
    }
    if (!rc) rc = msort(r, line, its, keys, n, reverse, t1, t2);
    if (!rc) rc = tv_list_new(&r->err, out);
    for (size_t i = 0; i < n && !rc; i++)
        if (tv_list_push(&r->err, out->u.l, tv_ref(its[i]))) { tv_drop(out); rc = -1; }
    for (size_t i = 0; i < made; i++) tv_unref(keys[i]);
    free(keys); free(its); free(t1); free(t2);
    return rc;
}

static int f_sort(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    int rc = sort_list(r, line, items, arg(a, 2, "attribute"), arg_bool(a, 1, "case_sensitive", 0),
                       arg_bool(a, 0, "reverse", 0), out);
    tv_unref(items);
    return rc;
}

static int f_dictsort(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind != TV_DICT) return FAIL(line, "dictsort expects a mapping, got %s", tv_type_name(v));
    const tv *by = arg(a, 1, "by");
    int by_value = by && by->kind == TV_STR && !strcmp(by->u.s->data, "value");
    tv pairs;
    if (f_items(r, line, v, a, &pairs)) return -1;
    tv attr = tv_int(by_value ? 1 : 0);
    int rc = sort_list(r, line, pairs, &attr, arg_bool(a, 0, "case_sensitive", 0), arg_bool(a, 2, "reverse", 0), out);
    tv_unref(pairs);
    return rc;
}

static int f_unique(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    int cs = arg_bool(a, 0, "case_sensitive", 0);
    const tv *attr = arg(a, 1, "attribute");
    tv seen;
    if (tv_list_new(&r->err, &seen)) { tv_unref(items); return -1; }
    if (tv_list_new(&r->err, out)) { tv_unref(items); tv_unref(seen); return -1; }
    int rc = 0;
    for (size_t i = 0; i < items.u.l->n && !rc; i++) {
        tv k;
        if (sort_key(r, line, items.u.l->items[i], attr, cs, &k)) { rc = -1; break; }
        int dup = 0;
        for (size_t j = 0; j < seen.u.l->n && !dup; j++) dup = tv_eq(seen.u.l->items[j], k);
        if (dup) { tv_unref(k); continue; }
        rc = tv_list_push(&r->err, seen.u.l, k) || tv_list_push(&r->err, out->u.l, tv_ref(items.u.l->items[i]));
    }
    tv_unref(items);
    tv_unref(seen);
    if (rc) { tv_drop(out); return -1; }
    return 0;
}

static int f_minmax(rctx *r, int line, tv v, const argv_t *a, tv *out, int want_max) {
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    int cs = arg_bool(a, 0, "case_sensitive", 0);
    const tv *attr = arg(a, 1, "attribute");
    tv best = tv_undef(), bestk = tv_undef();
    int rc = 0;
    for (size_t i = 0; i < items.u.l->n && !rc; i++) {
        tv k;
        if (sort_key(r, line, items.u.l->items[i], attr, cs, &k)) { rc = -1; break; }
        int c = 0;
        if (i && tv_cmp(&r->err, line, k, bestk, &c)) { tv_unref(k); rc = -1; break; }
        if (i == 0 || (want_max ? c > 0 : c < 0)) {
            tv_unref(bestk);
            bestk = k;
            best = items.u.l->items[i];
        } else tv_unref(k);
    }
    *out = rc ? tv_undef() : tv_ref(best);
    tv_unref(bestk);
    tv_unref(items);
    return rc;
}
static int f_min(rctx *r, int line, tv v, const argv_t *a, tv *out) { return f_minmax(r, line, v, a, out, 0); }
static int f_max(rctx *r, int line, tv v, const argv_t *a, tv *out) { return f_minmax(r, line, v, a, out, 1); }

static int f_sum(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    const tv *attr = arg(a, 0, "attribute"), *start = arg(a, 1, "start");
    int is_f = 0;
    int64_t si = 0;
    double sf = 0;
    if (start) { if (!tv_is_num(*start)) { tv_unref(items); return FAIL(line, "sum: start must be a number"); } is_f = start->kind == TV_FLOAT; si = (int64_t)tv_num(*start); sf = tv_num(*start); }
    for (size_t i = 0; i < items.u.l->n; i++) {
        tv x;
        if (attr) { if (attr_path(r, line, items.u.l->items[i], attr, &x)) { tv_unref(items); return -1; } }
        else x = tv_ref(items.u.l->items[i]);
        if (!tv_is_num(x)) { tv_unref(x); tv_unref(items); return FAIL(line, "unsupported operand type(s) for +: 'int' and '%s'", tv_type_name(x)); }
        if (x.kind == TV_FLOAT && !is_f) { is_f = 1; sf = (double)si; }
        if (is_f) sf += tv_num(x);
        else if (__builtin_add_overflow(si, x.kind == TV_INT ? x.u.i : x.u.b, &si)) { tv_unref(items); return tmpl_fail(&r->err, FP4MOE_EOVERFLOW, line, "integer overflow"); }
        tv_unref(x);
    }
    tv_unref(items);
    *out = is_f ? tv_float(sf) : tv_int(si);
    return 0;
}

static int f_reverse(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    if (v.kind == TV_STR) {
        sbuf b = {0};
        const char *s = v.u.s->data;
        size_t n = v.u.s->len, end = n;
        while (end > 0) {
            size_t i = end - 1;
            while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80 && end - i < 4) i--;
            if (sb_put(&b, s + i, end - i)) { sb_free(&b); return too_big(r, line); }
            end = i;
        }
        return sbuf_to_str(r, line, &b, out);
    }
    tv items;
    if (tmpl_iter_list(r, line, v, &items)) return -1;
    if (tv_list_new(&r->err, out)) { tv_unref(items); return -1; }
    for (size_t i = items.u.l->n; i-- > 0;)
        if (tv_list_push(&r->err, out->u.l, tv_ref(items.u.l->items[i]))) { tv_unref(items); tv_drop(out); return -1; }
    tv_unref(items);
    return 0;
}

/* str.splitlines() boundaries (ASCII + NEL, LS, PS); returns the length of the break at i, 0 if none */
static size_t line_break(const char *s, size_t n, size_t i) {
    unsigned char c = (unsigned char)s[i];
    if (c == '\r') return (i + 1 < n && s[i + 1] == '\n') ? 2 : 1;
    if (c == '\n' || c == '\v' || c == '\f' || c == 0x1c || c == 0x1d || c == 0x1e) return 1;
    if (c == 0xC2 && i + 1 < n && (unsigned char)s[i + 1] == 0x85) return 2;
    if (c == 0xE2 && i + 2 < n && (unsigned char)s[i + 1] == 0x80 && ((unsigned char)s[i + 2] == 0xA8 || (unsigned char)s[i + 2] == 0xA9)) return 3;
    return 0;
}

static int f_indent(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *w = arg(a, 0, "width");
    int first = arg_bool(a, 1, "first", 0), blank = arg_bool(a, 2, "blank", 0);
    sbuf ind = {0};
    if (w && w->kind == TV_STR) sb_put(&ind, w->u.s->data, w->u.s->len);
    else {
        int64_t n = arg_int(w, 4);
        for (int64_t i = 0; i < n && i < 1024; i++) sb_putc(&ind, ' ');
    }
    tv s;
    if (v.kind != TV_STR) {   /* jinja2 does `s += "\n"` first: a TypeError for anything but a string */
        sb_free(&ind);
        return FAIL(line, "indent expects a string, got %s", tv_type_name(v));
    }
    s = tv_ref(v);
    /* lines = (s + "\n").splitlines() */
    sbuf src = {0};
    if (sb_put(&src, s.u.s->data, s.u.s->len) || sb_putc(&src, '\n')) { tv_unref(s); sb_free(&ind); sb_free(&src); return too_big(r, line); }
    tv_unref(s);
    sbuf b = {0};
    b.limit = r->max_output;
    const char *p = src.p;
    size_t n = src.n, i = 0, ln = 0;
    int rc = 0;
    if (first && sb_put(&b, ind.p ? ind.p : "", ind.n)) rc = -1;
    while (i < n && !rc) {
        size_t a0 = i, brk = 0;
        while (i < n && !(brk = line_break(p, n, i))) i++;
        size_t len = i - a0;
        if (ln > 0) {
            if (sb_putc(&b, '\n')) rc = -1;
            if (!rc && (blank || len > 0) && sb_put(&b, ind.p ? ind.p : "", ind.n)) rc = -1;
        }
        if (!rc && sb_put(&b, p + a0, len)) rc = -1;
        i += brk;
        ln++;
    }
    sb_free(&src);
    sb_free(&ind);
    if (rc) { sb_free(&b); return too_big(r, line); }
    return sbuf_to_str(r, line, &b, out);
}

static int f_wordcount(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int64_t c = 0;
    int in = 0;
    const char *p = s.u.s->data;
    size_t n = s.u.s->len;
    for (size_t i = 0; i < n;) {
        uint32_t ch;
        i = u8_next(p, n, i, &ch);
        /* \w: ASCII letters, digits, _; non-ASCII counts unless space, punctuation or symbol
         * (Latin-1 signs, general punctuation .. dingbats, CJK punctuation, emoji, fullwidth signs) */
        int w;
        if (ch < 0x80) w = isalnum((int)ch) || ch == '_';
        else w = !(py_isspace(ch) || (ch >= 0x80 && ch <= 0xBF && ch != 0xAA && ch != 0xB2 && ch != 0xB3 &&
                                      ch != 0xB5 && ch != 0xB9 && ch != 0xBA && ch != 0xBC && ch != 0xBD && ch != 0xBE) ||
                   ch == 0xD7 || ch == 0xF7 || (ch >= 0x2000 && ch <= 0x2BFF) || (ch >= 0x3000 && ch <= 0x3003) ||
                   (ch >= 0x3008 && ch <= 0x3020) || (ch >= 0xFE30 && ch <= 0xFE4F) || (ch >= 0xFF01 && ch <= 0xFF0F) ||
                   (ch >= 0x1F000 && ch <= 0x1FAFF) || (ch >= 0xE000 && ch <= 0xF8FF));
        if (w && !in) c++;
        in = w;
    }
    tv_unref(s);
    *out = tv_int(c);
    return 0;
}

static int f_escape(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    sbuf b = {0};
    b.limit = r->max_output;
    int rc = 0;
    for (size_t i = 0; i < s.u.s->len && !rc; i++) {
        char c = s.u.s->data[i];
        switch (c) {
        case '&': rc = sb_puts(&b, "&amp;"); break;
        case '<': rc = sb_puts(&b, "&lt;"); break;
        case '>': rc = sb_puts(&b, "&gt;"); break;
        case '"': rc = sb_puts(&b, "&#34;"); break;
        case '\'': rc = sb_puts(&b, "&#39;"); break;
        default: rc = sb_putc(&b, c);
        }
    }
    tv_unref(s);
    if (rc) { sb_free(&b); return too_big(r, line); }
    return sbuf_to_str(r, line, &b, out);
}

static int f_attr(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    const tv *n = arg(a, 0, "name");
    if (!n || n->kind != TV_STR) return FAIL(line, "attr needs a name");
    if (v.kind == TV_UNDEF) { *out = tv_undef(); return 0; }
    return tmpl_getattr(r, line, v, n->u.s->data, out);
}

static int f_center(rctx *r, int line, tv v, const argv_t *a, tv *out) {
    int64_t w = arg_int(arg(a, 0, "width"), 80);
    tv s;
    if (f_string(r, line, v, a, &s)) return -1;
    int64_t len = (int64_t)u8_len(s.u.s->data, s.u.s->len);
    if (w > (int64_t)r->max_output) { tv_unref(s); return too_big(r, line); }
    if (w <= len) { *out = s; return 0; }
    int64_t pad = w - len, left = pad / 2 + (pad & w & 1);   /* Python's str.center split */
    sbuf b = {0};
    int rc = 0;
    for (int64_t i = 0; i < left && !rc; i++) rc = sb_putc(&b, ' ');
    if (!rc) rc = sb_put(&b, s.u.s->data, s.u.s->len);
    for (int64_t i = 0; i < pad - left && !rc; i++) rc = sb_putc(&b, ' ');
    tv_unref(s);
    if (rc) { sb_free(&b); return too_big(r, line); }
    return sbuf_to_str(r, line, &b, out);
}

static int f_batch_unsupported(rctx *r, int line, tv v, const argv_t *a, tv *out) { /* named by tmpl_filter */
    (void)v; (void)a; (void)out;
    return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, line, "this filter is not supported by this engine");
}

typedef struct { const char *name; filter_fn fn; } filter_entry;
static const filter_entry FILTERS[] = {
    {"tojson", f_tojson}, {"safe", f_safe}, {"string", f_string}, {"trim", f_trim}, {"length", f_length},
    {"count", f_length}, {"default", f_default}, {"d", f_default}, {"items", f_items}, {"upper", f_upper},
    {"lower", f_lower}, {"capitalize", f_capitalize}, {"title", f_title}, {"replace", f_replace},
    {"join", f_join}, {"first", f_first}, {"last", f_last}, {"list", f_list}, {"int", f_int},
    {"float", f_float}, {"abs", f_abs}, {"round", f_round}, {"map", f_map}, {"select", f_select},
    {"reject", f_reject}, {"selectattr", f_selectattr}, {"rejectattr", f_rejectattr},
    {"unique", f_unique}, {"sort", f_sort}, {"dictsort", f_dictsort}, {"indent", f_indent},
    {"wordcount", f_wordcount}, {"min", f_min}, {"max", f_max}, {"sum", f_sum}, {"reverse", f_reverse},
    {"escape", f_escape}, {"e", f_escape}, {"forceescape", f_escape}, {"attr", f_attr},
    {"center", f_center}, {"batch", f_batch_unsupported}, {"slice", f_batch_unsupported},
    {"format", f_batch_unsupported}, {"truncate", f_batch_unsupported}, {"wordwrap", f_batch_unsupported},
    {"striptags", f_batch_unsupported}, {"urlize", f_batch_unsupported}, {"urlencode", f_batch_unsupported},
    {"pprint", f_batch_unsupported}, {"xmlattr", f_batch_unsupported}, {"filesizeformat", f_batch_unsupported},
    {"groupby", f_batch_unsupported}, {"random", f_batch_unsupported}, {"mark_safe", f_safe},
    {NULL, NULL}};

int tmpl_has_filter(const char *name) {
    for (int i = 0; FILTERS[i].name; i++) if (!strcmp(FILTERS[i].name, name)) return 1;
    return 0;
}

int tmpl_filter(rctx *r, int line, const char *name, tv val, const argv_t *a, tv *out) {
    for (int i = 0; FILTERS[i].name; i++)
        if (!strcmp(FILTERS[i].name, name)) {
            if (FILTERS[i].fn == f_batch_unsupported) /* jinja2 has it; a template may hold it in a branch never taken */
                return tmpl_fail(&r->err, FP4MOE_EUNSUPPORTED, line, "the filter '%s' is not supported by this engine",
                                 name);
            return FILTERS[i].fn(r, line, val, a, out);
        }
    return FAIL(line, "No filter named '%s'", name);
}
