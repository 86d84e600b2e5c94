/* Regex matching for the tokenizer: HF compiles tokenizer.json regexes with Oniguruma (Ruby
 * syntax); we compile them with PCRE2 (UTF + UCP, JIT when available) after rewriting the few
 * escapes whose Unicode meaning differs between the two engines, and iterate matches exactly as
 * the onig crate's find_iter does. Split behaviors follow HF NormalizedString::split. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tok_internal.h"

/* Oniguruma's Unicode \s is [\t\n\v\f\r\x85] + Zs + Zl + Zp (= White_Space); PCRE2's UCP \s also
 * matches U+180E. Oniguruma's \w is Letter|Mark|Decimal_Number|Connector_Punctuation; PCRE2 10.42
 * UCP \w is L|N|_ . Rewrite \s \S \w \W (outside a class, and \s \w inside one) to explicit
 * property sets; copy everything else unchanged. */
#define ONIG_SPACE "\\t-\\r\\x{85}\\p{Zs}\\p{Zl}\\p{Zp}"
#define ONIG_WORD "\\p{L}\\p{M}\\p{Nd}\\p{Pc}"

static int rewrite_onig(const char *pat, tok_buf *out) {
    int in_class = 0, rc = 0;
    size_t n = strlen(pat);
    for (size_t i = 0; i < n && !rc; i++) {
        char c = pat[i];
        if (c == '\\' && i + 1 < n) {
            char e = pat[i + 1];
            const char *set = (e == 's' || e == 'S') ? ONIG_SPACE : (e == 'w' || e == 'W') ? ONIG_WORD : NULL;
            int negated = (e == 'S' || e == 'W');
            if (set && !in_class) {
                rc = tok_buf_append(out, negated ? "[^" : "[", negated ? 2 : 1);
                if (!rc) rc = tok_buf_append(out, set, (int64_t)strlen(set));
                if (!rc) rc = tok_buf_append(out, "]", 1);
            } else if (set && in_class && !negated) {
                rc = tok_buf_append(out, set, (int64_t)strlen(set));
            } else {
                rc = tok_buf_append(out, pat + i, 2);
            }
            i++;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = 1;
            rc = tok_buf_append(out, "[", 1);
            /* a leading ^ and a leading ] are part of the class syntax */
            if (!rc && i + 1 < n && pat[i + 1] == '^') rc = tok_buf_append(out, pat + ++i, 1);
            if (!rc && i + 1 < n && pat[i + 1] == ']') rc = tok_buf_append(out, pat + ++i, 1);
            continue;
        }
        if (c == '[' && in_class && i + 1 < n && pat[i + 1] == ':') {  /* POSIX [:alpha:] */
            const char *end = strstr(pat + i + 2, ":]");
            size_t len = end ? (size_t)(end - (pat + i)) + 2 : 1;
            rc = tok_buf_append(out, pat + i, (int64_t)len);
            i += len - 1;
            continue;
        }
        if (c == ']' && in_class) in_class = 0;
        rc = tok_buf_append(out, &c, 1);
    }
    if (!rc && !out->p) rc = tok_buf_append(out, "", 0);
    return rc;
}

int tok_pattern_regex(tok_pattern *p, const char *pattern, const char *where) {
    memset(p, 0, sizeof *p);
    tok_buf pat = {0};
    int rc = rewrite_onig(pattern, &pat);
    if (rc) return rc;
    int err;
    PCRE2_SIZE err_off;
    /* Ruby syntax (Oniguruma default): ^ and $ are line anchors -> PCRE2_MULTILINE. */
    p->re = pcre2_compile((PCRE2_SPTR)pat.p, (PCRE2_SIZE)pat.n, PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE,
                          &err, &err_off, NULL);
    tok_buf_free(&pat);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return fp4moe_set_error(FP4MOE_EFORMAT, "%s: regex \"%s\" does not compile with PCRE2: %s",
                                where, pattern, (const char *)msg);
    }
    pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE);  /* no JIT: the interpreter is used */
    return FP4MOE_OK;
}

int tok_pattern_literal(tok_pattern *p, const char *s, int64_t len) {
    memset(p, 0, sizeof *p);
    p->literal = malloc((size_t)len + 1);
    if (!p->literal) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory");
    memcpy(p->literal, s, (size_t)len);
    p->literal[len] = 0;
    p->literal_len = len;
    return FP4MOE_OK;
}

void tok_pattern_free(tok_pattern *p) {
    if (p->re) pcre2_code_free(p->re);
    free(p->literal);
    memset(p, 0, sizeof *p);
}

int tok_matcher_init(tok_matcher *m) {
    memset(m, 0, sizeof *m);
    m->md = pcre2_match_data_create(1, NULL);   /* only the whole-match offsets are used */
    m->mctx = pcre2_match_context_create(NULL);
    m->jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    if (!m->md || !m->mctx) {
        tok_matcher_free(m);
        return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (PCRE2 match data)");
    }
    if (m->jit_stack) pcre2_jit_stack_assign(m->mctx, NULL, m->jit_stack);
    return FP4MOE_OK;
}

void tok_matcher_free(tok_matcher *m) {
    if (m->md) pcre2_match_data_free(m->md);
    if (m->mctx) pcre2_match_context_free(m->mctx);
    if (m->jit_stack) pcre2_jit_stack_free(m->jit_stack);
    memset(m, 0, sizeof *m);
}

int tok_spans_push(tok_spans *v, int64_t start, int64_t end, int is_match) {
    if (v->n == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 64;
        tok_span *p = realloc(v->p, (size_t)cap * sizeof *p);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (splits)");
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = (tok_span){start, end, is_match};
    return FP4MOE_OK;
}

/* Next match at or after `from`: 1 with [*s, *e), 0 when none, < 0 on a PCRE2 error. */
static int next_match(const tok_pattern *p, tok_matcher *m, const char *s, int64_t n, int64_t from,
                      int64_t *ms, int64_t *me) {
    if (!p->re) {
        if (p->literal_len == 0 || from > n) return 0;
        const char *hit = memmem(s + from, (size_t)(n - from), p->literal, (size_t)p->literal_len);
        if (!hit) return 0;
        *ms = hit - s;
        *me = *ms + p->literal_len;
        return 1;
    }
    /* The subject was validated once by encode: PCRE2_NO_UTF_CHECK avoids an O(n) check per call. */
    int rc = pcre2_match(p->re, (PCRE2_SPTR)s, (PCRE2_SIZE)n, (PCRE2_SIZE)from, PCRE2_NO_UTF_CHECK,
                         m->md, m->mctx);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return fp4moe_set_error(FP4MOE_EFORMAT, "tokenizer: PCRE2 match failed at byte %lld: %s",
                                (long long)from, (const char *)msg);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(m->md);
    *ms = (int64_t)ov[0];
    *me = (int64_t)ov[1];
    return 1;
}

int tok_find_matches(const tok_pattern *p, tok_matcher *m, const char *s, int64_t n, int invert,
                     tok_spans *out) {
    out->n = 0;
    if (n == 0) return tok_spans_push(out, 0, 0, invert);
    int64_t prev = 0, last_end = 0, last_match_end = -1;
    int rc = 0;
    /* onig crate FindMatches: an empty match right at the end of the previous match is skipped by
     * advancing one character. */
    while (last_end <= n) {
        int64_t ms, me;
        int found = next_match(p, m, s, n, last_end, &ms, &me);
        if (found < 0) return found;
        if (!found) break;
        if (ms == me && me == last_match_end) {
            last_end += last_end < n ? tok_utf8_len((unsigned char)s[last_end]) : 1;
            continue;
        }
        last_end = me;
        last_match_end = me;
        if (prev != ms) rc = tok_spans_push(out, prev, ms, invert);
        if (!rc) rc = tok_spans_push(out, ms, me, !invert);
        if (rc) return rc;
        prev = me;
    }
    if (prev != n) return tok_spans_push(out, prev, n, invert);
    return FP4MOE_OK;
}

void tok_apply_behavior(tok_spans *v, tok_split_behavior b) {
    tok_span *p = v->p;
    int64_t k = 0;
    int prev_match = 0;
    switch (b) {
    case TOK_SPLIT_REMOVED:   /* matches are removed: the flag already says so */
        return;
    case TOK_SPLIT_ISOLATED:
        for (int64_t i = 0; i < v->n; i++) p[i].is_match = 0;
        return;
    case TOK_SPLIT_MERGED_WITH_PREVIOUS:
        for (int64_t i = 0; i < v->n; i++) {
            tok_span s = p[i];
            if (s.is_match && !prev_match && k > 0) p[k - 1].end = s.end;
            else p[k++] = (tok_span){s.start, s.end, 0};
            prev_match = s.is_match;
        }
        break;
    case TOK_SPLIT_MERGED_WITH_NEXT: {
        /* HF folds from the right: a match joins the split that follows it. */
        int64_t w = v->n;   /* write position, from the end */
        for (int64_t i = v->n - 1; i >= 0; i--) {
            tok_span s = p[i];
            if (s.is_match && !prev_match && w < v->n) p[w].start = s.start;
            else p[--w] = (tok_span){s.start, s.end, 0};
            prev_match = s.is_match;
        }
        k = v->n - w;
        memmove(p, p + w, (size_t)k * sizeof *p);
        break;
    }
    case TOK_SPLIT_CONTIGUOUS:
        for (int64_t i = 0; i < v->n; i++) {
            tok_span s = p[i];
            if (s.is_match == prev_match && k > 0) p[k - 1].end = s.end;
            else p[k++] = (tok_span){s.start, s.end, 0};
            prev_match = s.is_match;
        }
        break;
    }
    v->n = k;
}
