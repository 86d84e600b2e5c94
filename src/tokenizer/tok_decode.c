/* Decoding: ids -> token strings -> the decoder -> UTF-8 text, one id at a time.
 *
 * HF decode (tokenizer/mod.rs) maps each id to its token string (added tokens first), drops
 * special ones when asked, and runs the decoder over the list:
 *   ByteLevel:   each token's characters -> bytes through the GPT-2 byte map (a token with a
 *                character outside the map contributes its raw UTF-8 bytes), all joined, then
 *                String::from_utf8_lossy (each maximal invalid subpart -> one U+FFFD);
 *   null:        the token strings joined by " ";
 *   chain:       Replace (per token), ByteFallback (a run of <0xXX> tokens -> its bytes when they
 *                are valid UTF-8, else one U+FFFD per byte), Fuse, Strip (leading chars).
 * The streaming decoder below implements all three incrementally; full decode is the stream run
 * over all ids, so the two agree by construction and the goldens check the result against HF. */
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "tokenizer/tok_internal.h"

/* ---- the GPT-2 byte <-> unicode map (bytes_to_unicode in openai/gpt-2 encoder.py) ----------- */
/* Printable bytes '!'..'~', 0xA1..0xAC, 0xAE..0xFF stand for themselves; the other 68 bytes get
 * U+0100, U+0101, ... in increasing byte order. */
static int byte_printable(int b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_byte_to_cp(uint8_t b) {
    if (byte_printable(b)) return b;
    uint32_t n = 0;
    for (int x = 0; x < b; x++) n += !byte_printable(x);
    return 256 + n;
}

int tok_cp_to_byte(uint32_t cp) {
    if (cp < 256) return byte_printable((int)cp) ? (int)cp : -1;
    uint32_t n = 256;
    for (int x = 0; x < 256; x++) {
        if (byte_printable(x)) continue;
        if (n == cp) return x;
        n++;
    }
    return -1;
}

/* "<0xXX>" -> XX as Rust u8::from_str_radix(&t[3..5], 16) reads it (an optional '+' sign), or -1. */
static int byte_token_value(const char *t, int64_t n) {
    if (n != 6 || memcmp(t, "<0x", 3) != 0 || t[5] != '>') return -1;
    int v = 0, digits = 0;
    for (int i = 3; i < 5; i++) {
        char c = t[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0 && !(c == '+' && i == 3)) return -1;
        if (d >= 0) {
            v = v * 16 + d;
            digits++;
        }
    }
    return digits ? v : -1;
}

/* Replace every occurrence of `from` in s by `to` (non-overlapping, left to right). */
static int replace_all(const char *s, int64_t n, const tok_dec_replace *r, tok_buf *out) {
    int rc = FP4MOE_OK;
    out->n = 0;
    rc = tok_buf_append(out, "", 0);
    for (int64_t i = 0; i < n && !rc;) {
        if (r->from_len > 0 && i + r->from_len <= n && memcmp(s + i, r->from, (size_t)r->from_len) == 0) {
            rc = tok_buf_append(out, r->to, r->to_len);
            i += r->from_len;
        } else {
            rc = tok_buf_append(out, s + i, 1);
            i++;
        }
    }
    return rc;
}

int tok_build_pieces(fp4moe_tokenizer *tok) {
    int rc = FP4MOE_OK;
    tok_buf a = {0}, b = {0};
    tok->piece = calloc((size_t)tok->n_ids, sizeof *tok->piece);
    tok->piece_len = calloc((size_t)tok->n_ids, sizeof *tok->piece_len);
    tok->piece_byte = malloc((size_t)tok->n_ids * sizeof *tok->piece_byte);
    if (!tok->piece || !tok->piece_len || !tok->piece_byte)
        return fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (decode pieces)");
    for (int64_t id = 0; id < tok->n_ids && !rc; id++) {
        tok->piece_byte[id] = -1;
        const char *t = tok->id_str[id];
        int64_t n = tok->id_len[id];
        if (!t) continue;
        a.n = 0;
        if (tok->dec == TOK_DEC_BYTELEVEL) {
            int all = 1;
            for (int64_t i = 0; i < n && all && !rc;) {
                int l;
                int byte = tok_cp_to_byte(tok_utf8_decode(t + i, n - i, &l));
                if (byte < 0) all = 0;
                else rc = tok_buf_append(&a, &(char){(char)byte}, 1);
                i += l;
            }
            if (!all) {
                a.n = 0;
                rc = tok_buf_append(&a, t, n);
            }
        } else {
            rc = tok_buf_append(&a, t, n);
            for (int k = 0; k < tok->n_dec_repl && !rc; k++) {
                rc = replace_all(a.p, a.n, &tok->dec_repl[k], &b);
                tok_buf x = a;
                a = b;
                b = x;
            }
            if (!rc && tok->dec == TOK_DEC_CHAIN && tok->dec_byte_fallback) {
                int v = byte_token_value(a.p, a.n);
                if (v >= 0) {
                    tok->piece_byte[id] = (int16_t)v;
                    a.n = 0;
                    rc = tok_buf_append(&a, &(char){(char)v}, 1);
                }
            }
        }
        if (rc) break;
        tok->piece[id] = tok_arena_strndup(&tok->arena, a.p ? a.p : "", (size_t)a.n);
        tok->piece_len[id] = (int32_t)a.n;
        if (!tok->piece[id]) rc = fp4moe_set_error(FP4MOE_ENOMEM, "tokenizer: out of memory (decode pieces)");
    }
    tok_buf_free(&a);
    tok_buf_free(&b);
    return rc;
}

/* ---- lossy UTF-8 --------------------------------------------------------------------------- */
static const char REPLACEMENT[3] = {(char)0xEF, (char)0xBF, (char)0xBD};   /* U+FFFD */

/* Moves the decodable prefix of pending p[0..n) to out, replacing each maximal invalid subpart by
 * U+FFFD (Unicode 15 ch. 3 "U+FFFD substitution of maximal subparts", as Rust from_utf8_lossy).
 * Unless `final`, a trailing incomplete but so far valid sequence is kept: returns the number of
 * bytes consumed. */
static int64_t utf8_lossy(const uint8_t *p, int64_t n, int final, tok_buf *out, int *rc) {
    int64_t i = 0, run = 0;   /* p[run..i) is valid text not yet copied */
    *rc = FP4MOE_OK;
    if (n <= 0) return 0;     /* p may be NULL: no pointer arithmetic on it */
    while (i < n) {
        uint8_t c = p[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int len = tok_utf8_len(c);
        int k = 1;
        if (len > 1) {
            uint8_t lo = 0x80, hi = 0xBF;
            if (c == 0xE0) lo = 0xA0;
            else if (c == 0xED) hi = 0x9F;
            else if (c == 0xF0) lo = 0x90;
            else if (c == 0xF4) hi = 0x8F;
            for (; k < len && i + k < n; k++) {
                uint8_t x = p[i + k];
                if (k == 1 ? (x < lo || x > hi) : (x & 0xC0) != 0x80) break;
            }
            if (k == len) {   /* a whole valid character */
                i += len;
                continue;
            }
            if (i + k == n && !final) break;   /* incomplete so far: wait for more bytes */
        }
        /* p[i..i+k) is a maximal invalid subpart */
        if ((*rc = tok_buf_append(out, p + run, i - run))) return 0;
        if ((*rc = tok_buf_append(out, REPLACEMENT, 3))) return 0;
        i += k;
        run = i;
    }
    if ((*rc = tok_buf_append(out, p + run, i - run))) return 0;
    return i;
}

/* ---- the stream ---------------------------------------------------------------------------- */
void fp4moe_tokenizer_stream_init(fp4moe_tokenizer_stream *s, const fp4moe_tokenizer *tok,
                                  int skip_special) {
    if (!s) return;
    memset(s, 0, sizeof *s);
    s->tok = tok;
    s->skip_special = skip_special;
    s->strip_left = tok ? tok->strip_start : 0;
}

void fp4moe_tokenizer_stream_free(fp4moe_tokenizer_stream *s) {
    if (!s) return;
    free(s->pending);
    free(s->out);
    s->pending = NULL;
    s->out = NULL;
    s->n_pending = s->cap_pending = s->cap_out = 0;
}

static int pending_append(fp4moe_tokenizer_stream *s, const char *p, int64_t n) {
    tok_buf b = {(char *)s->pending, s->n_pending, s->cap_pending};
    int rc = tok_buf_append(&b, p, n);
    s->pending = (uint8_t *)b.p;
    s->n_pending = b.n;
    s->cap_pending = b.cap;
    return rc;
}

/* Appends final text to out, dropping the Strip decoder's leading characters first. */
static int emit(fp4moe_tokenizer_stream *s, const char *p, int64_t n, tok_buf *out) {
    while (s->strip_left > 0 && n > 0) {
        int l;
        if (tok_utf8_decode(p, n, &l) != s->tok->strip_char) {
            s->strip_left = 0;
            break;
        }
        p += l;
        n -= l;
        s->strip_left--;
    }
    if (n > 0) s->strip_left = 0;
    return tok_buf_append(out, p, n);
}

/* ByteFallback: resolves the pending run of byte tokens. */
static int flush_byte_run(fp4moe_tokenizer_stream *s, tok_buf *out) {
    int rc = FP4MOE_OK;
    if (s->n_pending == 0) return rc;
    if (tok_utf8_invalid_at((const char *)s->pending, s->n_pending) < 0) {
        rc = emit(s, (const char *)s->pending, s->n_pending, out);
    } else {
        for (int64_t i = 0; i < s->n_pending && !rc; i++) rc = emit(s, REPLACEMENT, 3, out);
    }
    s->n_pending = 0;
    return rc;
}

/* ByteLevel: emits the complete characters of the pending bytes (no Strip with ByteLevel, so the
 * text goes straight to out). */
static int flush_utf8(fp4moe_tokenizer_stream *s, int final, tok_buf *out) {
    int rc;
    int64_t used = utf8_lossy(s->pending, s->n_pending, final, out, &rc);
    if (rc) return rc;
    if (used > 0 && used < s->n_pending) memmove(s->pending, s->pending + used, (size_t)(s->n_pending - used));
    s->n_pending -= used;
    return FP4MOE_OK;
}

static int stream_feed(fp4moe_tokenizer_stream *s, int32_t id, tok_buf *out) {
    const fp4moe_tokenizer *tok = s->tok;
    if (id < 0 || id >= tok->n_ids || !tok->id_str[id])
        return fp4moe_set_error(FP4MOE_EINVAL, "tokenizer decode: id %d is not a token of %s (vocab size %lld)",
                                id, tok->path, (long long)tok->n_ids);
    if (s->skip_special && tok->id_special[id]) return FP4MOE_OK;
    const char *piece = tok->piece[id];
    int64_t n = tok->piece_len[id];
    int rc = FP4MOE_OK;
    switch (tok->dec) {
    case TOK_DEC_JOIN_SPACE:
        if (s->n_tokens > 0) rc = emit(s, " ", 1, out);
        if (!rc) rc = emit(s, piece, n, out);
        break;
    case TOK_DEC_BYTELEVEL:
        rc = pending_append(s, piece, n);
        if (!rc) rc = flush_utf8(s, 0, out);
        break;
    case TOK_DEC_CHAIN:
        if (tok->dec_byte_fallback && tok->piece_byte[id] >= 0) {
            rc = pending_append(s, piece, n);
        } else {
            rc = flush_byte_run(s, out);
            if (!rc) rc = emit(s, piece, n, out);
        }
        break;
    }
    s->n_tokens++;
    return rc;
}

static int stream_end(fp4moe_tokenizer_stream *s, tok_buf *out) {
    int rc = s->tok->dec == TOK_DEC_BYTELEVEL ? flush_utf8(s, 1, out) : flush_byte_run(s, out);
    s->n_pending = 0;
    s->n_tokens = 0;
    s->strip_left = s->tok->strip_start;
    return rc;
}

/* Runs f on the stream's own output buffer and returns it. */
static int stream_call(fp4moe_tokenizer_stream *s, int32_t id, int end, const char **text,
                       int64_t *text_len) {
    if (text) *text = "";
    if (text_len) *text_len = 0;
    if (!s || !s->tok || !text || !text_len)
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_stream: NULL argument");
    tok_buf out = {s->out, 0, s->cap_out};
    int rc = tok_buf_append(&out, "", 0);
    if (!rc) rc = end ? stream_end(s, &out) : stream_feed(s, id, &out);
    s->out = out.p;
    s->cap_out = out.cap;
    if (rc) return rc;
    *text = s->out;
    *text_len = out.n;
    return FP4MOE_OK;
}

int fp4moe_tokenizer_stream_push(fp4moe_tokenizer_stream *s, int32_t id, const char **text,
                                 int64_t *text_len) {
    return stream_call(s, id, 0, text, text_len);
}

int fp4moe_tokenizer_stream_flush(fp4moe_tokenizer_stream *s, const char **text,
                                  int64_t *text_len) {
    return stream_call(s, 0, 1, text, text_len);
}

int64_t fp4moe_tokenizer_stream_pending(const fp4moe_tokenizer_stream *s) { return s ? s->n_pending : 0; }

int fp4moe_tokenizer_decode(const fp4moe_tokenizer *tok, const int32_t *ids, int64_t n,
                            int skip_special, char **text, int64_t *text_len) {
    if (text) *text = NULL;
    if (text_len) *text_len = 0;
    if (!tok || !text || !text_len || n < 0 || (!ids && n > 0))
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_decode: NULL argument or n %lld < 0",
                                (long long)n);
    fp4moe_tokenizer_stream s;
    fp4moe_tokenizer_stream_init(&s, tok, skip_special);
    tok_buf out = {0};
    int rc = tok_buf_append(&out, "", 0);
    for (int64_t i = 0; i < n && !rc; i++) rc = stream_feed(&s, ids[i], &out);
    if (!rc) rc = stream_end(&s, &out);
    fp4moe_tokenizer_stream_free(&s);
    if (rc) {
        tok_buf_free(&out);
        return rc;
    }
    *text = out.p;
    *text_len = out.n;
    return FP4MOE_OK;
}

int fp4moe_tokenizer_token_to_piece(const fp4moe_tokenizer *tok, int32_t id, const char **piece,
                                    int64_t *piece_len) {
    if (!tok || !piece || !piece_len)
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_token_to_piece: NULL argument");
    if (id < 0 || id >= tok->n_ids || !tok->id_str[id])
        return fp4moe_set_error(FP4MOE_EINVAL, "fp4moe_tokenizer_token_to_piece: id %d is not a token of %s",
                                id, tok->path);
    *piece = tok->piece[id];
    *piece_len = tok->piece_len[id];
    return FP4MOE_OK;
}
