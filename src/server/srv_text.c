/* Generated text -> stop strings, then the reasoning / content split (see srv.h). */
#include <stdlib.h>
#include <string.h>

#include "server/srv.h"

static const char k_open[] = "<think>", k_close[] = "</think>";

static int grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 256;
    while (c < need) c *= 2;
    char *q = realloc(*p, c);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

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
    free(t->all);
    free(t->pend);
    free(t->out_r);
    free(t->out_c);
    memset(t, 0, sizeof *t);
}

/* The output of one call: reasoning and content bytes in two scratch buffers of t. */
static int out_add(srv_text *t, int reasoning, const char *s, size_t n) {
    if (!n) return 0;
    char **p = reasoning ? &t->out_r : &t->out_c;
    size_t *len = reasoning ? &t->n_out_r : &t->n_out_c, *cap = reasoning ? &t->cap_out_r : &t->cap_out_c;
    if (grow(p, cap, *len + n + 1)) return -1;
    memcpy(*p + *len, s, n);
    *len += n;
    (*p)[*len] = 0;
    return 0;
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

/* The split over released bytes; `final` releases everything held. */
static int split_feed(srv_text *t, const char *s, size_t n, int final) {
    if (!t->split) return out_add(t, 0, s, n);
    if (grow(&t->pend, &t->cap_pend, t->n_pend + n + 1)) return -1;
    memcpy(t->pend + t->n_pend, s, n);
    t->n_pend += n;
    for (;;) {
        char *p = t->pend;
        size_t m = t->n_pend;
        if (!t->in_reasoning && !t->content_started) {
            /* an output that opens with <think> (after whitespace) starts reasoning */
            size_t ws = 0;
            while (ws < m && (p[ws] == ' ' || p[ws] == '\n' || p[ws] == '\r' || p[ws] == '\t')) ws++;
            const size_t rest = m - ws, ol = sizeof k_open - 1;
            if (rest >= ol && !memcmp(p + ws, k_open, ol)) {
                t->in_reasoning = 1;
                t->content_started = 1;
                memmove(p, p + ws + ol, m - ws - ol);
                t->n_pend = m - ws - ol;
                continue;
            }
            if (!final && (rest == 0 || (rest < ol && !memcmp(p + ws, k_open, rest)))) return 0;
            t->content_started = 1;
        }
        if (t->in_reasoning) {
            const char *c = memfind(p, m, k_close);
            if (c) {
                if (out_add(t, 1, p, (size_t)(c - p))) return -1;
                const size_t used = (size_t)(c - p) + sizeof k_close - 1;
                memmove(p, p + used, m - used);
                t->n_pend = m - used;
                t->in_reasoning = 0;
                continue;
            }
            const size_t hold = final ? 0 : partial_tag(p, m, k_close);
            if (out_add(t, 1, p, m - hold)) return -1;
            memmove(p, p + m - hold, hold);
            t->n_pend = hold;
            return 0;
        }
        if (out_add(t, 0, p, m)) return -1;
        t->n_pend = 0;
        return 0;
    }
}

/* Bytes of all[0..n) that may be released: not inside a UTF-8 character's continuation. */
static size_t char_boundary(const char *s, size_t n, size_t at) {
    while (at > 0 && at < n && ((unsigned char)s[at] & 0xC0) == 0x80) at--;
    return at;
}

static void out_reset(srv_text *t, srv_delta *d) {
    t->n_out_r = t->n_out_c = 0;
    memset(d, 0, sizeof *d);
}

static void out_view(const srv_text *t, srv_delta *d) {
    d->reasoning = t->n_out_r ? t->out_r : "";
    d->n_reasoning = t->n_out_r;
    d->content = t->n_out_c ? t->out_c : "";
    d->n_content = t->n_out_c;
}

int srv_text_feed(srv_text *t, const char *s, size_t n, srv_delta *d) {
    out_reset(t, d);
    if (t->stopped) {
        out_view(t, d);
        return 1;
    }
    if (grow(&t->all, &t->cap_all, t->n_all + n + 1)) return -1;
    memcpy(t->all + t->n_all, s, n);
    t->n_all += n;
    t->all[t->n_all] = 0;
    /* earliest stop match that ends in the new bytes (matches before were found earlier) */
    size_t from = t->released, best = (size_t)-1;
    for (int i = 0; i < t->n_stop; i++) {
        const char *m = memfind(t->all + from, t->n_all - from, t->stop[i]);
        if (m && (size_t)(m - t->all) < best) best = (size_t)(m - t->all);
    }
    if (best != (size_t)-1) {
        if (split_feed(t, t->all + t->released, best - t->released, 1)) return -1;
        t->released = best;
        t->stopped = 1;
        out_view(t, d);
        return 1;
    }
    size_t safe = t->n_all;
    if (t->max_stop > 1) {
        /* hold back the longest tail that is a prefix of some stop string */
        size_t hold = 0;
        for (int i = 0; i < t->n_stop; i++) {
            const size_t k = partial_tag(t->all + t->released, t->n_all - t->released, t->stop[i]);
            if (k > hold) hold = k;
        }
        safe = char_boundary(t->all, t->n_all, t->n_all - hold);
        if (safe < t->released) safe = t->released;
    }
    if (split_feed(t, t->all + t->released, safe - t->released, 0)) return -1;
    t->released = safe;
    out_view(t, d);
    return 0;
}

int srv_text_finish(srv_text *t, srv_delta *d) {
    out_reset(t, d);
    if (!t->stopped && t->released < t->n_all) {
        if (split_feed(t, t->all + t->released, t->n_all - t->released, 1)) return -1;
        t->released = t->n_all;
    } else if (split_feed(t, "", 0, 1)) {
        return -1;
    }
    out_view(t, d);
    return 0;
}
