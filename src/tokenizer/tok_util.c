/* Tokenizer helpers: growable buffers, a string arena, two open-addressing hash maps (string ->
 * id for the vocab, id pair -> merge for the merges) and UTF-8 utilities. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tok_internal.h"

/* ---- buffers ------------------------------------------------------------------------------- */
int tok_buf_reserve(tok_buf *b, int64_t extra) {
    if (b->n + extra + 1 <= b->cap) return FP4MOE_OK;
    int64_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1) cap *= 2;
    char *p = realloc(b->p, (size_t)cap);
    if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (%lld bytes)", (long long)cap);
    b->p = p;
    b->cap = cap;
    return FP4MOE_OK;
}

int tok_buf_append(tok_buf *b, const void *src, int64_t n) {
    int rc = tok_buf_reserve(b, n);
    if (rc) return rc;
    if (n) memcpy(b->p + b->n, src, (size_t)n);
    b->n += n;
    b->p[b->n] = 0;
    return FP4MOE_OK;
}

void tok_buf_free(tok_buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

int tok_ivec_push(tok_ivec *v, int32_t x) {
    if (v->n == v->cap) {
        int64_t cap = v->cap ? 2 * v->cap : 64;
        int32_t *p = realloc(v->p, (size_t)cap * sizeof *p);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (%lld ids)", (long long)cap);
        v->p = p;
        v->cap = cap;
    }
    v->p[v->n++] = x;
    return FP4MOE_OK;
}

void tok_ivec_free(tok_ivec *v) {
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

void tok_spans_free(tok_spans *v) {
    free(v->p);
    v->p = NULL;
    v->n = v->cap = 0;
}

/* ---- arena --------------------------------------------------------------------------------- */
struct tok_arena_chunk {
    tok_arena_chunk *next;
    size_t used, cap;
    char data[];
};

char *tok_arena_strndup(tok_arena *a, const char *s, size_t n) {
    tok_arena_chunk *c = a->head;
    if (!c || c->cap - c->used < n + 1) {
        size_t cap = n + 1 > (1u << 16) ? n + 1 : (1u << 16);
        c = malloc(sizeof *c + cap);
        if (!c) return NULL;
        c->used = 0;
        c->cap = cap;
        c->next = a->head;
        a->head = c;
    }
    char *p = c->data + c->used;
    if (n) memcpy(p, s, n);
    p[n] = 0;
    c->used += n + 1;
    return p;
}

void tok_arena_free(tok_arena *a) {
    tok_arena_chunk *c = a->head;
    while (c) {
        tok_arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
}

/* ---- string map ---------------------------------------------------------------------------- */
uint32_t tok_hash(const char *s, int64_t n) {   /* FNV-1a, 32 bit */
    uint32_t h = 2166136261u;
    for (int64_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 16777619u;
    }
    return h;
}

static int strmap_grow(tok_strmap *m) {
    int64_t cap = m->cap ? 2 * m->cap : 1024;
    tok_strmap_entry *e = calloc((size_t)cap, sizeof *e);
    if (!e) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (vocab map)");
    for (int64_t i = 0; i < m->cap; i++) {
        if (!m->e[i].key) continue;
        int64_t j = m->e[i].hash & (cap - 1);
        while (e[j].key) j = (j + 1) & (cap - 1);
        e[j] = m->e[i];
    }
    free(m->e);
    m->e = e;
    m->cap = cap;
    return FP4MOE_OK;
}

int tok_strmap_put(tok_strmap *m, const char *key, int32_t len, int32_t val) {
    if (2 * (m->n + 1) > m->cap) {
        int rc = strmap_grow(m);
        if (rc) return rc;
    }
    uint32_t h = tok_hash(key, len);
    int64_t j = h & (m->cap - 1);
    while (m->e[j].key) {
        if (m->e[j].hash == h && m->e[j].len == len && memcmp(m->e[j].key, key, (size_t)len) == 0) {
            m->e[j].val = val;
            return FP4MOE_OK;
        }
        j = (j + 1) & (m->cap - 1);
    }
    m->e[j] = (tok_strmap_entry){key, len, val, h};
    m->n++;
    return FP4MOE_OK;
}

int32_t tok_strmap_get(const tok_strmap *m, const char *key, int64_t len) {
    if (!m->cap) return -1;
    uint32_t h = tok_hash(key, len);
    int64_t j = h & (m->cap - 1);
    while (m->e[j].key) {
        if (m->e[j].hash == h && m->e[j].len == len && memcmp(m->e[j].key, key, (size_t)len) == 0)
            return m->e[j].val;
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

void tok_strmap_free(tok_strmap *m) {
    free(m->e);
    m->e = NULL;
    m->cap = m->n = 0;
}

/* ---- pair map ------------------------------------------------------------------------------ */
static uint64_t pair_hash(uint64_t k) {   /* splitmix64 finalizer */
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ull;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebull;
    return k ^ (k >> 31);
}

static int pairmap_grow(tok_pairmap *m) {
    int64_t cap = m->cap ? 2 * m->cap : 1024;
    uint64_t *key = malloc((size_t)cap * sizeof *key);
    int32_t *rank = malloc((size_t)cap * sizeof *rank);
    int32_t *merged = malloc((size_t)cap * sizeof *merged);
    if (!key || !rank || !merged) {
        free(key);
        free(rank);
        free(merged);
        return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (merges map)");
    }
    memset(key, 0xff, (size_t)cap * sizeof *key);
    for (int64_t i = 0; i < m->cap; i++) {
        if (m->key[i] == UINT64_MAX) continue;
        int64_t j = pair_hash(m->key[i]) & (cap - 1);
        while (key[j] != UINT64_MAX) j = (j + 1) & (cap - 1);
        key[j] = m->key[i];
        rank[j] = m->rank[i];
        merged[j] = m->merged[i];
    }
    free(m->key);
    free(m->rank);
    free(m->merged);
    m->key = key;
    m->rank = rank;
    m->merged = merged;
    m->cap = cap;
    return FP4MOE_OK;
}

int tok_pairmap_put(tok_pairmap *m, int32_t left, int32_t right, int32_t rank, int32_t merged) {
    if (2 * (m->n + 1) > m->cap) {
        int rc = pairmap_grow(m);
        if (rc) return rc;
    }
    uint64_t k = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    int64_t j = pair_hash(k) & (m->cap - 1);
    while (m->key[j] != UINT64_MAX && m->key[j] != k) j = (j + 1) & (m->cap - 1);
    if (m->key[j] == UINT64_MAX) m->n++;
    m->key[j] = k;
    m->rank[j] = rank;
    m->merged[j] = merged;
    return FP4MOE_OK;
}

int tok_pairmap_get(const tok_pairmap *m, int32_t left, int32_t right, int32_t *rank,
                    int32_t *merged) {
    if (!m->cap) return 0;
    uint64_t k = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    int64_t j = pair_hash(k) & (m->cap - 1);
    while (m->key[j] != UINT64_MAX) {
        if (m->key[j] == k) {
            *rank = m->rank[j];
            *merged = m->merged[j];
            return 1;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return 0;
}

void tok_pairmap_free(tok_pairmap *m) {
    free(m->key);
    free(m->rank);
    free(m->merged);
    memset(m, 0, sizeof *m);
}

/* ---- UTF-8 --------------------------------------------------------------------------------- */
int tok_utf8_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 1;
}

/* Number of bytes of the valid sequence at s (n available), 0 when invalid or truncated. */
static int utf8_valid_seq(const unsigned char *s, int64_t n) {
    unsigned char c = s[0];
    if (c < 0x80) return 1;
    int len = tok_utf8_len(c);
    if (len == 1 || n < len) return 0;
    unsigned char lo = 0x80, hi = 0xBF;   /* allowed range of the second byte (RFC 3629) */
    if (c == 0xE0) lo = 0xA0;
    else if (c == 0xED) hi = 0x9F;
    else if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int i = 2; i < len; i++)
        if ((s[i] & 0xC0) != 0x80) return 0;
    return len;
}

int64_t fp4moe_utf8_invalid_at(const char *text, int64_t len) {
    return text && len > 0 ? tok_utf8_invalid_at(text, len) : -1;
}

int64_t fp4moe_utf8_lossy(const char *text, int64_t len, char *out) {
    const unsigned char *u = (const unsigned char *)text;
    int64_t i = 0, o = 0;
    while (i < len) {
        const unsigned c = u[i];
        /* the length of a valid sequence led by c, and the range of its second byte (RFC 3629 table 3-7) */
        int64_t need = 0;
        unsigned lo = 0x80, hi = 0xBF;
        if (c < 0x80) need = 1;
        else if (c >= 0xC2 && c <= 0xDF) need = 2;
        else if (c == 0xE0) need = 3, lo = 0xA0;
        else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 3;
        else if (c == 0xED) need = 3, hi = 0x9F;
        else if (c == 0xF0) need = 4, lo = 0x90;
        else if (c >= 0xF1 && c <= 0xF3) need = 4;
        else if (c == 0xF4) need = 4, hi = 0x8F;
        int64_t k = need ? 1 : 0; /* bytes of the sequence that are valid so far */
        while (k && k < need && i + k < len) {
            const unsigned t = u[i + k];
            if (k == 1 ? (t < lo || t > hi) : (t < 0x80 || t > 0xBF)) break;
            k++;
        }
        if (need && k == need) {
            memcpy(out + o, text + i, (size_t)need);
            o += need;
            i += need;
        } else { /* a maximal invalid subpart: its valid start (at least the one byte) -> U+FFFD */
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i += k ? k : 1;
        }
    }
    return o;
}

int64_t tok_utf8_invalid_at(const char *s, int64_t n) {
    const unsigned char *u = (const unsigned char *)s;
    int64_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int len = utf8_valid_seq(u + i, n - i);
        if (!len) return i;
        i += len;
    }
    return -1;
}

uint32_t tok_utf8_decode(const char *s, int64_t n, int *len) {
    const unsigned char *u = (const unsigned char *)s;
    int l = tok_utf8_len(u[0]);
    if (l > n) l = 1;
    *len = l;
    switch (l) {
    case 2: return (uint32_t)(u[0] & 0x1F) << 6 | (u[1] & 0x3F);
    case 3: return (uint32_t)(u[0] & 0x0F) << 12 | (uint32_t)(u[1] & 0x3F) << 6 | (u[2] & 0x3F);
    case 4:
        return (uint32_t)(u[0] & 0x07) << 18 | (uint32_t)(u[1] & 0x3F) << 12 |
               (uint32_t)(u[2] & 0x3F) << 6 | (u[3] & 0x3F);
    default: return u[0];
    }
}

int tok_utf8_append(tok_buf *b, uint32_t cp) {
    char t[4];
    int n;
    if (cp < 0x80) {
        t[0] = (char)cp;
        n = 1;
    } else if (cp < 0x800) {
        t[0] = (char)(0xC0 | cp >> 6);
        t[1] = (char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        t[0] = (char)(0xE0 | cp >> 12);
        t[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        t[2] = (char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        t[0] = (char)(0xF0 | cp >> 18);
        t[1] = (char)(0x80 | (cp >> 12 & 0x3F));
        t[2] = (char)(0x80 | (cp >> 6 & 0x3F));
        t[3] = (char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    return tok_buf_append(b, t, n);
}

int tok_is_whitespace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000;
}
