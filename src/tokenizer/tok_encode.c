/* Encoding: added tokens, normalizers, pre-tokenizers, BPE, post-processor.
 * Each stage follows HF tokenizers (src/tokenizer/added_vocabulary.rs find_matches,
 * normalizers/{prepend,replace}.rs, pre_tokenizers/{split,byte_level,digits}.rs,
 * processors/template.rs). */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tok_internal.h"

/* ---- added-token trie ---------------------------------------------------------------------- */
static int trie_node_new(tok_trie *t, uint8_t byte) {
    if (t->n == t->cap) {
        int64_t cap = t->cap ? 2 * t->cap : 64;
        tok_trie_node *p = realloc(t->node, (size_t)cap * sizeof *p);
        if (!p) return -1;
        t->node = p;
        t->cap = cap;
    }
    t->node[t->n] = (tok_trie_node){-1, -1, -1, byte};
    return (int)t->n++;
}

static int32_t trie_child(const tok_trie *t, int32_t node, uint8_t byte) {
    if (node == 0) return t->root_child[byte];
    for (int32_t c = t->node[node].first_child; c >= 0; c = t->node[c].next_sibling)
        if (t->node[c].byte == byte) return c;
    return -1;
}

static int trie_insert(tok_trie *t, const char *s, int64_t n, int32_t added_index) {
    if (t->n == 0) {
        for (int b = 0; b < 256; b++) t->root_child[b] = -1;
        if (trie_node_new(t, 0) < 0) goto oom;
    }
    int32_t node = 0;
    for (int64_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = trie_child(t, node, b);
        if (c < 0) {
            if ((c = trie_node_new(t, b)) < 0) goto oom;
            if (node == 0) {
                t->root_child[b] = c;
            } else {
                t->node[c].next_sibling = t->node[node].first_child;
                t->node[node].first_child = c;
            }
        }
        node = c;
    }
    if (node != 0) t->node[node].added = added_index;   /* an empty content never matches */
    return FP4MOE_OK;
oom:
    return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (added-token trie)");
}

/* Leftmost-longest match at or after `from`: the index into tok->added, or -1 (no match). */
static int32_t trie_find(const tok_trie *t, const char *s, int64_t n, int64_t from, int64_t *ms,
                         int64_t *me) {
    if (t->n == 0) return -1;
    for (int64_t i = from; i < n; i++) {
        int32_t node = t->root_child[(uint8_t)s[i]], best = -1;
        for (int64_t j = i + 1; node >= 0; j++) {
            if (t->node[node].added >= 0) {
                best = t->node[node].added;
                *me = j;
            }
            if (j >= n) break;
            node = trie_child(t, node, (uint8_t)s[j]);
        }
        if (best >= 0) {
            *ms = i;
            return best;
        }
    }
    return -1;
}

/* ---- normalizers --------------------------------------------------------------------------- */
/* Applies the normalizer steps to s[0..n); the result is in *out (ping-pong with *tmp). */
static int normalize(const fp4moe_tokenizer *tok, tok_matcher *m, tok_spans *sp, const char *s,
                     int64_t n, tok_buf *out, tok_buf *tmp) {
    int rc;
    out->n = 0;
    if ((rc = tok_buf_append(out, s, n))) return rc;
    for (int k = 0; k < tok->n_norm; k++) {
        const tok_norm *nm = &tok->norm[k];
        tmp->n = 0;
        if ((rc = tok_buf_append(tmp, "", 0))) return rc;
        if (nm->type == TOK_NORM_PREPEND) {
            if (out->n == 0) continue;   /* HF Prepend leaves an empty string empty */
            rc = tok_buf_append(tmp, nm->content, nm->content_len);
            if (!rc) rc = tok_buf_append(tmp, out->p, out->n);
        } else {   /* Replace: every match of the pattern -> content */
            if ((rc = tok_find_matches(&nm->pattern, m, out->p, out->n, 0, sp))) return rc;
            for (int64_t i = 0; i < sp->n && !rc; i++) {
                tok_span x = sp->p[i];
                rc = x.is_match ? tok_buf_append(tmp, nm->content, nm->content_len)
                                : tok_buf_append(tmp, out->p + x.start, x.end - x.start);
            }
        }
        if (rc) return rc;
        tok_buf t = *out;
        *out = *tmp;
        *tmp = t;
    }
    return FP4MOE_OK;
}

/* ---- encode context ------------------------------------------------------------------------ */
typedef struct {
    const fp4moe_tokenizer *tok;
    tok_matcher m;
    tok_bpe_scratch bpe;
    tok_spans spans[TOK_MAX_PRE];
    tok_buf prefixed[TOK_MAX_PRE];   /* ByteLevel add_prefix_space copies */
    tok_spans norm_spans;
    tok_spans added_raw, added_norm; /* split_added results of stage 1 and stage 2 */
    tok_buf norm, norm_tmp;
    tok_ivec *out;
} enc_ctx;

static void enc_ctx_free(enc_ctx *c) {
    tok_matcher_free(&c->m);
    tok_bpe_scratch_free(&c->bpe);
    for (int k = 0; k < TOK_MAX_PRE; k++) {
        tok_spans_free(&c->spans[k]);
        tok_buf_free(&c->prefixed[k]);
    }
    tok_spans_free(&c->norm_spans);
    tok_spans_free(&c->added_raw);
    tok_spans_free(&c->added_norm);
    tok_buf_free(&c->norm);
    tok_buf_free(&c->norm_tmp);
}

/* Pre-tokenizer step k on the piece s[0..n), then the following steps, then BPE. */
static int pretokenize(enc_ctx *c, int k, const char *s, int64_t n) {
    const fp4moe_tokenizer *tok = c->tok;
    if (n == 0) return FP4MOE_OK;   /* HF drops empty splits */
    if (k == tok->n_pre) return tok_bpe_word(tok, &c->bpe, s, n, c->out);
    const tok_pre *p = &tok->pre[k];
    int rc;
    if (p->type == TOK_PRE_BYTELEVEL) {
        if (p->add_prefix_space && s[0] != ' ') {
            tok_buf *b = &c->prefixed[k];
            b->n = 0;
            if ((rc = tok_buf_append(b, " ", 1)) || (rc = tok_buf_append(b, s, n))) return rc;
            s = b->p;
            n = b->n;
        }
        if (!p->has_pattern) return pretokenize(c, k + 1, s, n);
    }
    tok_spans *sp = &c->spans[k];
    if ((rc = tok_find_matches(&p->pattern, &c->m, s, n, p->invert, sp))) return rc;
    tok_apply_behavior(sp, p->behavior);
    for (int64_t i = 0; i < sp->n; i++) {
        tok_span x = sp->p[i];
        if (x.is_match) continue;   /* removed */
        if ((rc = pretokenize(c, k + 1, s + x.start, x.end - x.start))) return rc;
    }
    return FP4MOE_OK;
}

/* Rust regex \w at the last (at_end) or first character of s[0..n). */
static int word_char_at(const fp4moe_tokenizer *tok, tok_matcher *m, const char *s, int64_t n,
                        int at_end) {
    if (n == 0 || !tok->word_char_re) return 0;
    int64_t i = 0;
    if (at_end) {
        i = n - 1;
        while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
    }
    int len = tok_utf8_len((unsigned char)s[i]);
    int rc = pcre2_match(tok->word_char_re, (PCRE2_SPTR)(s + i), (PCRE2_SIZE)len, 0,
                         PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, m->md, m->mctx);
    return rc >= 0;
}

/* HF AddedVocabulary::find_matches + split_with_indices: s[0..n) -> spans whose is_match is the
 * added-token id, or -1 for text between added tokens (spans may overlap only as HF's do). */
static int split_added(enc_ctx *c, const tok_trie *t, const char *s, int64_t n, tok_spans *out) {
    const fp4moe_tokenizer *tok = c->tok;
    out->n = 0;
    int64_t start_offset = 0, from = 0, ms, me;
    int rc = FP4MOE_OK;
    for (;;) {
        int32_t a = trie_find(t, s, n, from, &ms, &me);
        if (a < 0) break;
        from = me;   /* the automaton resumes after the match, whatever happens to it */
        const tok_added *ad = &tok->added[a];
        int64_t start = ms, stop = me;
        if (ad->single_word) {
            int start_space = start == 0 || !word_char_at(tok, &c->m, s, start, 1);
            int stop_space = stop == n || !word_char_at(tok, &c->m, s + stop, n - stop, 0);
            if (!start_space || !stop_space) continue;
        }
        if (ad->lstrip) {   /* absorb the whitespace run before the token */
            int64_t j = start;
            while (j > 0) {
                int64_t i = j - 1;
                while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
                int l;
                if (!tok_is_whitespace(tok_utf8_decode(s + i, n - i, &l))) break;
                j = i;
            }
            start = j > start_offset ? j : start_offset;
        }
        if (ad->rstrip) {   /* and the run after it */
            while (stop < n) {
                int l;
                if (!tok_is_whitespace(tok_utf8_decode(s + stop, n - stop, &l))) break;
                stop += l;
            }
        }
        if (start_offset < start && (rc = tok_spans_push(out, start_offset, start, -1))) return rc;
        if ((rc = tok_spans_push(out, start, stop, tok->added[a].id))) return rc;
        start_offset = stop;
    }
    if (start_offset != n) return tok_spans_push(out, start_offset, n, -1);
    return FP4MOE_OK;
}

/* Stage 2 on one piece of raw text between non-normalized added tokens: normalize, cut out the
 * normalized added tokens, pre-tokenize and BPE the rest. */
static int encode_piece(enc_ctx *c, const char *s, int64_t n) {
    const fp4moe_tokenizer *tok = c->tok;
    int rc;
    if (n == 0) return FP4MOE_OK;
    if ((rc = normalize(tok, &c->m, &c->norm_spans, s, n, &c->norm, &c->norm_tmp))) return rc;
    if ((rc = split_added(c, &tok->trie_norm, c->norm.p, c->norm.n, &c->added_norm))) return rc;
    for (int64_t i = 0; i < c->added_norm.n; i++) {
        tok_span x = c->added_norm.p[i];
        if (x.is_match >= 0) rc = tok_ivec_push(c->out, x.is_match);
        else rc = pretokenize(c, 0, c->norm.p + x.start, x.end - x.start);
        if (rc) return rc;
    }
    return FP4MOE_OK;
}

int fp4moe_tokenizer_encode(const fp4moe_tokenizer *tok, const char *text, int64_t len,
                            int add_special, int32_t **ids, int64_t *n_ids) {
    if (ids) *ids = NULL;
    if (n_ids) *n_ids = 0;
    if (!tok || !ids || !n_ids || (!text && len != 0) || len < 0)
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_encode: %s", !tok ? "NULL tokenizer"
                                : !ids || !n_ids ? "NULL output pointer" : len < 0 ? "len < 0" : "NULL text with len > 0");
    int64_t bad = tok_utf8_invalid_at(text, len);
    if (bad >= 0)
        return fp4moe_set_error(FP4MOE_EINVAL,
                                "the text is not valid UTF-8 at byte %lld (0x%02x)",
                                (long long)bad, (unsigned char)text[bad]);
    tok_ivec out = {0};
    enc_ctx c;
    memset(&c, 0, sizeof c);
    c.tok = tok;
    c.out = &out;
    int rc = tok_matcher_init(&c.m);
    if (!rc && add_special)
        for (int64_t i = 0; i < tok->post_prefix.n && !rc; i++) rc = tok_ivec_push(&out, tok->post_prefix.p[i]);
    if (!rc && len > 0) rc = split_added(&c, &tok->trie_raw, text, len, &c.added_raw);
    for (int64_t i = 0; !rc && len > 0 && i < c.added_raw.n; i++) {
        tok_span x = c.added_raw.p[i];
        if (x.is_match >= 0) rc = tok_ivec_push(&out, x.is_match);
        else rc = encode_piece(&c, text + x.start, x.end - x.start);
    }
    if (!rc && add_special)
        for (int64_t i = 0; i < tok->post_suffix.n && !rc; i++) rc = tok_ivec_push(&out, tok->post_suffix.p[i]);
    if (!rc && !out.p) {   /* a non-NULL array even when empty */
        rc = tok_ivec_push(&out, 0);
        out.n = 0;
    }
    enc_ctx_free(&c);
    if (rc) {
        tok_ivec_free(&out);
        return rc;
    }
    *ids = out.p;
    *n_ids = out.n;
    return FP4MOE_OK;
}

int tok_build_tries(fp4moe_tokenizer *tok) {
    int rc = FP4MOE_OK, need_word_re = 0;
    tok_matcher m;
    tok_spans sp = {0};
    tok_buf norm = {0}, tmp = {0};
    if ((rc = tok_matcher_init(&m))) return rc;
    for (int64_t i = 0; i < tok->n_added && !rc; i++) {
        const tok_added *a = &tok->added[i];
        need_word_re |= a->single_word;
        if (!a->normalized) {
            rc = trie_insert(&tok->trie_raw, a->content, a->len, (int32_t)i);
        } else {   /* HF matches the normalized form of a normalized token */
            rc = normalize(tok, &m, &sp, a->content, a->len, &norm, &tmp);
            if (!rc) rc = trie_insert(&tok->trie_norm, norm.p, norm.n, (int32_t)i);
        }
    }
    if (!rc && need_word_re) {
        /* Rust regex \w = Alphabetic | Mark | Decimal_Number | Connector_Punctuation | Join_Control */
        static const char word_re[] = "[\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]";
        int err;
        PCRE2_SIZE off;
        tok->word_char_re = pcre2_compile((PCRE2_SPTR)word_re, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                          &err, &off, NULL);
        if (!tok->word_char_re) rc = fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: cannot compile the word regex");
    }
    tok_matcher_free(&m);
    tok_spans_free(&sp);
    tok_buf_free(&norm);
    tok_buf_free(&tmp);
    return rc;
}
