/* The BPE model (HF tokenizers models/bpe/model.rs merge_word + word.rs merge_all):
 *   1. the word's characters become symbols (vocab ids); a character not in the vocab becomes its
 *      <0xXX> byte tokens (byte_fallback) or the unk token (consecutive ones fused with fuse_unk)
 *      or is dropped when there is no unk token;
 *   2. repeatedly the adjacent pair with the lowest merge rank is merged (leftmost on ties),
 *      using a binary heap of candidate pairs and a linked list of symbols: O(n log n) per word.
 * With ByteLevel, the word arrives as raw bytes and byte b is the symbol byte_sym[b] (the vocab id
 * of the printable character that stands for b). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tok_internal.h"

struct tok_sym {
    int32_t id;          /* -1 once merged into its left neighbour */
    int32_t prev, next;  /* -1 at the ends */
};

struct tok_merge_cand {
    int32_t rank, pos;   /* pos: index of the left symbol; heap order (rank, pos) */
    int32_t left, right, merged;
};

static int add_sym(tok_bpe_scratch *sc, int32_t id) {
    if (sc->n_sym == sc->cap_sym) {
        int64_t cap = sc->cap_sym ? 2 * sc->cap_sym : 64;
        if (cap > INT32_MAX) return fp4moe_set_error(FP4MOE_EOVERFLOW, "tokenizer: word too long for BPE");
        struct tok_sym *p = realloc(sc->sym, (size_t)cap * sizeof *p);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (BPE symbols)");
        sc->sym = p;
        sc->cap_sym = cap;
    }
    int32_t i = (int32_t)sc->n_sym++;
    sc->sym[i] = (struct tok_sym){id, i - 1, -1};
    if (i > 0) sc->sym[i - 1].next = i;
    return FP4MOE_OK;
}

static int cand_less(const struct tok_merge_cand *a, const struct tok_merge_cand *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static int heap_push(tok_bpe_scratch *sc, struct tok_merge_cand c) {
    if (sc->n_heap == sc->cap_heap) {
        int64_t cap = sc->cap_heap ? 2 * sc->cap_heap : 64;
        struct tok_merge_cand *p = realloc(sc->heap, (size_t)cap * sizeof *p);
        if (!p) return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (BPE heap)");
        sc->heap = p;
        sc->cap_heap = cap;
    }
    struct tok_merge_cand *h = sc->heap;
    int64_t i = sc->n_heap++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!cand_less(&c, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = c;
    return FP4MOE_OK;
}

static struct tok_merge_cand heap_pop(tok_bpe_scratch *sc) {
    struct tok_merge_cand *h = sc->heap;
    struct tok_merge_cand top = h[0], last = h[--sc->n_heap];
    int64_t i = 0, n = sc->n_heap;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && cand_less(&h[child + 1], &h[child])) child++;
        if (!cand_less(&h[child], &last)) break;
        h[i] = h[child];
        i = child;
    }
    if (n > 0) h[i] = last;
    return top;
}

/* Queues the pair starting at symbol pos if the merges know it. */
static int queue_pair(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc, int32_t pos) {
    int32_t next = sc->sym[pos].next;
    if (next < 0) return FP4MOE_OK;
    int32_t left = sc->sym[pos].id, right = sc->sym[next].id, rank, merged;
    if (!tok_pairmap_get(&tok->merges, left, right, &rank, &merged)) return FP4MOE_OK;
    return heap_push(sc, (struct tok_merge_cand){rank, pos, left, right, merged});
}

static int merge_all(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc) {
    int rc = FP4MOE_OK;
    sc->n_heap = 0;
    for (int32_t i = 0; i + 1 < (int32_t)sc->n_sym && !rc; i++) rc = queue_pair(tok, sc, i);
    while (!rc && sc->n_heap > 0) {
        struct tok_merge_cand c = heap_pop(sc);
        struct tok_sym *s = sc->sym;
        int32_t next = s[c.pos].next;
        /* stale candidate: a side was merged away since it was queued */
        if (s[c.pos].id != c.left || next < 0 || s[next].id != c.right) continue;
        s[c.pos].id = c.merged;
        s[c.pos].next = s[next].next;
        if (s[next].next >= 0) s[s[next].next].prev = c.pos;
        s[next].id = -1;
        if (s[c.pos].prev >= 0) rc = queue_pair(tok, sc, s[c.pos].prev);
        if (!rc) rc = queue_pair(tok, sc, c.pos);
    }
    return rc;
}

/* One character `ch` (len bytes, prefix/suffix already applied) of the word -> symbols, with the
 * unknown-character rules of HF merge_word. *unk_pending is the unk id waiting to be added. */
static int add_char(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc, const char *ch, int64_t len,
                    int32_t *unk_pending) {
    int32_t id = tok_strmap_get(&tok->vocab, ch, len);
    int rc = FP4MOE_OK;
    if (id >= 0) {
        if (*unk_pending >= 0) {
            rc = add_sym(sc, *unk_pending);
            *unk_pending = -1;
        }
        return rc ? rc : add_sym(sc, id);
    }
    if (tok->byte_fallback) {
        int all = 1;
        for (int64_t i = 0; i < len; i++) all &= tok->fallback_id[(unsigned char)ch[i]] >= 0;
        if (all) {   /* (a pending unk is not flushed here: HF does the same) */
            for (int64_t i = 0; i < len && !rc; i++) rc = add_sym(sc, tok->fallback_id[(unsigned char)ch[i]]);
            return rc;
        }
    }
    if (tok->unk_id >= 0) {
        if (*unk_pending >= 0 && !tok->fuse_unk) rc = add_sym(sc, *unk_pending);
        *unk_pending = tok->unk_id;
    }
    return rc;
}

/* Appends the ByteLevel image of w (each byte -> its printable character) to b. */
static int map_bytes(const char *w, int64_t n, tok_buf *b) {
    int rc = FP4MOE_OK;
    for (int64_t i = 0; i < n && !rc; i++) rc = tok_utf8_append(b, tok_byte_to_cp((unsigned char)w[i]));
    return rc;
}

/* Symbols of a word given as a string of characters (general path). */
static int word_symbols(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc, const char *w, int64_t n) {
    tok_buf ch = {0};
    int32_t unk = -1;
    int rc = FP4MOE_OK;
    for (int64_t i = 0; i < n && !rc;) {
        int l;
        tok_utf8_decode(w + i, n - i, &l);
        ch.n = 0;
        if (i > 0 && tok->cont_prefix) rc = tok_buf_append(&ch, tok->cont_prefix, (int64_t)strlen(tok->cont_prefix));
        if (!rc) rc = tok_buf_append(&ch, w + i, l);
        if (!rc && i + l == n && tok->eow_suffix) rc = tok_buf_append(&ch, tok->eow_suffix, (int64_t)strlen(tok->eow_suffix));
        if (!rc) rc = add_char(tok, sc, ch.p, ch.n, &unk);
        i += l;
    }
    if (!rc && unk >= 0) rc = add_sym(sc, unk);
    tok_buf_free(&ch);
    return rc;
}

int tok_bpe_word(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc, const char *w, int64_t n,
                 tok_ivec *out) {
    int rc = FP4MOE_OK;
    sc->n_sym = 0;
    const char *word = w;   /* the word as the model sees it (ByteLevel-mapped when byte_level) */
    int64_t word_len = n;
    int simple = !tok->cont_prefix && !tok->eow_suffix;
    if (tok->byte_level && (tok->ignore_merges || !simple)) {
        sc->tmp.n = 0;
        if ((rc = map_bytes(w, n, &sc->tmp))) return rc;
        word = sc->tmp.p;
        word_len = sc->tmp.n;
    }
    if (tok->ignore_merges) {
        int32_t id = tok_strmap_get(&tok->vocab, word, word_len);
        if (id >= 0) return tok_ivec_push(out, id);
    }
    if (tok->byte_level && simple) {
        /* fast path: one symbol per byte; the general rules only for bytes missing in the vocab */
        int32_t unk = -1;
        char mapped[4];
        for (int64_t i = 0; i < n && !rc; i++) {
            int32_t id = tok->byte_sym[(unsigned char)w[i]];
            if (id >= 0 && unk < 0) {
                rc = add_sym(sc, id);
                continue;
            }
            uint32_t cp = tok_byte_to_cp((unsigned char)w[i]);   /* < 0x144: 1 or 2 bytes */
            int64_t len = 1;
            if (cp < 0x80) {
                mapped[0] = (char)cp;
            } else {
                mapped[0] = (char)(0xC0 | cp >> 6);
                mapped[1] = (char)(0x80 | (cp & 0x3F));
                len = 2;
            }
            rc = add_char(tok, sc, mapped, len, &unk);
        }
        if (!rc && unk >= 0) rc = add_sym(sc, unk);
    } else {
        rc = word_symbols(tok, sc, word, word_len);
    }
    if (!rc) rc = merge_all(tok, sc);
    for (int32_t i = 0; !rc && i >= 0 && sc->n_sym > 0; i = sc->sym[i].next) rc = tok_ivec_push(out, sc->sym[i].id);
    return rc;
}

void tok_bpe_scratch_free(tok_bpe_scratch *sc) {
    tok_buf_free(&sc->tmp);
    free(sc->sym);
    free(sc->heap);
    memset(sc, 0, sizeof *sc);
}
