/* Internal structures of the tokenizer.json BPE tokenizer (see include/fp4moe/tokenizer.h for
 * the pipeline). Layout:
 *   tok_util.c    growable buffers, string arena, hash maps, UTF-8 helpers
 *   tok_load.c    tokenizer.json (cJSON) -> struct fp4moe_tokenizer
 *   tok_regex.c   PCRE2 compile (Oniguruma -> PCRE2 rewrite), match iteration, split behaviors
 *   tok_bpe.c     the BPE model: initial symbols, merges by rank (binary heap)
 *   tok_encode.c  added tokens, normalizers, pre-tokenizers, post-processor, the public encode
 *   tok_decode.c  ByteLevel map, decoders, lossy UTF-8, decode and the streaming decoder */
#ifndef FP4MOE_TOK_INTERNAL_H
#define FP4MOE_TOK_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include "fp4moe/tokenizer.h"

/* ---- growable byte buffer ------------------------------------------------------------------ */
typedef struct {
    char *p;
    int64_t n, cap;
} tok_buf;
int tok_buf_reserve(tok_buf *b, int64_t extra);          /* FP4MOE_OK / FP4MOE_ENOMEM */
int tok_buf_append(tok_buf *b, const void *src, int64_t n);
void tok_buf_free(tok_buf *b);

/* growable int32 vector */
typedef struct {
    int32_t *p;
    int64_t n, cap;
} tok_ivec;
int tok_ivec_push(tok_ivec *v, int32_t x);
void tok_ivec_free(tok_ivec *v);

/* ---- string arena: stable copies of strings, freed all at once ----------------------------- */
typedef struct tok_arena_chunk tok_arena_chunk;
typedef struct {
    tok_arena_chunk *head;
} tok_arena;
/* Copies n bytes + a NUL terminator; returns NULL when out of memory. */
char *tok_arena_strndup(tok_arena *a, const char *s, size_t n);
void tok_arena_free(tok_arena *a);

/* ---- hash map: byte string -> int32 (keys are not owned: they must outlive the map) -------- */
typedef struct {
    const char *key;
    int32_t len;
    int32_t val;
    uint32_t hash;
} tok_strmap_entry;
typedef struct {
    tok_strmap_entry *e;
    int64_t cap, n;   /* cap is a power of two; key == NULL marks an empty slot */
} tok_strmap;
uint32_t tok_hash(const char *s, int64_t n);
/* Inserts or overwrites. FP4MOE_OK / FP4MOE_ENOMEM. */
int tok_strmap_put(tok_strmap *m, const char *key, int32_t len, int32_t val);
/* The value, or -1 when absent. */
int32_t tok_strmap_get(const tok_strmap *m, const char *key, int64_t len);
void tok_strmap_free(tok_strmap *m);

/* ---- hash map: (left id, right id) -> (merge rank, merged id) ------------------------------ */
typedef struct {
    uint64_t *key;    /* (uint64)left << 32 | right; UINT64_MAX marks an empty slot */
    int32_t *rank;
    int32_t *merged;
    int64_t cap, n;
} tok_pairmap;
int tok_pairmap_put(tok_pairmap *m, int32_t left, int32_t right, int32_t rank, int32_t merged);
/* 1 and (*rank, *merged) when the pair merges, else 0. */
int tok_pairmap_get(const tok_pairmap *m, int32_t left, int32_t right, int32_t *rank,
                    int32_t *merged);
void tok_pairmap_free(tok_pairmap *m);

/* ---- UTF-8 --------------------------------------------------------------------------------- */
/* Byte offset of the first invalid UTF-8 sequence in s[0..n), or -1 when all of it is valid
 * (RFC 3629: no overlongs, no surrogates, <= U+10FFFF). */
int64_t tok_utf8_invalid_at(const char *s, int64_t n);
/* Length in bytes of the (valid) UTF-8 character starting with byte c (1 for a bad lead byte). */
int tok_utf8_len(unsigned char c);
/* Decodes the valid character at s (n bytes available); returns its code point, sets *len. */
uint32_t tok_utf8_decode(const char *s, int64_t n, int *len);
/* Appends the UTF-8 encoding of cp to b. */
int tok_utf8_append(tok_buf *b, uint32_t cp);
/* Rust char::is_whitespace (the Unicode White_Space property). */
int tok_is_whitespace(uint32_t cp);

/* ---- regex (PCRE2) ------------------------------------------------------------------------- */
typedef struct {
    pcre2_code *re;     /* NULL for a literal (String) pattern */
    char *literal;      /* the String pattern (NUL-terminated, owned) */
    int64_t literal_len;
} tok_pattern;

/* Compiles an Oniguruma-syntax pattern (as in HF tokenizer.json "Regex") with PCRE2 UTF|UCP and
 * JIT. `where` names the file/field for the error message. */
int tok_pattern_regex(tok_pattern *p, const char *pattern, const char *where);
int tok_pattern_literal(tok_pattern *p, const char *s, int64_t len);
void tok_pattern_free(tok_pattern *p);

/* Per-call matching scratch (one per encode call: the compiled patterns are shared). */
typedef struct {
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
} tok_matcher;
int tok_matcher_init(tok_matcher *m);
void tok_matcher_free(tok_matcher *m);

/* One split of a string: [start, end) and whether it is a pattern match. */
typedef struct {
    int64_t start, end;
    int is_match;
} tok_span;
typedef struct {
    tok_span *p;
    int64_t n, cap;
} tok_spans;
int tok_spans_push(tok_spans *v, int64_t start, int64_t end, int is_match);
void tok_spans_free(tok_spans *v);

/* HF Pattern::find_matches: all of s[0..n) as alternating non-match / match spans (match spans
 * as Oniguruma find_iter gives them; an empty s gives one empty non-match span). invert flips
 * the flags. Appends to *out (cleared first). */
int tok_find_matches(const tok_pattern *p, tok_matcher *m, const char *s, int64_t n, int invert,
                     tok_spans *out);

typedef enum {
    TOK_SPLIT_REMOVED = 0,
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_MERGED_WITH_PREVIOUS,
    TOK_SPLIT_MERGED_WITH_NEXT,
    TOK_SPLIT_CONTIGUOUS
} tok_split_behavior;
/* HF NormalizedString::split: turns find_matches spans in place into the spans to keep
 * (is_match = 1 now means "remove"). */
void tok_apply_behavior(tok_spans *v, tok_split_behavior b);

/* ---- the tokenizer ------------------------------------------------------------------------- */
typedef struct {
    const char *content;
    int32_t len;
    int32_t id;
    uint8_t special, normalized, lstrip, rstrip, single_word;
} tok_added;

/* A byte trie over added-token contents for leftmost-longest matching. */
typedef struct {
    int32_t first_child, next_sibling;
    int32_t added;          /* index into tok->added of the token ending here, or -1 */
    uint8_t byte;
} tok_trie_node;
typedef struct {
    tok_trie_node *node;
    int64_t n, cap;          /* node 0 is the root */
    int32_t root_child[256]; /* child of the root for each first byte, -1 when none */
} tok_trie;

typedef enum { TOK_NORM_PREPEND = 0, TOK_NORM_REPLACE } tok_norm_type;
typedef struct {
    tok_norm_type type;
    tok_pattern pattern;     /* Replace */
    char *content;           /* Prepend text / Replace content (owned) */
    int64_t content_len;
} tok_norm;

#define TOK_MAX_PRE 16   /* pre-tokenizer steps after flattening Sequences (checked at load) */
typedef enum { TOK_PRE_SPLIT = 0, TOK_PRE_BYTELEVEL } tok_pre_type;
typedef struct {
    tok_pre_type type;
    tok_pattern pattern;          /* Split / Digits; ByteLevel with use_regex: the GPT-2 regex */
    int has_pattern;
    tok_split_behavior behavior;
    int invert;
    int add_prefix_space;         /* ByteLevel */
} tok_pre;

typedef enum { TOK_DEC_JOIN_SPACE = 0, TOK_DEC_BYTELEVEL, TOK_DEC_CHAIN } tok_dec_type;
typedef struct {
    char *from, *to;              /* Replace(String from -> to), applied to each token */
    int64_t from_len, to_len;
} tok_dec_replace;

struct fp4moe_tokenizer {
    char *path;                   /* tokenizer.json (for messages) */
    tok_arena arena;

    /* ids: the token string of each id (added tokens override the vocab), NULL for a hole */
    int64_t n_ids;
    const char **id_str;
    int32_t *id_len;
    uint8_t *id_special;          /* 1: special added token */
    /* decode piece of each id (bytes; see token_to_piece) and ByteFallback byte (-1 if none) */
    const char **piece;
    int32_t *piece_len;
    int16_t *piece_byte;

    /* model: BPE */
    tok_strmap vocab;             /* model vocab only */
    tok_pairmap merges;
    int byte_fallback, ignore_merges, fuse_unk;
    int32_t unk_id;               /* -1: none */
    char *cont_prefix, *eow_suffix;  /* NULL: none (arena) */
    int32_t byte_sym[256];        /* ByteLevel: id of the symbol of byte b, -1 when not in vocab */
    int32_t fallback_id[256];     /* id of "<0xXX>", -1 when not in vocab */

    /* added tokens */
    tok_added *added;
    int64_t n_added;
    tok_strmap added_map;         /* content -> id */
    tok_trie trie_raw, trie_norm; /* normalized=false / normalized=true */
    pcre2_code *word_char_re;     /* single_word: Rust regex \w (one character), NULL if unused */

    /* normalizer steps, pre-tokenizer steps */
    tok_norm *norm;
    int n_norm;
    tok_pre *pre;
    int n_pre;
    int byte_level;               /* the last pre-tokenizer step is ByteLevel */

    /* post-processor (template "single"): ids before and after the sequence */
    tok_ivec post_prefix, post_suffix;

    /* decoder */
    tok_dec_type dec;
    tok_dec_replace *dec_repl;
    int n_dec_repl;
    int dec_byte_fallback;
    uint32_t strip_char;          /* Strip decoder after Fuse (chain) */
    int strip_start;

    int32_t bos_id, eos_id;
};

/* tok_bpe.c: appends the ids of one pre-tokenized word (raw bytes; mapped through ByteLevel when
 * tok->byte_level) to out. */
typedef struct {
    tok_buf tmp;                          /* mapped word / lookup strings */
    struct tok_sym *sym;                  /* symbols of the current word */
    int64_t n_sym, cap_sym;
    struct tok_merge_cand *heap;
    int64_t n_heap, cap_heap;
} tok_bpe_scratch;
int tok_bpe_word(const fp4moe_tokenizer *tok, tok_bpe_scratch *sc, const char *w, int64_t n,
                 tok_ivec *out);
void tok_bpe_scratch_free(tok_bpe_scratch *sc);

/* tok_decode.c: fills piece / piece_len / piece_byte for every id (called at the end of load). */
int tok_build_pieces(fp4moe_tokenizer *tok);
/* The ByteLevel map: unicode code point of byte b, and the byte of code point cp (-1 if none). */
uint32_t tok_byte_to_cp(uint8_t b);
int tok_cp_to_byte(uint32_t cp);

/* tok_encode.c: builds the two tries (after added tokens are loaded). */
int tok_build_tries(fp4moe_tokenizer *tok);

#endif
