/* Growable buffers, and generated text -> stop strings, then the reasoning / content split (see
 * srv.h). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

/* ---- srv_buf -------------------------------------------------------------------------------------- */

int srv_buf_reserve(srv_buf *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap) return 0;
    size_t c = b->cap ? b->cap : 256;
    while (c < b->n + extra + 1) c *= 2;
    char *q = realloc(b->p, c);
    if (!q) return -1;
    b->p = q;
    b->cap = c;
    return 0;
}

int srv_buf_add(srv_buf *b, const void *s, size_t n) {
    if (srv_buf_reserve(b, n)) return -1;
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int srv_buf_printf(srv_buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    const int k = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (k < 0 || srv_buf_reserve(b, (size_t)k)) return -1;
    va_start(ap, fmt);
    vsnprintf(b->p + b->n, (size_t)k + 1, fmt, ap);
    va_end(ap);
    b->n += (size_t)k;
    return 0;
}

void srv_buf_free(srv_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

/* ---- stop strings and the reasoning split ------------------------------------------------------------ */

/* ---- lossy UTF-8 ------------------------------------------------------------------------------- */

int64_t srv_utf8_lossy(srv_buf *b, const char *s, size_t n) {
    char *tmp = malloc(n * 3 + 1);
    if (!tmp) return -1;
    const int64_t len = fp4moe_utf8_lossy(s, (int64_t)n, tmp);
    int64_t chars = 0;
    for (int64_t i = 0; i < len; i++) chars += ((unsigned char)tmp[i] & 0xC0) != 0x80; /* lead bytes */
    const int rc = srv_buf_add(b, tmp, (size_t)len);
    free(tmp);
    return rc ? -1 : chars;
}

int srv_text_idle(const srv_text *t) { return t->stopped || (t->released == t->all.n && t->pend.n == 0); }

static const char k_open[] = "<think>", k_close[] = "</think>";

void srv_text_init(srv_text *t, char *const *stop, int n_stop, int split, int reasoning_start) {
    memset(t, 0, sizeof *t);
    for (int i = 0; i < n_stop && i < SRV_MAX_STOP; i++) {
        t->stop[t->n_stop++] = stop[i];
        const size_t l = strlen(stop[i]);
        if (l > t->max_stop) t->max_stop = l;
    }
    t->split = split;
    t->in_reasoning = split && reasoning_start;
}

void srv_text_free(srv_text *t) {
    srv_buf_free(&t->all);
    srv_buf_free(&t->pend);
    srv_buf_free(&t->out_r);
    srv_buf_free(&t->out_c);
    memset(t, 0, sizeof *t);
}

/* Longest suffix of s[0..n) that is a proper prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag) {
    const size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, tag, k)) return k;
    return 0;
}

static const char *memfind(const char *h, size_t n, const char *needle) {
    const size_t l = strlen(needle);
    if (l == 0 || l > n) return NULL;
    for (size_t i = 0; i + l <= n; i++)
        if (h[i] == needle[0] && !memcmp(h + i, needle, l)) return h + i;
    return NULL;
}

/* Drops the first k held bytes. */
static void pend_drop(srv_text *t, size_t k) {
    memmove(t->pend.p, t->pend.p + k, t->pend.n - k);
    t->pend.n -= k;
}

/* The split over released bytes; `final` releases everything held. */
static int split_feed(srv_text *t, const char *s, size_t n, int final) {
    if (!t->split) return srv_buf_add(&t->out_c, s, n);
    if (srv_buf_add(&t->pend, s, n)) return -1;
    for (;;) {
        const char *p = t->pend.p ? t->pend.p : "";
        const size_t m = t->pend.n;
        if (!t->in_reasoning && !t->content_started) {
            /* an output that opens with <think> (after whitespace) starts reasoning */
            size_t ws = 0;
            while (ws < m && (p[ws] == ' ' || p[ws] == '\n' || p[ws] == '\r' || p[ws] == '\t')) ws++;
            const size_t rest = m - ws, ol = sizeof k_open - 1;
            if (rest >= ol && !memcmp(p + ws, k_open, ol)) {
                t->in_reasoning = 1;
                t->content_started = 1;
                pend_drop(t, ws + ol);
                continue;
            }
            if (!final && (rest == 0 || (rest < ol && !memcmp(p + ws, k_open, rest)))) return 0;
            t->content_started = 1;
        }
        if (t->in_reasoning) {
            const char *c = memfind(p, m, k_close);
            if (c) {
                if (srv_buf_add(&t->out_r, p, (size_t)(c - p))) return -1;
                pend_drop(t, (size_t)(c - p) + sizeof k_close - 1);
                t->in_reasoning = 0;
                continue;
            }
            const size_t hold = final ? 0 : partial_tag(p, m, k_close);
            if (srv_buf_add(&t->out_r, p, m - hold)) return -1;
            pend_drop(t, m - hold);
            return 0;
        }
        if (srv_buf_add(&t->out_c, p, m)) return -1;
        t->pend.n = 0;
        return 0;
    }
}

/* Bytes of s[0..n) that may be released: not inside a UTF-8 character's continuation. */
static size_t char_boundary(const char *s, size_t n, size_t at) {
    while (at > 0 && at < n && ((unsigned char)s[at] & 0xC0) == 0x80) at--;
    return at;
}

static void out_reset(srv_text *t, srv_delta *d) {
    t->out_r.n = t->out_c.n = 0;
    memset(d, 0, sizeof *d);
}

static void out_view(const srv_text *t, srv_delta *d) {
    d->reasoning = t->out_r.n ? t->out_r.p : "";
    d->n_reasoning = t->out_r.n;
    d->content = t->out_c.n ? t->out_c.p : "";
    d->n_content = t->out_c.n;
}

int srv_text_feed(srv_text *t, const char *s, size_t n, srv_delta *d) {
    out_reset(t, d);
    if (t->stopped) {
        out_view(t, d);
        return 1;
    }
    if (srv_buf_add(&t->all, s, n)) return -1;
    const char *all = t->all.p;
    /* earliest stop match that ends in the new bytes (matches before were found earlier) */
    size_t best = (size_t)-1;
    for (int i = 0; i < t->n_stop; i++) {
        const char *m = memfind(all + t->released, t->all.n - t->released, t->stop[i]);
        if (m && (size_t)(m - all) < best) best = (size_t)(m - all);
    }
    if (best != (size_t)-1) {
        if (split_feed(t, all + t->released, best - t->released, 1)) return -1;
        t->released = best;
        t->stopped = 1;
        out_view(t, d);
        return 1;
    }
    size_t safe = t->all.n;
    if (t->max_stop > 1) {
        /* hold back the longest tail that is a prefix of some stop string */
        size_t hold = 0;
        for (int i = 0; i < t->n_stop; i++) {
            const size_t k = partial_tag(all + t->released, t->all.n - t->released, t->stop[i]);
            if (k > hold) hold = k;
        }
        safe = char_boundary(all, t->all.n, t->all.n - hold);
        if (safe < t->released) safe = t->released;
    }
    if (split_feed(t, all + t->released, safe - t->released, 0)) return -1;
    t->released = safe;
    out_view(t, d);
    return 0;
}

int srv_text_finish(srv_text *t, srv_delta *d) {
    out_reset(t, d);
    const char *all = t->all.p ? t->all.p : "";
    if (split_feed(t, all + t->released, t->stopped ? 0 : t->all.n - t->released, 1)) return -1;
    if (!t->stopped) t->released = t->all.n;
    out_view(t, d);
    return 0;
}
